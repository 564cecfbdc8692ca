"""FlyDSL (AMD gfx950) kernels of turbo_moe's grouped FP8 GEMMs.

``grouped_gemm_fp8`` holds the device code (imports flydsl, lazily, when a kernel is built);
``host`` holds the pure-Python side (argument packing, grids, the int64 re-base model) and needs
only the standard library, so its tests run without flydsl; ``compile_only`` compiles kernels for
an arch with no GPU present and reports on their ISA.
"""
