"""Delayed scaling (``Float8Config(strategy="delayed")``, turbo_moe.delayed_scaling, kernels/triton/amax_history.py).

* The recipe's rule against a float64 model of Transformer Engine's: each cast uses the scale the
  history held before it, records its own amax, the next scale is ``fp8_max / amax_h`` (newest or
  max of the history), 0/Inf/NaN amaxes keep the old scale, the first cast is seeded with its own
  amax, an empty tensor records nothing.
* The one-pass kernels (interpreted on the CPU, compiled on a GPU) against the torch path: the
  scale each cast used, the history and the next scale bit for bit; the FP8 bytes bit for bit
  where both round the same (the first cast against current scaling's kernel; on a GPU every cast
  against the torch path).
* The layers: GroupedLinearFP8 and GroupedSwiGLUMLPFP8 with delayed scaling against float64 math,
  and current scaling's results where the scales coincide (the first step); Megatron's
  ``fp8_recipe="delayed"``; bad configs and calls name their argument.
"""

import textwrap

import pytest
import torch

from interpreter_child import assert_prints_ok, run_on_gpu
from turbo_moe import DelayedScalingState, Float8Config, GroupedLinearFP8, GroupedSwiGLUMLPFP8, grouped_gemm_fp8
from turbo_moe.autograd import grouped_wgrad_fp8
from turbo_moe.config import fp8_max
from turbo_moe.delayed_scaling import AmaxHistory
from turbo_moe.quantize import quantize_tensorwise_layouts

E4M3 = torch.float8_e4m3fn


def test_config_validation_names_the_field():
    cfg = Float8Config(strategy="delayed", amax_history_len=1024, amax_compute_algo="most_recent")
    assert cfg.delayed and not Float8Config().delayed
    with pytest.raises(ValueError, match="strategy='delayed'.*granularity='rowwise'"):
        Float8Config(strategy="delayed", granularity="rowwise")
    with pytest.raises(ValueError, match="strategy='delayed'.*blockwise"):
        Float8Config(strategy="delayed", granularity="blockwise")
    with pytest.raises(ValueError, match="amax_compute_algo"):
        Float8Config(strategy="delayed", amax_compute_algo="mean")
    for bad in (0, 4097, True, 2.0):
        with pytest.raises(ValueError, match="amax_history_len"):
            Float8Config(strategy="delayed", amax_history_len=bad)


def test_calls_need_the_state_exactly_with_a_delayed_config():
    x, w = torch.randn(8, 32), torch.randn(2, 16, 32)
    lens = torch.tensor([3, 5])
    with pytest.raises(ValueError, match="needs delayed_state="):
        grouped_gemm_fp8(x, w, lens, config=Float8Config(strategy="delayed"))
    with pytest.raises(ValueError, match="delayed_state= is for.*'current'"):
        grouped_gemm_fp8(x, w, lens, delayed_state=DelayedScalingState(Float8Config(strategy="delayed")))
    with pytest.raises(ValueError, match="DelayedScalingState is for"):
        DelayedScalingState(Float8Config())
    with pytest.raises(ValueError, match="grouped_wgrad_fp8.*strategy must be 'current'"):
        grouped_wgrad_fp8(torch.randn(8, 16), x, torch.tensor([0, 3, 8]), config=Float8Config(strategy="delayed"))


def _te_model(amaxes, history_len, most_recent, fmax=448.0):
    """float64 model of the rule: the scale each cast uses, given the amaxes of the casts in order
    (the first seeds the history with its own amax)."""
    used, history, scale = [], [], None
    for i, amax in enumerate(amaxes):
        if i == 0:
            ok = 0 < amax < float("inf")
            scale = fmax / amax if ok else 1.0
            history = [amax]
        used.append(scale)
        history = ([amax] + history)[:history_len]
        amax_h = history[0] if most_recent else (float("nan") if any(a != a for a in history) else max(history))
        if 0 < amax_h < float("inf"):
            scale = fmax / amax_h
    return used


@pytest.mark.parametrize("history_len, algo", [(1, "most_recent"), (1, "max"), (3, "max"), (3, "most_recent"),
                                               (16, "max")])
