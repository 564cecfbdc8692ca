"""The fused FP8 quantization kernels give the same bits as the torch quantization path.

On the CPU the kernel runs in Triton's interpreter (in a subprocess, because Triton fixes a
kernel's mode when the module is imported); on a GPU (marked ``gpu``) it runs compiled.

Triton 3.9's interpreter rounds float->fp8 wrongly when rounding carries into the exponent
(-125.87 -> -64 instead of -128 in e4m3; its numpy ``_convert_float``) and encodes NaN as 0x7C
in e4m3fn, which the hardware conversion does not do. So under the interpreter the inputs are values that scale *exactly* onto
the FP8 grid (random FP8 values times a power of two, amax pinned to a power of two times the
format's max): no rounding happens, and the test checks layout, masks, strides, scale and NaN
handling bit for bit. The compiled GPU test uses arbitrary random data and checks rounding too.
"""

import textwrap

import pytest

from interpreter_child import assert_prints_ok, run_on_gpu

CHECK = textwrap.dedent(
    """
    import torch
    from turbo_moe.kernels.triton.fp8_cast import fp8_tensorwise_cast
    from turbo_moe.quantize import _cast, _quant_scale, _amax

    def fp8_cast(x, scale, fp8, fmax, write_rows=True, write_transposed=False):
        # the kernels find the scale themselves: it must equal the torch path's
        rows, trans, dequant = fp8_tensorwise_cast(x, fp8, fmax, 0, write_rows, write_transposed)
        assert torch.equal(dequant, scale.reciprocal()), (dequant, scale.reciprocal())
        return rows, trans
    from turbo_moe.config import fp8_max
    device = DEVICE
    gen = torch.Generator().manual_seed(0)
    # (3, 65, 129) and (130, 80) span several amax partials (4096 elements each). Sizes that are
    # multiples of 16 get vectorized stores: (320, 80) is where ptxas 12.9 garbled the transposed
    # copy on an H100 (fp8_cast's module docstring), so they are here on purpose.
    cases = [((37, 70), torch.float32), ((3, 65, 129), torch.bfloat16), ((1, 1), torch.float16), ((0, 5), torch.float32),
             ((130, 80), torch.bfloat16), ((320, 80), torch.float32), ((320, 96), torch.float32),
             ((2, 128, 256), torch.bfloat16), ((256, 64), torch.float16)]
    for shape, dtype in cases:
        for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
            if EXACT:
                grid_values = (torch.randn(shape, generator=gen) * 50).to(fp8).float()
                x = (grid_values * 2.0**-5).to(dtype).to(device)
                if x.numel():
                    x.view(-1)[-1] = torch.finfo(fp8).max * 2.0**-5  # amax: scale is exactly 2**5
            else:
                x = (torch.randn(shape, generator=gen) * 7).to(dtype).to(device)
                if x.numel():
                    x.view(-1)[0] = 1e-30 if dtype == torch.float32 else 0  # an underflow
            scale = _quant_scale(_amax(x), fp8, 0)
            ref = _cast(x, scale, fp8)
            rows, trans = fp8_cast(x, scale, fp8, fp8_max(fp8), write_rows=True, write_transposed=True)
            assert rows.is_contiguous() and trans.is_contiguous()
            assert torch.equal(rows.view(torch.uint8), ref.view(torch.uint8)), (shape, dtype, fp8)
            assert torch.equal(trans.view(torch.uint8), ref.transpose(-1, -2).contiguous().view(torch.uint8))
            only_t = fp8_cast(x, scale, fp8, fp8_max(fp8), write_rows=False, write_transposed=True)
            assert only_t[0] is None and torch.equal(only_t[1].view(torch.uint8), trans.view(torch.uint8))
    # a row capacity past the row count (a token bucket, docs/design.md "Not yet served"): the copies
    # are views of the first R rows of capacity-row buffers, their bits the R-row call's; the amax
    # partition and the cast grid are the capacity's
    from turbo_moe.kernels.triton import fp8_cast as F
    for (r, c), cap in (((70, 48), 96), ((200, 33), 9000), ((5, 130), 5)):
        grid_values = (torch.randn(r, c, generator=gen) * 50).to(torch.float8_e4m3fn).float()
        x = (grid_values * 2.0**-5).to(device)
        x[0, 0] = 448.0 * 2.0**-5
        want_rows, want_t, want_dq = fp8_tensorwise_cast(x, torch.float8_e4m3fn, 448.0, 0, True, True)
        rows, trans, dq = fp8_tensorwise_cast(x, torch.float8_e4m3fn, 448.0, 0, True, True, row_capacity=cap)
        assert rows.shape == (r, c) and trans.shape == (c, r) and trans.stride() == (cap, 1), (trans.stride(), cap)
        assert rows._base is None or rows._base.shape == (cap, c)
        assert torch.equal(rows.view(torch.uint8), want_rows.view(torch.uint8)), (r, c, cap)
        assert torch.equal(trans.view(torch.uint8), want_t.view(torch.uint8)) and torch.equal(dq, want_dq), (r, c, cap)
        geo = F._TENSORWISE_GEOMETRY[(x.shape, x.dtype, torch.float8_e4m3fn, 448.0, 0, True, True, cap)]
        full = F._TensorwiseGeometry(torch.empty(cap, c), torch.float8_e4m3fn, 448.0, 0, True, True, cap)
        assert (geo.num_partials, geo.chunk, geo.cast_grid) == (full.num_partials, full.chunk, full.cast_grid)
        assert geo.numel == r * c
    try:
        fp8_tensorwise_cast(torch.zeros(8, 4, device=device), torch.float8_e4m3fn, 448.0, row_capacity=7)
        raise AssertionError("a row capacity under the row count must raise")
    except ValueError as err:
        assert "row_capacity" in str(err)
    # a strided (transposed) source
    x = (torch.randn(40, 24, generator=gen) * 50).to(torch.float8_e4m3fn).float().to(device).t()
    x[0, 0] = 448.0
    scale = _quant_scale(_amax(x), torch.float8_e4m3fn, 0)
    rows, _ = fp8_cast(x, scale, torch.float8_e4m3fn, 448.0)
    assert torch.equal(rows.view(torch.uint8), _cast(x, scale, torch.float8_e4m3fn).contiguous().view(torch.uint8))
    if not EXACT:  # the interpreter also encodes NaN wrongly (0x7C in e4m3fn), so compiled only
        # NaN propagates instead of clamping to +-max
        for shape, where in (((8, 8), (1, 1)), ((300, 70), (250, 3))):  # NaN in the first / a later partial
            x = torch.randn(*shape, generator=gen).to(device)
            x[where] = float("nan")
            rows, _, dequant = fp8_tensorwise_cast(x, torch.float8_e4m3fn, 448.0)
            assert torch.isnan(rows.float()).all() and torch.isnan(dequant)
    print("ok")
    """
)


