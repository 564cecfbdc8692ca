"""The model side of the training-step benchmark: a one-process Megatron-core world, the MoE GPT
configs and variants, one initialisation shared by every variant, and the mixed-precision Adam.

Megatron-core 0.19.2 without Transformer Engine has one expert implementation of its own:
``SequentialMLP`` (a ``ColumnParallelLinear``/``RowParallelLinear`` pair per expert, run one
after the other after a ``tokens_per_expert.tolist()``). Its ``TEGroupedMLP`` needs TE, and the
legacy ``GroupedMLP`` (grouped_gemm package) is gone from 0.19, so ``megatron`` below is
``SequentialMLP``; the grouped bf16 baseline is turbo_moe's own ``fp8=None`` path
(``torch._grouped_mm``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import socket
from typing import Dict, Iterator, List, Optional

import torch

from .recipes import DELAYED, bench_float8_config
from .text_corpus import VOCAB_SIZE

__all__ = ["TrainConfig", "GPU_CONFIGS", "CPU_CONFIGS", "TRAIN_VARIANTS", "DEFAULT_TRAIN_VARIANTS", "apply_overrides", "megatron_world",
           "build_model", "experts_of", "canonical_state", "load_canonical_state", "MasterWeightAdam"]


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    name: str
    layers: int
    hidden: int
    heads: int
    ffn: int  # each expert's FFN width (fc1 is 2 * ffn wide: SwiGLU)
    experts: int
    topk: int
    seq: int
    mbs: int  # sequences per micro-batch
    loss_curve: bool  # trained for --train-steps (the loss comparison), else --warmup + --timed steps
    # Megatron's token dispatcher. "alltoall" (what multi-GPU MoE runs use) keeps a dropless step
    # free of host syncs; "allgather" copies tokens_per_expert to the host in every MoE layer of
    # every micro-batch (a sync that makes the step pay host and GPU time one after the other).
    dispatcher: str = "alltoall"

    def tokens_per_step(self, micro_batches: int) -> int:
        return self.seq * self.mbs * micro_batches

    def describe(self, micro_batches: int) -> str:
        return (f"{self.layers} layers, hidden {self.hidden}, {self.heads} heads, {self.experts} experts top-{self.topk}, "
                f"expert FFN {self.ffn} (SwiGLU), seq {self.seq} x {self.mbs} seqs x {micro_batches} micro-batches = "
                f"{self.tokens_per_step(micro_batches)} tokens/step, {self.dispatcher} dispatcher")


GPU_CONFIGS = {
    # Experts 16 x top-2 at hidden 1024: attention, the optimizer and the router weigh as much as the experts.
    "moderate": TrainConfig("moderate", layers=4, hidden=1024, heads=8, ffn=2048, experts=16, topk=2, seq=1024,
                            mbs=2, loss_curve=True),
    # Top-8 of 64 experts, short sequences, 2 layers: expert GEMMs are ~90% of the FLOPs; enough tokens per
    # step (48k) that Adam over the 800M expert parameters does not dominate. Expert FFN 2048: with
    # Megatron's SwiGLU fusion on (the bf16 baseline's activation compiled), FFN 1024 left the bf16
    # experts at 42% of the step's GPU time, under issue 10's 50% (H100, 2026-11-23: 52% at 2048).
    "expert-dominated": TrainConfig("expert-dominated", layers=2, hidden=1024, heads=8, ffn=2048, experts=64,
                                    topk=8, seq=256, mbs=48, loss_curve=False),
}
CPU_CONFIGS = {  # the smoke mode: same structure, tiny
    "moderate": TrainConfig("moderate", layers=2, hidden=32, heads=4, ffn=48, experts=4, topk=2, seq=32, mbs=2,
                            loss_curve=True, dispatcher="allgather"),
    "expert-dominated": TrainConfig("expert-dominated", layers=1, hidden=32, heads=4, ffn=32, experts=8, topk=4,
                                    seq=16, mbs=4, loss_curve=False, dispatcher="allgather"),
}  # (Megatron's alltoall dispatcher makes a CUDA stream when it is built: GPU only)
# name -> (turbo_moe experts?, fp8 granularity or None for bf16)
TRAIN_VARIANTS = {
    "turbo-bf16": (True, None),
    "fp8-tensorwise": (True, "tensorwise"),
    "fp8-rowwise": (True, "rowwise"),
    "megatron": (False, None),
    # The fine-grained recipes (turbo_moe.fine_grained; Megatron's fp8_recipe "blockwise"/"mxfp8"):
    # opt-in (--variants), so the default run keeps its GPU time.
    "fp8-blockwise": (True, "blockwise"),
    "fp8-mxfp8": (True, "mxfp8"),
    # Delayed scaling (Megatron's fp8_recipe="delayed"): per-tensor scales from a 16-step amax
    # history, reduced by max (turbo_moe.delayed_scaling): no amax pass before each cast.
    "fp8-delayed": (True, DELAYED),
}
DEFAULT_TRAIN_VARIANTS = ("turbo-bf16", "fp8-tensorwise", "fp8-rowwise", "megatron")


def apply_overrides(configs: Dict[str, TrainConfig], overrides: List[str]) -> Dict[str, TrainConfig]:
    """``["expert-dominated.mbs=64", ...]`` -> configs with those fields replaced."""
    configs = dict(configs)
    fields = {f.name: f.type for f in dataclasses.fields(TrainConfig)}
    for item in overrides:
        key, sep, value = item.partition("=")
        name, dot, field = key.rpartition(".")
        if not sep or not dot or name not in configs or field not in fields or field == "name":
            raise ValueError(f"--train-override {item!r}: expected CONFIG.FIELD=VALUE with CONFIG in "
                             f"{sorted(configs)} and FIELD in {sorted(set(fields) - {'name'})}")
        if field == "loss_curve":
            parsed = value.lower() in ("1", "true", "yes")
        elif field == "dispatcher":
            if value not in ("alltoall", "allgather"):
                raise ValueError(f"--train-override {item!r}: the dispatcher is alltoall or allgather")
            parsed = value
        else:
            parsed = int(value)
        configs[name] = dataclasses.replace(configs[name], **{field: parsed})
    return configs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def megatron_world(device: torch.device, seed: int = 1234) -> Iterator[None]:
    """A world-size-1 Megatron process (nccl on CUDA, gloo on CPU).

    On a CPU, Megatron's few CUDA assumptions (the router's ``torch.cuda.current_device()``,
    ``synchronize``, the dropout RNG tracker) are pointed at the CPU for the duration.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mp_random

    saved = (torch.cuda.current_device, torch.cuda.synchronize, mp_random.CudaRNGStatesTracker.fork)
    created = False
    try:
        if device.type == "cuda":
            torch.cuda.set_device(device.index if device.index is not None else torch.cuda.current_device())
        else:
            torch.cuda.current_device = lambda: torch.device("cpu")
            if not torch.cuda.is_available():
                torch.cuda.synchronize = lambda *a, **k: None
            mp_random.CudaRNGStatesTracker.fork = lambda self, *a, **k: contextlib.nullcontext()
        if not dist.is_initialized():
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ["MASTER_PORT"] = str(_free_port())
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
            created = True
        parallel_state.initialize_model_parallel()
        if device.type == "cuda":
            mp_random.model_parallel_cuda_manual_seed(seed)
        yield
    finally:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        if created:
            dist.destroy_process_group()
        torch.cuda.current_device, torch.cuda.synchronize, mp_random.CudaRNGStatesTracker.fork = saved


