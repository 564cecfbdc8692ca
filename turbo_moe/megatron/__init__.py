"""Megatron-core drop-in: turbo_moe grouped GEMMs as the expert MLPs of a Megatron ``MoELayer``.

Needs megatron-core >= 0.19.2 (the ``[megatron]`` extra); ``import turbo_moe`` never imports this
module. The one line a user changes::

    from turbo_moe.megatron import use_turbo_moe_experts
    layer_spec = use_turbo_moe_experts(get_gpt_layer_local_spec(num_experts=8, moe_grouped_gemm=True),
                                       fp8="hybrid")

(or ``get_turbo_moe_module_spec(...)`` for the ``MoELayer`` builder alone).

What is here:

* :class:`TurboGroupedLinear` (and its column/row-parallel flavours) -- the grouped linear that
  Megatron's ``GroupedMLPSubmodules`` builds for ``linear_fc1`` / ``linear_fc2``, with the
  constructor and ``forward(x, m_splits) -> (out, bias)`` of Transformer Engine's
  ``TEColumnParallelGroupedLinear`` / ``TERowParallelGroupedLinear``. It keeps one
  ``weight`` Parameter ``[E_local, out, in]`` (the storage the kernels read) and presents it to
  checkpoints the way Megatron names per-expert weights (``weight{i}`` in ``state_dict``; a
  ``...experts.linear_fc1.weight`` ShardedTensor of global shape ``[E, out, in]`` in
  ``sharded_state_dict``).
* :class:`TurboMoEGroupedMLP` -- a ``TEGroupedMLP`` subclass whose forward keeps
  ``tokens_per_expert`` on the device (Megatron's calls ``.tolist()``, a host sync), so the expert
  computation can be captured in a CUDA graph with a kernel backend.
* spec helpers: :func:`get_turbo_moe_experts_spec`, :func:`get_turbo_moe_module_spec`,
  :func:`use_turbo_moe_experts`.

Layout of the package: ``options`` (turbo_moe's settings, Megatron's FP8 recipe -> Float8Config),
``main_grad`` (autograd helpers for ``main_grad`` and delayed wgrad), ``linear`` (the grouped
linears), ``checkpoint`` (their state-dict and distributed-checkpoint layout), ``experts`` (the
grouped MLP), ``specs`` (spec helpers).

FP8 is turbo_moe's own switch (``fp8=`` on the helpers): Megatron's ``config.fp8`` refuses MoE
without Transformer Engine. ``fp8="megatron"`` (the default) follows ``config.fp8`` when it is set
(``"e4m3"`` / ``"hybrid"``), so TE users keep their setting; ``None`` runs the high-precision
``turbo_moe.grouped_gemm``; ``"e4m3"`` / ``"hybrid"`` or a :class:`turbo_moe.Float8Config` turn
FP8 on explicitly. See docs/megatron.md for the checkpoint layout and the trade-offs.
"""

from __future__ import annotations


def _require_megatron() -> None:
    """Import what this package needs from megatron-core; on failure name the module that is missing.

    megatron-core 0.19.2 imports triton unconditionally (``transformer/moe/ops/paged_stash.py``)
    without declaring it, so a missing triton surfaces here, not as a missing megatron-core.
    """
    try:
        import megatron.core.transformer.moe.experts  # noqa: F401
        import megatron.core.transformer.moe.moe_layer  # noqa: F401
        import megatron.core.dist_checkpointing.mapping  # noqa: F401
    except ImportError as exc:
        missing = getattr(exc, "name", None) or ""
        install = ("pip install 'turbo_moe[megatron]' (on Python 3.11: pip install --no-deps "
                   "--ignore-requires-python megatron-core==0.19.2 numpy packaging psutil triton)")
        if missing == "megatron" or missing.startswith("megatron."):
            if isinstance(exc, ModuleNotFoundError) and missing in ("megatron", "megatron.core"):
                why = "megatron-core is not installed"
            else:
                why = f"megatron-core does not provide what it needs (>= 0.19.2 required): {exc}"
        else:
            why = (f"megatron-core imports the module {missing or '?'!r}, which is not installed "
                   f"({exc})")
        raise ImportError(f"turbo_moe.megatron: {why}. Install: {install}", name=missing or None) from exc


_require_megatron()

from .experts import TurboMoEGroupedMLP  # noqa: E402
from .linear import (  # noqa: E402
    TurboColumnParallelGroupedLinear,
    TurboGroupedLinear,
    TurboRowParallelGroupedLinear,
)
from .main_grad import invalidate_fp8_weight_cache_on_step, invalidate_fp8_weight_caches  # noqa: E402
from .options import TurboMoEOptions, resolve_fp8_config  # noqa: E402
from .specs import get_turbo_moe_experts_spec, get_turbo_moe_module_spec, use_turbo_moe_experts  # noqa: E402
from .experts import _turbo_submodules  # noqa: E402,F401  (kept importable from here for callers of 0.1)

__all__ = [
    "TurboMoEOptions",
    "resolve_fp8_config",
    "TurboGroupedLinear",
    "TurboColumnParallelGroupedLinear",
    "TurboRowParallelGroupedLinear",
    "TurboMoEGroupedMLP",
    "get_turbo_moe_experts_spec",
    "get_turbo_moe_module_spec",
    "use_turbo_moe_experts",
    "invalidate_fp8_weight_cache_on_step",
    "invalidate_fp8_weight_caches",
]