def test_history_rule_matches_a_float64_model(history_len, algo):
    gen = torch.Generator().manual_seed(history_len)
    mags = [3.0, 50.0, 0.25, 0.0, 7.0, float("nan"), 2.0, 1e-3, 900.0, 5.0]
    hist = AmaxHistory(history_len, algo == "most_recent")
    used = []
    for mag in mags:
        t = torch.randn(13, 24, generator=gen)
        t = t / t.abs().max() * mag if mag == mag else t.index_put_((torch.tensor([2]), torch.tensor([5])),
                                                                    torch.tensor(float("nan")))
        _, _, dequant = hist.quantize(t, E4M3, 0, rows=True, transposed=False)
        used.append(1.0 / dequant.double().item())
    amaxes = [m if m == m else float("nan") for m in mags]
    want = _te_model(amaxes, history_len, algo == "most_recent")
    assert torch.allclose(torch.tensor(used, dtype=torch.float64), torch.tensor(want, dtype=torch.float64),
                          rtol=1e-6), (used, want)
    assert hist.state[1].item() == 0.0 and hist.history.shape == (history_len,)


def test_casts_clamp_to_fp8_max_and_record_nothing_when_empty():
    hist = AmaxHistory(2, False)
    t = torch.randn(40, 8)
    _, _, d0 = hist.quantize(t, E4M3, 0, rows=True, transposed=False)
    state = hist.state.clone()
    rows, trans, d_empty = hist.quantize(torch.randn(0, 8), E4M3, 0, rows=True, transposed=True)
    assert rows.shape == (0, 8) and trans.shape == (8, 0) and torch.equal(hist.state, state)
    big = t * 100  # outgrows the history: saturates at fp8_max, never inf, until the scale adapts
    rows, _, d1 = hist.quantize(big, E4M3, 0, rows=True, transposed=False)
    assert torch.equal(d1, d0) and rows.float().abs().max().item() == fp8_max(E4M3)
    assert torch.isfinite(rows.float()).all()
    rows, _, d2 = hist.quantize(big, E4M3, 0, rows=True, transposed=False)
    assert d2.item() == pytest.approx(big.abs().max().item() / 448.0, rel=1e-6)


def test_first_cast_is_current_scaling_and_margin_applies():
    t = torch.randn(33, 17) * 5
    for margin in (0, 2):
        hist = AmaxHistory(4, False)
        got = hist.quantize(t, E4M3, margin, rows=True, transposed=True)
        want = quantize_tensorwise_layouts(t, E4M3, margin, rows=True, transposed=True)
        for g, w in zip(got, want):
            assert torch.equal(g.view(torch.uint8) if g.dtype == E4M3 else g, w.view(torch.uint8) if w.dtype == E4M3
                               else w)


