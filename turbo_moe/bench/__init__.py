"""Benchmarks of turbo_moe against its peers: ``python -m turbo_moe.bench --help`` (docs/benchmarks.md).

Importing this package needs torch alone; Triton (timing on CUDA), matplotlib (the plot) and
torchao (a peer) are imported when used.
"""

from .cli import main

__all__ = ["main"]
