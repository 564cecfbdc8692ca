"""Kernel sources of turbo_moe, installed as ``turbo_moe.kernels``.

``tile_scheduler`` is the one tile-order source of every backend; ``triton/`` and ``flydsl/`` hold
the backend kernels. Nothing here imports an optional library at package import time.
"""