KERNEL_CHECK = textwrap.dedent(
    """
    import torch
    from turbo_moe.kernels.triton.amax_history import fp8_tensorwise_cast_delayed
    from turbo_moe.kernels.triton.fp8_cast import fp8_tensorwise_cast
    from turbo_moe.kernels.triton import swiglu_fp8 as sk
    from turbo_moe.delayed_scaling import AmaxHistory
    from turbo_moe.config import fp8_max
    device = DEVICE
    gen = torch.Generator().manual_seed(0)

    def u8(t):
        return None if t is None else t.cpu().view(torch.uint8)

    def same_fp8(a, b, label):
        # bit for bit, except (interpreter) its float->fp8 carry into the exponent (test_fp8_cast)
        if a is None or b is None:
            assert a is None and b is None, label
            return
        if not EXACT:
            assert torch.equal(u8(a), u8(b)), label
            return
        # the interpreter's numpy conversion is off by up to one FP8 step (carries, subnormals):
        # here the kernel's bytes are the interpreter's, the torch path's torch's
        fa, fb = a.cpu().float(), b.cpu().float()
        ok = ((fa - fb).abs() <= torch.maximum(fb.abs() * 2.0 ** -3, torch.full_like(fb, 2.0 ** -9))) | \
            ((torch.frexp(fb)[0].abs() == 0.5) & (fa.abs() * 2 == fb.abs()))
        assert ok.all(), (label, (fa - fb).abs().max())

    # shapes off the 64 x 64 tile, several programs (the ticket), a batch, one element
    cases = [((37, 70), torch.float32), ((130, 200), torch.bfloat16), ((2, 65, 129), torch.bfloat16),
             ((1, 1), torch.float16), ((300, 64), torch.float32)]
    for shape, dtype in cases:
        for history_len, most_recent in ((1, True), (5, False)):
            for rows_t in ((True, False), (False, True), (True, True)):
                k_hist, t_hist = AmaxHistory(history_len, most_recent), AmaxHistory(history_len, most_recent)
                for step, mag in enumerate((3.0, 40.0, 0.0, 0.5, 600.0)):
                    x = torch.randn(shape, generator=gen) * mag
                    xd = x.to(dtype).to(device)
                    k_hist.prepare(xd.device, torch.float8_e4m3fn, 0, lambda: xd.abs().max().float())
                    got = fp8_tensorwise_cast_delayed(xd, k_hist.state, k_hist.ticket, history_len, most_recent,
                                                      torch.float8_e4m3fn, 448.0, 0, *rows_t)
                    want = t_hist.quantize(xd.cpu(), torch.float8_e4m3fn, 0, rows=rows_t[0], transposed=rows_t[1])
                    label = (shape, dtype, history_len, rows_t, step)
                    assert torch.equal(got[2].cpu(), want[2]), (label, got[2], want[2])
                    assert torch.equal(k_hist.state.cpu(), t_hist.state), (label, k_hist.state, t_hist.state)
                    assert k_hist.ticket.item() == 0 and k_hist.state[1].item() == 0.0, label
                    same_fp8(got[0], want[0], label)
                    same_fp8(got[1], want[1], label)
                    if step == 0:  # seeded with its own amax: current scaling's kernel, bit for bit
                        cur = fp8_tensorwise_cast(xd, torch.float8_e4m3fn, 448.0, 0, *rows_t)
                        assert torch.equal(got[2], cur[2]), label
                        for g, c in zip(got[:2], cur[:2]):
                            assert (g is None and c is None) or torch.equal(u8(g), u8(c)), label

    # a row capacity past the row count (a token bucket, docs/design.md "Not yet served"): views of
    # capacity-row buffers with the R-row call's bits, and the same record in the history
    for (r, c), cap in (((70, 48), 130), ((5, 200), 5), ((33, 64), 1000)):
        x = (torch.randn(r, c, generator=gen) * 3).to(device)
        states = []
        for row_capacity in (None, cap):
            hist = AmaxHistory(4, False)
            hist.prepare(x.device, torch.float8_e4m3fn, 0, lambda: x.abs().max().float() * 0.5)
            out = fp8_tensorwise_cast_delayed(x, hist.state, hist.ticket, 4, False, torch.float8_e4m3fn, 448.0, 0,
                                              True, True, row_capacity=row_capacity)
            states.append((out, hist.state.clone(), hist.ticket.clone()))
        (want, want_state, want_ticket), (got, got_state, got_ticket) = states
        assert got[1].shape == (c, r) and got[1].stride() == (cap, 1) and got[0].shape == (r, c), (r, c, cap)
        assert torch.equal(u8(got[0]), u8(want[0])) and torch.equal(u8(got[1]), u8(want[1])), (r, c, cap)
        assert torch.equal(got[2], want[2]) and torch.equal(got_state, want_state), (r, c, cap)
        assert got_ticket.item() == 0 == want_ticket.item(), (r, c, cap)

    # a NaN in a program's second column tile (each program walks two 64-wide tiles): recorded in
    # the history, and the scale kept
    for rows_t in ((True, False), (False, True), (True, True)):
        k_hist = AmaxHistory(3, False)
        x = torch.randn(130, 200, generator=gen).to(device)
        k_hist.prepare(x.device, torch.float8_e4m3fn, 0, lambda: x.abs().max().float())
        fp8_tensorwise_cast_delayed(x, k_hist.state, k_hist.ticket, 3, False, torch.float8_e4m3fn, 448.0, 0, *rows_t)
        scale = k_hist.state[0].clone()
        x[70, 100] = float("nan")
        fp8_tensorwise_cast_delayed(x, k_hist.state, k_hist.ticket, 3, False, torch.float8_e4m3fn, 448.0, 0, *rows_t)
        assert torch.isnan(k_hist.state[2]).item() and torch.equal(k_hist.state[0], scale), (rows_t, k_hist.state)
        assert k_hist.ticket.item() == 0 and k_hist.state[1].item() == 0.0, rows_t

    # the SwiGLU casts: the first (seeded) cast equals current scaling's kernels bit for bit; later
    # casts use the scale the history held and record max|a| (max|dh|) of the float32 values
    for m, f in ((37, 70), (130, 80), (300, 96), (5, 129)):
        h = (torch.randn(m, 2 * f, generator=gen) * 2).to(torch.bfloat16).to(device)
        p = torch.rand(m, generator=gen).to(device)
        da = torch.randn(m, f, generator=gen).to(torch.bfloat16).to(device)
        for history_len, most_recent in ((1, True), (4, False)):
            for rows_t in ((True, True), (False, True), (True, False)):
                fwd, bwd = AmaxHistory(history_len, most_recent), AmaxHistory(history_len, most_recent)
                for step, mag in enumerate((1.0, 8.0, 0.25)):
                    hs, das = (h.float() * mag).to(torch.bfloat16), (da.float() * mag).to(torch.bfloat16)
                    fwd.prepare(hs.device, torch.float8_e4m3fn, 0, lambda: sk.swiglu_amax(hs, p))
                    bwd.prepare(hs.device, torch.float8_e5m2, 0, lambda: sk.swiglu_backward_dh_amax(hs, p, das))
                    scale_f, scale_b = fwd.state[0].clone(), bwd.state[0].clone()
                    a = sk.swiglu_fp8_delayed(hs, p, fwd.state, fwd.ticket, history_len, most_recent,
                                              torch.float8_e4m3fn, 448.0, 0, *rows_t)
                    d = sk.swiglu_backward_fp8_delayed(hs, p, das, bwd.state, bwd.ticket, history_len, most_recent,
                                                       torch.float8_e5m2, 57344.0, 0, torch.float32, *rows_t)
                    label = (m, f, history_len, rows_t, step)
                    assert torch.equal(a[2], 1.0 / scale_f) and torch.equal(d[2], 1.0 / scale_b), label
                    for hist in (fwd, bwd):
                        assert hist.ticket.item() == 0 and hist.state[1].item() == 0.0, label
                    cur_a = sk.swiglu_fp8_tensorwise(hs, p, torch.float8_e4m3fn, 448.0, 0, *rows_t)
                    cur_d = sk.swiglu_backward_fp8_tensorwise(hs, p, das, torch.float8_e5m2, 57344.0, 0, torch.float32,
                                                              *rows_t)
                    assert torch.equal(fwd.state[2], 448.0 * cur_a[2]) or \\
                        abs(fwd.state[2].item() / (448.0 * cur_a[2].item()) - 1) < 1e-6, label  # max|a| recorded
                    assert abs(bwd.state[2].item() / (57344.0 * cur_d[2].item()) - 1) < 1e-6, label
                    # dprobs: row sums per tile, then over tiles in order (deterministic); other tiles
                    # than current scaling's pass, so float32 rounding apart from its sums
                    g64, u64 = hs.cpu().double().chunk(2, dim=1)
                    terms = (das.cpu().double() * torch.nn.functional.silu(g64) * u64).abs().sum(1) + 1e-30
                    assert ((d[3] - cur_d[3]).cpu().double().abs() <= 1e-5 * terms).all(), label
                    if step == 0:
                        assert torch.equal(a[2], cur_a[2]) and torch.equal(d[2], cur_d[2]), label
                        for g, c in zip(a[:2] + d[:2], cur_a[:2] + cur_d[:2]):
                            assert (g is None and c is None) or torch.equal(u8(g), u8(c)), label
    print("ok")
    """
)