def test_fp8_cast_kernel_matches_torch_in_interpreter():
    assert_prints_ok(CHECK.replace("DEVICE", "'cpu'").replace("EXACT", "True"))


@pytest.mark.gpu
def test_fp8_cast_kernel_matches_torch_on_gpu():
    run_on_gpu(CHECK.replace("DEVICE", "'cuda'").replace("EXACT", "False"), "fp8_cast_check")


ROWWISE_CHECK = textwrap.dedent(
    """
    import torch
    from turbo_moe.kernels.triton.fp8_cast import fp8_rowwise_cast, fp8_colwise_grouped_cast
    from turbo_moe.kernels.triton.rowwise_layouts import fp8_rowwise_layouts
    from turbo_moe.config import fp8_max
    import turbo_moe.quantize as Q
    device = DEVICE
    gen = torch.Generator().manual_seed(1)

    def data(shape, offs, dtype, margin):
        if not EXACT:
            return (torch.randn(shape, generator=gen) * 3).to(dtype).to(device)
        # FP8 grid values g with |g| <= 448 / 2**margin: x = g * 2**(margin-5) scales back onto g exactly
        g = (torch.randn(shape, generator=gen) * 40).clamp(-224, 224).to(torch.float8_e5m2).float()
        g = torch.where(g.abs() < 1, torch.zeros_like(g), g)  # keep off the formats' subnormal ranges
        x = g * 2.0 ** (margin - 5)
        x[..., :, 0] = 14.0  # every row's amax: 448 * 2**-5, so every scale is exactly 2**5
        for lo, hi in zip(offs[:-1], offs[1:]):
            if hi > lo:
                x[..., lo, :] = -14.0  # every (group, column) amax too
        return x.to(dtype).to(device)

    def torch_path(fn, *args, **kw):  # the reference: the same function without the GPU kernels
        saved, Q._cast_kernels = Q._cast_kernels, lambda t: None
        try:
            return fn(*args, **kw)
        finally:
            Q._cast_kernels = saved

    same = lambda a, b: torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
        for margin in (0, 1):
            for shape, lens, dtype in (((37, 70), [5, 0, 20, 12], torch.float32), ((3, 33, 129), None, torch.bfloat16),
                                       ((320, 80), [100, 100, 120, 0], torch.float32), ((2, 128, 96), None, torch.bfloat16),
                ((70, 1100), [0, 65, 5], torch.bfloat16)):  # 1100 columns: two column splits
                offs = [0] if lens else [0, shape[-2]]
                for n in lens or []:
                    offs.append(offs[-1] + n)
                x = data(shape, offs, dtype, margin)
                q, s = fp8_rowwise_cast(x, fp8, fp8_max(fp8), margin)
                q_ref, s_ref = torch_path(Q.quantize_rowwise, x, fp8, margin)
                assert same(q, q_ref) and torch.equal(s, s_ref), ("rowwise", shape, fp8, margin)
                g_offs = torch.tensor(offs, device=device) if lens else None
                qt, st = Q.quantize_columnwise(x, fp8, margin, group_offs=g_offs) if device != "cpu" else \
                    (lambda r: (r[0] if lens else r[0], r[1] if lens else r[1].squeeze(-2)))(
                        fp8_colwise_grouped_cast(x, g_offs, fp8, fp8_max(fp8), margin))
                qt_ref, st_ref = torch_path(Q.quantize_columnwise, x, fp8, margin, group_offs=g_offs)
                assert qt.shape == qt_ref.shape and st.shape == st_ref.shape, (qt.shape, qt_ref.shape, st.shape, st_ref.shape)
                assert same(qt, qt_ref) and torch.equal(st, st_ref), ("colwise", shape, fp8, margin)
                for g, n in enumerate(lens or []):
                    if n == 0:  # an empty group's scales are 1
                        assert torch.equal(st[g], torch.ones_like(st[g]))
                # both layouts in two passes: the bits of the two one-pass kernels (and of torch)
                both = Q.quantize_rowwise_layouts(x, fp8, margin, group_offs=g_offs) if device != "cpu" else \
                    (lambda r: r[:3] + (r[3] if lens else r[3].squeeze(-2),))(
                        fp8_rowwise_layouts(x, g_offs, fp8, fp8_max(fp8), margin))
                for got, want in zip(both, (q_ref, s_ref, qt_ref, st_ref)):
                    assert got.shape == want.shape and got.is_contiguous(), ("layouts", shape, got.shape, want.shape)
                    assert same(got, want) if got.dtype == fp8 else torch.equal(got, want), ("layouts", shape, fp8)
    # random routings (seeded): empty groups, one group holding most rows, rows past one 256-row stats
    # tile, columns off the 64-column tiles; the stats pass's tile scan and the cast's group search
    # against torch, bit for bit
    for case in range(5):
        g = int(torch.randint(1, 40, (1,), generator=gen))
        lens = torch.randint(0, 30, (g,), generator=gen) * (torch.rand(g, generator=gen) < 0.7)
        lens[int(torch.randint(0, g, (1,), generator=gen))] += int(torch.randint(0, 400, (1,), generator=gen))
        offs = [0] + lens.cumsum(0).tolist()
        if offs[-1] == 0:
            continue
        x = data((offs[-1], int(torch.randint(1, 200, (1,), generator=gen))), offs, torch.float32, 0)
        for j, (lo, hi) in enumerate(zip(offs[:-1], offs[1:])):
            x[lo:hi] *= 2.0 ** (j % 3)  # groups' amaxes differ by powers of two: a row scaled by another
            # group's column scales comes out different, still exactly (no rounding under the interpreter)
        g_offs = torch.tensor(offs, device=device)
        got = fp8_rowwise_layouts(x, g_offs, torch.float8_e4m3fn, 448.0, 0)
        want = torch_path(Q.quantize_rowwise_layouts, x, torch.float8_e4m3fn, 0, group_offs=g_offs)
        assert all(same(a, b) if a.dtype != torch.float32 else torch.equal(a, b) for a, b in zip(got, want)), \
            ("random routing", case, offs[-1], x.shape)
    # many groups, one row each and empty ones between (a tile per group; groups found by the vector scan)
    offs = torch.tensor([0] + [min(i // 2, 60) for i in range(2, 128)] + [64], device=device)
    x = data((64, 48), offs.tolist(), torch.float32, 0)
    got = fp8_rowwise_layouts(x, offs, torch.float8_e4m3fn, 448.0, 0)
    want = torch_path(Q.quantize_rowwise_layouts, x, torch.float8_e4m3fn, 0, group_offs=offs)
    assert all(same(a, b) if a.dtype != torch.float32 else torch.equal(a, b) for a, b in zip(got, want)), "many groups"
    if not EXACT:  # NaN: its row and its (group, column) slice go NaN, nothing else (compiled only)
        x = torch.randn(300, 1500, generator=gen).to(device)
        x[250, 1300] = float("nan")
        offs = torch.tensor([0, 100, 240, 300], device=device)
        rows, rs, trans, cs = fp8_rowwise_layouts(x, offs, torch.float8_e4m3fn, 448.0, 0)
        assert torch.isnan(rs[250]) and torch.isfinite(rs[:250]).all() and torch.isfinite(rs[251:]).all()
        assert torch.isnan(cs[2, 1300]) and torch.isnan(cs).sum() == 1 and torch.isnan(rows[250].float()).all()
        assert torch.isnan(trans[1300, 240:].float()).all() and not torch.isnan(trans[1300, :240].float()).any()
    print("ok")
    """
)


