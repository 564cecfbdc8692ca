"""Host side of the block-scaled Triton GEMMs (``kernels/triton/blockwise_gemm.py``): tile
configuration, the choice between the TMA and pointer kernels (``tma_declined``), the persistent
grid (the shared scheduler's bounds), and launch plans cached per problem signature and launched
keyed (``plan``, ``run``; the tensorwise backend's scheme, ``backends/triton_backend.py``)."""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass
from typing import Optional

import torch

from ..backends.base import GemmKind
from ..backends.triton_checks import _tma_reason, _tma_store_ok

__all__ = ["BlockKernelConfig", "plan", "run", "kernels", "tma_declined", "gluon_declined", "use_dot_scaled"]


@dataclass(frozen=True)
class BlockKernelConfig:
    block_m: int
    block_n: int
    block_k: int  # == the recipe's block for the promotion loop; a multiple of 32 for dot_scaled
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 4
    band_cyclic: bool = False  # K-grouped order (group-major measured faster for the tensorwise kernels)
    # Promotion loop: load the operands through TMA descriptors where they allow it (Hopper+, unit
    # stride along the contraction, 16-byte aligned: the tensorwise kernels' conditions), else pointers.
    tma: bool = True
    # With tma, K-grouped: the output tile leaves through a descriptor where ``out`` allows it.
    tma_store: bool = True
    # Blockwise on sm_90: the Gluon kernels, the same bits as the TMA kernels. K-grouped:
    # kernels/triton/blockwise_gemm_gluon.py, its loads running ahead across blocks and tiles;
    # M-grouped: kernels/triton/m_grouped_blockwise_gluon.py, two cooperative consumers promoting each
    # block, the activation scales brought by TMA. Where a problem cannot take one (gluon_declined),
    # the TMA kernel runs.
    gluon: bool = False
    # With gluon, K-grouped: the cooperative wgrad (k_grouped_block_scaled_coop_kernel: two consumer
    # warpgroups, the block's row and column scales through the TMA ring) where it can run
    # (coop_declined), else the single-stream one.
    cooperative: bool = True


# H100 defaults (two warpgroups, 128x128 tiles: DeepGEMM's shape for blockwise), from
# scripts/bench_fine_grained.py --sweep (docs/results/h100_fine_grained.md): blockwise M-grouped
# through TMA with 4 stages (0.72-0.76x tensorwise, against 0.27-0.46x through pointers; 3 or 5
# stages within 3%; on sm_90 the Gluon kernels take these configs where they can, the M-grouped one
# at 0.83-0.95x). MXFP8's promotion loop steps 32 of K, so it pipelines deeper, and through
# pointers: 32-byte TMA boxes ran it slower (108-122 against 131-148 TFLOPS).
_GPU_DEFAULTS = {
    (128, False): BlockKernelConfig(128, 128, 128, num_stages=4),
    (32, False): BlockKernelConfig(128, 128, 32, num_stages=6, tma=False),
    (32, True): BlockKernelConfig(128, 128, 128, num_stages=3),
}
# ROCm (gfx950: where FlyDSL does not take a call, e.g. float32-scale blockwise or the hybrid
# format's e5m2 gradients), per (block, dot_scaled, kind): the pointer kernels (no TMA). Compiled for
# gfx950 the H100 defaults spill (blockwise M-grouped 500 bytes, K-grouped 20; MXFP8's dot_scaled
# M-grouped 244; its promotion loop 296); these compile with no scratch, dot_scaled to gfx950's
# MX-scaled MFMA (tests/test_triton_gfx950_compile.py). Their speed has never been measured.
_HIP_DEFAULTS = {
    (128, False, GemmKind.M_GROUPED): BlockKernelConfig(128, 64, 128, num_warps=4, num_stages=2, tma=False),
    (128, False, GemmKind.K_GROUPED): BlockKernelConfig(128, 128, 128, num_stages=2, tma=False),
    (32, False, GemmKind.M_GROUPED): BlockKernelConfig(128, 128, 32, num_stages=2, tma=False),
    (32, False, GemmKind.K_GROUPED): BlockKernelConfig(128, 128, 32, num_stages=2, tma=False),
    (32, True, GemmKind.M_GROUPED): BlockKernelConfig(128, 64, 128, num_stages=2, tma=False),
    (32, True, GemmKind.K_GROUPED): BlockKernelConfig(128, 128, 128, num_stages=2, tma=False),
}