def test_delayed_kernels_in_interpreter():
    assert_prints_ok(KERNEL_CHECK.replace("DEVICE", "'cpu'").replace("EXACT", "True"))


@pytest.mark.gpu
def test_delayed_kernels_on_gpu():
    run_on_gpu(KERNEL_CHECK.replace("DEVICE", "'cuda'").replace("EXACT", "False"), "delayed_check")


def _float64_linear(x, w, lens):
    out, start = [], 0
    for g, n in enumerate(lens):
        out.append(x[start:start + n].double() @ w[g].double().T)
        start += n
    return torch.cat(out)


def _layers_case(device):
    torch.manual_seed(0)
    cfg = Float8Config(format="hybrid", strategy="delayed", amax_history_len=4)
    lens = [19, 0, 40, 7]
    layer = GroupedLinearFP8(4, 96, 80, config=cfg, device=device)
    ref = GroupedLinearFP8(4, 96, 80, config=Float8Config(format="hybrid"), device=device)
    ref.load_state_dict(layer.state_dict())
    offs_lens = torch.tensor(lens, device=device)
    for step, mag in enumerate((1.0, 1.5, 0.7)):
        x = (torch.randn(sum(lens), 96, device=device) * mag).requires_grad_()
        dy = torch.randn(sum(lens), 80, device=device)
        y = layer(x, offs_lens)
        y.backward(dy)
        want = _float64_linear(x.detach(), layer.weight.detach(), lens)
        err = (y.double() - want).norm() / want.norm()
        assert err < 0.08, (step, err)  # e4m3 on x and W: a few percent
        dx_want = torch.cat([dy[s:s + n].double() @ layer.weight[g].detach().double()
                             for g, (s, n) in enumerate(zip([0, 19, 19, 59], lens))])
        assert (x.grad.double() - dx_want).norm() / dx_want.norm() < 0.15, step  # e5m2 dy
        if step == 0:  # seeded with its own amaxes: current scaling, bit for bit
            x0 = x.detach().clone().requires_grad_()
            y0 = ref(x0, offs_lens)
            y0.backward(dy)
            assert torch.equal(y, y0) and torch.equal(x.grad, x0.grad) and torch.equal(layer.weight.grad,
                                                                                        ref.weight.grad)
        layer.weight.grad = None
    hist = layer.fp8_delayed.input.history
    assert hist.shape == (4,) and (hist[:3] > 0).all() and hist[3] > 0  # seed + three casts


