"""Blockwise and MXFP8 quantization: the torch reference (the semantics) and the GPU dispatch.

Every function returns FP8 data and *stored* scales: float32 dequantization factors (blockwise)
or uint8 e8m0 biased exponents (mxfp8); :func:`dequantize_scales` turns either into float32
factors. Scale tensors of 1xB blocks along rows are returned as ``[..., R, num_blocks]`` views
of block-major storage (``[..., num_blocks, R]`` contiguous): the GEMM kernels load one block's
scales for a tile of rows at a time, which is then one contiguous load.

On a CUDA device the Triton kernels of ``kernels/triton/blockwise_cast.py`` do each function in
one launch, no host sync, bit-for-bit as here; elsewhere the torch ops below run.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ..config import Float8Config, ScalingGranularity, fp8_max
from ..quantize import _cast, _quant_scale

__all__ = [
    "FineRecipe", "recipe_of", "quantize_rows", "quantize_weight_blocks", "quantize_tokens",
    "token_slots", "token_slot_mask", "dequantize_scales", "num_token_slots", "quantize_tokens_aligned",
    "aligned_token_offsets", "aligned_token_columns", "quantize_tokens_for_wgrad", "WGRAD_TOKEN_ALIGN",
    "quantize_swiglu_rows", "quantize_swiglu_backward_rows",
]

# Largest e8m0 exponent a scale takes (and minus the smallest): 2**X and 2**-X stay normal float32.
MX_MAX_EXPONENT = 126
_FP8_EMAX = {torch.float8_e4m3fn: 8, torch.float8_e5m2: 15}  # fp8_max == 1.75 * 2**emax for both


class FineRecipe(NamedTuple):
    """``block``: elements per scale along the contraction (128 or 32); ``e8m0``: MX power-of-two
    exponent scales (uint8) instead of float32; ``pow2``: blockwise scales rounded to powers of
    two; ``weight_block``: rows per weight scale block (128: 128x128 blocks; 1 for mxfp8)."""

    block: int
    e8m0: bool
    pow2: bool
    weight_block: int

    @property
    def scale_dtype(self) -> torch.dtype:
        return torch.uint8 if self.e8m0 else torch.float32


BLOCKWISE = FineRecipe(128, False, False, 128)
MXFP8 = FineRecipe(32, True, False, 1)


def recipe_of(config: Float8Config) -> FineRecipe:
    if config.granularity is ScalingGranularity.BLOCKWISE:
        return BLOCKWISE._replace(pow2=config.power_of_two_scales)
    if config.granularity is ScalingGranularity.MXFP8:
        return MXFP8
    raise ValueError(f"config.granularity={config.granularity.value!r} is not a fine-grained recipe "
                     "('blockwise' or 'mxfp8')")


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _fp32_bits(t: torch.Tensor) -> torch.Tensor:
    return t.float().contiguous().view(torch.int32)


def _floor_pow2(scale: torch.Tensor) -> torch.Tensor:
    """Largest power of two <= scale (positive normal scales; 0 stays 0, NaN stays NaN)."""
    floored = (_fp32_bits(scale) & 0x7F800000).view(torch.float32)
    return torch.where(torch.isnan(scale), scale, floored)


def mx_exponent(amax: torch.Tensor, fp8_dtype: torch.dtype, margin: int) -> torch.Tensor:
    """The e8m0 exponent X (int32) of blocks with these amaxes: the smallest X with
    ``amax * 2**-X <= fp8_max`` (exact, from the float32 bits), plus margin, clamped to
    [-126, 126]; 0 for amax == 0. Non-finite amax is flagged separately (see block_scales)."""
    bits = _fp32_bits(amax)
    exponent = ((bits >> 23) & 0xFF) - 127
    above_175 = ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)  # mantissa above fp8_max's 1.75
    x = (exponent - _FP8_EMAX[fp8_dtype] + above_175 + margin).clamp(-MX_MAX_EXPONENT, MX_MAX_EXPONENT)
    return torch.where(amax == 0, torch.zeros_like(x), x)


def block_scales(amax: torch.Tensor, recipe: FineRecipe, fp8_dtype: torch.dtype, margin: int):
    """(float32 quantization scale, stored scale) of blocks with these amaxes."""
    if recipe.e8m0:
        x = mx_exponent(amax, fp8_dtype, margin)
        nonfinite = ((_fp32_bits(amax) >> 23) & 0xFF) == 255
        quant = ((127 - x) << 23).view(torch.float32)  # 2**-X, exact
        quant = torch.where(nonfinite, torch.full_like(quant, float("nan")), quant)
        stored = torch.where(nonfinite, torch.full_like(x, 255), x + 127).to(torch.uint8)
        return quant, stored
    quant = _quant_scale(amax, fp8_dtype, margin)
    if recipe.pow2:
        quant = _floor_pow2(quant)
    return quant, quant.reciprocal()


def dequantize_scales(stored: torch.Tensor) -> torch.Tensor:
    """float32 dequantization factors of stored scales (uint8 e8m0: ``2**(e - 127)``, 255 -> NaN)."""
    if stored.dtype == torch.uint8:
        e = stored.to(torch.int32)
        value = (e << 23).view(torch.float32) if e.is_contiguous() else (e.contiguous() << 23).view(torch.float32)
        return torch.where(e == 255, torch.full_like(value, float("nan")), value)
    return stored.float()


def _amax_nan(t: torch.Tensor, dim) -> torch.Tensor:
    """amax over ``dim`` of |t| in float32, NaN if any element is NaN (torch's amax keeps NaN)."""
    return t.abs().float().amax(dim=dim)


def _kernels(t: torch.Tensor):
    if not t.is_cuda:
        return None
    from turbo_moe.kernels.triton import blockwise_cast

    return blockwise_cast


def quantize_rows(t: torch.Tensor, recipe: FineRecipe, fp8_dtype: torch.dtype, margin: int = 0):
    """1xB blocks along the last dim of ``t`` ([R, C] or [B, R, C], any strides; C contracted).

    Returns (fp8 ``[..., R, C]`` contiguous, stored scales ``[..., R, cdiv(C, B)]`` as a view of
    block-major storage)."""
    kernels = _kernels(t)
    if kernels is not None:
        return kernels.block_cast_rows(t, recipe, fp8_dtype, fp8_max(fp8_dtype), _FP8_EMAX[fp8_dtype], margin)
    *lead, rows, cols = t.shape
    nb = _cdiv(cols, recipe.block)
    padded = torch.nn.functional.pad(t.float(), (0, nb * recipe.block - cols))  # zeros: amax unchanged
    blocks = padded.reshape(*lead, rows, nb, recipe.block)
    amax = _amax_nan(blocks, -1) if blocks.numel() else blocks.new_zeros(*lead, rows, nb)
    quant, stored = block_scales(amax, recipe, fp8_dtype, margin)
    q = _cast(blocks, quant[..., None], fp8_dtype).reshape(*lead, rows, nb * recipe.block)[..., :cols].contiguous()
    return q, stored.transpose(-1, -2).contiguous().transpose(-1, -2)


def quantize_swiglu_rows(h: torch.Tensor, probs: torch.Tensor, recipe: FineRecipe, fp8_dtype: torch.dtype,
                         margin: int = 0):
    """fc2's input ``a = silu(h[:, :F]) * h[:, F:] * probs[:, None]`` (``turbo_moe.swiglu.weighted_swiglu``,
    float32, rounded to h's dtype) and its rows copy: ``(a [M, F], fp8 [M, F], stored scales)``, the
    copy bit for bit ``quantize_rows(a)``. On a GPU one launch computes ``a`` from ``h [M, 2F]``
    (unit column stride) and ``probs [M]`` and casts it (``block_cast_rows`` of a stored ``a``
    needs a launch and a read of ``a`` more)."""
    if h.is_cuda:
        from turbo_moe.kernels.triton import swiglu_fp8

        return swiglu_fp8.swiglu_block_cast_rows(h, probs, recipe, fp8_dtype, fp8_max(fp8_dtype), _FP8_EMAX[fp8_dtype],
                                                 margin)
    from ..swiglu import weighted_swiglu

    a = weighted_swiglu(h, probs).to(h.dtype)
    return (a, *quantize_rows(a, recipe, fp8_dtype, margin))


def quantize_swiglu_backward_rows(h: torch.Tensor, probs: torch.Tensor, da: torch.Tensor, recipe: FineRecipe,
                                  fp8_dtype: torch.dtype, margin: int = 0):
    """``turbo_moe.swiglu.weighted_swiglu_backward``'s ``(dh, dprobs)`` and ``dh``'s rows copy:
    ``(dh [M, 2F], dprobs [M], fp8 [M, 2F], stored scales)``, the copy bit for bit
    ``quantize_rows(dh)``; F a multiple of ``recipe.block`` (no block across the two halves). On a
    GPU one launch (``swiglu_fp8.swiglu_backward_block_rows``)."""
    if h.is_cuda:
        from turbo_moe.kernels.triton import swiglu_fp8

        return swiglu_fp8.swiglu_backward_block_rows(h, probs, da, probs.dtype, recipe, fp8_dtype, fp8_max(fp8_dtype),
                                                     _FP8_EMAX[fp8_dtype], margin)
    from ..swiglu import weighted_swiglu_backward

    dh, dprobs = weighted_swiglu_backward(h, probs, da)
    return (dh, dprobs, *quantize_rows(dh, recipe, fp8_dtype, margin))


def quantize_weight_blocks(w: torch.Tensor, recipe: FineRecipe, fp8_dtype: torch.dtype, margin: int = 0,
                           transposed: bool = True):
    """128x128 blocks of ``w [G, N, K]``: (fp8 ``[G, N, K]``, fp8 ``[G, K, N]`` or None, float32
    scales ``[G, cdiv(N, 128), cdiv(K, 128)]`` shared by both: the transposed copy's scales are
    ``scales.transpose(1, 2)``)."""
    if recipe.e8m0 or recipe.weight_block != recipe.block:
        raise ValueError("quantize_weight_blocks is the blockwise recipe's square weight blocks")
    kernels = _kernels(w)
    if kernels is not None:
        return kernels.block_cast_weight(w, recipe, fp8_dtype, fp8_max(fp8_dtype), margin, transposed)
    g, n, k = w.shape
    b = recipe.block
    nb, kb = _cdiv(n, b), _cdiv(k, b)
    padded = torch.nn.functional.pad(w.float(), (0, kb * b - k, 0, nb * b - n))
    blocks = padded.reshape(g, nb, b, kb, b)
    amax = _amax_nan(blocks, (2, 4)) if blocks.numel() else blocks.new_zeros(g, nb, kb)
    quant, stored = block_scales(amax, recipe, fp8_dtype, margin)
    q = _cast(blocks, quant[:, :, None, :, None], fp8_dtype).reshape(g, nb * b, kb * b)[:, :n, :k].contiguous()
    q_t = q.transpose(1, 2).contiguous() if transposed else None
    return q, q_t, stored


def num_token_slots(num_tokens: int, num_groups: int, block: int) -> int:
    """Slots of a token-block scale tensor: every ``token_slot`` of M tokens in G groups is below it."""
    return num_tokens // block + num_groups


def token_slots(group_offs, block: int):
    """``(group, j) -> slot`` as a list per group (host ints; tests and the reference): group g's
    j-th token block sits in slot ``offs[g] // block + g + j``. Distinct groups never share a slot:
    group g's last slot ``offs[g]//B + g + cdiv(L, B) - 1 <= offs[g+1]//B + g`` because
    ``floor(hi/B) >= floor(lo/B) + floor(L/B)``; all are below ``M // B + G``."""
    offs = [int(v) for v in (group_offs.tolist() if isinstance(group_offs, torch.Tensor) else group_offs)]
    return [[offs[g] // block + g + j for j in range(_cdiv(offs[g + 1] - offs[g], block))]
            for g in range(len(offs) - 1)]


def token_slot_mask(group_offs, num_tokens: int, block: int) -> torch.Tensor:
    """bool ``[M // B + G]``: the slots some token block maps to."""
    mask = torch.zeros(num_token_slots(num_tokens, len(group_offs) - 1, block), dtype=torch.bool)
    for slots in token_slots(group_offs, block):
        mask[slots] = True
    return mask


def quantize_tokens(t: torch.Tensor, group_offs: torch.Tensor, recipe: FineRecipe, fp8_dtype: torch.dtype,
                    margin: int = 0, num_groups_hint: Optional[int] = None):
    """The wgrad operand: ``t [M, C]`` contracted over each group's tokens, blocks of B tokens
    restarting at each group's first token (module doc of ``turbo_moe.fine_grained``).

    Returns (fp8 ``[C, M]`` token-contiguous, stored scales ``[C, M // B + G]`` as a view of
    slot-major storage)."""
    kernels = _kernels(t)
    if kernels is not None:
        return kernels.block_cast_tokens(t, group_offs, recipe, fp8_dtype, fp8_max(fp8_dtype), _FP8_EMAX[fp8_dtype],
                                         margin)
    m, c = t.shape
    b = recipe.block
    num_groups = group_offs.shape[0] - 1
    slots_total = num_token_slots(m, num_groups, b)
    fill = 127 if recipe.e8m0 else 1.0
    stored = torch.full((slots_total, c), fill, dtype=recipe.scale_dtype, device=t.device)
    q_t = torch.empty((c, m), dtype=fp8_dtype, device=t.device)
    if t.device.type == "meta":  # shape inference
        return q_t, stored.T
    offs = group_offs.tolist()
    for g, slots in enumerate(token_slots(offs, b)):
        for j, slot in enumerate(slots):
            t0, t1 = offs[g] + j * b, min(offs[g] + (j + 1) * b, offs[g + 1])
            chunk = t[t0:t1].float()
            quant, stored[slot] = block_scales(_amax_nan(chunk, 0), recipe, fp8_dtype, margin)
            q_t[:, t0:t1] = _cast(chunk, quant[None, :], fp8_dtype).T
    return q_t, stored.T


# The wgrad kernels' token boxes start on 16-token boundaries (a TMA coordinate along the contiguous
# dimension is 16-byte aligned): a group starting elsewhere costs them two masked boxes for every
# block (the H100's blockwise wgrad fell from 737 to 190 TFLOPS under zipf routing with ragged
# groups). The aligned layout starts every group on such a boundary instead.
WGRAD_TOKEN_ALIGN = 16


def aligned_token_offsets(group_offs: torch.Tensor, token_align: int, columns: Optional[int] = None) -> torch.Tensor:
    """``[G + 1]`` offsets of the aligned token layout: group g's tokens at columns
    ``[out[g], out[g] + len_g)``, ``out[g + 1] = out[g] + round_up(len_g, token_align)``, at most
    ``columns`` (offsets that are not non-decreasing, which the layer's never are, could pass it)."""
    lens = (group_offs[1:] - group_offs[:-1]).clamp(min=0)
    padded = (lens + token_align - 1) // token_align * token_align
    out = torch.cat([group_offs.new_zeros(1), padded.cumsum(0)])
    return out if columns is None else out.clamp_(max=columns)


def aligned_token_columns(num_tokens: int, num_groups: int, token_align: int) -> int:
    """Columns of an aligned token layout: room for every group rounded up to ``token_align``
    whatever the routing (no host sync), rounded up to 16 so each row starts 16-byte aligned."""
    return _cdiv(num_tokens + (token_align - 1) * num_groups, 16) * 16


def quantize_tokens_aligned(t: torch.Tensor, group_offs: torch.Tensor, recipe: FineRecipe, fp8_dtype: torch.dtype,
                            margin: int = 0, token_align: int = WGRAD_TOKEN_ALIGN,
                            aligned_offs: Optional[torch.Tensor] = None):
    """``quantize_tokens`` in the aligned token layout, for a wgrad whose groups start anywhere.

    The same FP8 values and scales, stored differently: group g's tokens from column
    ``aligned_offs[g]`` (``aligned_token_offsets``), the columns up to ``aligned_offs[g + 1]``
    zeros, block j's scales in slot ``aligned_offs[g] // B + g + j``; columns past
    ``aligned_offs[G]`` unspecified. A wgrad over ``(q_t, scales, aligned_offs)`` is the wgrad
    over the tokens (the zeros add nothing). Returns (fp8 ``[C, cols]``, scales, aligned_offs);
    ``aligned_offs``: an earlier call's, for the same ``group_offs`` (not computed again)."""
    m, c = t.shape
    num_groups = group_offs.shape[0] - 1
    cols = aligned_token_columns(m, num_groups, token_align)
    kernels = _kernels(t)
    if kernels is not None:
        if aligned_offs is None and m and not c:  # no columns: the cast kernel would not run to write them
            aligned_offs = aligned_token_offsets(group_offs, token_align, cols)
        return kernels.block_cast_tokens_aligned(t, group_offs, recipe, fp8_dtype, fp8_max(fp8_dtype),
                                                 _FP8_EMAX[fp8_dtype], margin, token_align, cols, aligned_offs)
    if aligned_offs is None:
        aligned_offs = aligned_token_offsets(group_offs, token_align, cols)
    q, scales = quantize_tokens(t, group_offs, recipe, fp8_dtype, margin)
    fill = 127 if recipe.e8m0 else 1.0
    stored = torch.full((num_token_slots(cols, num_groups, recipe.block), c), fill, dtype=recipe.scale_dtype,
                        device=t.device)
    q_t = torch.zeros((c, cols), dtype=fp8_dtype, device=t.device)
    if t.device.type == "meta":
        return q_t, stored.T, aligned_offs
    offs, dest = group_offs.tolist(), aligned_offs.tolist()
    for g, slots in enumerate(token_slots(offs, recipe.block)):
        q_t[:, dest[g]:dest[g] + offs[g + 1] - offs[g]] = q[:, offs[g]:offs[g + 1]]
        for j, slot in enumerate(slots):
            stored[dest[g] // recipe.block + g + j] = scales[:, slot]
    return q_t, stored.T, aligned_offs


def quantize_tokens_for_wgrad(t: torch.Tensor, group_offs: torch.Tensor, recipe: FineRecipe, fp8_dtype: torch.dtype,
                              margin: int = 0, wgrad_offs: Optional[torch.Tensor] = None):
    """A wgrad operand as the device's kernels want it: (fp8 ``[C, cols]``, scales, the offsets to
    pass the wgrad). On a GPU the aligned token layout (``quantize_tokens_aligned``; ``wgrad_offs``:
    the other operand's, for the same routing); elsewhere ``quantize_tokens`` and ``group_offs``."""
    if _kernels(t) is None:
        return (*quantize_tokens(t, group_offs, recipe, fp8_dtype, margin), group_offs)
    return quantize_tokens_aligned(t, group_offs, recipe, fp8_dtype, margin, aligned_offs=wgrad_offs)
