"""Time the blockwise wgrad-operand cast (``block_cast_tokens_kernel``, the aligned token layout the
autograd writes on a GPU) under its variants, beside the rows cast of the same tensor.

The training step's profile (``docs/results/h100_fine_grained.md``, 2026-11-27) had this cast
taking 2.6 times as long as the rows cast of the same tensors. Variants, in one process on the
same data:

* ``1 program a group, BLOCK_C 64``: the kernel as it was before 2026-11-27: a (C / 64, G) grid
  of 4-warp programs, each walking its group's token blocks serially, so a long group is one
  program's loop;
* ``the library's default``: ``_TOKEN_TILE`` columns a program, a (C / BLOCK_C, G, S) grid,
  S = ``_token_splits``;
* ``split grid`` / ``n slots a program``: the (C / BLOCK_C, G, S) grid, and the (slots / n,
  C / BLOCK_C) grid whose programs find their blocks' groups from the offsets (``_TOKEN_FLAT``
  = n; ``--flat``, ``--flat-tiles``);
* with ``--tiles`` / ``--splits``: other column tiles, warps and split counts;
* with ``--col-tiles`` / ``--trans-regs``: the flat grid (one slot a program) casting n column
  tiles a program (``_TOKEN_COL_TILES``), and the transposed tile from registers instead of a
  second read (``_TOKEN_TRANS_REGS``), alone and together; ``--trans-tiles``: the transposed tile
  from registers under other column tiles and warps (``_TOKEN_TILE``).

Every variant's FP8 values, scales and offsets are checked equal to the first's (the bits must
not depend on the variant). Times: ``triton.testing.do_bench`` medians; GB/s counts the bf16 read
once and the FP8 write.

Usage: ``python scripts/probe_token_cast.py [--routings balanced,zipf] [--shapes all|N,...] [--tiles 32x4,128x4]
[--splits 1,2,4|default] [--flat 1,2,4] [--flat-tiles 64x4] [--col-tiles 2,4] [--trans-regs]
[--trans-tiles 64x4,64x2x2] [--recipe blockwise|mxfp8]``
"""

from __future__ import annotations

import argparse

import torch

# (experts, tokens per expert, columns): the expert-dominated training config's four wgrad
# operands per micro-batch (64 experts top-8 of 12288 tokens; hidden 1024, FFN 2048, SwiGLU), and
# DeepSeek-V3 fc1's x at 32 x 512.
SHAPES = [(64, 1536, 1024), (64, 1536, 2048), (64, 1536, 4096), (32, 512, 7168)]


