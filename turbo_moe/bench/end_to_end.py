"""End-to-end benchmark: one grouped linear layer, forward + backward, quantization included.

Implementations:

* ``turbo:<backend>:<granularity>`` -- ``turbo_moe.GroupedLinearFP8`` (its weight is the shared
  ``[G, N, K]`` bf16 parameter; the granularity a recipe of ``recipes.RECIPES``, delayed scaling
  included); ``<granularity>+wcache`` with ``cache_fp8_weight=True``: the
  weight does not change between the timed steps (no optimizer step), so it is quantized once,
  as it is once per optimizer step under gradient accumulation;
* ``bf16`` -- ``torch._grouped_mm`` forward and its autograd backward;
* ``torchao_fp8`` -- torchao's ``_to_fp8_rowwise_then_scaled_grouped_mm`` (dynamic rowwise e4m3,
  CUTLASS grouped GEMMs; torchao 0.18).

Each step is ``y = layer(x); dx, dW = autograd.grad(y, (x, W), dy)``: no gradient accumulation
kernel in the timing. Peak memory is ``torch.cuda.max_memory_allocated`` over one step, reset
just before it, the inputs (x, W, dy: the same for all) included, measured two ways:

* ``peak_mb``: x held by the caller through the step (the timed step), so keeping x for backward
  costs an implementation nothing;
* ``peak_act_mb``: x and dy activations, as the permuted tokens entering an expert layer and the
  gradient its next layer hands back are in a model. x is made inside the step (a copy of the leaf,
  whose gradient flows back to it) and owned by nothing but the layer's autograd once the forward
  returns; dy is a fresh copy made by the backward of an identity after the layer, owned by the
  autograd engine alone. What each implementation saves of x for backward then counts (bf16
  ``_grouped_mm`` keeps x itself, turbo_moe an FP8 copy of it), and so does how long it holds dy
  (turbo_moe's planned layers free it once quantized; a Python ``Function`` holds it to the end of
  its backward). Both copies count in every implementation's peak, beside the held inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from . import data
from .kernel_level import Missing, peer_impls
from .recipes import bench_float8_config
from .shapes import Case

__all__ = ["E2E_PEERS", "E2E_EXTRAS", "MICRO_BATCHES", "E2EInputs", "HandOverGrad", "prepare_e2e", "e2e_impls",
           "reference_errors", "hot_path_metrics"]

E2E_PEERS = ("bf16", "torchao_fp8")


@dataclass
class E2EInputs:
    x: torch.Tensor  # [M, K] bf16, requires grad
    w: torch.nn.Parameter  # [G, N, K] bf16
    dy: torch.Tensor  # [M, N] bf16
    group_lens: torch.Tensor  # int64 [G] on the device
    group_ends_int32: torch.Tensor  # int32 [G]
    offs_host: List[int]


def prepare_e2e(case: Case, device: torch.device, seed: int) -> E2EInputs:
    gen = data.maybe_generator(device, seed)
    bf16 = torch.bfloat16
    m, n, k, g = case.m, case.n, case.k, case.num_experts
    x = data.random_normal((m, k), bf16, device, gen).requires_grad_(True)
    # nn.Linear-like weight scale so y has unit-ish magnitude.
    w = torch.nn.Parameter(data.random_normal((g, n, k), bf16, device, gen, std=k**-0.5))
    dy = data.random_normal((m, n), bf16, device, gen)
    offs_host = data.group_offsets(case.group_sizes)
    return E2EInputs(
        x,
        w,
        dy,
        torch.tensor(case.group_sizes, dtype=torch.int64, device=device),
        torch.tensor(offs_host[1:], dtype=torch.int32, device=device),
        offs_host,
    )


Step = Callable[[], Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


class HandOverGrad(torch.autograd.Function):
    """Identity whose backward hands on a fresh copy of its gradient, owned by the autograd engine
    alone, as the gradient of an expert layer's output is in a model (a planned layer's node may
    then free it once quantized: ``planned_layer.release_after_last_read``)."""

    @staticmethod
    def forward(ctx, y):
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        return grad.clone()


def _grad_step(inputs: E2EInputs, forward: Callable[[torch.Tensor], torch.Tensor]) -> Step:
    def step():
        y = forward(inputs.x)
        dx, dw = torch.autograd.grad(y, (inputs.x, inputs.w), inputs.dy)
        return y, dx, dw

    def step_on_activation():
        y = forward(inputs.x.clone())  # nothing outside autograd holds the copy after this line
        dx, dw = torch.autograd.grad(HandOverGrad.apply(y), (inputs.x, inputs.w), inputs.dy)
        return y, dx, dw

    step.on_activation = step_on_activation
    return step


def turbo_step(inputs: E2EInputs, backend: str, granularity: str, fmt: str, num_cu: Optional[int]) -> Step:
    import turbo_moe

    g, n, k = inputs.w.shape
    granularity, _, option = granularity.partition("+")
    config = bench_float8_config(fmt, granularity)
    # Build on the meta device (no init kernels, no memory), then share the bench's weight.
    layer = turbo_moe.GroupedLinearFP8(g, k, n, config=config, num_cu=num_cu, backend=backend, device="meta",
                                       dtype=inputs.w.dtype, cache_fp8_weight=option == "wcache")
    layer.weight = inputs.w
    return _grad_step(inputs, lambda x: layer(x, inputs.group_lens))


def bf16_step(inputs: E2EInputs) -> Step:
    if not hasattr(torch, "_grouped_mm"):
        raise Missing(f"torch {torch.__version__} has no torch._grouped_mm")
    ends = inputs.group_ends_int32
    return _grad_step(inputs, lambda x: torch._grouped_mm(x, inputs.w.transpose(-2, -1), offs=ends))


def torchao_step(inputs: E2EInputs) -> Step:
    if inputs.x.device.type != "cuda":
        raise Missing("torchao's FP8 grouped GEMM runs on CUDA only")
    try:
        from torchao.prototype.moe_training.fp8_grouped_mm import _to_fp8_rowwise_then_scaled_grouped_mm
    except Exception as exc:  # not installed, or an incompatible build
        raise Missing(f"torchao FP8 grouped GEMM not importable: {type(exc).__name__}: {exc}") from None
    ends = inputs.group_ends_int32

    def forward(x):
        # Groups are already 16-aligned (--align 16); torchao 0.18 asserts when asked to pad.
        return _to_fp8_rowwise_then_scaled_grouped_mm(
            x, inputs.w.transpose(-2, -1), ends, out_dtype=torch.bfloat16, pad_token_groups_for_grouped_mm=False
        )

    return _grad_step(inputs, forward)


def e2e_impls(
    inputs: E2EInputs, backends: List[str], granularities: List[str], fmt: str, peers: List[str], num_cu: Optional[int]
) -> List[Tuple[str, object]]:
    """``(label, step or Missing)``, turbo_moe first."""
    out: List[Tuple[str, object]] = []
    for backend in backends:
        for granularity in granularities:
            label = f"turbo:{backend}:{granularity}"
            try:
                out.append((label, turbo_step(inputs, backend, granularity, fmt, num_cu)))
            except Exception as exc:  # a module that cannot be built here is reported, not fatal
                out.append((label, Missing(f"{type(exc).__name__}: {exc}")))
    return out + peer_impls({"bf16": bf16_step, "torchao_fp8": torchao_step}, inputs, peers)


def reference_errors(inputs: E2EInputs, y: torch.Tensor, dx: torch.Tensor, dw: torch.Tensor) -> Dict[str, float]:
    """Relative errors of y, dx, dW against float32 group-by-group references."""
    with torch.no_grad():
        return _reference_errors(inputs, y.detach(), dx.detach(), dw.detach())


def _reference_errors(inputs: E2EInputs, y: torch.Tensor, dx: torch.Tensor, dw: torch.Tensor) -> Dict[str, float]:
    x, w, dy = inputs.x.detach(), inputs.w.detach(), inputs.dy
    num = {"y": 0.0, "dx": 0.0, "dw": 0.0}
    den = {"y": 0.0, "dx": 0.0, "dw": 0.0}

    def add(key, got, ref):
        num[key] += float((got.double() - ref.double()).square().sum())
        den[key] += float(ref.double().square().sum())

    offs = inputs.offs_host
    for g in range(len(offs) - 1):
        lo, hi = offs[g], offs[g + 1]
        wg = w[g].float()
        xg, dyg = x[lo:hi].float(), dy[lo:hi].float()
        if hi > lo:
            add("y", y[lo:hi].float(), xg @ wg.T)
            add("dx", dx[lo:hi].float(), dyg @ wg)
        add("dw", dw[g].float(), dyg.T @ xg)  # an empty group's dW must be exactly zero
    errs = {}
    for key, tensor in (("y", y), ("dx", dx), ("dw", dw)):
        if not bool(torch.isfinite(tensor).all()):
            errs[key] = math.inf
        elif den[key] == 0.0:
            errs[key] = 0.0 if num[key] == 0.0 else math.inf
        else:
            errs[key] = math.sqrt(num[key] / den[key])
    return errs


# The hot-path measurements the benchmark adds to each end-to-end record (``--e2e-extras``).
E2E_EXTRAS = ("host", "launches", "graph", "microbatch", "gpusplit")
MICRO_BATCHES = 4


def hot_path_metrics(name: str, step: Step, inputs: E2EInputs, device: torch.device, extras: List[str],
                     ms: Optional[float], warmup_ms: float, rep_ms: float) -> Dict[str, object]:
    """Host µs to issue a step, GPU launches per step, CUDA-graph ms, ms per micro-batch, and the
    profiler's split of the GPU time into quantization, GEMM and other kernels.

    ``mb4_ms``: per micro-batch of a ``MICRO_BATCHES``-micro-batch optimizer step (the weight's
    version bumped once per step, so ``+wcache`` layers quantize it once per step); ``mb1_ms``: one
    micro-batch per optimizer step (measured for ``+wcache`` layers; for the others the work is the
    same as every timed call, so it is ``ms``). ``gpusplit``: one profiled optimizer step of
    ``MICRO_BATCHES`` micro-batches and one of 1 (:func:`step_metrics.gpu_time_breakdown`), per
    micro-batch: ``{gpu,quant,gemm,other}_mb4_ms``, ``quant_share_mb4`` and the same with ``mb1``.
    What cannot be measured here gets its reason in ``hot_path_notes``.
    """
    from . import step_metrics as sm

    out: Dict[str, object] = {}
    why: List[str] = []

    def attempt(key, fn):
        try:
            fn()
        except sm.NotAvailable as exc:
            why.append(f"{key}: {exc}")
        except Exception as exc:  # measured where possible; one failure does not lose the others
            why.append(f"{key}: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}")
            if device.type == "cuda":
                torch.cuda.synchronize(device)

    if "host" in extras:
        def host():
            res = sm.host_issue_us(step, device)
            out.update(host_us=res["us"], host_sync=res["synchronizes"])
        attempt("host", host)
    if "launches" in extras:
        def launches():
            counts = sm.gpu_activity_counts(step, device)
            out.update(launches=counts["total"], launch_kernels=counts["kernel"],
                       launch_memsets=counts["memset"], launch_memcpys=counts["memcpy"])
        attempt("launches", launches)
    if "graph" in extras:
        def graph():
            out["graph_ms"] = sm.cuda_graph_ms(step, device, warmup_ms, rep_ms)
        attempt("graph", graph)
    if "microbatch" in extras:
        def microbatch():
            out["mb4_ms"] = sm.microbatch_ms(step, inputs.w, MICRO_BATCHES, device, warmup_ms, rep_ms)
            if "+wcache" in name:
                out["mb1_ms"] = sm.microbatch_ms(step, inputs.w, 1, device, warmup_ms, rep_ms)
            else:
                out["mb1_ms"] = ms
        attempt("microbatch", microbatch)
    if "gpusplit" in extras:
        def gpusplit():
            for label, micro in (("mb4", MICRO_BATCHES), ("mb1", 1)):
                split = sm.gpu_time_breakdown(sm.optimizer_step(step, inputs.w, micro), device, calls=micro)
                out.update({f"gpu_{label}_ms": split["total_ms"], f"quant_{label}_ms": split["quant_ms"],
                            f"gemm_{label}_ms": split["gemm_ms"], f"other_{label}_ms": split["other_ms"],
                            f"quant_share_{label}": split["quant_share"],
                            f"quant_launches_{label}": split["quant_launches"],
                            f"gemm_launches_{label}": split["gemm_launches"]})
        attempt("gpusplit", gpusplit)
    if why:
        out["hot_path_notes"] = "; ".join(why)
    return out
