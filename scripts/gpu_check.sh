#!/usr/bin/env bash
# One call on a GPU machine does everything: install turbo_moe, print the environment, run every
# GPU test of the project (pytest -m gpu), then the benchmark. Logs and results go to $OUT:
#
#   gpu_check.log   environment, each step's exit status and time, the final summary
#   pytest.log      pytest -m gpu
#   bench.log       the benchmark's progress lines and tables
#   results.md / results.json / results.csv / results.png   (python -m turbo_moe.bench --out $OUT)
#
# Usage, from anywhere (it works in the repository root):
#   scripts/gpu_check.sh [quick|peers|full|train|issue10|none]      default: quick (or $BENCH)
# STEPS (default "pytest bench") picks what runs, in this order:
#   pytest    pytest -m gpu (the fuzz cases are left to the fuzz step)
#   fuzz      scripts/gpu_fuzz.py: the issue-16 failure-mode table (gpu_fuzz.md)
#   hotpath   scripts/hotpath.py: host us, launches, eager/graph ms, peak MB per fwd+bwd beside bf16;
#             with .old/before (a checkout of the previous tree) also the same for it (hotpath_before.json);
#             HOTPATH_ARGS="--shapes ... --compare-host-plans" adds host us without host launch plans
#             (turbo_moe/host_plan.py), measured alternately with them
#   megatron  scripts/megatron_gpu_proof.py (distributed optimizer, alltoall, fp32 main_grad fusion)
#   hostbreak scripts/host_breakdown.py: where the host time of one fwd+bwd goes (hostbreak.log)
#   hostab    scripts/host_breakdown.py for this tree and .old/before, interleaved twice (hostab.log)
#   hostprof  scripts/host_breakdown.py --profile: cProfile of the fwd+bwd's Python (hostprof.log)
#   accum     scripts/bench_accumulation.py: fast vs promoted FP8 accumulation, speed and error
#   fine      scripts/bench_fine_grained.py: blockwise / MXFP8 kernels beside tensorwise
#   bench     python -m turbo_moe.bench with the preset given as $1 (train: the training-step preset)
# Environment:
#   OUT         output folder (default ./gpu_check_out)
#   BUDGET_S    wall-clock seconds the whole script may take (default 540: one 10-minute device call)
#   PYTEST_S    cap on the pytest step (default 300: the whole GPU suite with cold compile caches took
#               more than 230 s with 6 workers; with STEPS=pytest alone, the budget less the serial
#               tests' reserve); PYTEST_ARGS extra pytest arguments (split on
#               spaces); PYTEST_K a -k expression (kept whole: PYTEST_K="fp32 or cast");
#               PYTEST_PATHS the test files or folders (default tests; e.g. "tests/test_fp8_cast.py
#               tests/test_fine_grained_gpu.py": PYTEST_ARGS paths are added to tests/, not instead);
#               PYTEST_WORKERS pytest-xdist processes when a carried xdist wheel is installed (default 6;
#               `pip download pytest-xdist execnet --no-deps -d .whl` before the call: 3.5 -> ~3 min);
#               SERIAL_RESERVE seconds kept from the parallel run's cap for the serial tests (default
#               90; the whole suite wants BUDGET_S ~585: ~320 s parallel, ~70 s serial). A run that
#               prints a clean summary and then hangs past its cap keeps its summary's verdict.
#               PYTEST_SHARD=i/n (without PYTEST_PATHS): only the i-th of n shards of the test files
#               (sorted, every n-th from the i-th): since the ninth session the whole suite outgrew
#               one 600 s device call (417 s parallel cap reached at ~99%); run 1/2 and 2/2.
#   FUZZ_S, FUZZ_ARGS, HOTPATH_S, HOTPATH_ARGS, MEGATRON_S   caps and arguments of those steps
#   BENCH_ARGS  extra benchmark arguments (e.g. "--levels kernel --num-cu 66")
#   PTXAS       a ptxas for Triton to compile with instead of its own (TRITON_PTXAS_PATH): Triton 3.6
#               bundles CUDA 12.8's, which lacks 12.9+'s FFMA interleaving and miscompiled a Gluon
#               wgrad variant (docs/results/h100_wgrad_skew.md). `bash scripts/fetch_ptxas.sh` puts
#               CUDA 13.0's in .ptxas/ptxas (38 MB) to carry: PTXAS=.ptxas/ptxas with carry ".ptxas".
# Wheels in .whl/ (carried with the call) are installed into /tmp/site first; nothing is downloaded.
# The benchmark is given what is left of BUDGET_S: it starts no new case after its --time-budget,
# and a SIGTERM at the hard limit still leaves the results measured so far.
set -u
cd "$(dirname "$0")/.."
START=$(date +%s)
OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
MODE=${1:-${BENCH:-quick}}
BUDGET_S=${BUDGET_S:-540}
PYTEST_S=${PYTEST_S:-}  # default below: 300, or the budget when pytest is the only step
PY=${PYTHON:-python3}
LOG="$OUT/gpu_check.log"
export PYTHONUNBUFFERED=1
: >"$LOG"