def _transformer_config(cfg: TrainConfig, device: torch.device):
    from megatron.core.transformer.transformer_config import TransformerConfig

    on_gpu = device.type == "cuda"
    return TransformerConfig(
        num_layers=cfg.layers, hidden_size=cfg.hidden, num_attention_heads=cfg.heads, ffn_hidden_size=cfg.ffn,
        num_moe_experts=cfg.experts, moe_ffn_hidden_size=cfg.ffn, moe_router_topk=cfg.topk,
        moe_token_dispatcher_type=cfg.dispatcher, moe_router_dtype="fp32", moe_aux_loss_coeff=1e-2,
        moe_router_load_balancing_type="aux_loss",
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        # No TE, no apex: every fusion that needs them off. The SwiGLU fusion needs neither (Megatron's
        # weighted_bias_swiglu_impl, compiled by torch.compile through megatron.core.jit): on, as in
        # Megatron's training scripts, so the bf16 experts' activation is one fused kernel each way,
        # not torch's eager elementwise ops. (CPU: off, no compiler needed for the smoke mode.)
        bias_activation_fusion=on_gpu, bias_dropout_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=not on_gpu,
        params_dtype=torch.bfloat16 if on_gpu else torch.float32, bf16=on_gpu,
    )


def build_model(cfg: TrainConfig, variant: str, device: torch.device, fp8_format: str = "hybrid",
                backend: str = "auto", main_grad_fusion: bool = False):
    """A Megatron-core GPTModel (byte vocabulary, RoPE) with the variant's experts, on ``device``.

    ``main_grad_fusion``: ``config.gradient_accumulation_fusion`` on for turbo_moe's expert linears
    (they read it when they run; Megatron's own dense linears read it when built, and need APEX
    for it, so they are built without it): with ``MasterWeightAdam(main_grads=True)`` their weight
    gradients accumulate in float32 ``main_grad`` buffers, as under Megatron's DDP."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    if variant not in TRAIN_VARIANTS:
        raise ValueError(f"variant {variant!r} is not one of {', '.join(TRAIN_VARIANTS)}")
    _fresh_moe_metrics_tracker()
    logging.getLogger("megatron.core.models.gpt.gpt_model").setLevel(logging.ERROR)  # "GPTModel IS DEPRECATED"
    turbo, granularity = TRAIN_VARIANTS[variant]
    spec = get_gpt_layer_local_spec(num_experts=cfg.experts, moe_grouped_gemm=True)
    if turbo:
        from turbo_moe.megatron import use_turbo_moe_experts

        if granularity is None:
            spec = use_turbo_moe_experts(spec, fp8=None)
        else:
            if granularity == DELAYED:
                spec = use_turbo_moe_experts(spec, fp8=bench_float8_config(fp8_format, DELAYED), backend=backend)
            else:
                spec = use_turbo_moe_experts(spec, fp8=fp8_format, granularity=granularity, backend=backend)
    config = _transformer_config(cfg, device)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB_SIZE,
                     max_sequence_length=cfg.seq, position_embedding_type="rope")
    if config.bf16:
        # As Megatron's get_model does: Float16Module casts the whole model to bf16 (the torch
        # LayerNorms, which ignore params_dtype, included) and returns the loss in float32.
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    config.gradient_accumulation_fusion = main_grad_fusion
    return model.to(device)


def _fresh_moe_metrics_tracker() -> None:
    """Megatron's global MoE metrics (aux loss per layer) are sized by the first model's layer count."""
    try:
        from megatron.core.transformer.moe import moe_logging
    except ImportError:  # an older megatron-core: its tracker is a dict that is reset by name
        return
    moe_logging.set_moe_metrics_tracker(moe_logging.MoEMetricsTracker())


def experts_of(model) -> List[torch.nn.Module]:
    """The expert modules (``MoELayer.experts``) of every layer."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return [m.experts for m in model.modules() if isinstance(m, MoELayer)]


