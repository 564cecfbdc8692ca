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
#   scripts/gpu_check.sh [quick|peers|full|none]      default: quick (or $BENCH)
# Environment:
#   OUT         output folder (default ./gpu_check_out)
#   BUDGET_S    wall-clock seconds the whole script may take (default 540: one 10-minute device call)
#   PYTEST_S    cap on the pytest step (default 240); PYTEST_ARGS extra pytest arguments
#   BENCH_ARGS  extra benchmark arguments (e.g. "--levels kernel --num-cu 66")
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
PYTEST_S=${PYTEST_S:-240}
PY=${PYTHON:-python3}
LOG="$OUT/gpu_check.log"
export PYTHONUNBUFFERED=1
: >"$LOG"

log() { echo "[gpu_check +$(($(date +%s) - START))s] $*" | tee -a "$LOG"; }
left() { echo $((BUDGET_S - ($(date +%s) - START))); }

case "$MODE" in
  quick) BENCH_PRESET=(--preset quick) ;;
  peers) BENCH_PRESET=(--preset peers) ;;
  full) BENCH_PRESET=(--preset full) ;;
  none) BENCH_PRESET=() ;;
  *) echo "gpu_check.sh: mode must be quick, peers, full or none, got '$MODE'" >&2; exit 2 ;;
esac

# 1. Install: carried wheels into /tmp/site, then the repository itself (editable, no network).
if compgen -G ".whl/*.whl" >/dev/null; then
  if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >>"$LOG" 2>&1; then
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    log "installed wheels: $(cd .whl && ls *.whl | tr '\n' ' ')"
  else
    log "WARNING: installing .whl/*.whl failed (see above); peers that need them will be reported missing"
  fi
fi
if "$PY" -m pip install -q --no-deps --no-build-isolation -e . >>"$LOG" 2>&1; then
  log "installed turbo_moe (editable)"
else
  log "ERROR: pip install -e . failed (see above)"
  exit 1
fi

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
for op in ("_scaled_grouped_mm", "_grouped_mm", "_scaled_mm"):
    print(f"torch.{op}:", "present" if hasattr(torch, op) else "MISSING")
EOF
} >"$ENV_TXT" 2>&1
cat "$ENV_TXT" | tee -a "$LOG"
rm -f "$ENV_TXT"

# 3. Every GPU test of the project.
PYTEST_CAP=$(( PYTEST_S < $(left) - 60 ? PYTEST_S : $(left) - 60 ))
log "pytest -m gpu (cap ${PYTEST_CAP}s)"
timeout --signal=TERM --kill-after=10 "$PYTEST_CAP" "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider ${PYTEST_ARGS:-} tests \
  2>&1 | tee "$OUT/pytest.log" | tail -n 40
PYTEST_RC=${PIPESTATUS[0]}
[ "$PYTEST_RC" = 124 ] && log "pytest hit its ${PYTEST_CAP}s cap"
log "pytest exit status $PYTEST_RC ($(grep -E '^(=+ )?[0-9]+ (passed|failed|error|skipped)|(passed|failed|error).* in [0-9.]+s' "$OUT/pytest.log" | tail -n 1))"

# 4. The benchmark, in what is left of the budget.
BENCH_RC=skipped
if [ "${#BENCH_PRESET[@]}" -gt 0 ]; then
  HARD=$(( $(left) - 15 ))
  SOFT=$(( HARD - 75 ))  # a case started just before the soft limit must still finish (compile + timing)
  if [ "$SOFT" -lt 30 ]; then
    log "no time left for the benchmark (${HARD}s)"
  else
    log "benchmark ${BENCH_PRESET[*]} ${BENCH_ARGS:-} (start no case after ${SOFT}s, stop at ${HARD}s)"
    timeout --signal=TERM --kill-after=10 "$HARD" "$PY" -m turbo_moe.bench "${BENCH_PRESET[@]}" --out "$OUT" \
      --time-budget "$SOFT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | grep -v '^  \['
    BENCH_RC=${PIPESTATUS[0]}
  fi
fi
log "done: pytest $PYTEST_RC, benchmark $BENCH_RC; files: $(cd "$OUT" && ls | tr '\n' ' ')"
[ "$PYTEST_RC" = 0 ] && { [ "$BENCH_RC" = 0 ] || [ "$BENCH_RC" = skipped ]; }