log() { echo "[gpu_check +$(($(date +%s) - START))s] $*" | tee -a "$LOG"; }
if [ -n "${PTXAS:-}" ]; then  # before anything compiles: every kernel of the run uses it
  if [ -f "$PTXAS" ]; then
    chmod +x "$PTXAS"
    export TRITON_PTXAS_PATH="$(cd "$(dirname "$PTXAS")" && pwd)/$(basename "$PTXAS")"
    log "PTXAS: TRITON_PTXAS_PATH=$TRITON_PTXAS_PATH ($("$TRITON_PTXAS_PATH" --version 2>&1 | tail -n 1))"
  else
    log "PTXAS=$PTXAS is not a file: Triton's own ptxas is used"
  fi
fi
left() { echo $((BUDGET_S - ($(date +%s) - START))); }

case "$MODE" in
  quick) BENCH_PRESET=(--preset quick) ;;
  peers) BENCH_PRESET=(--preset peers) ;;
  full) BENCH_PRESET=(--preset full) ;;
  train) BENCH_PRESET=(--preset train) ;;
  issue10) BENCH_PRESET=(--preset issue10) ;;
  none) BENCH_PRESET=() ;;
  *) echo "gpu_check.sh: mode must be quick, peers, full, train, issue10 or none, got '$MODE'" >&2; exit 2 ;;
esac

# 1. Install: carried wheels into /tmp/site, then the repository itself (editable, no network).
. scripts/device_install.sh
install_turbo_moe
STEPS=" ${STEPS:-pytest bench} "
has_step() { case "$STEPS" in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
# run_step NAME CAP_S COMMAND...: one step under a time cap, output to $OUT/NAME.log, status logged.
run_step() {
  local name=$1 cap=$2; shift 2
  local room=$(( $(left) - 20 ))
  [ "$cap" -gt "$room" ] && cap=$room
  if [ "$cap" -lt 20 ]; then log "$name: no time left"; return 0; fi
  log "$name (cap ${cap}s): $*"
  timeout --signal=TERM --kill-after=10 "$cap" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  tail -n "${TAIL_LINES:-25}" "$OUT/$name.log"
  log "$name exit status $rc"
}

# 2. Environment.
ENV_TXT="$OUT/.env.txt"
{
  echo "== nvidia-smi"; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv 2>&1
  echo "== versions"
  "$PY" - <<'EOF' 2>&1
import platform, torch
print("python", platform.python_version(), "| torch", torch.__version__, "| cuda", torch.version.cuda)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, "| SMs", p.multi_processor_count, "| memory GiB", round(p.total_memory / 2**30, 1))
else:
    print("device: none visible to torch")
for name in ("triton", "torchao", "matplotlib"):
    try:
        mod = __import__(name)
        print(name, getattr(mod, "__version__", "?"))
    except Exception as exc:
        print(name, "not importable:", type(exc).__name__, exc)
import turbo_moe
print("turbo_moe", turbo_moe.__version__, "| backends:", turbo_moe.available_backends())
from turbo_moe.backends.triton_backend import ptxas_description
print("ptxas", ptxas_description())
for op in ("_scaled_grouped_mm", "_grouped_mm", "_scaled_mm"):
    print(f"torch.{op}:", "present" if hasattr(torch, op) else "MISSING")
EOF
} >"$ENV_TXT" 2>&1
cat "$ENV_TXT" | tee -a "$LOG"
rm -f "$ENV_TXT"

# 3. Every GPU test of the project.
PYTEST_RC=skipped
if has_step pytest; then
# The serial tests run after the parallel ones: keep SERIAL_RESERVE seconds for them.
SERIAL_RESERVE=${SERIAL_RESERVE:-90}
# A run of pytest alone (a shard, say) gives the parallel tests what the serial ones leave: a fixed
# 300 s stopped shard 2/2 at ~99% twice while 180 s of the call went unused (2026-11-27).
if [ -z "$PYTEST_S" ]; then
  if [ "$(echo $STEPS)" = pytest ]; then PYTEST_S=$BUDGET_S; else PYTEST_S=300; fi