# SequentialMLP's per-expert parameters; turbo_moe (like TEGroupedMLP) stacks them as [E, out, in].
_PER_EXPERT = re.compile(r"^(?P<pre>.*\.experts)\.local_experts\.(?P<e>\d+)\.(?P<fc>linear_fc[12])\.(?P<kind>weight|bias)$")


def _canonical_name(name: str):
    m = _PER_EXPERT.match(name)
    if m is None:
        return name, None
    return f"{m['pre']}.{m['fc']}.{m['kind']}", int(m["e"])


def canonical_state(model, value=lambda p: p.detach()) -> Dict[str, torch.Tensor]:
    """Every parameter (or ``value(parameter)``, e.g. its gradient), on the CPU, by name; per-expert
    weights stacked into turbo_moe's ``[E, out, in]``."""
    state: Dict[str, torch.Tensor] = {}
    stacks: Dict[str, Dict[int, torch.Tensor]] = {}
    for name, p in model.named_parameters():
        key, expert = _canonical_name(name)
        if expert is None:
            state[key] = value(p).to("cpu", copy=True)
        else:
            stacks.setdefault(key, {})[expert] = value(p)
    for key, by_expert in stacks.items():
        state[key] = torch.stack([by_expert[e] for e in sorted(by_expert)]).to("cpu")
    return state


