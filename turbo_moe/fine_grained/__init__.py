"""Fine-grained FP8 recipes: DeepSeek-style blockwise and OCP MXFP8 (``Float8Config.granularity``).

Semantics (the torch reference in :mod:`.quantize` and :mod:`.gemm` defines them; the Triton
kernels in ``kernels/triton/blockwise_cast.py`` and ``blockwise_gemm.py`` reproduce them):

``blockwise`` (DeepSeek-V3, TE ``Float8BlockScaling``)
    Activations and gradients: one float32 scale per 1x128 tile along the contracted dimension
    (``x`` along K for the forward, ``dy`` along N for dgrad, ``x`` and ``dy`` along the tokens of
    each group for wgrad). Weights: one float32 scale per 128x128 block of ``W[g]`` (``[N, K]``),
    so ``W`` and ``W^T`` share them and dgrad reads the same FP8 values transposed. A block's
    scale is ``fp8_max / amax`` (``2**-margin``), as for tensorwise; ``power_of_two_scales``
    rounds it down to a power of two.

``mxfp8`` (OCP Microscaling v1.0, MXFP8)
    Every operand: one e8m0 scale per 1x32 block along the contracted dimension, so weights are
    quantized twice (``W`` along K, ``W^T`` along N) and activations/gradients twice (along the
    row for fwd/dgrad, along tokens for wgrad). The shared exponent is chosen so that nothing
    saturates: ``X = ceil(log2(amax / fp8_max))`` (NVIDIA's MXFP8 training recipe; OCP's
    ``floor(log2 amax) - emax`` clips block maxima above 448 by up to 12.5%), plus ``margin``,
    clamped to ``[-126, 126]``; stored as ``uint8`` ``X + 127`` (the e8m0 bit pattern; 255 = NaN
    for a block holding NaN/Inf), so ``dequant = 2**X`` is exact. An all-zero block gets ``X = 0``.

GEMMs (:mod:`.gemm`): the scales vary along the contraction, so they are applied per K block
inside the main loop, accumulating in fp32:
``acc += (a_blk @ b_blk^T) * (sa_blk[:, None] * sb_blk[None, :])`` for every K block in order.

wgrad (K_GROUPED, contraction over the tokens of each group): scale blocks restart at each group's
first token, so no block straddles two experts and each expert's scales depend on its own tokens
only (as when every expert's tensor is quantized on its own). Group ``g``'s ``j``-th token block
covers tokens ``[offs[g] + j*B, min(offs[g] + (j+1)*B, offs[g+1]))`` (``B`` = 128 or 32; the last
block of a group whose token count is not a multiple of ``B`` is short) and its scale sits in
slot ``offs[g] // B + g + j`` of a ``[C, M // B + G]`` scale tensor: that slot map needs no prefix
sum (no host sync, one formula on host and device) and never collides (see ``token_slot``).
Slots no block maps to hold unspecified values and are never read.

On a GPU the wgrad's two token operands are stored in an aligned layout
(``quantize_tokens_for_wgrad``): group g from column ``sum_{h<g} round_up(len_h, 16)``, zeros up
to the next group, the same values and scales (slots from the aligned offsets), so the kernels'
16-byte TMA boxes start on every group's first token wherever the routing put it.
"""

from .quantize import (
    FineRecipe,
    recipe_of,
    quantize_rows,
    quantize_weight_blocks,
    quantize_tokens,
    token_slots,
    token_slot_mask,
    dequantize_scales,
)
from .gemm import BlockScaledProblem, reference_block_scaled_gemm, run_block_scaled
from .autograd import FineGrainedFP8Function, grouped_gemm_fine, grouped_wgrad_fine, quantize_weight_fine

__all__ = [
    "FineRecipe",
    "recipe_of",
    "quantize_rows",
    "quantize_weight_blocks",
    "quantize_tokens",
    "token_slots",
    "token_slot_mask",
    "dequantize_scales",
    "BlockScaledProblem",
    "reference_block_scaled_gemm",
    "run_block_scaled",
    "FineGrainedFP8Function",
    "grouped_gemm_fine",
    "grouped_wgrad_fine",
    "quantize_weight_fine",
]