def main() -> int:
    import triton.testing

    from turbo_moe.bench.shapes import make_group_sizes
    from turbo_moe.fine_grained import quantize as Q
    from turbo_moe.kernels.triton import blockwise_cast as BC

    parser = argparse.ArgumentParser()
    parser.add_argument("--routings", default="balanced,zipf,skewed")
    parser.add_argument("--shapes", default="all")
    parser.add_argument("--tiles", default="", help="extra variants: BLOCK_CxWARPS,... each with every --splits")
    parser.add_argument("--splits", default="1", help="with --tiles: split counts, or 'default'")
    parser.add_argument("--flat", default="1,2,4", help="the flat grid's slots a program (FLAT), each a variant")
    parser.add_argument("--flat-tiles", default="", help="the flat variants under these BLOCK_CxWARPS too")
    parser.add_argument("--col-tiles", default="", help="one slot a program, n column tiles a program: each a variant")
    parser.add_argument("--trans-regs", action="store_true",
                        help="one slot a program, the transposed tile from registers (with each --col-tiles too)")
    parser.add_argument("--recipe", default="blockwise", choices=["blockwise", "mxfp8"])
    parser.add_argument("--maxnreg", default="", help="the library's default tile under these register caps too")
    parser.add_argument("--given-offsets", action="store_true",
                        help="time the cast given the aligned offsets (as the wgrad casts dy over x's), not writing them")
    parser.add_argument("--trans-tiles", default="",
                        help="one slot a program, the transposed tile from registers, under these BLOCK_CxWARPS[xCOL_TILES]")
    args = parser.parse_args()
    shapes = SHAPES if args.shapes == "all" else [SHAPES[int(i)] for i in args.shapes.split(",")]
    e4m3 = torch.float8_e4m3fn
    fmax = torch.finfo(e4m3).max
    recipe = Q.BLOCKWISE if args.recipe == "blockwise" else Q.MXFP8
    default_splits = BC._token_splits
    default_tiles, default_flat = BC._TOKEN_TILE, BC._TOKEN_FLAT
    default_col_tile_map, default_trans = BC._TOKEN_COL_TILES, BC._TOKEN_TRANS_REGS
    default_tile, default_col_tiles = default_tiles[recipe.block], default_col_tile_map[recipe.block]
    # (name, splits rule, (BLOCK_C, num_warps), FLAT, column tiles a program, transposed in registers)
    variants = [("1 program a group, BLOCK_C 64", lambda tokens, groups, block: 1, (64, 4), 0, 1, False),
                ("the library's default", default_splits, default_tile, BC._TOKEN_FLAT, default_col_tiles,
                 default_trans),
                ("split grid", default_splits, default_tile, 0, 1, False)]
    for flat in (int(v) for v in args.flat.split(",") if v):
        for tile in [default_tile] + [tuple(int(v) for v in t.split("x")) for t in args.flat_tiles.split(",") if t]:
            variants.append((f"{flat} slots a program, BLOCK_C {tile[0]}, {tile[1]} warps", default_splits, tile, flat,
                             1, False))
    for tile in (tuple(int(v) for v in t.split("x")) for t in args.tiles.split(",") if t):
        for split in args.splits.split(","):
            rule = default_splits if split == "default" else (lambda tokens, groups, block, n=int(split): n)
            variants.append((f"BLOCK_C {tile[0]}, {tile[1]} warps, S {split}", rule, tile, 0, 1, False))
    for col_tiles in [int(v) for v in args.col_tiles.split(",") if v] + ([1] if args.trans_regs else []):
        for trans in ([False, True] if args.trans_regs else [False]):
            if col_tiles > 1 or trans:
                variants.append((f"1 slot, {col_tiles} column tiles a program{', transposed in registers' if trans else ''}",
                                 default_splits, default_tile, 1, col_tiles, trans))
    for spec in (tuple(int(v) for v in t.split("x")) for t in args.trans_tiles.split(",") if t):
        tile, col_tiles = spec[:2], spec[2] if len(spec) > 2 else 1
        variants.append((f"1 slot, {col_tiles} x BLOCK_C {tile[0]}, {tile[1]} warps, transposed in registers",
                         default_splits, tile, 1, col_tiles, True))
    caps = {}  # variant name -> ptxas register cap (_TOKEN_MAXNREG)
    for cap in (int(v) for v in args.maxnreg.split(",") if v):
        name = f"the library's default, at most {cap} registers"
        caps[name] = cap
        variants.append((name, default_splits, default_tile, BC._TOKEN_FLAT, default_col_tiles, default_trans))
    default_caps = BC._TOKEN_MAXNREG
    print(f"device: {torch.cuda.get_device_name()}")
    print("| experts x tokens, C | routing | variant | S | ms | GB/s | bits vs first | rows cast ms |")
    print("|---|---|---|---|---|---|---|---|")
    for G, T, C in shapes:
        for routing in args.routings.split(","):
            lens = make_group_sizes(G, T, routing, seed=0, align=1)
            M = sum(lens)
            offs = torch.tensor([0] + lens, device="cuda").cumsum(0)
            x = torch.randn(M, C, device="cuda", dtype=torch.bfloat16)
            cols = Q.aligned_token_columns(M, G, 16)
            rows_ms = triton.testing.do_bench(lambda: BC.block_cast_rows(x, recipe, e4m3, fmax, 8), warmup=10, rep=100)
            first = None
            for name, splits_fn, tile, flat, col_tiles, trans in variants:
                BC._token_splits, BC._TOKEN_TILE, BC._TOKEN_FLAT = splits_fn, {recipe.block: tile}, flat
                BC._TOKEN_COL_TILES, BC._TOKEN_TRANS_REGS = {recipe.block: col_tiles}, trans
                # the library's cap for its default tile alone; the other variants uncapped unless asked
                library_cap = default_caps.get(recipe.block) if name == "the library's default" else None
                BC._TOKEN_MAXNREG = {recipe.block: caps.get(name, library_cap)}
                try:
                    given = Q.aligned_token_offsets(offs, 16, cols) if args.given_offsets else None

                    def run():
                        return BC.block_cast_tokens_aligned(x, offs, recipe, e4m3, fmax, 8, 0, 16, cols, given)

                    q, s, aligned = run()
                    torch.cuda.synchronize()
                    end = int(aligned[-1])
                    got = (q[:, :end].view(torch.uint8).clone(), s.clone(), aligned.clone())
                    ms = triton.testing.do_bench(run, warmup=10, rep=100)
                finally:
                    BC._token_splits, BC._TOKEN_TILE, BC._TOKEN_FLAT = default_splits, default_tiles, default_flat
                    BC._TOKEN_COL_TILES, BC._TOKEN_TRANS_REGS = default_col_tile_map, default_trans
                    BC._TOKEN_MAXNREG = default_caps
                if first is None:
                    first, same = got, "-"
                else:
                    used = Q.token_slot_mask(got[2], end, recipe.block)
                    same = "equal" if (torch.equal(got[0], first[0]) and torch.equal(got[2], first[2])
                                       and torch.equal(got[1][:, :used.numel()][:, used],
                                                       first[1][:, :used.numel()][:, used])) else "DIFFER"
                gbs = (2 * M * C + C * cols) / ms / 1e6
                print(f"| {G}x{T}, {C} | {routing} | {name} | {'-' if flat else splits_fn(M, G, recipe.block)} | {ms:.4f} | {gbs:.0f} "
                      f"| {same} | {rows_ms:.4f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
