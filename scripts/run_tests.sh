#!/usr/bin/env bash
# The test command (README's second command; .ci/run calls it). Installs everything the CPU suite
# needs on a fresh machine, then runs it. GPU tests (marked `gpu`) skip here; scripts/gpu_check.sh
# runs them on a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# A CPU torch build (satisfied offline on the project's machines); the package and its dev extra:
# pytest, hypothesis, triton (its CPU interpreter runs the Triton kernels), flydsl + ziglang
# (gfx950 compile-only checks).
"$PY" -m pip install -q --disable-pip-version-check "torch==2.13.0"
"$PY" -m pip install -q --disable-pip-version-check -e ".[dev]"
# megatron-core 0.19 declares Python >= 3.12 but ships cp311 wheels; its deps are numpy + packaging.
"$PY" -m pip install -q --disable-pip-version-check --no-deps --ignore-requires-python "megatron-core==0.19.2"
"$PY" -m pip install -q --disable-pip-version-check "numpy" "packaging>=24.2" psutil
exec "$PY" -m pytest -q tests "$@"