def test_layers_with_delayed_scaling_cpu():
    _layers_case("cpu")


@pytest.mark.gpu
def test_layers_with_delayed_scaling_gpu():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    _layers_case("cuda")


def _mlp_case(device):
    torch.manual_seed(1)
    cfg = Float8Config(strategy="delayed", amax_history_len=2, amax_compute_algo="most_recent")
    lens = torch.tensor([30, 0, 17, 64], device=device)
    mlp = GroupedSwiGLUMLPFP8(4, 64, 48, config=cfg, device=device)
    ref = GroupedSwiGLUMLPFP8(4, 64, 48, config=Float8Config(), device=device)
    ref.load_state_dict(mlp.state_dict())
    for step in range(3):
        x = torch.randn(111, 64, device=device, requires_grad=True)
        p = torch.rand(111, device=device, requires_grad=True)
        y = mlp(x, lens, probs=p)
        dy = torch.randn_like(y)
        y.backward(dy)
        if step == 0:  # every history seeded by its first cast: current scaling's bits
            x0, p0 = x.detach().clone().requires_grad_(), p.detach().clone().requires_grad_()
            y0 = ref(x0, lens, probs=p0)
            y0.backward(dy)
            assert torch.equal(y, y0) and torch.equal(x.grad, x0.grad)
            # dprobs sums its rows over other tiles than current scaling's pass: float32 rounding apart
            assert torch.allclose(p.grad, p0.grad, rtol=1e-5, atol=1e-6 * p0.grad.abs().max().item())
            assert torch.equal(mlp.fc1.weight.grad, ref.fc1.weight.grad)
            assert torch.equal(mlp.fc2.weight.grad, ref.fc2.weight.grad)
        # float64 reference of the whole chain
        xd, pd = x.detach().double().requires_grad_(), p.detach().double().requires_grad_()
        w1, w2 = mlp.fc1.weight.detach().double(), mlp.fc2.weight.detach().double()
        outs, start = [], 0
        for g, n in enumerate(lens.tolist()):
            h = xd[start:start + n] @ w1[g].T
            gate, lin = h.chunk(2, dim=1)
            outs.append((torch.nn.functional.silu(gate) * lin * pd[start:start + n, None]) @ w2[g].T)
            start += n
        want = torch.cat(outs)
        want.backward(dy.double())
        assert (y.double() - want).norm() / want.norm() < 0.1, step
        assert (x.grad.double() - xd.grad).norm() / xd.grad.norm() < 0.15, step
        assert (p.grad.double() - pd.grad).norm() / pd.grad.norm() < 0.15, step
        for m in (mlp, ref):
            m.zero_grad()
    for lin in (mlp.fc1, mlp.fc2):
        for hist in (lin.fp8_delayed.input, lin.fp8_delayed.grad_output):
            assert hist.state is not None and (hist.history > 0).all()


def test_swiglu_mlp_with_delayed_scaling_cpu():
    _mlp_case("cpu")


@pytest.mark.gpu
def test_swiglu_mlp_with_delayed_scaling_gpu():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    _mlp_case("cuda")