class _Kernels:
    def __init__(self) -> None:
        from turbo_moe.kernels.triton import blockwise_gemm
        from turbo_moe.kernels.triton.launch import lean

        self.module = blockwise_gemm
        self.interpreting = type(blockwise_gemm.m_grouped_block_scaled_kernel).__name__ == "InterpretedFunction"
        self.m_grouped = lean(blockwise_gemm.m_grouped_block_scaled_kernel)
        self.m_grouped_tma = lean(blockwise_gemm.m_grouped_block_scaled_tma_kernel)
        self.k_grouped = lean(blockwise_gemm.k_grouped_block_scaled_kernel)
        self.k_grouped_tma = lean(blockwise_gemm.k_grouped_block_scaled_tma_kernel)

    @functools.cached_property
    def m_grouped_gluon(self):  # imported on first use: only sm_90 plans launch it
        from turbo_moe.kernels.triton import launch, m_grouped_blockwise_gluon

        return launch.lean(m_grouped_blockwise_gluon.m_grouped_block_scaled_coop_kernel)

    @functools.cached_property
    def k_grouped_gluon(self):  # imported on first use: only sm_90 plans launch it
        from turbo_moe.kernels.triton import blockwise_gemm_gluon, launch

        return launch.lean(blockwise_gemm_gluon.k_grouped_block_scaled_gluon_kernel)

    @functools.cached_property
    def k_grouped_coop(self):  # imported on first use: only sm_90 plans launch it
        from turbo_moe.kernels.triton import blockwise_gemm_gluon, launch

        return launch.lean(blockwise_gemm_gluon.k_grouped_block_scaled_coop_kernel)


_KERNELS: Optional[_Kernels] = None


def kernels() -> _Kernels:
    global _KERNELS
    if _KERNELS is None:
        _KERNELS = _Kernels()
    return _KERNELS


def use_dot_scaled(device: torch.device) -> bool:
    """Whether MXFP8 takes ``tl.dot_scaled``: where the hardware applies e8m0 scales (sm_100+,
    gfx950). On sm_90 Triton emulates it through bf16 (half the FP8 rate), so Hopper takes the
    promotion loop. ``TURBO_MOE_MX_DOT_SCALED=1/0`` forces it either way (tests, benchmarks)."""
    forced = os.environ.get("TURBO_MOE_MX_DOT_SCALED")
    if forced is not None:
        return forced not in ("", "0")
    if device.type != "cuda":
        return False
    if torch.version.hip:
        return torch.cuda.get_device_properties(device).gcnArchName.startswith("gfx95")
    return torch.cuda.get_device_capability(device) >= (10, 0)


def default_config(problem) -> BlockKernelConfig:
    r = problem.recipe
    dot_scaled = r.e8m0 and use_dot_scaled(problem.device)
    if problem.device.type != "cuda":  # interpreter: small tiles, so small shapes span many tiles
        return BlockKernelConfig(16, 16, 64 if dot_scaled else r.block, group_m=2, num_warps=1, num_stages=1)
    if torch.version.hip:
        return _HIP_DEFAULTS[(r.block, dot_scaled, problem.kind)]
    config = _GPU_DEFAULTS[(r.block, dot_scaled)]
    # The Gluon kernels where they can run (docs/results/h100_fine_grained.md, the same bits as the
    # TMA kernels). The single-stream wgrad, TFLOPS against the TMA kernel: 128 x 128 tokens per
    # expert 243 / 166, 32 x 512 437 / 388 (skewed 363 / 290), 8 x 4096 567 / 527 (DeepSeek-V3 fc1)
    # and 574 / 590 (fc2); the cooperative one (a bf16 dW or main_grad) against the single-stream:
    # 737 / 547 (8 x 4096, K 7168, N 4096), 690 / 531 (K 2048, N 7168), 635 / 434 (32 x 512).
    gluon = dataclasses.replace(config, gluon=True)
    if not gluon_declined(problem, gluon):
        return gluon
    return config


