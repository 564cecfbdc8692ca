"""``triton.jit`` wrappers of the shared tile-scheduler functions (one source: ``tile_scheduler``).

Triton compiles the code objects of ``turbo_moe.kernels.tile_scheduler``'s functions; its code
generator maps their builtin ``min``/``max`` to ``tl.minimum``/``tl.maximum`` on scalars. Each
function is re-created with ``types.FunctionType`` over the same ``__code__`` and a copy of its
module globals with ``tl`` added, because the interpreter (``TRITON_INTERPRET=1``) insists that
``triton.language`` be visible from every jitted function; the scheduler module itself stays free
of any triton import. Do not re-implement any of this index math in a kernel: call these.
"""

from __future__ import annotations

import types

import triton
import triton.language as tl

from .. import tile_scheduler as _ts


def _jit_shared(fn):
    rebound = types.FunctionType(fn.__code__, {**fn.__globals__, "tl": tl}, fn.__name__, fn.__defaults__)
    rebound.__doc__ = fn.__doc__
    rebound.__module__ = fn.__module__
    rebound.__qualname__ = fn.__qualname__
    return triton.jit(rebound)


cdiv = _jit_shared(_ts.cdiv)
m_grouped_group_tiles = _jit_shared(_ts.m_grouped_group_tiles)
swizzle_group_m = _jit_shared(_ts.swizzle_group_m)
k_grouped_band_cyclic = _jit_shared(_ts.k_grouped_band_cyclic)
k_grouped_group_major = _jit_shared(_ts.k_grouped_group_major)
