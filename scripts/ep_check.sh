#!/usr/bin/env bash
# Issue 11 in one call on `nvidia-h200-x2` (two GPUs, NCCL): installs what was carried, then runs
# each step under a time cap, results to $OUT:
#
#   ep_check.log            environment (nvidia-smi topo, NCCL version), each step's status and time
#   ep_train.{md,json,png}  scripts/ep_train.py: EP=2 / ETP=2 / EP=2+overlap_moe_expert_parallel_comm
#                           loss vs EP=1 (FP8 hybrid, Triton, alltoall) + dist-checkpoint reshard checks
#   ep_overlap.{md,json,png} scripts/ep_overlap_bench.py: GEMM(chunk i) beside NCCL all-to-all(chunk i+1),
#                           time vs num_cu for gemm / a2a / serial / overlap, verdicts, best cap vs the rule
#   cap_scaling.{md,json,png} scripts/cap_scaling.py on GPU 0: time(cap) of fwd/dgrad/wgrad, autotune off
#   cap_scaling_autotune/   the same with TURBO_MOE_TRITON_AUTOTUNE=1 (does the tuning follow the cap?)
#   pytest.log              tests/test_megatron_cuda_graph_gpu.py (Megatron local CUDA graphs, step times) + cap-rule tests
#   <step>.log              each step's full output
#
# Usage (repository root): scripts/ep_check.sh        STEPS picks steps (default: all, in this order)
#   STEPS="train overlap pytest scaling"   (in order of priority: a step that would overrun is cut short)
# Environment: OUT (default ./ep_check_out), BUDGET_S (default 575: one 10-minute device call), PYTHON;
# per-step caps TRAIN_S OVERLAP_S PYTEST_S SCALING_S; TRAIN_STEPS; OVERLAP_ARGS (e.g. "--graph").
# Wheels in .whl/ (carried) are installed into /tmp/site first, as scripts/gpu_check.sh does.
set -u
cd "$(dirname "$0")/.."
START=$(date +%s)
OUT=${OUT:-$PWD/ep_check_out}
mkdir -p "$OUT"
BUDGET_S=${BUDGET_S:-575}
PY=${PYTHON:-python3}
LOG="$OUT/ep_check.log"
export PYTHONUNBUFFERED=1
: >"$LOG"
log() { echo "[ep_check +$(($(date +%s) - START))s] $*" | tee -a "$LOG"; }
left() { echo $((BUDGET_S - ($(date +%s) - START))); }

# 1. Install (as gpu_check.sh: carried wheels, then the repository, no network).
. scripts/device_install.sh
install_turbo_moe
# torchrun's children and the scripts import turbo_moe from the tree either way.
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

# 2. Environment.
{
  echo "== nvidia-smi"; nvidia-smi --query-gpu=index,name,memory.total,clocks.max.sm --format=csv 2>&1
  echo "== topology"; nvidia-smi topo -m 2>&1 | head -n 6
  "$PY" - <<'EOF' 2>&1
import torch
print("torch", torch.__version__, "| cuda", torch.version.cuda, "| nccl", ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "-")
print("GPUs", torch.cuda.device_count(), "| SMs", torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else "-")
import os
from turbo_moe.comm_cap import comm_ctas_from_env, num_cu_for_comm
print("NCCL env:", {k: v for k, v in os.environ.items() if k.startswith("NCCL_")})
try:
    print("num_cu_for_comm(ep_size=2) ->", num_cu_for_comm(ep_size=2), "| comm CTAs", comm_ctas_from_env())
except Exception as exc:
    print("num_cu_for_comm:", exc)
for m in ("megatron.core", "triton", "matplotlib"):
    try:
        mod = __import__(m, fromlist=["x"]); print(m, getattr(mod, "__version__", "?"))
    except Exception as exc:
        print(m, "NOT importable:", exc)
EOF
} 2>&1 | tee -a "$LOG"

STEPS=" ${STEPS:-train overlap pytest scaling} "
has_step() { case "$STEPS" in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
declare -A RC
run_step() {  # run_step NAME CAP_S COMMAND...
  local name=$1 cap=$2; shift 2
  local room=$(( $(left) - 15 ))
  [ "$cap" -gt "$room" ] && cap=$room
  if [ "$cap" -lt 20 ]; then log "$name: no time left"; RC[$name]=no-time; return 0; fi
  log "$name (cap ${cap}s): $*"
  timeout --signal=TERM --kill-after=10 "$cap" "$@" >"$OUT/$name.log" 2>&1
  RC[$name]=$?
  grep -E "CHECK|VERDICT|PASS|FAIL|best cap|^\| |passed|failed|skipped|\[cuda graph\]" "$OUT/$name.log" | tail -n "${TAIL_LINES:-30}"
  log "$name exit status ${RC[$name]}"
}
TORCHRUN=("$PY" -m torch.distributed.run --standalone --nproc-per-node 2)

has_step train && run_step ep_train "${TRAIN_S:-180}" "${TORCHRUN[@]}" scripts/ep_train.py --etp --overlap --bf16-pairs \
  --steps "${TRAIN_STEPS:-20}" --out "$OUT"
has_step overlap && run_step ep_overlap "${OVERLAP_S:-150}" "${TORCHRUN[@]}" scripts/ep_overlap_bench.py --out "$OUT" \
  ${OVERLAP_ARGS:-}
# Megatron's local CUDA graphs around a turbo_moe layer (prints step times with -s) + the cap rule's unit tests.
has_step pytest && run_step pytest "${PYTEST_S:-120}" "$PY" -m pytest -q -rs -s -p no:cacheprovider \
  tests/test_megatron_cuda_graph_gpu.py tests/test_comm_cap.py
if has_step scaling; then
  run_step cap_scaling "${SCALING_S:-60}" env CUDA_VISIBLE_DEVICES=0 TURBO_MOE_TRITON_AUTOTUNE=0 "$PY" scripts/cap_scaling.py \
    --rep-ms 50 --out "$OUT"
  run_step cap_scaling_autotune "${SCALING_S:-60}" env CUDA_VISIBLE_DEVICES=0 TURBO_MOE_TRITON_AUTOTUNE=1 "$PY" scripts/cap_scaling.py \
    --points 5 --rep-ms 50 --out "$OUT/cap_scaling_autotune"
fi

summary=""
for k in "${!RC[@]}"; do summary+="$k=${RC[$k]} "; done
log "done: $summary; files: $(cd "$OUT" && ls | tr '\n' ' ')"
for k in "${!RC[@]}"; do [ "${RC[$k]}" = 0 ] || exit 1; done
exit 0