# The M-grouped Gluon kernel: 128 x 128 tiles (one weight block across the columns) split between
# two 4-warp consumers (num_warps is one consumer's), a producer warp; its ring holds config.num_stages
# slots of a, b and 128 row scales (32.5 KB each) beside two 64 x 128 staging tiles. The consumers'
# and the producer's registers (setmaxnreg, per thread): 232 leaves a consumer room for its 64 x 128
# float32 accumulator and a block's (64 each a thread), 40 the producer's warpgroup, 64512 of 65536 in
# all; the kernel's own limit (maxnreg) the SM's file over its 12 warps, which setmaxnreg needs (without
# it the H100 raised an illegal instruction).
_COOP_WARPS = 4
_COOP_REGS = dict(CONSUMER_REGS=232, PRODUCER_REGS=40, maxnreg=168)


def gluon_declined(problem, config: BlockKernelConfig, out: Optional[torch.Tensor] = None) -> str:
    """Why ``problem`` does not take the Gluon blockwise kernel of its kind under ``config``; empty
    when it does. ``out``: the output (None: ``problem.out``, or a fresh contiguous one)."""
    from ..backends.triton_backend import gluon_output_reason, gluon_unavailable

    if not config.gluon:
        return "config.gluon is off"
    r = problem.recipe
    if r.e8m0 or r.block != 128 or config.block_k != 128:
        return "the Gluon kernels take blockwise recipes (128-element blocks, float32 scales)"
    why = gluon_unavailable(problem.device) or tma_declined(problem, config)
    if why:
        return why
    if problem.kind is GemmKind.M_GROUPED:
        return _m_grouped_gluon_declined(problem, config, out if out is not None else problem.out)
    why = gluon_output_reason(problem, config, out if out is not None else problem.out)
    if why:
        return why
    if config.num_stages < 3:
        return "a block off a 16-token boundary takes two ring entries: 3 stages at least"
    from turbo_moe.kernels.triton import blockwise_gemm_gluon

    return blockwise_gemm_gluon.GLUON_ERROR


def _num_programs_limit(problem) -> int:
    if problem.num_cu is not None:
        return int(problem.num_cu)
    if problem.device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(problem.device).multi_processor_count


def _m_grouped_gluon_declined(problem, config: BlockKernelConfig, out: Optional[torch.Tensor]) -> str:
    """Why the M-grouped Gluon kernel does not take ``problem`` (``out``: None for a fresh
    contiguous output); empty when it does."""
    from ..backends.triton_backend import _SHARED_MEMORY_BUDGET, _store_descriptor_reason
    from turbo_moe.kernels.triton import m_grouped_blockwise_gluon

    sa, r = problem.a_scale, problem.recipe
    if sa.shape[1] == 0:
        return "K is 0: no block to stage (the TMA kernel writes the zeros)"
    if (config.block_m, config.block_n) != (128, 128) or r.weight_block != config.block_n:
        return "the M-grouped Gluon kernel runs 128 x 128 tiles (one weight block across the columns)"
    if sa.stride(0) != 1 or sa.data_ptr() % 16:
        return "its TMA reads the activation scales as block-major storage (sa[:, k] contiguous), 16-byte aligned"
    if _flat_scales(sa) >= 2**31:
        return "its TMA coordinates into the activation scales are 32-bit"
    why = _store_descriptor_reason(problem.out_dtype, problem.mnk[1], out)
    if why:
        return why
    item = torch.empty((), dtype=problem.out_dtype).element_size()
    ring = config.num_stages * ((config.block_m + config.block_n) * config.block_k + 4 * config.block_m)
    if ring + config.block_m * config.block_n * item > _SHARED_MEMORY_BUDGET:
        return "its ring and two staging tiles do not fit in shared memory"
    return m_grouped_blockwise_gluon.GLUON_ERROR


