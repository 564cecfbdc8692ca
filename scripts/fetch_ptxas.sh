#!/usr/bin/env bash
# Put CUDA 13.0's ptxas in .ptxas/ptxas, to carry to the (offline) device machine and select with
# scripts/gpu_check.sh's PTXAS=.ptxas/ptxas (Triton's TRITON_PTXAS_PATH). Why: Triton 3.6 bundles CUDA
# 12.8's ptxas, which lacks the FFMA interleaving of 12.9+ (a blockwise promotion loop at 0.77x of
# tensorwise under 12.8, 0.95x under 13.0) and miscompiled a Gluon wgrad variant that 13.0 compiles
# right (docs/results/h100_wgrad_skew.md, docs/results/h100_fine_grained.md). It comes from NVIDIA's
# nvidia-cuda-nvcc wheel on PyPI (38 MB unpacked; .ptxas/ is git-ignored). VERSION picks another
# release (default 13.0.88, the one measured).
set -eu
cd "$(dirname "$0")/.."
VERSION=${VERSION:-13.0.88}
rm -rf .ptxas/wheel && mkdir -p .ptxas/wheel
python3 -m pip download -q --no-deps --only-binary=:all: --platform manylinux2014_x86_64 \
  --python-version 3.12 -d .ptxas/wheel "nvidia-cuda-nvcc==$VERSION"
python3 - <<'PY'
import glob, os, zipfile
wheel = glob.glob(".ptxas/wheel/nvidia_cuda_nvcc-*.whl")[0]
with zipfile.ZipFile(wheel) as z:
    name = next(n for n in z.namelist() if n.endswith("/bin/ptxas"))
    with z.open(name) as src, open(".ptxas/ptxas", "wb") as dst:
        dst.write(src.read())
os.chmod(".ptxas/ptxas", 0o755)
PY
rm -rf .ptxas/wheel
.ptxas/ptxas --version | tail -n 1
