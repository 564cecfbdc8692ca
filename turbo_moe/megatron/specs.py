"""Spec helpers: put turbo_moe's experts into a Megatron layer, block or ``MoELayer`` spec."""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Union

from megatron.core.transformer.moe.moe_layer import MoESubmodules
from megatron.core.transformer.spec_utils import ModuleSpec

from .experts import TurboMoEGroupedMLP, _turbo_submodules
from .options import Fp8Setting, TurboMoEOptions

__all__ = ["get_turbo_moe_experts_spec", "get_turbo_moe_module_spec", "use_turbo_moe_experts"]


def _make_options(fp8, granularity, backend, num_cu, cache_fp8_weight) -> TurboMoEOptions:
    return TurboMoEOptions(fp8=fp8, granularity=granularity, backend=backend, num_cu=num_cu,
                           cache_fp8_weight=cache_fp8_weight)


def get_turbo_moe_experts_spec(*, fp8: Fp8Setting = "megatron", granularity: Optional[str] = None,
                               backend: str = "auto", num_cu: Optional[int] = None,
                               cache_fp8_weight: Union[bool, str] = "auto"):
    """The experts builder (``MoESubmodules.experts``) for turbo_moe's grouped experts."""
    options = _make_options(fp8, granularity, backend, num_cu, cache_fp8_weight)
    return functools.partial(TurboMoEGroupedMLP, submodules=_turbo_submodules(options), options=options)


def get_turbo_moe_module_spec(*, use_te: bool = False, num_experts: Optional[int] = None,
                              fp8: Fp8Setting = "megatron", granularity: Optional[str] = None,
                              backend: str = "auto", num_cu: Optional[int] = None,
                              cache_fp8_weight: Union[bool, str] = "auto"):
    """``MoELayer`` builder as Megatron's ``get_moe_module_spec`` makes it, with turbo_moe experts.

    ``use_te`` picks TE or local modules for the router-side pieces Megatron builds (shared
    experts); the routed experts are turbo_moe's either way.
    """
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    base = get_moe_module_spec(use_te=use_te, num_experts=num_experts, moe_grouped_gemm=True)
    return use_turbo_moe_experts(base, fp8=fp8, granularity=granularity, backend=backend, num_cu=num_cu,
                                 cache_fp8_weight=cache_fp8_weight)


def use_turbo_moe_experts(spec, *, fp8: Fp8Setting = "megatron", granularity: Optional[str] = None,
                          backend: str = "auto", num_cu: Optional[int] = None,
                          cache_fp8_weight: Union[bool, str] = "auto"):
    """Return a copy of ``spec`` whose MoE layers use turbo_moe's experts.

    ``spec``: a GPT layer spec (``ModuleSpec``), a decoder block spec (``TransformerBlockSubmodules``
    or a list of layer specs), or an ``MoELayer`` builder (``functools.partial``). Everything other
    than ``MoESubmodules.experts`` is kept. Raises ValueError if it contains no MoE layer.
    """
    experts = get_turbo_moe_experts_spec(fp8=fp8, granularity=granularity, backend=backend, num_cu=num_cu,
                                         cache_fp8_weight=cache_fp8_weight)
    replaced = [0]

    def swap(obj, depth=0):
        if depth > 20:
            return obj
        if isinstance(obj, MoESubmodules):
            replaced[0] += 1
            return dataclasses.replace(obj, experts=experts)
        if isinstance(obj, functools.partial):
            keywords = {k: swap(v, depth + 1) for k, v in obj.keywords.items()}
            if all(keywords[k] is obj.keywords[k] for k in keywords):
                return obj
            return functools.partial(obj.func, *obj.args, **keywords)
        if isinstance(obj, ModuleSpec):
            new_sub = swap(obj.submodules, depth + 1)
            new_params = {k: swap(v, depth + 1) for k, v in (obj.params or {}).items()}
            if new_sub is obj.submodules and all(new_params[k] is obj.params[k] for k in new_params):
                return obj
            return dataclasses.replace(obj, submodules=new_sub, params=new_params)
        if isinstance(obj, (list, tuple)):
            items = [swap(v, depth + 1) for v in obj]
            if all(a is b for a, b in zip(items, obj)):
                return obj
            return type(obj)(items)
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            changes = {}
            for f in dataclasses.fields(obj):
                value = getattr(obj, f.name)
                new = swap(value, depth + 1)
                if new is not value:
                    changes[f.name] = new
            return dataclasses.replace(obj, **changes) if changes else obj
        return obj

    result = swap(spec)
    if replaced[0] == 0:
        raise ValueError(f"spec contains no MoE layer (no MoESubmodules found in {type(spec).__name__})")
    return result