def _flat_scales(sa: torch.Tensor) -> int:
    """Elements of ``sa``'s ([M, blocks], column stride >= M) block-major storage that the M-grouped
    Gluon kernel's flat scale descriptor spans."""
    rows, blocks = sa.shape
    return (blocks - 1) * sa.stride(1) + rows


def coop_declined(problem, config: BlockKernelConfig, out: Optional[torch.Tensor] = None) -> str:
    """Why the cooperative K-grouped wgrad does not take ``problem`` under ``config`` (a Gluon config
    ``gluon_declined`` accepts); empty when it does. ``out``: None for ``problem.out`` or a fresh one."""
    from ..backends.triton_backend import _SHARED_MEMORY_BUDGET

    if problem.kind is not GemmKind.K_GROUPED or not config.cooperative:
        return "the cooperative kernel is the K-grouped one, where config.cooperative is on"
    if (config.block_m, config.block_n) != (128, 128):
        return "the cooperative kernel runs 128 x 128 tiles"
    if (problem.out_dtype == torch.float32) != bool(problem.accumulate):
        # its consumers read ACCUMULATE off the output's dtype (a worker partition's flags arrive as
        # run-time values)
        return "the cooperative kernel adds into a float32 main_grad or writes a 16-bit dW"
    for name, scales in (("a_scale", problem.a_scale), ("b_scale", problem.b_scale)):
        # its TMA boxes of a slot's 128 scales start on 16-byte boundaries only so
        if scales.stride(0) != 1 or scales.stride(1) % 4 or scales.data_ptr() % 16:
            return f"its TMA reads {name} as slot-major storage with a column stride of whole 16 bytes, 16-byte aligned"
        if _flat_slots(scales) >= 2**31:
            return f"its TMA coordinates into {name} are 32-bit"
    item = torch.empty((), dtype=problem.out_dtype).element_size()
    ring = config.num_stages * ((config.block_m + config.block_n) * config.block_k + 4 * (config.block_m + config.block_n))
    if ring + config.block_m * config.block_n * item > _SHARED_MEMORY_BUDGET:
        return "its ring and two staging tiles do not fit in shared memory"
    return ""


def _flat_slots(scales: torch.Tensor) -> int:
    """Elements of a wgrad operand's slot-major scales ([C, slots], slot stride >= C) that the
    cooperative kernel's flat scale descriptor spans."""
    rows, slots = scales.shape
    return (slots - 1) * scales.stride(1) + rows


# The K-grouped TMA kernel's boxes for groups that start off a 16-token boundary: the narrowest
# an FP8 wgmma takes (k = 32).
_NARROW_TOKENS = 32

_FORMATS = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}


def tma_declined(problem, config: Optional[BlockKernelConfig] = None) -> str:
    """Why ``run`` takes the pointer kernel for ``problem`` under ``config``; empty when it takes
    the TMA kernel (``m_grouped_block_scaled_tma_kernel``, ``k_grouped_block_scaled_tma_kernel``;
    the latter takes a group that starts off a 16-token boundary through narrow masked boxes)."""
    cfg = config or default_config(problem)
    if not cfg.tma:
        return "config.tma is off"
    if problem.recipe.e8m0 and cfg.block_k != problem.recipe.block:
        return "tl.dot_scaled takes the pointer kernel"
    if problem.kind is GemmKind.K_GROUPED:
        # The K-grouped TMA kernel keeps the scales' row offsets in int32.
        rows_a, rows_b = problem.a_scale.shape[0], problem.b_scale.shape[0]
        if max(rows_a * abs(problem.a_scale.stride(0)), rows_b * abs(problem.b_scale.stride(0))) >= 2**31:
            return "scale row offsets past 2**31 elements"
    return _tma_reason(problem)


