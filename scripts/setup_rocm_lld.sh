#!/bin/sh
# Make a folder usable as ROCM_PATH for FlyDSL's compile-only mode on a machine without ROCm:
# FlyDSL links the code object with $ROCM_PATH/llvm/bin/ld.lld (it never searches PATH); here that
# file runs the LLD shipped in the ziglang wheel.
#
#   . scripts/setup_rocm_lld.sh [DIR]      # default DIR: a new temp dir; exports ROCM_PATH=DIR
#
# Only for compiling. Do not point ROCM_PATH at it on a machine that runs ROCm: it holds no runtime.
# Python code does the same through turbo_moe.kernels.flydsl.compile_only.lld_shim().
set -e
PYTHON="${PYTHON:-$(command -v python3 || command -v python)}"
"$PYTHON" -c "import ziglang" 2>/dev/null || { echo "setup_rocm_lld.sh: pip install ziglang first" >&2; return 1 2>/dev/null || exit 1; }
DIR="${1:-$(mktemp -d -t turbo_moe_rocm_lld_XXXXXX)}"
mkdir -p "$DIR/llvm/bin"
printf '#!/bin/sh\nexec "%s" -m ziglang ld.lld "$@"\n' "$PYTHON" > "$DIR/llvm/bin/ld.lld"
chmod +x "$DIR/llvm/bin/ld.lld"
"$DIR/llvm/bin/ld.lld" --version
export ROCM_PATH="$DIR"
echo "ROCM_PATH=$ROCM_PATH"