def load_canonical_state(model, state: Dict[str, torch.Tensor]) -> None:
    """Copy a :func:`canonical_state` into ``model`` (either expert layout); every entry must be used."""
    used = set()
    with torch.no_grad():
        for name, p in model.named_parameters():
            key, expert = _canonical_name(name)
            if key not in state:
                raise KeyError(f"parameter {name} has no entry {key!r} in the initial state")
            src = state[key] if expert is None else state[key][expert]
            if tuple(src.shape) != tuple(p.shape):
                raise ValueError(f"parameter {name}: shape {tuple(p.shape)} but the initial state has {tuple(src.shape)}")
            p.copy_(src)
            used.add(key)
    unused = sorted(set(state) - used)
    if unused:
        raise KeyError(f"initial state entries matched no parameter: {unused[:5]}")


class MasterWeightAdam:
    """Adam on float32 master copies of low-precision parameters, gradients clipped by global norm.

    What Megatron's mixed-precision optimizer does without apex/TE: after the micro-batches'
    gradients have accumulated in ``param.grad`` (bf16), they are copied into float32 master
    gradients, clipped, Adam updates the float32 masters (fused kernel on CUDA), and the
    parameters are overwritten with the rounded masters. float32 parameters are updated in place.

    ``main_grads``: as under Megatron's DDP, every parameter gets a float32 ``main_grad`` (a
    low-precision parameter's is its master's gradient) and ``grad_added_to_main_grad``; a layer
    that accumulates its weight gradient there (``gradient_accumulation_fusion``) sets the flag
    and hands autograd a placeholder, which a post-accumulate hook drops (DDP's hook does the same);
    the other parameters' ``.grad`` is taken as before.
    """

    def __init__(self, params, lr: float, betas=(0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.0,
                 clip_grad: Optional[float] = 1.0, main_grads: bool = False):
        self.params = [p for p in params if p.requires_grad]
        self.low = [p for p in self.params if p.dtype != torch.float32]
        self.masters = [p.detach().float().clone() for p in self.low]
        for m in self.masters:
            m.grad = torch.zeros_like(m)
        self.fp32 = [p for p in self.params if p.dtype == torch.float32]
        self.clip_grad = clip_grad
        self.main_grads = main_grads
        if main_grads:
            for p, m in zip(self.low, self.masters):
                p.main_grad = m.grad
            for p in self.fp32:
                p.main_grad = torch.zeros_like(p)
            for p in self.params:
                p.grad_added_to_main_grad = False
                p.register_post_accumulate_grad_hook(_drop_placeholder_grad)
        on_cuda = bool(self.params) and self.params[0].is_cuda
        self.inner = torch.optim.Adam(self.masters + self.fp32, lr=lr, betas=betas, eps=eps,
                                      weight_decay=weight_decay, **({"fused": True} if on_cuda else {}))

    def set_lr(self, lr: float) -> None:
        for group in self.inner.param_groups:
            group["lr"] = lr

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        if self.main_grads:
            torch._foreach_zero_([p.main_grad for p in self.params])
            for p in self.params:
                p.grad_added_to_main_grad = False

    @torch.no_grad()
    def step(self) -> None:
        for p in self.params:
            if getattr(p, "grad_added_to_main_grad", False):  # accumulated in main_grad already
                if p.dtype == torch.float32:
                    p.grad = p.main_grad  # what the inner Adam reads
            elif p.grad is None:  # an unused parameter (no token reached it) gets a zero gradient
                p.grad = torch.zeros_like(p)
        copies = [(m.grad, p.grad) for p, m in zip(self.low, self.masters)
                  if not getattr(p, "grad_added_to_main_grad", False)]
        if copies:
            torch._foreach_copy_([m for m, _ in copies], [g for _, g in copies])
        if self.clip_grad:
            torch.nn.utils.clip_grad_norm_(self.masters + self.fp32, self.clip_grad, foreach=True)
        self.inner.step()
        if self.low:
            torch._foreach_copy_(self.low, self.masters)


def _drop_placeholder_grad(param: torch.Tensor) -> None:
    """Post-accumulate hook: the weight gradient went into ``main_grad``; ``.grad`` holds
    Megatron's placeholder, which Megatron's DDP hook drops the same way."""
    if getattr(param, "grad_added_to_main_grad", False):
        param.grad = None