@dataclass(frozen=True)
class _BlockPlan:
    """One launch of a block-scaled kernel, decided once per problem signature
    (``BlockScaledProblem.signature``): kernel, grid, descriptor geometry, integer arguments and
    keywords. ``launch`` then costs a keyed lean launch (``kernels/triton/launch.py``): no
    ``arg_fact`` per argument, and each host TMA descriptor expanded once per address."""

    key: int
    kernel_name: str  # an attribute of kernels()
    grid: tuple
    tma: bool
    tma_store: bool
    geometry: tuple  # (shape, strides, block shape) per descriptor slot: a, b[, a narrow, b narrow, out]
    int_args: tuple  # the kernel's integer arguments after its tensors
    constexprs: dict
    # A Gluon kernel, each geometry entry with its layout: K-grouped a, b, out (one [G*N, K] matrix);
    # the cooperative K-grouped one a, b, both scales' storage flattened, out; M-grouped a, b, the
    # activation scales' storage flattened, out.
    gluon: bool = False

    def launch(self, problem, out: torch.Tensor) -> None:
        from turbo_moe.kernels.triton.launch import HostDesc

        launcher = getattr(kernels(), self.kernel_name)
        a, b, sa, sb, offs = problem.a, problem.b, problem.a_scale, problem.b_scale, problem.group_offs
        key = (self.key, sa.data_ptr() % 16 == 0, sb.data_ptr() % 16 == 0, offs.data_ptr() % 16 == 0,
               out.data_ptr() % 16 == 0)
        if not self.tma:
            launcher.launch_keyed(self.grid, key, a, b, out, sa, sb, offs, *self.int_args, **self.constexprs)
            return
        geometry, plan, a_ptr, b_ptr = self.geometry, self.key, a.data_ptr(), b.data_ptr()
        if self.gluon and problem.kind is GemmKind.M_GROUPED:  # a, b, the scales flattened, out
            a_geo, b_geo, sa_geo, out_geo = geometry
            launcher.launch_keyed(self.grid, key, HostDesc(a, *a_geo[:3], (plan, 0, a_ptr), a_geo[3]),
                                  HostDesc(b, *b_geo[:3], (plan, 1, b_ptr), b_geo[3]),
                                  HostDesc(sa, *sa_geo[:3], (plan, 2, sa.data_ptr()), sa_geo[3]),
                                  HostDesc(out, *out_geo[:3], (plan, 3, out.data_ptr()), out_geo[3]),
                                  out, sa, sb, offs, *self.int_args, **self.constexprs)
            return
        if self.gluon and self.kernel_name == "k_grouped_coop":  # a, b, both scales flattened, out
            a_geo, b_geo, sa_geo, sb_geo, out_geo = geometry
            launcher.launch_keyed(self.grid, key, HostDesc(a, *a_geo[:3], (plan, 0, a_ptr), a_geo[3]),
                                  HostDesc(b, *b_geo[:3], (plan, 1, b_ptr), b_geo[3]),
                                  HostDesc(sa, *sa_geo[:3], (plan, 2, sa.data_ptr()), sa_geo[3]),
                                  HostDesc(sb, *sb_geo[:3], (plan, 3, sb.data_ptr()), sb_geo[3]),
                                  HostDesc(out, *out_geo[:3], (plan, 4, out.data_ptr()), out_geo[3]),
                                  offs, *self.int_args, **self.constexprs)
            return
        if self.gluon:
            (a_geo, b_geo, out_geo) = geometry
            launcher.launch_keyed(self.grid, key, HostDesc(a, *a_geo[:3], (plan, 0, a_ptr), a_geo[3]),
                                  HostDesc(b, *b_geo[:3], (plan, 1, b_ptr), b_geo[3]),
                                  HostDesc(out, *out_geo[:3], (plan, 2, out.data_ptr()), out_geo[3]),
                                  sa, sb, offs, *self.int_args, **self.constexprs)
            return
        a_desc = HostDesc(a, *geometry[0], (plan, 0, a_ptr))
        b_desc = HostDesc(b, *geometry[1], (plan, 1, b_ptr))
        if problem.kind is GemmKind.M_GROUPED:
            launcher.launch_keyed(self.grid, key, a_desc, b_desc, out, sa, sb, offs, *self.int_args, **self.constexprs)
            return
        out_desc = HostDesc(out, *geometry[4], (plan, 4, out.data_ptr())) if self.tma_store else None
        launcher.launch_keyed(self.grid, key, a_desc, b_desc, HostDesc(a, *geometry[2], (plan, 2, a_ptr)),
                              HostDesc(b, *geometry[3], (plan, 3, b_ptr)), out_desc, out, sa, sb, offs,
                              *self.int_args, **self.constexprs)


