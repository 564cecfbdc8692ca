"""Triton backend: the persistent FP8 grouped GEMM kernels of ``turbo_moe.kernels.triton``.

Where it runs
-------------
* CUDA devices of compute capability >= 8.9 (FP8 tensor cores: Ada, Hopper and later), and ROCm
  devices whose Triton supports the OCP FP8 types (gfx950, gfx12);
* CPU tensors when the kernels were imported under ``TRITON_INTERPRET=1`` (Triton fixes a kernel's
  mode when it is decorated, so the backend asks the kernel object, not the environment). That is
  how the CPU tests run it. CPU tensors without the interpreter are declined with that reason.

Tuning and CUDA graphs
----------------------
Each call picks a kernel configuration (block sizes, warps, pipeline stages) from a small
candidate table per problem kind. On the first *eager* call of a shape class (kind, N, K, the
power-of-two classes of M and of the rows per group, FP8 dtypes, scaling, output dtype, device)
every candidate is timed on the call's own operands and the fastest is cached for the process.
A call made while a CUDA graph is being captured never benchmarks (that would launch outside the
captured stream's rules and allocate): it uses the cached choice if there is one, else the
first candidate, and does not cache it. So: run one eager step first, capture afterwards.
``TURBO_MOE_TRITON_AUTOTUNE=0`` turns tuning off (the first candidate always).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import threading
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from ..kernels.triton.launch import HostDesc  # torch only: importing it needs no triton
from .base import GemmKind, GroupedGemmBackend, GroupedGemmProblem
from .triton_checks import _tma_reason, _tma_store_ok, _validate

__all__ = ["TritonBackend", "KernelConfig", "BACKEND"]

@dataclass(frozen=True)
class KernelConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 4
    # K-grouped only: band-cyclic (True) or group-major (False) tile order.
    band_cyclic: bool = True
    # Load through TMA descriptors where the operands allow it (see _tma_reason), else pointers.
    tma: bool = True
    # With tma: also store the output tile through a descriptor (async, coalesced, overlaps the
    # next tile's loads) where the output's strides allow it.
    tma_store: bool = True
    # Programs per SM of the persistent grid when no num_cu cap is set: 2 lets one program's
    # epilogue (or pipeline fill) run beside another's MMAs on the same SM, for configs whose
    # shared memory and registers fit twice. With a cap, one per SM (the cap counts SMs).
    programs_per_sm: int = 1
    # On sm_90, a Gluon kernel. K-grouped: kernels/triton/grouped_gemm_gluon.py, whose loads run
    # ahead across tiles and whose epilogue store overlaps the next tile. M-grouped:
    # kernels/triton/m_grouped_gemm_gluon.py, a warp-specialized ping-pong (num_warps: each of its
    # two consumer warpgroups'; a producer warp besides). num_stages is the ring's depth. Same bits
    # as the Triton TMA kernels. A problem it cannot take (_gluon_reason) runs the Triton TMA kernel
    # with the same tiles.
    gluon: bool = False
    # K-grouped, with gluon: the warp-specialized ping-pong
    # (grouped_gemm_gluon.k_grouped_gemm_pingpong_kernel), whose consumers take alternate tiles so
    # one's epilogue (into an fp32 main_grad: the read-modify-write; into bf16: the store) runs
    # beside the other's MMAs. num_warps: each consumer warpgroup's (4); a producer warp besides.
    # Same bits as the other wgrad kernels.
    pingpong: bool = False

    def __str__(self) -> str:
        return (
            f"{self.block_m}x{self.block_n}x{self.block_k} gm{self.group_m} w{self.num_warps} s{self.num_stages}"
            + ("" if self.band_cyclic else " group-major")
            + ("" if self.tma else " ptr")
            + ("" if (self.tma_store or not self.tma) else " ptr-store")
            + ("" if self.programs_per_sm == 1 else f" x{self.programs_per_sm}/SM")
            + (" gluon" if self.gluon else "")
            + (" pingpong" if self.pingpong else "")
        )


# Candidates per problem kind on GPUs; the first is the default (no tuning, or during capture).
# 128x128x128 with 8 warps is what Hopper's FP8 wgmma likes (two warpgroups, K-major operands).
GPU_CANDIDATES: Dict[GemmKind, Tuple[KernelConfig, ...]] = {
    GemmKind.M_GROUPED: (
        # The Gluon ping-pong first (the untuned default where a problem can take it): two 128 x 128
        # consumer warpgroups, one's epilogue beside the other's MMAs
        # (kernels/triton/m_grouped_gemm_gluon.py). H100, the expert-dominated training layer's four
        # M-grouped GEMMs, ms against the Triton kernel's 128 x 256 tiles: fc1 fwd 0.82 / 0.97,
        # fc2 fwd 0.38 / 0.46, fc2 dgrad 0.44 / 0.55, fc1 dgrad 0.72 / 0.76
        # (scripts/probe_m_grouped_epilogue.py).
        KernelConfig(128, 128, 128, 8, 4, 4, gluon=True),
        KernelConfig(128, 256, 128, 8, 8, 3),
        KernelConfig(128, 128, 128, 8, 8, 4),
        KernelConfig(128, 256, 128, 8, 8, 3, tma_store=False),
        KernelConfig(128, 256, 128, 8, 8, 3, tma=False),
        KernelConfig(128, 128, 128, 8, 4, 5, tma=False),
    ),
    # Group-major first: measured faster than band-cyclic on the H100 for every shape, balanced
    # or skewed (docs/triton_notes.md): with a static round-robin deal both orders give every
    # program the same work, and group-major keeps concurrent programs on the same group's
    # tokens (L2 reuse).
    GemmKind.K_GROUPED: (
        # The Gluon kernel, first (the untuned default where a problem can take it). H100, TFLOPS of
        # its best config / the Triton kernel's best / CUTLASS FP8 on the kernel bench's data
        # (docs/results/h100_gluon_wgrad.md): DeepSeek-V3 fc1 32x512 749 / 665 / 795, 128x128
        # 272 / 248 / 283, Qwen3 fc2 32x512 701 / 612 / 662.
        KernelConfig(128, 256, 128, 8, 8, 3, band_cyclic=False, gluon=True),
        KernelConfig(128, 128, 128, 8, 8, 4, band_cyclic=False, gluon=True),
        KernelConfig(128, 128, 128, 8, 4, 4, band_cyclic=False, gluon=True),
        # The ping-pong: four stages beside two 32 KB bf16 staging tiles, each consumer's epilogue
        # beside the other's MMAs. H100, warm (scripts/probe_wgrad_bf16_pingpong.py,
        # docs/results/h100_wgrad_bf16_pingpong.md): 0.88-0.93x the best single-stream config's
        # time at 32 x 512 tokens (DeepSeek-V3 fc1, Qwen3 fc1 / fc2), 1.03-1.27x at 128 and 4096
        # tokens per expert, where the tuner keeps the others.
        KernelConfig(128, 128, 128, 8, 4, 4, band_cyclic=False, gluon=True, pingpong=True),
        # Two programs per SM (96 KB of shared memory each): one's epilogue beside the other's
        # MMAs, for groups of one or two boxes (128 x 128 tokens per expert).
        KernelConfig(128, 128, 128, 8, 4, 2, band_cyclic=False, programs_per_sm=2, gluon=True),
        KernelConfig(128, 256, 128, 8, 8, 3, band_cyclic=False),
        KernelConfig(128, 256, 128, 8, 8, 3),
        KernelConfig(128, 128, 128, 8, 8, 4, band_cyclic=False),
        KernelConfig(128, 256, 128, 8, 8, 3, band_cyclic=False, tma_store=False),
        KernelConfig(128, 256, 128, 8, 8, 3, band_cyclic=False, tma=False),
        # Short groups (many experts, few tokens each): each output tile runs 1-4 K-steps, so the
        # tile's fixed cost (prologue, epilogue store) dominates; smaller or one-warpgroup tiles
        # give more tiles in flight per SM and overlap one tile's store with another's loads.
        KernelConfig(128, 128, 128, 8, 4, 3, band_cyclic=False),
        KernelConfig(64, 256, 128, 8, 4, 3, band_cyclic=False),
        # Two programs per SM (96 KB of shared memory each): one tile's fill/drain and store
        # beside another's MMAs. DeepSeek-V3 fc1 at 128 x 128: 3.92 -> 3.36 ms, CUTLASS FP8's time
        # (docs/results/h100_wgrad_main_grad.md); slower where groups are long.
        KernelConfig(128, 128, 128, 8, 4, 2, band_cyclic=False, programs_per_sm=2),
    ),
}
# The single-stream Gluon wgrad into an fp32 main_grad reads a tile's old values after box
# min(boxes // 2, this) of its MMAs: early enough to arrive before the epilogue, late enough that
# the previous tile's store (64 KB, about six boxes of MMA time at the train preset's shapes) has
# drained, since both share one staging tile. H100 (scripts/probe_wgrad_old_tile.py): 0.93-0.96x
# the time of reading it in the epilogue at the train preset's fc1, 0.93x at DeepSeek-V3's fc1.
WGRAD_OLD_TILE_BOX = 6

# K-grouped into an fp32 main_grad (accumulate): the epilogue's fp32 read-modify-write is about as
# many bytes as the operands at training-step group sizes. 128 x 128 tiles (64 fp32 registers a
# thread for the tile with 8 warps) with the read-modify-write through TMA both ways: 6-10% faster
# than the pointer epilogue, and 128 x 256 tiles spill there (H100, scripts/bench_wgrad.py,
# docs/results/h100_wgrad_main_grad.md). Where the output cannot take a descriptor, the same tiles
# fall back to the pointer epilogue.
ACCUMULATE_CANDIDATES: Tuple[KernelConfig, ...] = (
    # The Gluon kernel: its read-modify-write through TMA overlaps the next tile's loads.
    KernelConfig(128, 128, 128, 8, 8, 4, band_cyclic=False, gluon=True),
    # The ping-pong: three stages beside two 64 KB float32 staging tiles. H100: 0.95x the first
    # candidate's time at DeepSeek-V3's fc1 32 x 512, 1.04-1.15x at the train preset's DRAM-bound
    # fc1 / fc2 (scripts/probe_wgrad_pingpong.py), measured before the first candidate's mid-tile
    # read (WGRAD_OLD_TILE_BOX), which took it to 0.92-0.94x there; the tuner picks per shape class.
    KernelConfig(128, 128, 128, 8, 4, 3, band_cyclic=False, gluon=True, pingpong=True),
    KernelConfig(128, 128, 128, 8, 4, 4, band_cyclic=False, gluon=True),
    KernelConfig(128, 64, 128, 8, 4, 3, band_cyclic=False, programs_per_sm=2, gluon=True),
    KernelConfig(128, 128, 128, 8, 8, 4, band_cyclic=False),
    KernelConfig(128, 128, 128, 8, 4, 3, band_cyclic=False),
    KernelConfig(64, 256, 128, 8, 4, 2, band_cyclic=False),
    # Two programs per SM (106 KB of shared memory, 129 registers each): one's read-modify-write
    # beside the other's MMAs. 8-9% faster at 32-128 experts of DeepSeek-V3 fc1 (K = 512 / 128
    # tokens per tile), 20% slower at the train preset's 1536-token groups.
    KernelConfig(128, 64, 128, 8, 4, 3, band_cyclic=False, programs_per_sm=2),
)


# On ROCm (where FlyDSL does not take a call: the hybrid format's e5m2 gradients, float32-scale
# blockwise) the pointer kernels run, and the Hopper sets above spill there: compiled for gfx950,
# every M-grouped candidate above takes 76-896 bytes of scratch (128 x 256 tiles, and 128-deep K
# steps beside a 128 x 128 tile). These compile for gfx950 with no scratch (Triton 3.9,
# tests/test_triton_gfx950_compile.py checks each); which is fastest has never been measured (no
# AMD GPU is lent): tuning times them on the device, and the first is the untuned default.
HIP_CANDIDATES: Dict[GemmKind, Tuple[KernelConfig, ...]] = {
    GemmKind.M_GROUPED: (
        KernelConfig(128, 128, 64, 8, 8, 2, tma=False),
        KernelConfig(128, 64, 128, 8, 4, 2, tma=False),
        KernelConfig(64, 64, 128, 8, 4, 2, tma=False),
    ),
    GemmKind.K_GROUPED: (
        KernelConfig(128, 128, 64, 8, 8, 2, band_cyclic=False, tma=False),
        KernelConfig(128, 128, 128, 8, 8, 2, band_cyclic=False, tma=False),
        KernelConfig(256, 128, 64, 8, 8, 2, band_cyclic=False, tma=False),
        KernelConfig(128, 64, 128, 8, 4, 2, band_cyclic=False, tma=False),
    ),
}
# Into an fp32 main_grad: the epilogue's read-modify-write makes 128 x 128 x 128 (88 bytes) and
# 256 x 128 x 64 (16 bytes) spill on gfx950; these two do not.
HIP_ACCUMULATE_CANDIDATES: Tuple[KernelConfig, ...] = (
    KernelConfig(128, 128, 64, 8, 8, 2, band_cyclic=False, tma=False),
    KernelConfig(128, 64, 128, 8, 4, 2, band_cyclic=False, tma=False),
)


def _on_rocm(problem: GroupedGemmProblem) -> bool:
    return problem.device.type == "cuda" and bool(torch.version.hip)


# fc1 with the SwiGLU amax epilogue: the ping-pong's SWIGLU tiles (kernels/triton/m_grouped_gemm_gluon.py),
# block_n counting a tile's gate columns (it holds as many linear ones: 128 x 128 in all). Its
# epilogue, which computes the SwiGLU for the amax, runs beside the other consumer's MMAs.
SWIGLU_CANDIDATES: Tuple[KernelConfig, ...] = (KernelConfig(128, 64, 128, 8, 4, 4, gluon=True),)


def candidates_for(problem: GroupedGemmProblem) -> Tuple[KernelConfig, ...]:
    """The configurations tuning chooses among for ``problem``; the first is the default. Gluon
    configurations only where the problem can take them (``_gluon_reason``)."""
    if problem.swiglu_probs is not None:
        return SWIGLU_CANDIDATES
    if _on_rocm(problem):
        return HIP_ACCUMULATE_CANDIDATES if problem.accumulate else HIP_CANDIDATES[problem.kind]
    candidates = ACCUMULATE_CANDIDATES if problem.accumulate else GPU_CANDIDATES[problem.kind]
    if not any(c.gluon for c in candidates):
        return candidates
    return tuple(c for c in candidates if not c.gluon or not _gluon_reason(problem, c, problem.out))


def gluon_output_reason(problem, config, out: Optional[torch.Tensor], store_tiles: int = 1) -> str:
    """Empty if a Gluon K-grouped kernel (tensorwise or blockwise) can store ``problem``'s output
    (``out``, or a fresh contiguous one when None) under ``config``: one [G*N, K] store descriptor,
    and its operand ring plus ``store_tiles`` store tiles (the wgrad ping-pong: one a consumer)
    within shared memory."""
    _, N, K = problem.mnk
    if N % config.block_m:
        return f"N={N} is not a multiple of the Gluon kernel's BLOCK_M={config.block_m} (one [G*N, K] store descriptor)"
    if problem.num_groups * N >= 2**31:
        return "TMA coordinates are 32-bit"
    why = _store_descriptor_reason(problem.out_dtype, K, out)
    if why:
        return why
    item = torch.empty((), dtype=problem.out_dtype).element_size()
    operands = config.num_stages * (config.block_m + config.block_n) * config.block_k
    if operands + store_tiles * config.block_m * config.block_n * item > _SHARED_MEMORY_BUDGET:
        return f"its ring and {'store tile' if store_tiles == 1 else f'{store_tiles} store tiles'} do not fit in " \
               "shared memory"
    return ""


def _store_descriptor_reason(out_dtype: torch.dtype, row: int, out: Optional[torch.Tensor]) -> str:
    """Empty if the Gluon kernels' host store descriptor can cover an output of ``row``-element rows
    (``out``, or a fresh contiguous one when None), else why not."""
    item = torch.empty((), dtype=out_dtype).element_size()
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32) or (row * item) % 16:
        return "the output needs a 16-byte row stride and a 16/32-bit float dtype"
    if out is not None and not (out.is_contiguous() and _tma_store_ok(out)):
        return "the output must be contiguous and 16-byte aligned"
    return ""


def ptxas_description() -> str:
    """The ptxas Triton compiles CUDA kernels with, as "<version> (<path>)", or why it is unknown.
    Benchmarks and the GPU check print it beside their numbers. Triton 3.6 bundles CUDA 12.8's ptxas:
    it lacks the FFMA interleaving that 12.9+ does (worth 0.77x -> 0.95x in a blockwise promotion
    loop), and it miscompiled a Gluon wgrad variant that CUDA 13.0's compiles right
    (docs/results/h100_wgrad_skew.md, h100_fine_grained.md). TRITON_PTXAS_PATH points Triton at
    another one."""
    try:
        import triton

        tool = triton.knobs.nvidia.ptxas
        return f"{tool.version} ({tool.path})"
    except Exception as exc:  # no Triton, no CUDA backend, or a Triton without knobs
        return f"unknown ({type(exc).__name__}: {str(exc)[:80]})"


@functools.lru_cache(maxsize=None)
def _gluon_device_reason(device: torch.device) -> str:
    """Empty if ``device`` is an sm_90 GPU (the Gluon kernel's wgmma), else why not."""
    if device.type != "cuda" or torch.version.hip or not torch.cuda.is_available():
        return "the Gluon kernel needs an NVIDIA sm_90 GPU (wgmma)"
    cap = torch.cuda.get_device_capability(device)
    return "" if cap == (9, 0) else f"the Gluon kernel needs sm_90 (wgmma), not sm_{cap[0]}{cap[1]}"


# Why the Gluon kernels are off in this process ("" while they are on): the first compile of one
# failed here, e.g. under a Triton whose Gluon API differs from the 3.6 and 3.9 they compile with.
_GLUON_OFF = ""


def gluon_unavailable(device: torch.device) -> str:
    """Empty if the Gluon kernels may run on ``device``, else why not (the device, or a failed compile)."""
    return _GLUON_OFF or _gluon_device_reason(device)


def launch_gluon_or_fall_back(plan, launch, fallback):
    """``launch(plan)`` for a new Gluon plan, whose first launch compiles its kernel. If that compile
    fails, the Gluon kernels are turned off for the process (a warning says why) and
    ``launch(fallback())`` runs the Triton kernel instead. Returns the plan that ran. Only compile
    errors are caught: they come before anything is launched, so nothing runs twice (an fp32
    main_grad is never added into twice)."""
    global _GLUON_OFF
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources, PTXASError

    try:
        launch(plan)
        return plan
    except (CompilationError, OutOfResources, PTXASError) as exc:
        first_line = (str(exc).strip().splitlines() or [""])[-1][:300]
        _GLUON_OFF = f"a Gluon kernel did not compile here ({type(exc).__name__}: {first_line})"
    import warnings

    warnings.warn(f"turbo_moe: {_GLUON_OFF}; the Triton kernels run instead", RuntimeWarning, stacklevel=3)
    plan = fallback()
    launch(plan)
    return plan


def _gluon_reason(problem: GroupedGemmProblem, config: KernelConfig, out: Optional[torch.Tensor]) -> str:
    """Empty if the Gluon kernel of ``problem``'s kind (the K-grouped wgrad, the M-grouped
    ping-pong) can run it with ``config``'s tiles into ``out`` (None: a fresh contiguous output),
    else why not."""
    if not config.tma:
        return "the configuration asks for pointer loads"
    why = gluon_unavailable(problem.device)
    if why:
        return why
    if problem.promote_accumulation:
        return "the Gluon kernel does not promote the accumulator"
    why = _tma_reason(problem)
    if why:
        return why
    if problem.kind is GemmKind.M_GROUPED:
        why = pingpong_reason(problem, config, out)
        if why:
            return why
        from turbo_moe.kernels.triton import m_grouped_gemm_gluon

        return m_grouped_gemm_gluon.GLUON_ERROR
    why = wgrad_pingpong_reason(problem, config, out) if config.pingpong else gluon_output_reason(problem, config, out)
    if why:
        return why
    from turbo_moe.kernels.triton import grouped_gemm_gluon

    return grouped_gemm_gluon.GLUON_ERROR


# The ping-pong's register split (setmaxnreg, per thread): 224 for each consumer warpgroup (a 128 x
# 128 fp32 accumulator is 128 of them), 64 for the producer's warpgroup, 65536 in all; the kernel's
# own limit is the SM's file over its 12 warps. sm_90 compile: no spills, tensorwise or rowwise.
PINGPONG_REGS = dict(CONSUMER_REGS=224, PRODUCER_REGS=64, maxnreg=168)


def wgrad_pingpong_reason(problem: GroupedGemmProblem, config: KernelConfig, out: Optional[torch.Tensor]) -> str:
    """Empty if the wgrad ping-pong can run ``problem`` with ``config``'s tiles into ``out`` (None: a
    fresh contiguous output), else why not. Its epilogue follows the output's dtype: it adds into a
    float32 main_grad (accumulate) and writes a bf16 / fp16 output."""
    if problem.kind is not GemmKind.K_GROUPED:
        return "the wgrad ping-pong runs K-grouped problems only"
    if problem.accumulate and problem.out_dtype != torch.float32:
        return f"the wgrad ping-pong accumulates into float32 only, not {problem.out_dtype}"
    if not problem.accumulate and problem.out_dtype == torch.float32:
        return "the wgrad ping-pong writes 16-bit outputs only (a float32 one is a main_grad it adds into)"
    if config.num_warps != 4:
        return "the ping-pong's consumers are one warpgroup each (num_warps=4)"
    if config.programs_per_sm != 1:
        return "the ping-pong runs one program per SM"
    return gluon_output_reason(problem, config, out, store_tiles=2)  # a staging tile a consumer


def swiglu_reason(problem: GroupedGemmProblem) -> str:
    """Empty if the ping-pong's SWIGLU tiles can run ``problem`` (fc1 with the SwiGLU amax
    epilogue, whose operands ``GroupedGemmProblem.swiglu_reason`` has checked), else why not."""
    config = SWIGLU_CANDIDATES[0]
    F = problem.mnk[1] // 2
    if F % config.block_n:
        return f"F={F} is not a multiple of the SwiGLU tile's {config.block_n} gate columns"
    if problem.swiglu_amax.numel() < 2:
        return "the SwiGLU amax needs two slots a program"
    return _gluon_reason(problem, config, problem.out)


def pingpong_reason(problem: GroupedGemmProblem, config: KernelConfig, out: Optional[torch.Tensor]) -> str:
    """Empty if the Gluon M-grouped ping-pong can run ``problem`` with ``config``'s tiles into
    ``out`` (None: a fresh contiguous output), else why not."""
    if config.num_warps != 4:
        return "the ping-pong's consumers are one warpgroup each (num_warps=4)"
    if config.programs_per_sm != 1:
        return "the ping-pong runs one program per SM"
    _, N, _ = problem.mnk
    why = _store_descriptor_reason(problem.out_dtype, N, out)
    if why:
        return why
    item = torch.empty((), dtype=problem.out_dtype).element_size()
    widen = 2 if problem.swiglu_probs is not None else 1  # SWIGLU tiles: a gate and a linear box
    operands = config.num_stages * (config.block_m + widen * config.block_n) * config.block_k
    if operands + 2 * config.block_m * widen * config.block_n * item > _SHARED_MEMORY_BUDGET:
        return "its ring and two store tiles do not fit in shared memory"
    return ""


# Under the interpreter: small tiles, so that small test shapes still span many tiles.
INTERPRETER_CONFIG = KernelConfig(16, 16, 32, 2, 1, 1)


_KERNELS = None
_PLAN_IDS = itertools.count()


class _Kernels:
    """The GEMM kernels behind host-lean launchers (kernels/triton/launch.py)."""

    def __init__(self, module) -> None:
        from turbo_moe.kernels.triton.launch import lean

        self.module = module
        for name in ("m_grouped_gemm_kernel", "m_grouped_gemm_tma_kernel", "k_grouped_gemm_kernel",
                     "k_grouped_gemm_tma_kernel"):
            setattr(self, name, lean(getattr(module, name)))

    @functools.cached_property
    def k_grouped_gemm_gluon_kernel(self):  # imported on first use: only sm_90 plans launch it
        from turbo_moe.kernels.triton import grouped_gemm_gluon, launch

        return launch.lean(grouped_gemm_gluon.k_grouped_gemm_gluon_kernel)

    @functools.cached_property
    def k_grouped_gemm_pingpong_kernel(self):  # imported on first use: only sm_90 plans launch it
        from turbo_moe.kernels.triton import grouped_gemm_gluon, launch

        return launch.lean(grouped_gemm_gluon.k_grouped_gemm_pingpong_kernel)

    @functools.cached_property
    def m_grouped_gemm_pingpong_kernel(self):  # imported on first use: only sm_90 plans launch it
        from turbo_moe.kernels.triton import launch, m_grouped_gemm_gluon

        return launch.lean(m_grouped_gemm_gluon.m_grouped_gemm_pingpong_kernel)


def _kernels():
    """The kernels, imported on first use so that importing this backend needs no triton."""
    global _KERNELS
    if _KERNELS is None:
        from turbo_moe.kernels.triton import grouped_gemm

        _KERNELS = _Kernels(grouped_gemm)
    return _KERNELS


def _interpreting() -> bool:
    """Whether the kernels were decorated in interpreter mode (TRITON_INTERPRET=1 at import)."""
    return type(_kernels().module.m_grouped_gemm_kernel).__name__ == "InterpretedFunction"


def _pow2_class(x: int) -> int:
    return 0 if x <= 0 else (x - 1).bit_length()


class TritonBackend(GroupedGemmBackend):
    name = "triton"

    def __init__(self) -> None:
        self._tuned: Dict[tuple, KernelConfig] = {}
        self._plans: Dict[tuple, _LaunchPlan] = {}
        self._lock = threading.Lock()
        self._sm_count: Dict[int, int] = {}

    # ------------------------------------------------------------------ availability
    def is_available(self) -> Tuple[bool, str]:
        try:
            import triton  # noqa: F401

            interpreting = _interpreting()
        except Exception as exc:  # triton missing or broken
            return False, f"triton does not import: {type(exc).__name__}: {exc}"
        if interpreting:
            return True, ""
        if not torch.cuda.is_available():
            return False, "no CUDA/ROCm device (and the Triton kernels were not imported under TRITON_INTERPRET=1)"
        why = self._device_reason(torch.device("cuda", torch.cuda.current_device()))
        return (not why), why

    def _device_reason(self, device: torch.device) -> str:
        """Empty if the kernels can run on ``device``, else why not."""
        interpreting = _interpreting()
        if device.type == "cpu":
            return "" if interpreting else "CPU tensors need the Triton interpreter (TRITON_INTERPRET=1 before import)"
        if device.type != "cuda":
            return f"tensors on {device.type} are not supported"
        if interpreting:
            return "the Triton kernels were imported under TRITON_INTERPRET=1; GPU tensors need compiled kernels"
        if torch.version.hip:
            arch = torch.cuda.get_device_properties(device).gcnArchName
            if not (arch.startswith("gfx95") or arch.startswith("gfx12")):
                return f"ROCm {arch} has no OCP FP8 (e4m3fn/e5m2) dot in Triton"
            return ""
        cap = torch.cuda.get_device_capability(device)
        if cap < (8, 9):
            return f"compute capability {cap[0]}.{cap[1]} has no FP8 tensor cores (needs >= 8.9)"
        return ""

    # ------------------------------------------------------------------ validation
    def can_handle(self, problem: GroupedGemmProblem) -> Tuple[bool, str]:
        try:
            import triton  # noqa: F401
        except Exception as exc:
            return False, f"triton does not import: {type(exc).__name__}: {exc}"
        why = self._device_reason(problem.device)
        if why:
            return False, why
        why = _validate(problem) or problem.out_reason() or problem.swiglu_reason()
        if not why and problem.swiglu_probs is not None:
            why = swiglu_reason(problem)
        if why:
            return False, why
        return True, ""

    # ------------------------------------------------------------------ run
    def run(self, problem: GroupedGemmProblem, config: Optional[KernelConfig] = None) -> torch.Tensor:
        """Compute ``problem``; ``config`` overrides the tuned choice (tests, tuning scripts).

        The first call of a problem signature (``GroupedGemmProblem.signature``) validates it,
        picks (or tunes) the configuration and builds a launch plan; later calls of the same
        signature reuse the plan: the host work per call is the launch itself."""
        key = problem.signature() if config is None else None
        plan = self._plans.get(key) if key is not None else None
        if plan is None:
            ok, why = self.can_handle(problem)
            if not ok:
                raise ValueError(f"triton backend cannot run {problem.describe()}: {why}")
            out = _output(problem)
            if out.numel() == 0:
                if problem.swiglu_amax is not None:
                    problem.swiglu_amax.zero_()  # no SwiGLU values: amax 0, as the amax pass gives
                return out
            tuned_or_given = config is not None or self._is_tuned(problem)
            plan = self._make_plan(problem, out, config or self._choose_config(problem, out))
            launched = plan.gluon
            if launched:  # its first launch compiles the Gluon kernel, which may fail under another Triton
                same_tiles = dataclasses.replace(plan.config, gluon=False)
                plan = launch_gluon_or_fall_back(plan, lambda p: p.launch(problem, out),
                                                 lambda: self._make_plan(problem, out, same_tiles))
            if key is not None and (tuned_or_given or not torch.cuda.is_current_stream_capturing()):
                self._plans[key] = plan
            if launched:
                return out
        else:
            out = _output(problem)
        plan.launch(problem, out)
        return out

    def num_programs_limit(self, problem: GroupedGemmProblem) -> int:
        """The persistent grid's cap: ``problem.num_cu`` if given, else every SM/CU."""
        if problem.num_cu is not None:
            return int(problem.num_cu)
        if problem.device.type != "cuda":
            return 4  # interpreter: a few programs, so that the persistent loop is exercised
        index = problem.device.index if problem.device.index is not None else torch.cuda.current_device()
        if index not in self._sm_count:
            self._sm_count[index] = torch.cuda.get_device_properties(index).multi_processor_count
        return self._sm_count[index]

    def _make_plan(self, problem: GroupedGemmProblem, out: torch.Tensor, config: KernelConfig) -> "_LaunchPlan":
        from turbo_moe.kernels import tile_scheduler as ts

        M, N, K = problem.mnk
        G = problem.num_groups
        limit = self.num_programs_limit(problem)
        if problem.num_cu is None:
            limit *= config.programs_per_sm
        if config.gluon and _gluon_reason(problem, config, out):  # e.g. a config given by a caller
            config = dataclasses.replace(config, gluon=False, pingpong=False)
        if problem.swiglu_probs is not None and not config.gluon:
            raise ValueError(f"only the Gluon ping-pong reduces the SwiGLU amax, not {config}")
        if config.gluon and problem.kind is GemmKind.M_GROUPED:
            return self._make_pingpong_plan(problem, out, config, limit)
        if config.gluon:
            return self._make_gluon_plan(problem, out, config, limit)
        use_tma = config.tma and not _tma_reason(problem)
        if use_tma:
            config = _fit_shared_memory(config, out.element_size(), problem.accumulate)
        if problem.kind is GemmKind.M_GROUPED:
            bound = ts.m_grouped_tile_upper_bound(M, G, config.block_m, ts.cdiv(N, config.block_n))
        else:
            bound = ts.k_grouped_total_tiles(G, ts.cdiv(N, config.block_m), ts.cdiv(K, config.block_n))
        tma_store = use_tma and config.tma_store and _tma_store_ok(out)
        a_rowwise, b_rowwise = problem.a_scale.dim() > 0, problem.b_scale.dim() > 0
        # Every keyword of the launch, built once per plan (in the order the call sites always used).
        flags = dict(A_ROWWISE=a_rowwise, B_ROWWISE=b_rowwise)
        if problem.kind is GemmKind.M_GROUPED:
            if use_tma:
                flags.update(TMA_STORE=tma_store)
            else:
                flags.update(EVEN_K=K % config.block_k == 0)
        else:
            flags.update(BAND_CYCLIC=config.band_cyclic)
            if use_tma:
                flags.update(TMA_STORE=tma_store, TAIL_K=min(32, config.block_k))
            flags.update(ACCUMULATE=problem.accumulate)
        flags.update(BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
                     PROMOTE_ACC=problem.promote_accumulation)
        if not _interpreting():
            flags.update(num_warps=config.num_warps, num_stages=config.num_stages)
        return _LaunchPlan(
            key=next(_PLAN_IDS), kind=problem.kind, config=config, grid=(ts.persistent_grid_size(bound, limit),), use_tma=use_tma,
            tma_store=tma_store, constexprs=flags,
            descriptor_geometry=_descriptor_geometry(problem, out, config, flags) if use_tma else (),
            kernel_name=("m" if problem.kind is GemmKind.M_GROUPED else "k") + "_grouped_gemm"
                        + ("_tma" if use_tma else "") + "_kernel",
            int_args=_int_args(problem, out, use_tma),
        )

    def _make_gluon_plan(self, problem: GroupedGemmProblem, out: torch.Tensor, config: KernelConfig,
                         limit: int) -> "_LaunchPlan":
        from turbo_moe.kernels import tile_scheduler as ts
        from turbo_moe.kernels.triton.grouped_gemm_gluon import shared_layout

        a, b = problem.a, problem.b
        M, N, K = problem.mnk
        G = problem.num_groups
        bm, bn, bk = config.block_m, config.block_n, config.block_k
        tiles = ts.k_grouped_total_tiles(G, ts.cdiv(N, bm), ts.cdiv(K, bn))
        flags = dict(A_ROWWISE=problem.a_scale.dim() > 0, B_ROWWISE=problem.b_scale.dim() > 0, GROUP_M=config.group_m,
                     BAND_CYCLIC=config.band_cyclic)
        if config.pingpong:  # accumulates exactly when out is float32 (wgrad_pingpong_reason)
            flags.update(STAGES=config.num_stages, **PINGPONG_REGS, num_warps=config.num_warps)
        else:
            flags.update(ACCUMULATE=problem.accumulate, OLD_TILE_BOX=WGRAD_OLD_TILE_BOX if problem.accumulate else -1,
                         STAGES=config.num_stages, num_warps=config.num_warps)
        geometry = (([N, M], [a.stride(0), 1], [bm, bk], shared_layout([bm, bk], a.dtype)),
                    ([K, M], [b.stride(0), 1], [bn, bk], shared_layout([bn, bk], b.dtype)),
                    ([G * N, K], [K, 1], [bm, bn], shared_layout([bm, bn], out.dtype)))
        return _LaunchPlan(
            key=next(_PLAN_IDS), kind=problem.kind, config=config, grid=(ts.persistent_grid_size(tiles, limit),),
            use_tma=True, tma_store=True, constexprs=flags, descriptor_geometry=geometry,
            kernel_name="k_grouped_gemm_pingpong_kernel" if config.pingpong else "k_grouped_gemm_gluon_kernel",
            int_args=(N, K, G), gluon=True,
        )

    def _make_pingpong_plan(self, problem: GroupedGemmProblem, out: torch.Tensor, config: KernelConfig,
                            limit: int) -> "_LaunchPlan":
        from turbo_moe.kernels import tile_scheduler as ts
        from turbo_moe.kernels.triton.grouped_gemm_gluon import shared_layout

        a, b = problem.a, problem.b
        M, N, K = problem.mnk
        G = problem.num_groups
        bm, bn, bk = config.block_m, config.block_n, config.block_k
        swiglu = problem.swiglu_probs is not None  # bn: a tile's gate columns (and as many linear ones)
        bound = ts.m_grouped_tile_upper_bound(M, G, bm, ts.cdiv(N // 2 if swiglu else N, bn))
        grid = ts.persistent_grid_size(bound, limit)
        slots = problem.swiglu_amax.numel() if swiglu else 0
        if swiglu:  # two partials a program (one a consumer), every slot written
            grid = min(grid, slots // 2)
        flags = dict(A_ROWWISE=problem.a_scale.dim() > 0, B_ROWWISE=problem.b_scale.dim() > 0, GROUP_M=config.group_m,
                     STAGES=config.num_stages, **PINGPONG_REGS, SWIGLU=swiglu, num_warps=config.num_warps)
        geometry = (([M, K], [a.stride(0), 1], [bm, bk], shared_layout([bm, bk], a.dtype)),
                    ([G * N, K], [b.stride(1), 1], [bn, bk], shared_layout([bn, bk], b.dtype)),
                    ([M, N], [N, 1], [bm, bn], shared_layout([bm, bn], out.dtype)))
        return _LaunchPlan(
            key=next(_PLAN_IDS), kind=problem.kind, config=config, grid=(grid,),
            use_tma=True, tma_store=True, constexprs=flags, descriptor_geometry=geometry,
            kernel_name="m_grouped_gemm_pingpong_kernel", int_args=(N, K, G, N),  # out's row stride: N
            gluon=True, swiglu=swiglu, amax_slots=slots,
        )

    # ------------------------------------------------------------------ tuning
    def shape_class(self, problem: GroupedGemmProblem) -> tuple:
        M, N, K = problem.mnk
        G = problem.num_groups
        return (
            problem.kind, N, K, _pow2_class(M), _pow2_class(max(M // max(G, 1), 1)), G if G <= 8 else _pow2_class(G) + 100,
            problem.a.dtype, problem.b.dtype, problem.a_scale.dim(), problem.b_scale.dim(), problem.out_dtype,
            str(problem.device), problem.num_cu, problem.swiglu_probs is not None, problem.accumulate,
            problem.promote_accumulation,
        )

    def _is_tuned(self, problem: GroupedGemmProblem) -> bool:
        return problem.device.type != "cuda" or self.shape_class(problem) in self._tuned

    def _choose_config(self, problem: GroupedGemmProblem, out: torch.Tensor) -> KernelConfig:
        if problem.device.type != "cuda":
            return INTERPRETER_CONFIG
        candidates = candidates_for(problem)
        key = self.shape_class(problem)
        cached = self._tuned.get(key)
        if cached is not None:
            return cached
        if torch.cuda.is_current_stream_capturing() or os.environ.get("TURBO_MOE_TRITON_AUTOTUNE", "1") == "0":
            return candidates[0]
        with self._lock:
            if key not in self._tuned:
                # Timing launches the kernel many times: never into a buffer being accumulated into.
                scratch = torch.zeros_like(out) if problem.accumulate else out
                self._tuned[key] = self._benchmark(problem, scratch, candidates)
        return self._tuned[key]

    def _benchmark(self, problem: GroupedGemmProblem, out: torch.Tensor, candidates) -> KernelConfig:
        """Time every candidate twice, the second pass in reverse order, and rank by the sum of
        each one's two times. The GPU's clock drifts while it is timed (it ramps up, and FP8 data
        spread over many binades draws enough power to throttle it): with the best of two passes
        in one order, whichever candidate came first while the clock was high won (on the H100 the
        first wgrad candidate was kept at 562 TFLOPS beside another at 688). In mirrored passes a
        steady drift adds the same to every candidate's sum."""
        import triton.testing

        total_ms: Dict[KernelConfig, float] = {}
        plans: Dict[KernelConfig, _LaunchPlan] = {}  # one plan (one launch key) per candidate
        failed = set()
        for order in (list(candidates), list(reversed(candidates))):
            for config in order:
                if config in failed:
                    continue
                try:
                    plan = plans.get(config) or plans.setdefault(config, self._make_plan(problem, out, config))
                    ms = triton.testing.do_bench(lambda plan=plan: plan.launch(problem, out), warmup=5, rep=20)
                except Exception:  # e.g. out of shared memory for this block shape on this device
                    failed.add(config)
                    total_ms.pop(config, None)
                    continue
                total_ms[config] = total_ms.get(config, 0.0) + ms
        if not total_ms:
            return candidates[0]
        return min(total_ms, key=total_ms.get)

    def tuned_configs(self) -> Dict[tuple, KernelConfig]:
        """The cached choice per shape class (for logs and notes)."""
        return dict(self._tuned)

    def describe_tuned(self) -> Dict[tuple, str]:
        """``tuned_configs`` as readable lines, by the same keys: the GEMM kind, N, K, the pow2
        classes of M and of rows per group, accumulation, and the chosen config."""
        lines = {}
        for key, config in self._tuned.items():
            kind, n, k, m_class, rows_class = key[:5]
            accumulate = key[-2]  # shape_class's layout: (..., num_cu, accumulate, promote)
            lines[key] = (f"{kind.name.lower()} N={n} K={k} M~2^{m_class} rows/group~2^{rows_class}"
                          f"{' +=' if accumulate else ''} -> {config}")
        return lines


@dataclass(frozen=True)
class _LaunchPlan:
    """What a launch of one problem signature needs besides the tensors themselves."""

    # A number of its own: with the alignment of the tensors the problem signature leaves out
    # (scales, offsets, a fresh output), the lean launcher's key (LeanLauncher.launch_keyed). A plan
    # serves one signature and one config, which fix every shape, stride, dtype and constexpr the
    # launch's arguments and descriptors derive from.
    key: int
    kind: GemmKind
    config: KernelConfig
    grid: Tuple[int]
    use_tma: bool
    tma_store: bool
    constexprs: dict  # the launch's keywords (scales, accumulation, tiles...) and launch options
    # (shape, strides, block shape) of each host TMA descriptor, by slot: M_GROUPED a, b; K_GROUPED
    # a, b, a's and b's token tails, out. Empty without TMA.
    descriptor_geometry: tuple = ()
    # The kernel's lean launcher (an attribute of _kernels()) and its integer arguments after the
    # tensors: sizes and strides, all fixed by the signature.
    kernel_name: str = ""
    int_args: tuple = ()
    # The Gluon K-grouped kernel: descriptor_geometry's entries carry their shared layout, slots a,
    # b, out (as one [G*N, K] matrix).
    gluon: bool = False
    # The ping-pong's SWIGLU tiles (fc1 with the SwiGLU amax epilogue) and the amax partials it writes.
    swiglu: bool = False
    amax_slots: int = 0

    def launch(self, problem: GroupedGemmProblem, out: torch.Tensor) -> None:
        launcher = getattr(_kernels(), self.kernel_name)
        a, b, offs = problem.a, problem.b, problem.group_offs
        a_scale, b_scale = problem.a_scale.contiguous(), problem.b_scale.contiguous()
        key = (self.key, a_scale.data_ptr() % 16 == 0, b_scale.data_ptr() % 16 == 0, offs.data_ptr() % 16 == 0,
               out.data_ptr() % 16 == 0)
        if not self.use_tma:
            launcher.launch_keyed(self.grid, key, a, b, out, a_scale, b_scale, offs, *self.int_args, **self.constexprs)
            return
        if self.gluon:  # host descriptors only: no global scratch to allocate
            (a_geo, b_geo, out_geo), plan = self.descriptor_geometry, self.key
            descriptors = (HostDesc(a, *a_geo[:3], (plan, 0, a.data_ptr()), a_geo[3]),
                           HostDesc(b, *b_geo[:3], (plan, 1, b.data_ptr()), b_geo[3]),
                           HostDesc(out, *out_geo[:3], (plan, 2, out.data_ptr()), out_geo[3]))
            if self.kind is GemmKind.K_GROUPED:
                launcher.launch_keyed(self.grid, key, *descriptors, a_scale, b_scale, offs, *self.int_args,
                                      **self.constexprs)
                return
            # The ping-pong also stores a group's last rows through out's pointer; its SWIGLU tiles
            # read the routing weights and write the amax partials (plain tiles: unused pointers).
            if self.swiglu:
                probs, amax = problem.swiglu_probs, problem.swiglu_amax
                key += (probs.dtype, probs.data_ptr() % 16 == 0, amax.data_ptr() % 16 == 0)
            else:
                probs = amax = a_scale
            launcher.launch_keyed(self.grid, key, *descriptors, out, a_scale, b_scale, offs, *self.int_args, probs,
                                  amax, self.amax_slots, **self.constexprs)
            return
        # Device-side TMA descriptors need global scratch memory; hand Triton torch's allocator
        # (stream-ordered, so also legal while a CUDA graph is captured). triton.set_allocator sets
        # a per-thread context variable, and autograd runs backward on its own device threads: so
        # before every TMA launch, not once per process (a one-shot flag left the forward thread
        # without one).
        _triton_set_allocator()(_torch_scratch_allocator)
        # Host descriptors as HostDesc: the geometry is the plan's (fixed by its signature), so
        # (plan id, slot, address) determines each one, and the launcher expands it once per key.
        geometry, plan = self.descriptor_geometry, self.key
        a_ptr, b_ptr = a.data_ptr(), b.data_ptr()
        a_desc = HostDesc(a, *geometry[0], (plan, 0, a_ptr))
        b_desc = HostDesc(b, *geometry[1], (plan, 1, b_ptr))  # M_GROUPED: b's groups as one [G*N, K]
        if self.kind is GemmKind.M_GROUPED:
            launcher.launch_keyed(self.grid, key, a_desc, b_desc, out, a_scale, b_scale, offs, *self.int_args,
                                  **self.constexprs)
            return
        # Narrow boxes for a group's first and last tokens (32: the FP8 dot's smallest K).
        a_tail_desc = HostDesc(a, *geometry[2], (plan, 2, a_ptr))
        b_tail_desc = HostDesc(b, *geometry[3], (plan, 3, b_ptr))
        out_desc = HostDesc(out, *geometry[4], (plan, 4, out.data_ptr())) if self.tma_store else None
        launcher.launch_keyed(self.grid, key, a_desc, b_desc, a_tail_desc, b_tail_desc, out_desc, out, a_scale, b_scale,
                              offs, *self.int_args, **self.constexprs)


@functools.lru_cache(maxsize=None)
def _triton_set_allocator():
    """``triton.set_allocator``, imported once (an import statement costs microseconds on every launch)."""
    import triton

    return triton.set_allocator


def _int_args(problem: GroupedGemmProblem, out: torch.Tensor, use_tma: bool) -> tuple:
    """The kernel's integer arguments after its tensors (see each kernel's signature)."""
    a, b = problem.a, problem.b
    _, N, K = problem.mnk
    sizes = (N, K, problem.num_groups)
    if problem.kind is GemmKind.M_GROUPED:
        if use_tma:
            return (*sizes, out.stride(0), out.stride(1))
        return (*sizes, a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), out.stride(0), out.stride(1))
    if use_tma:
        return (*sizes, out.stride(0), out.stride(1), out.stride(2))
    return (*sizes, a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1), out.stride(2))


def _descriptor_geometry(problem: GroupedGemmProblem, out: torch.Tensor, cfg: KernelConfig, flags: dict) -> tuple:
    """(shape, strides, block shape) of each host TMA descriptor of a TMA plan, by slot (see
    ``_LaunchPlan.descriptor_geometry``): all of it fixed by the problem's signature."""
    a, b = problem.a, problem.b
    M, N, K = problem.mnk
    if problem.kind is GemmKind.M_GROUPED:
        G = problem.num_groups
        return (([M, K], [a.stride(0), 1], [cfg.block_m, cfg.block_k]),
                ([G * N, K], [b.stride(1), 1], [cfg.block_n, cfg.block_k]))
    tail_k = flags["TAIL_K"]
    return (([N, M], [a.stride(0), 1], [cfg.block_m, cfg.block_k]),
            ([K, M], [b.stride(0), 1], [cfg.block_n, cfg.block_k]),
            ([N, M], [a.stride(0), 1], [cfg.block_m, tail_k]),
            ([K, M], [b.stride(0), 1], [cfg.block_n, tail_k]),
            (list(out.shape), list(out.stride()), [1, cfg.block_m, cfg.block_n]))


def _output(problem: GroupedGemmProblem) -> torch.Tensor:
    return problem.out if problem.out is not None else _new_output(problem.out_shape, problem.out_dtype, problem.device)


def _new_output(shape, dtype, device) -> torch.Tensor:
    """The output allocation (every element is written by the kernels; tests poison it here)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _torch_scratch_allocator(size: int, alignment: int, stream):
    # The interpreter's kernels run on CPU tensors; compiled ones on the current CUDA device.
    return torch.empty(size, dtype=torch.int8, device="cpu" if _interpreting() else "cuda")


# Hopper's per-block shared memory (227 KiB), less a little for the pipeline's barriers.
_SHARED_MEMORY_BUDGET = 232448 - 1024


def _fit_shared_memory(config: KernelConfig, out_bytes: int, accumulate: bool = False) -> KernelConfig:
    """Drop the TMA store's staging tile when it would not fit beside the operand pipeline
    (num_stages * (BM + BN) * BK bytes of FP8, plus BM * BN * out_bytes): e.g. 128x256 tiles
    with fp32 output. The accumulating epilogue also reads the tile through the copy engine: the
    read shares the staging tile, but converting it to the accumulator's layout took another half
    tile at 128 x 256 (sm_90 compile: 262152 bytes for 2 stages), so half a tile more is counted.
    Every candidate then compiles, whatever the output dtype."""
    operands = config.num_stages * (config.block_m + config.block_n) * config.block_k
    staging = config.block_m * config.block_n * out_bytes * (3 if accumulate else 2) // 2
    if config.tma_store and operands + staging > _SHARED_MEMORY_BUDGET:
        return dataclasses.replace(config, tma_store=False)
    return config


BACKEND = TritonBackend()