def test_rowwise_cast_kernels_match_torch_in_interpreter():
    assert_prints_ok(ROWWISE_CHECK.replace("DEVICE", "'cpu'").replace("EXACT", "True"))


@pytest.mark.gpu
def test_rowwise_cast_kernels_match_torch_on_gpu():
    run_on_gpu(ROWWISE_CHECK.replace("DEVICE", "'cuda'").replace("EXACT", "False"), "rowwise_check")


TINY_CHECK = textwrap.dedent(
    """
    import torch
    from turbo_moe.kernels.triton.fp8_cast import fp8_rowwise_cast, fp8_colwise_grouped_cast
    from turbo_moe.kernels.triton.rowwise_layouts import fp8_rowwise_layouts
    from turbo_moe.config import fp8_max
    import turbo_moe.quantize as Q
    device = DEVICE
    gen = torch.Generator().manual_seed(2)
    same = lambda a, b: torch.equal(a.view(torch.uint8), b.view(torch.uint8))

    def torch_path(fn, *args, **kw):
        saved, Q._cast_kernels = Q._cast_kernels, lambda t: None
        try:
            return fn(*args, **kw)
        finally:
            Q._cast_kernels = saved

    # Rows (and groups of rows) at amax = 448 * 2**e: e = 0 (scale 2**0), -125 (scale 2**125, under the
    # cap), -127 (2**127, capped), -130 (2**130 overflows float32, capped), an all-zero row, a NaN-free
    # mix. Data are FP8 grid values g (|g| >= 1) times the row's 2**e, so that with the capped scale
    # 2**126, g * 2**(e + 126) is still exact in both formats: no rounding under the interpreter.
    exps = [0, -125, -127, -130, None, -130, -127, 0]
    g = (torch.randn(len(exps), 40, generator=gen) * 40).clamp(-224, 224).to(torch.float8_e5m2).float()
    g = torch.where(g.abs() < 1, torch.ones_like(g), g)
    g[:, 0] = 448.0
    x = torch.stack([g[i] * 2.0**e if e is not None else torch.zeros(40) for i, e in enumerate(exps)])
    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
        xs = x if fp8 == torch.float8_e4m3fn else x * (57344.0 / 448.0)  # amax on e5m2's max
        xs = xs.to(device)
        q, s = fp8_rowwise_cast(xs, fp8, fp8_max(fp8))
        q_ref, s_ref = torch_path(Q.quantize_rowwise, xs, fp8)
        assert same(q, q_ref) and torch.equal(s, s_ref), ("rowwise", fp8, s, s_ref)
        want = torch.tensor([1.0 if e is None else 2.0 ** max(-126, e) for e in exps], device=device)
        assert torch.equal(s, want), s  # dequant amax / fp8_max, at least 2**-126; an all-zero row 1
        deq = q.float() * s[:, None]
        assert torch.equal(deq, xs.float()), "every row, the capped ones too, must come back exactly"
        offs = torch.tensor([0, 1, 2, 4, 5, 5, 8], device=device)  # one row each, a pair, an empty group
        qt, st = fp8_colwise_grouped_cast(xs.t().contiguous().t(), offs, fp8, fp8_max(fp8))
        qt_ref, st_ref = torch_path(Q.quantize_columnwise, xs, fp8, 0, group_offs=offs)
        assert same(qt, qt_ref) and torch.equal(st, st_ref), ("colwise", fp8)
        assert torch.isfinite(st).all() and (st >= 2.0**-126).all()
        both = fp8_rowwise_layouts(xs, offs, fp8, fp8_max(fp8))
        assert same(both[0], q_ref) and torch.equal(both[1], s_ref), ("layouts rows", fp8)
        assert same(both[2], qt_ref) and torch.equal(both[3], st_ref), ("layouts columns", fp8)
    print("ok")
    """
)


def test_tiny_amax_scale_cap_matches_torch_in_interpreter():
    assert_prints_ok(TINY_CHECK.replace("DEVICE", "'cpu'"))


@pytest.mark.gpu
def test_tiny_amax_scale_cap_matches_torch_on_gpu():
    run_on_gpu(TINY_CHECK.replace("DEVICE", "'cuda'"), "tiny_check")