fi
PYTEST_CAP=$(( PYTEST_S < $(left) - 60 - SERIAL_RESERVE ? PYTEST_S : $(left) - 60 - SERIAL_RESERVE ))
if [ -n "${PYTEST_SHARD:-}" ] && [ -z "${PYTEST_PATHS:-}" ]; then
  IFS=/ read -r SHARD_I SHARD_N <<< "$PYTEST_SHARD"
  PYTEST_PATHS=$(ls tests/test_*.py | sort | awk -v i="$SHARD_I" -v n="$SHARD_N" '(NR - 1) % n == i - 1' | tr '\n' ' ')
  log "shard $PYTEST_SHARD: $(echo $PYTEST_PATHS | wc -w) test files"
fi
log "pytest -m gpu (cap ${PYTEST_CAP}s)"
# TURBO_MOE_LAUNCH_CHECK: every lean Triton launch is checked against Triton's own dispatch.
# With pytest-xdist (a carried wheel) the tests run in PYTEST_WORKERS processes: most of their time
# is Triton compiling on the CPU. Tests marked serial measure time and run alone afterwards.
PYTEST_PAR=()
if "$PY" -c "import xdist" 2>/dev/null; then PYTEST_PAR=(-n "${PYTEST_WORKERS:-6}"); fi
pytest_gpu() {  # pytest_gpu MARKEXPR CAP LOGFILE [extra...]
  local expr=$1 cap=$2 logf=$3; shift 3
  TURBO_MOE_LAUNCH_CHECK=${TURBO_MOE_LAUNCH_CHECK:-1} timeout --signal=TERM --kill-after=10 "$cap" "$PY" -m pytest -m "$expr" -q -rs \
    -p no:cacheprovider --deselect tests/test_fuzz_gpu.py::test_gpu_fuzz_case "$@" ${PYTEST_K:+-k "$PYTEST_K"} ${PYTEST_ARGS:-} ${PYTEST_PATHS:-tests} \
    2>&1 | tee "$logf" | tail -n 40
  local rc=${PIPESTATUS[0]}
  # Seen once (2026-11-25): the pytest-xdist controller printed its final summary, every test
  # passed, and the process then sat until the cap. A run whose summary is in the log and names
  # no failure or error keeps that verdict; the log says what happened.
  if { [ "$rc" = 124 ] || [ "$rc" = 137 ]; } && summary_is_clean "$logf"; then
    log "pytest printed a clean summary, then did not exit within ${cap}s: killed; its summary stands"
    rc=0
  fi
  return "$rc"
}
summary_is_clean() {  # the log's last pytest summary line reports passes and no failure or error
  local line
  line=$(grep -E '^(=+ )?[0-9]+ (passed|failed|error|skipped|deselected)|(passed|failed|error).* in [0-9.]+s' "$1" | tail -n 1)
  echo "$line" | grep -Eq '[0-9]+ passed' || return 1
  ! echo "$line" | grep -Eq '[0-9]+ (failed|errors?)'  # "xfailed" is no failure
}
pytest_gpu "gpu and not serial" "$PYTEST_CAP" "$OUT/pytest.log" "${PYTEST_PAR[@]}"
PYTEST_RC=$?
SERIAL_CAP=$(( $(left) - 60 < 120 ? $(left) - 60 : 120 ))
if [ "$SERIAL_CAP" -ge 20 ]; then
  pytest_gpu "gpu and serial" "$SERIAL_CAP" "$OUT/pytest_serial.log"
  SERIAL_RC=$?
  log "pytest (serial tests) exit status $SERIAL_RC ($(tail -n 1 "$OUT/pytest_serial.log"))"
  # exit 5 (no serial test selected, e.g. PYTEST_ARGS named one file) is not a failure here
  [ "$PYTEST_RC" = 0 ] && [ "$SERIAL_RC" != 0 ] && [ "$SERIAL_RC" != 5 ] && PYTEST_RC=$SERIAL_RC
fi
[ "$PYTEST_RC" = 124 ] && log "pytest hit its ${PYTEST_CAP}s cap"
log "pytest exit status $PYTEST_RC ($(grep -E '^(=+ )?[0-9]+ (passed|failed|error|skipped)|(passed|failed|error).* in [0-9.]+s' "$OUT/pytest.log" | tail -n 1))"
fi
has_step fuzz && run_step fuzz "${FUZZ_S:-200}" "$PY" scripts/gpu_fuzz.py --out "$OUT" ${FUZZ_ARGS:-}
if has_step hotpath; then
  HOT_ARGS=${HOTPATH_ARGS:---shapes tiny-8x128-256x256,qwen3-fc2-32x512,dsv3-fc1-32x512,dsv3-fc1-128x128,dsv3-fc1-8x4096}
  if [ -d .old/before/turbo_moe ]; then
    run_step hotpath_before "${HOTPATH_S:-150}" env PYTHONPATH="$PWD/.old/before" "$PY" scripts/hotpath.py $HOT_ARGS \
      --granularities tensorwise --micro-batches 1 --label before --json "$OUT/hotpath_before.json"
  fi
  run_step hotpath "${HOTPATH_S:-200}" env PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$PY" scripts/hotpath.py $HOT_ARGS \
    --label after --json "$OUT/hotpath.json"