@pytest.mark.gpu
def test_delayed_layer_replays_in_a_cuda_graph_with_new_data():
    """Warmed up, a delayed-scaling fwd+bwd captures (no host sync, no seeding in the graph) and each
    replay casts with the scale the previous replay left, as eager calls do."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    torch.manual_seed(2)
    cfg = Float8Config(strategy="delayed", amax_history_len=3)
    layer = GroupedLinearFP8(4, 128, 64, config=cfg, device="cuda", cache_fp8_weight=False)
    twin = GroupedLinearFP8(4, 128, 64, config=cfg, device="cuda", cache_fp8_weight=False)
    twin.load_state_dict(layer.state_dict())
    lens = torch.tensor([50, 0, 100, 106], device="cuda")
    x = torch.randn(256, 128, device="cuda", requires_grad=True)
    dy = torch.randn(256, 64, device="cuda")
    x = x.detach().requires_grad_()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            torch.autograd.grad(layer(x, lens), (x, layer.weight), dy)
    torch.cuda.current_stream().wait_stream(s)
    for _ in range(2):  # the twin follows the same eager history
        torch.autograd.grad(twin(x, lens), (x, twin.weight), dy)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = layer(x, lens)
        dx, dw = torch.autograd.grad(y, (x, layer.weight), dy)
    for mag in (2.0, 0.5, 3.0):
        with torch.no_grad():
            x.copy_(torch.randn(256, 128, device="cuda") * mag)
            dy.mul_(1.1)
        graph.replay()
        yt = twin(x, lens)
        dxt, dwt = torch.autograd.grad(yt, (x, twin.weight), dy)
        assert torch.equal(y, yt) and torch.equal(dx, dxt) and torch.equal(dw, dwt)
        assert torch.equal(layer.fp8_delayed.input.state, twin.fp8_delayed.input.state)
        assert torch.equal(layer.fp8_delayed.grad_output.state, twin.fp8_delayed.grad_output.state)


def _resume_case(device):
    """A delayed-scaling MLP saved mid-run and loaded into a fresh one continues exactly as the
    uninterrupted run (outputs, gradients and histories bit for bit); one not loaded does not."""
    import io

    torch.manual_seed(3)
    cfg = Float8Config(strategy="delayed", amax_history_len=3)
    lens = torch.tensor([30, 0, 17, 64], device=device)
    run = GroupedSwiGLUMLPFP8(4, 64, 48, config=cfg, device=device)
    mags = (1.0, 4.0, 0.3, 2.0)  # each step's amax unlike the last: the history decides the scale
    inputs = [(torch.randn(111, 64, device=device) * m, torch.rand(111, device=device),
               torch.randn(111, 64, device=device) * m) for m in mags]

    def step(mlp, i):
        x, p, dy = inputs[i]
        x, p = x.clone().requires_grad_(), p.clone().requires_grad_()
        y = mlp(x, lens, probs=p)
        y.backward(dy)
        out = (y.detach(), x.grad, p.grad, mlp.fc1.weight.grad.clone(), mlp.fc2.weight.grad.clone())
        mlp.zero_grad()
        return out

    for i in range(3):
        step(run, i)
    buf = io.BytesIO()
    torch.save(run.state_dict(), buf)
    saved = run.state_dict()["fc1._extra_state"]  # one float32 CPU tensor: header 6 + 2 x (scale + 3 amaxes)
    assert saved.dtype == torch.float32 and saved.shape == (6 + 4 + 4,) and saved.device.type == "cpu"
    buf.seek(0)
    resumed = GroupedSwiGLUMLPFP8(4, 64, 48, config=cfg, device=device)
    resumed.load_state_dict(torch.load(buf, weights_only=False))
    fresh = GroupedSwiGLUMLPFP8(4, 64, 48, config=cfg, device=device)
    fresh.load_state_dict({k: v for k, v in run.state_dict().items() if not k.endswith("_extra_state")})
    want = step(run, 3)
    got = step(resumed, 3)
    for w, g in zip(want, got):
        assert torch.equal(w, g)
    for a, b in ((run.fc1, resumed.fc1), (run.fc2, resumed.fc2)):
        assert torch.equal(a.fp8_delayed.input.state, b.fp8_delayed.input.state)
        assert torch.equal(a.fp8_delayed.grad_output.state, b.fp8_delayed.grad_output.state)
    # without the histories the step is current-scaled: other bits (the test can fail)
    assert not torch.equal(step(fresh, 3)[0], want[0])


def test_resumed_delayed_state_continues_bit_for_bit_cpu():
    _resume_case("cpu")


@pytest.mark.gpu
def test_resumed_delayed_state_continues_bit_for_bit_gpu():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    _resume_case("cuda")


def test_extra_state_loading_rules():
    cfg = Float8Config(strategy="delayed", amax_history_len=4)
    layer = GroupedLinearFP8(2, 16, 8, config=cfg)
    lens = torch.tensor([5, 6])
    for mag in (1.0, 3.0, 0.5):
        layer(torch.randn(11, 16) * mag, lens).sum().backward()
    saved = layer.state_dict()
    hist = layer.fp8_delayed.input.state.clone()
    # tensors only (as TE's extra state), so checkpoint formats that hold tensors alone take it
    assert all(isinstance(v, torch.Tensor) for v in saved.values())
    with pytest.raises(ValueError, match="header promising"):
        layer.fp8_delayed.load_state_dict(saved["_extra_state"][:-1])
    # current scaling: parameters only; checkpoints without histories load strictly
    plain = GroupedLinearFP8(2, 16, 8)
    assert set(plain.state_dict()) == {"weight"} and set(saved) == {"weight", "_extra_state"}
    plain.load_state_dict({"weight": saved["weight"]})
    layer2 = GroupedLinearFP8(2, 16, 8, config=cfg)
    layer2.load_state_dict({"weight": saved["weight"]})
    assert layer2.fp8_delayed.input.state is None  # nothing saved: the next cast seeds
    # histories into a current-scaling layer: dropped with a warning
    with pytest.warns(UserWarning, match="amax histories were dropped"):
        plain.load_state_dict(saved)
    with pytest.raises(RuntimeError, match="_extra_state: expected a saved delayed-scaling state"):
        layer2.load_state_dict({"weight": saved["weight"], "_extra_state": torch.ones(3)})
    # another history length keeps the newest entries, padded with zeros
    short = GroupedLinearFP8(2, 16, 8, config=Float8Config(strategy="delayed", amax_history_len=2))
    short.load_state_dict(saved)
    assert torch.equal(short.fp8_delayed.input.state, torch.cat((hist[:2], hist[2:4])))
    long = GroupedLinearFP8(2, 16, 8, config=Float8Config(strategy="delayed", amax_history_len=6))
    long.load_state_dict(saved)
    assert torch.equal(long.fp8_delayed.input.state, torch.cat((hist, torch.zeros(2))))
    # a state that already exists is loaded in place (a captured CUDA graph keeps reading it)
    buffer = layer.fp8_delayed.input.state
    layer(torch.randn(11, 16) * 7, lens)
    layer.load_state_dict(saved)
    assert layer.fp8_delayed.input.state is buffer and torch.equal(buffer, hist)
    # a checkpoint without histories resets a layer that has them
    layer.load_state_dict({"weight": saved["weight"], "_extra_state": None})
    assert layer.fp8_delayed.input.state is None and layer.fp8_delayed.grad_output.state is None


def test_delayed_layer_under_torch_compile_follows_its_eager_twin():
    """torch.compile around a delayed-scaling layer: each step casts with the scale the history held
    and records the new amax, as the eager layer does (outputs, gradients, histories bit for bit)."""
    torch.manual_seed(4)
    cfg = Float8Config(strategy="delayed", amax_history_len=3)
    layer = GroupedLinearFP8(3, 32, 16, bias=True, config=cfg)
    twin = GroupedLinearFP8(3, 32, 16, bias=True, config=cfg)
    twin.load_state_dict(layer.state_dict())
    compiled = torch.compile(layer, backend="eager")
    lens = torch.tensor([5, 0, 7])
    for mag in (1.0, 5.0, 0.2):  # amaxes that move: the history decides each scale
        x = torch.randn(12, 32) * mag
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = compiled(xa, lens), twin(xb, lens)
        dy = torch.randn_like(ya)
        ya.backward(dy)
        yb.backward(dy)
        assert torch.equal(ya, yb) and torch.equal(xa.grad, xb.grad)
        assert torch.equal(layer.weight.grad, twin.weight.grad)
        for a, b in ((layer.fp8_delayed.input, twin.fp8_delayed.input),
                     (layer.fp8_delayed.grad_output, twin.fp8_delayed.grad_output)):
            assert torch.equal(a.state, b.state)
        layer.zero_grad()
        twin.zero_grad()
    assert layer.fp8_delayed.input.history.unique().numel() == 3  # three distinct amaxes recorded