_PLANS: dict = {}  # BlockScaledProblem.signature() -> _BlockPlan (default configs only)
_PLAN_IDS = iter(range(1 << 62))
_MAX_PLANS = 4096  # shapes seen by one process (tuning sweeps, ragged benchmarks): cleared past this


def plan(problem, config: Optional[BlockKernelConfig] = None, out: Optional[torch.Tensor] = None) -> _BlockPlan:
    """The launch ``run`` makes for ``problem`` (``out``: its output, allocated as ``run`` would when
    not given). Deterministic in the problem's signature and ``config``."""
    from turbo_moe.kernels import tile_scheduler as ts

    k = kernels()
    cfg = config or default_config(problem)
    r = problem.recipe
    dot_scaled = r.e8m0 and cfg.block_k != r.block
    if not dot_scaled and cfg.block_k != r.block:
        raise ValueError(f"block_k={cfg.block_k} must equal the recipe's scale block {r.block}")
    if out is None:
        out = problem.out if problem.out is not None else torch.empty(problem.out_shape, dtype=problem.out_dtype,
                                                                       device="meta")
    a, b, sa, sb = problem.a, problem.b, problem.a_scale, problem.b_scale
    M, N, K = problem.mnk
    G = problem.num_groups
    limit = _num_programs_limit(problem)
    extra = {} if k.interpreting else {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    if cfg.gluon and gluon_declined(problem, cfg, None if out.device.type == "meta" else out):
        cfg = dataclasses.replace(cfg, gluon=False)
    if cfg.gluon and problem.kind is GemmKind.M_GROUPED:
        from turbo_moe.kernels.triton.grouped_gemm_gluon import shared_layout

        bm, bn, bk, half = cfg.block_m, cfg.block_n, cfg.block_k, cfg.block_m // 2
        flat = _flat_scales(sa)
        geometry = (([M, K], [a.stride(0), 1], [bm, bk], shared_layout([bm, bk], a.dtype)),
                    ([G * N, K], [b.stride(1), 1], [bn, bk], shared_layout([bn, bk], b.dtype)),
                    ([flat], [1], [bm], shared_layout([bm], sa.dtype)),
                    ([M, N], [N, 1], [half, bn], shared_layout([half, bn], problem.out_dtype)))
        bound = ts.m_grouped_tile_upper_bound(M, G, bm, ts.cdiv(N, bn))
        # the scales' TMA boxes start on 16-byte boundaries only with a column stride of whole 16 bytes
        constexprs = dict(GROUP_M=cfg.group_m, SCALES_TMA=sa.stride(1) % 4 == 0, STAGES=cfg.num_stages, **_COOP_REGS,
                          num_warps=_COOP_WARPS)
        return _BlockPlan(next(_PLAN_IDS), "m_grouped_gluon", (ts.persistent_grid_size(bound, limit),), True, True,
                          geometry, (N, K, G, N, sa.stride(1), sb.stride(0), sb.stride(1), sb.stride(2)), constexprs,
                          gluon=True)
    if cfg.gluon and cfg.cooperative and not coop_declined(problem, cfg, None if out.device.type == "meta" else out):
        from turbo_moe.kernels.triton.grouped_gemm_gluon import shared_layout

        bm, bn, half = cfg.block_m, cfg.block_n, cfg.block_m // 2
        geometry = (([N, M], [a.stride(0), 1], [bm, r.block], shared_layout([bm, r.block], a.dtype)),
                    ([K, M], [b.stride(0), 1], [bn, r.block], shared_layout([bn, r.block], b.dtype)),
                    ([_flat_slots(sa)], [1], [bm], shared_layout([bm], sa.dtype)),
                    ([_flat_slots(sb)], [1], [bn], shared_layout([bn], sb.dtype)),
                    ([G * N, K], [K, 1], [half, bn], shared_layout([half, bn], problem.out_dtype)))
        tiles = ts.k_grouped_total_tiles(G, ts.cdiv(N, bm), ts.cdiv(K, bn))
        constexprs = dict(GROUP_M=cfg.group_m, BAND_CYCLIC=cfg.band_cyclic, STAGES=cfg.num_stages, **_COOP_REGS,
                          num_warps=_COOP_WARPS)
        return _BlockPlan(next(_PLAN_IDS), "k_grouped_coop", (ts.persistent_grid_size(tiles, limit),), True, True,
                          geometry, (N, K, G, sa.stride(1), sb.stride(1)), constexprs, gluon=True)
    if cfg.gluon:
        from turbo_moe.kernels.triton.grouped_gemm_gluon import shared_layout

        bm, bn = cfg.block_m, cfg.block_n
        geometry = (([N, M], [a.stride(0), 1], [bm, r.block], shared_layout([bm, r.block], a.dtype)),
                    ([K, M], [b.stride(0), 1], [bn, r.block], shared_layout([bn, r.block], b.dtype)),
                    ([G * N, K], [K, 1], [bm, bn], shared_layout([bm, bn], problem.out_dtype)))
        tiles = ts.k_grouped_total_tiles(G, ts.cdiv(N, bm), ts.cdiv(K, bn))
        constexprs = dict(GROUP_M=cfg.group_m, BAND_CYCLIC=cfg.band_cyclic, ACCUMULATE=problem.accumulate,
                          STAGES=cfg.num_stages, num_warps=cfg.num_warps)
        return _BlockPlan(next(_PLAN_IDS), "k_grouped_gluon", (ts.persistent_grid_size(tiles, limit),), True, True,
                          geometry, (N, K, G, sa.stride(0), sa.stride(1), sb.stride(0), sb.stride(1)), constexprs,
                          gluon=True)
    tma = not tma_declined(problem, cfg)
    tma_store = False
    if problem.kind is GemmKind.M_GROUPED:
        bound = ts.m_grouped_tile_upper_bound(M, G, cfg.block_m, ts.cdiv(N, cfg.block_n))
        scale_strides = (sa.stride(0), sa.stride(1), sb.stride(0), sb.stride(1), sb.stride(2))
        if tma:
            name, geometry = "m_grouped_tma", (([M, K], [a.stride(0), 1], [cfg.block_m, cfg.block_k]),
                                               ([G * N, K], [b.stride(1), 1], [cfg.block_n, cfg.block_k]))
            int_args = (N, K, G, out.stride(0), out.stride(1), *scale_strides)
            constexprs = dict(B_ROW_BLOCK=r.weight_block, E8M0=r.e8m0, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                              BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, **extra)
        else:
            name, geometry = "m_grouped", ()
            int_args = (N, K, G, a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), out.stride(0),
                        out.stride(1), *scale_strides)
            constexprs = dict(B_ROW_BLOCK=r.weight_block, EVEN_K=K % cfg.block_k == 0,
                              **_pointer_constexprs(r, a, b, cfg, dot_scaled, extra))
    else:
        bound = ts.k_grouped_total_tiles(G, ts.cdiv(N, cfg.block_m), ts.cdiv(K, cfg.block_n))
        scale_strides = (sa.stride(0), sa.stride(1), sb.stride(0), sb.stride(1))
        out_strides = (out.stride(0), out.stride(1), out.stride(2))
        if tma:
            tma_store = cfg.tma_store and _tma_store_ok(out)
            name = "k_grouped_tma"
            geometry = (([N, M], [a.stride(0), 1], [cfg.block_m, r.block]),
                        ([K, M], [b.stride(0), 1], [cfg.block_n, r.block]),
                        ([N, M], [a.stride(0), 1], [cfg.block_m, _NARROW_TOKENS]),
                        ([K, M], [b.stride(0), 1], [cfg.block_n, _NARROW_TOKENS]),
                        (list(out.shape), list(out.stride()), [1, cfg.block_m, cfg.block_n]))
            int_args = (N, K, G, *out_strides, *scale_strides)
            constexprs = dict(SCALE_BLOCK=r.block, E8M0=r.e8m0, NARROW=_NARROW_TOKENS, BLOCK_M=cfg.block_m,
                              BLOCK_N=cfg.block_n, GROUP_M=cfg.group_m, BAND_CYCLIC=cfg.band_cyclic,
                              ACCUMULATE=problem.accumulate, TMA_STORE=tma_store, **extra)
        else:
            name, geometry = "k_grouped", ()
            int_args = (N, K, G, a.stride(0), a.stride(1), b.stride(0), b.stride(1), *out_strides, *scale_strides)
            constexprs = dict(BAND_CYCLIC=cfg.band_cyclic, ACCUMULATE=problem.accumulate,
                              **_pointer_constexprs(r, a, b, cfg, dot_scaled, extra))
    return _BlockPlan(next(_PLAN_IDS), name, (ts.persistent_grid_size(bound, limit),), tma, tma_store, geometry,
                      int_args, constexprs)