fi
has_step megatron && run_step megatron "${MEGATRON_S:-180}" "$PY" scripts/megatron_gpu_proof.py
has_step hostbreak && run_step hostbreak "${HOSTBREAK_S:-120}" bash -c \
  "'$PY' scripts/host_breakdown.py --shape tiny && '$PY' scripts/host_breakdown.py --shape dsv3"
# hostab: the host breakdown of this tree and of .old/before, interleaved (after, before, after,
# before): host time drifts between minutes on the device machine, so only interleaved runs compare.
has_step hostab && [ -d .old/before/turbo_moe ] && run_step hostab "${HOSTAB_S:-200}" bash -c \
  "for i in 1 2; do echo '== after run' \$i; '$PY' scripts/host_breakdown.py --shape tiny; \
   echo '== before run' \$i; PYTHONPATH='$PWD/.old/before' '$PY' scripts/host_breakdown.py --shape tiny; done"
has_step hostprof && TAIL_LINES=0 run_step hostprof "${HOSTPROF_S:-120}" "$PY" scripts/host_breakdown.py \
  --shape tiny --profile "${HOSTPROF_STEPS:-200}"
has_step accum && run_step accum "${ACCUM_S:-180}" "$PY" scripts/bench_accumulation.py --out "$OUT/accumulation.md"
has_step fine && run_step fine "${FINE_S:-180}" "$PY" scripts/bench_fine_grained.py --shapes deepseek --out "$OUT/fine_grained.md"

# 4. The benchmark, in what is left of the budget.
BENCH_RC=skipped
if has_step bench && [ "${#BENCH_PRESET[@]}" -gt 0 ]; then
  HARD=$(( $(left) - 15 ))
  SOFT=$(( HARD - 75 ))  # a case started just before the soft limit must still finish (compile + timing)
  # A --time-budget in BENCH_ARGS may only shorten this one: it replaces it instead of following it
  # on the command line (where the later one won, and a longer one ran into the hard limit).
  ASKED=$(printf ' %s ' "${BENCH_ARGS:-}" | sed -n 's/.* --time-budget[ =]\([0-9][0-9.]*\) .*/\1/p')
  if [ -n "$ASKED" ]; then
    ASKED=${ASKED%%.*}
    [ "${ASKED:-0}" -lt "$SOFT" ] && SOFT=$ASKED
    BENCH_ARGS=$(printf ' %s ' "$BENCH_ARGS" | sed 's/ --time-budget[ =][0-9][0-9.]* / /')
  fi
  if [ "$SOFT" -lt 30 ]; then
    log "no time left for the benchmark (${HARD}s)"
  else
    log "benchmark ${BENCH_PRESET[*]} ${BENCH_ARGS:-} (start no case after ${SOFT}s, stop at ${HARD}s)"
    timeout --signal=TERM --kill-after=10 "$HARD" "$PY" -m turbo_moe.bench "${BENCH_PRESET[@]}" --out "$OUT" \
      --time-budget "$SOFT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | grep -v '^  \['
    BENCH_RC=${PIPESTATUS[0]}
  fi
fi
log "done: pytest $PYTEST_RC, benchmark $BENCH_RC; files: $(cd "$OUT" && find . -type f | sed 's|^./||' | tr '\n' ' ')"
# The device tool brings back at most 8 files (no deeper than two folders): past 7, everything
# also goes into one archive, and the loose copies of all but the summaries are dropped.
if [ "$(find "$OUT" -type f | wc -l)" -gt 7 ]; then
  tar czf /tmp/gpu_check_all.tar.gz -C "$OUT" . && mv /tmp/gpu_check_all.tar.gz "$OUT/all.tar.gz"
  find "$OUT" -type f ! -name all.tar.gz ! -name gpu_check.log ! -name pytest.log ! -name bench.log \
    ! -path "$OUT/results.md" -delete
  find "$OUT" -mindepth 1 -type d -empty -delete
  log "more than 7 files: all of them are in all.tar.gz (kept beside it: the logs and results.md)"
fi
{ [ "$PYTEST_RC" = 0 ] || [ "$PYTEST_RC" = skipped ]; } && { [ "$BENCH_RC" = 0 ] || [ "$BENCH_RC" = skipped ]; }