def _pointer_constexprs(r, a, b, cfg, dot_scaled, extra) -> dict:
    return dict(SCALE_BLOCK=r.block, E8M0=r.e8m0, USE_DOT_SCALED=dot_scaled, A_FORMAT=_FORMATS[a.dtype],
                B_FORMAT=_FORMATS[b.dtype], BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                GROUP_M=cfg.group_m, **extra)


def run(problem, config: Optional[BlockKernelConfig] = None, signature: Optional[tuple] = None) -> torch.Tensor:
    """Launch the block-scaled kernel for ``problem`` (checked by ``BlockScaledProblem.reason``).
    With the default config the launch plan is cached by ``signature`` (``problem.signature()``
    when not given)."""
    out = problem.out if problem.out is not None else torch.empty(problem.out_shape, dtype=problem.out_dtype,
                                                                   device=problem.device)
    if out.numel() == 0:
        return out
    if config is not None:
        _launch_new(plan(problem, config, out), problem, out, config)
        return out
    if signature is None:
        signature = problem.signature()
    cached = _PLANS.get(signature)
    if cached is None:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[signature] = _launch_new(plan(problem, None, out), problem, out, None)
        return out
    cached.launch(problem, out)
    return out


def _launch_new(new: _BlockPlan, problem, out: torch.Tensor, config: Optional[BlockKernelConfig]) -> _BlockPlan:
    """The first launch of ``new`` (made from ``config``, None: the default); a Gluon plan whose
    kernel does not compile here is replaced by the TMA kernel's, same tiles
    (``triton_backend.launch_gluon_or_fall_back``). Returns the plan that ran."""
    if not new.gluon:
        new.launch(problem, out)
        return new
    from ..backends.triton_backend import launch_gluon_or_fall_back

    return launch_gluon_or_fall_back(new, lambda p: p.launch(problem, out), lambda: plan(
        problem, dataclasses.replace(config or default_config(problem), gluon=False), out))
