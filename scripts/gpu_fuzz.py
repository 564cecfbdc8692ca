"""GPU fuzz of the public API's failure modes (issue 16, item 7): prints a case -> result table.

    python scripts/gpu_fuzz.py [--out DIR] [--cases NAME,...] [--routings 100] [--device cuda|cpu]

Every case runs in its own child process (``--case NAME``): a device-side assert leaves the CUDA
context unusable, so one case must not take the others down. Cases:

* ``device_*``: CPU ``group_lens`` / ``group_offs`` with CUDA ``x`` -> a ValueError naming the argument.
* ``sync_*``: ``TURBO_MOE_SYNC_CHECKS=1`` with each bad routing, through every public entry -> a
  clean ValueError each, and the context still works afterwards.
* ``assert_*``: the default asynchronous checks with a bad routing -> the error surfaces at the
  next synchronization (device-side assert), never a silent result.
* ``guard_*``: the asynchronous checks switched off (``torch._assert_async`` made a no-op, as if
  they had not fired yet) with a bad routing: operands live inside larger buffers whose margins
  hold sentinels (NaN for the inputs the kernels read, a byte pattern around every output), so a
  read outside an operand shows up as NaN and a write outside an output as a changed sentinel.
  Passes when every sentinel is intact and the outputs equal a run on the clamped routing.
  ``guard_kernel_*`` drives the Triton backend directly (FP8 operands in NaN-guarded buffers,
  integer data, so the torch reference must agree bit for bit); ``guard_api_*`` runs
  ``grouped_gemm_fp8`` forward and backward on guarded x, w, dy.
* ``graph_replay``: forward+backward of ``grouped_gemm_fp8`` (Triton backend, tensorwise and
  rowwise) captured once after an eager warm-up and replayed for ``--routings`` random routings
  (empty experts, skew, one expert holding every token, single tokens), equal to eager bit for bit.

``--device cpu`` (with ``TRITON_INTERPRET=1``) runs the cases that make sense without a GPU
(``guard_kernel_*``, ``sync_*``), as a smoke test of this script. Exit status 0 iff every case passed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
import traceback
import zlib

import torch

# This checkout's turbo_moe, whatever is installed (the script runs as scripts/gpu_fuzz.py).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# M and every clamped routing's total are multiples of 16, so that the token-major wgrad operands
# qualify for the TMA kernels in the bad run and in its clamped reference run alike.
G, M, K, N = 4, 320, 96, 80
# Bad routings: (name, "lens" or "offs", values) for M = 320 rows.
BAD_ROUTINGS = [
    ("lens_sum_over", "lens", [100, 100, 100, 100]),
    ("lens_sum_under", "lens", [48, 48, 48, 48]),
    ("lens_negative", "lens", [420, -100, 0, 0]),
    ("lens_huge", "lens", [2**40, 0, 0, 0]),
    ("offs_past_end", "offs", [0, 100, 200, 340, 9999]),
    ("offs_decreasing", "offs", [0, 200, 100, 250, 320]),
    ("offs_negative_start", "offs", [-50, 100, 200, 250, 320]),
]
SENTINEL_BYTE = 0xA5
GUARD = 4096  # bytes of margin on each side of every guarded tensor


# ------------------------------------------------------------------------------ helpers


def _clamped_offs(kind: str, values, num_rows: int) -> list[int]:
    """What turbo_moe.checks makes of a bad routing on a GPU: offsets clamped into [0, M], non-decreasing."""
    t = torch.tensor(values, dtype=torch.int64)
    offs = torch.cat([t.new_zeros(1), torch.cumsum(t, 0)]) if kind == "lens" else t
    return torch.cummax(offs.clamp(0, num_rows), 0).values.tolist()


class Guarded:
    """Tensors carved out of larger byte buffers whose margins hold a known pattern."""

    def __init__(self, device):
        self.device = device
        self.buffers = []  # (buffer, lo, hi, fill byte)

    def tensor(self, shape, dtype, fill_byte=SENTINEL_BYTE):
        item = torch.empty((), dtype=dtype).element_size()
        nbytes = item * max(1, int(torch.Size(shape).numel()))
        buf = torch.full((GUARD + nbytes + GUARD,), fill_byte, dtype=torch.uint8, device=self.device)
        self.buffers.append((buf, GUARD, GUARD + nbytes, fill_byte))
        return buf[GUARD:GUARD + item * int(torch.Size(shape).numel())].view(dtype).view(shape)

    def like(self, t: torch.Tensor, fill_byte: int) -> torch.Tensor:
        out = self.tensor(t.shape, t.dtype, fill_byte)
        out.copy_(t)
        return out

    def intact(self) -> bool:
        for buf, lo, hi, fill in self.buffers:
            if not (bool((buf[:lo] == fill).all()) and bool((buf[hi:] == fill).all())):
                return False
        return True


def _nan_byte(dtype) -> int:
    # 0x7F is NaN in float8_e4m3fn and float8_e5m2; 0xFF is NaN (all-ones) in bf16/fp16/fp32 byte fills.
    return 0x7F if dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else 0xFF


def _guard_outputs(guarded: Guarded):
    """Make the Triton backend allocate every output inside a sentinel-guarded buffer."""
    from turbo_moe.backends import triton_backend

    triton_backend._new_output = lambda shape, dtype, device: guarded.tensor(shape, dtype, SENTINEL_BYTE)


def _disable_async_asserts():
    torch._assert_async = lambda *args, **kwargs: None
    try:  # the one-launch offsets kernel asserts on the device too
        from turbo_moe.kernels.triton import group_offsets

        group_offsets.DEVICE_ASSERTS = False
    except ImportError:
        pass


def _bad_args(kind, values, device):
    t = torch.tensor(values, dtype=torch.int64, device=device)
    return {"group_lens": t} if kind == "lens" else {"group_offs": t}


# ------------------------------------------------------------------------------ cases


def case_device(device):
    import turbo_moe
    from turbo_moe.autograd import grouped_gemm_fp8_with_offs, grouped_wgrad_fp8

    x, w = torch.randn(M, K, device=device), torch.randn(G, N, K, device=device)
    lens_cpu = torch.tensor([M, 0, 0, 0])
    offs_cpu = torch.tensor([0, M, M, M, M])
    layer = turbo_moe.GroupedLinearFP8(G, K, N, device=device)
    checks = [
        ("grouped_gemm_fp8(group_lens=cpu)", lambda: turbo_moe.grouped_gemm_fp8(x, w, lens_cpu), "group_lens must be on"),
        ("grouped_gemm_fp8(group_offs=cpu)", lambda: turbo_moe.grouped_gemm_fp8(x, w, group_offs=offs_cpu),
         "group_offs must be on"),
        ("grouped_gemm_fp8_with_offs(cpu)", lambda: grouped_gemm_fp8_with_offs(x, w, offs_cpu), "offs must be on"),
        ("grouped_wgrad_fp8(cpu offs)", lambda: grouped_wgrad_fp8(torch.randn(M, N, device=device), x, offs_cpu),
         "group_offs must be on"),
        ("GroupedLinearFP8(cpu lens)", lambda: layer(x, lens_cpu), "group_lens must be on"),
    ]
    details = []
    for what, fn, match in checks:
        try:
            fn()
            return False, f"{what}: no error"
        except ValueError as e:
            if match not in str(e):
                return False, f"{what}: {e}"
            details.append(what)
    torch.cuda.synchronize()
    return True, "ValueError naming the argument: " + "; ".join(details)


def case_sync(device):
    """TURBO_MOE_SYNC_CHECKS=1 (set by the runner): every bad routing, every entry -> ValueError."""
    import turbo_moe
    from turbo_moe.autograd import grouped_gemm_fp8_with_offs, grouped_wgrad_fp8

    assert os.environ.get("TURBO_MOE_SYNC_CHECKS") == "1"
    x, w, dy = torch.randn(M, K, device=device), torch.randn(G, N, K, device=device), torch.randn(M, N, device=device)
    layer = turbo_moe.GroupedLinearFP8(G, K, N, device=device)
    backend = "triton" if device == "cuda" else "torch"
    count = 0
    for name, kind, values in BAD_ROUTINGS:
        args = _bad_args(kind, values, device)
        calls = [lambda: turbo_moe.grouped_gemm_fp8(x, w, backend=backend, **args), lambda: layer(x, **args)]
        if kind == "offs":
            offs = args["group_offs"]
            calls += [lambda: grouped_gemm_fp8_with_offs(x, w, offs, backend=backend),
                      lambda: grouped_wgrad_fp8(dy, x, offs, backend=backend)]
        for i, call in enumerate(calls):
            try:
                call()
                return False, f"{name}: entry {i} raised nothing"
            except ValueError:
                count += 1
    y = turbo_moe.grouped_gemm_fp8(x, w, torch.tensor([M, 0, 0, 0], device=device), backend=backend)
    if device == "cuda":
        torch.cuda.synchronize()
    ok = bool(torch.isfinite(y).all())
    return ok, f"{count} clean ValueErrors; a valid call afterwards {'works' if ok else 'FAILS'}"


def case_assert(device, routing):
    """Default async checks: the bad routing must fail at the next synchronization."""
    import turbo_moe

    name, kind, values = routing
    x = torch.randn(M, K, device=device, requires_grad=True)
    w = torch.randn(G, N, K, device=device, requires_grad=True)
    try:
        y = turbo_moe.grouped_gemm_fp8(x, w, backend="triton", **_bad_args(kind, values, device))
        y.sum().backward()
        torch.cuda.synchronize()
    except RuntimeError as e:
        msg = str(e).splitlines()[0][:160]
        return "device-side assert" in str(e) or "turbo_moe" in str(e), f"{type(e).__name__}: {msg}"
    return False, "no error at synchronize: the bad routing went through silently"


def case_guard_kernel(device, routing):
    """Triton backend on NaN-guarded FP8 operands, clamped bad offsets, guarded outputs; on a GPU
    every candidate tile configuration (TMA and pointer loads, TMA and pointer stores)."""
    from turbo_moe.backends import GemmKind, GroupedGemmProblem, get_backend
    from turbo_moe.backends.triton_backend import GPU_CANDIDATES
    from turbo_moe.backends.torch_backend import reference_grouped_gemm
    from turbo_moe.checks import resolve_group_offs

    name, kind, values = routing
    _disable_async_asserts()
    guarded = Guarded(device)
    _guard_outputs(guarded)
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    ints = lambda *shape: torch.randint(-4, 5, shape, generator=gen).float()  # noqa: E731  exact in FP8 and fp32
    if device == "cuda":
        args = _bad_args(kind, values, device)
        offs = resolve_group_offs(args.get("group_lens"), args.get("group_offs"), G, M, torch.device(device))
    else:  # the CPU smoke: checks raise on the host there; apply the GPU path's clamp here instead
        offs = torch.tensor(_clamped_offs(kind, values, M))
    if offs.tolist() != _clamped_offs(kind, values, M):
        return False, f"offsets {offs.tolist()} are not the clamped {_clamped_offs(kind, values, M)}"
    results = []
    triton = get_backend("triton")
    for gemm in (GemmKind.M_GROUPED, GemmKind.K_GROUPED):
        e4m3 = torch.float8_e4m3fn
        shapes = ((M, K), (G, N, K)) if gemm is GemmKind.M_GROUPED else ((N, M), (K, M))
        a = guarded.like(ints(*shapes[0]).to(e4m3).to(device), _nan_byte(e4m3))
        b = guarded.like(ints(*shapes[1]).to(e4m3).to(device), _nan_byte(e4m3))
        sa, sb = torch.tensor(0.5, device=device), torch.tensor(4.0, device=device)
        problem = GroupedGemmProblem(gemm, a, b, sa, sb, offs, torch.float32)
        ref = reference_grouped_gemm(problem).to(torch.float32)
        covered = offs[-1].item()  # M_GROUPED rows past it belong to no group: unspecified
        configs = GPU_CANDIDATES[gemm] if device == "cuda" else (None,)
        for config in configs:
            out = triton.run(problem, config=config)
            if device == "cuda":
                torch.cuda.synchronize()
            got, want = (out[:covered], ref[:covered]) if gemm is GemmKind.M_GROUPED else (out, ref)
            if not torch.equal(got, want):
                return False, f"{gemm.value} [{config}]: output differs from the reference on the clamped offsets"
        results.append(f"{gemm.value} x{len(configs)} configs")
    if not guarded.intact():
        return False, "a sentinel around an operand or output changed"
    return True, f"offs {offs.tolist()}: {', '.join(results)} equal the reference; every sentinel intact"


def case_guard_api(device, routing):
    """grouped_gemm_fp8 fwd+bwd on guarded x, w, dy with bad routing and the async asserts off."""
    import turbo_moe

    name, kind, values = routing
    _disable_async_asserts()
    os.environ["TURBO_MOE_TRITON_AUTOTUNE"] = "0"  # the same tile config for the reference run
    clamped = _clamped_offs(kind, values, M)
    covered = clamped[-1]
    notes = []
    for granularity in ("tensorwise", "rowwise"):
        cfg = turbo_moe.Float8Config(granularity=granularity)
        guarded = Guarded(device)
        _guard_outputs(guarded)
        gen = torch.Generator().manual_seed(1)
        x0, w0, dy0 = torch.randn(M, K, generator=gen), torch.randn(G, N, K, generator=gen), torch.randn(M, N, generator=gen)
        x0[0, 0], dy0[0, 0] = 20.0, 20.0  # amax inside the first group: the clamped run has the same tensorwise scales
        x = guarded.like(x0.to(device), _nan_byte(torch.float32)).requires_grad_()
        w = guarded.like(w0.to(device), _nan_byte(torch.float32)).requires_grad_()
        dy = guarded.like(dy0.to(device), _nan_byte(torch.float32))
        y = turbo_moe.grouped_gemm_fp8(x, w, config=cfg, backend="triton", **_bad_args(kind, values, device))
        dx, dw = torch.autograd.grad(y, (x, w), dy)
        if device == "cuda":
            torch.cuda.synchronize()
        if not guarded.intact():
            return False, f"{granularity}: a sentinel around an operand or output changed"
        # The reference: the same call on the rows the clamped routing covers, with a valid routing.
        xr = x0[:covered].to(device).requires_grad_()
        wr = w0.to(device).requires_grad_()
        lens = torch.tensor([clamped[g + 1] - clamped[g] for g in range(G)], device=device)
        yr = turbo_moe.grouped_gemm_fp8(xr, wr, lens, config=cfg, backend="triton")
        dxr, dwr = torch.autograd.grad(yr, (xr, wr), dy0[:covered].to(device))
        checks = [("y", y[:covered], yr), ("dx", dx[:covered], dxr), ("dW", dw, dwr)]
        if kind == "offs":  # the delayed-wgrad entry takes the same bad offsets
            from turbo_moe.autograd import grouped_wgrad_fp8

            dw2 = grouped_wgrad_fp8(dy, x.detach(), torch.tensor(values, device=device), config=cfg, backend="triton",
                                    out_dtype=torch.float32)
            checks.append(("grouped_wgrad_fp8", dw2, dwr))
            if not guarded.intact():
                return False, f"{granularity}: a sentinel changed in grouped_wgrad_fp8"
        for what, got, want in checks:
            if not torch.isfinite(got).all():
                return False, f"{granularity} {what}: non-finite values (a read outside the operands?)"
            if not torch.equal(got, want):
                return False, f"{granularity} {what}: differs from the run on the clamped routing"
        notes.append(granularity)
    extra = ", grouped_wgrad_fp8" if kind == "offs" else ""
    return True, f"clamped to {clamped}: y, dx, dW{extra} equal the clamped run ({', '.join(notes)}); sentinels intact"


def random_routing(rng: random.Random, i: int, m: int, g: int) -> list[int]:
    """Routing number i: cycles through balanced, empty experts, skew, one expert holding every
    token, single-token experts and random multinomial draws; always sums to m."""
    pattern = i % 6
    if pattern == 0:
        lens = [m // g] * g
        lens[-1] += m - sum(lens)
        return lens
    if pattern == 1:  # some experts empty
        live = rng.sample(range(g), rng.randint(1, g - 1))
        cuts = sorted(rng.randint(0, m) for _ in range(len(live) - 1))
        sizes = [b - a for a, b in zip([0] + cuts, cuts + [m])]
        lens = [0] * g
        for e, s in zip(live, sizes):
            lens[e] = s
        return lens
    if pattern == 2:  # heavy skew: a power law
        weights = [rng.paretovariate(0.7) for _ in range(g)]
    elif pattern == 3:  # one expert holds every token
        lens = [0] * g
        lens[rng.randrange(g)] = m
        return lens
    elif pattern == 4:  # single tokens and one big expert
        lens = [rng.choice([0, 1]) for _ in range(g)]
        lens[rng.randrange(g)] = 0
        lens[lens.index(0)] = m - sum(lens)
        return lens
    else:
        weights = [rng.random() for _ in range(g)]
    total = sum(weights)
    lens = [int(m * w / total) for w in weights]
    lens[rng.randrange(g)] += m - sum(lens)
    return lens


def case_graph_replay(device, routings: int):
    import turbo_moe

    gm, gk, gn, gg = 1024, 256, 384, 8
    rng = random.Random(16)
    gen = torch.Generator(device=device).manual_seed(16)
    summary = []
    for granularity in ("tensorwise", "rowwise"):
        cfg = turbo_moe.Float8Config(granularity=granularity, format="hybrid")
        x = torch.randn(gm, gk, device=device, generator=gen, dtype=torch.bfloat16).requires_grad_()
        w = torch.randn(gg, gn, gk, device=device, generator=gen, dtype=torch.bfloat16).requires_grad_()
        dy = torch.randn(gm, gn, device=device, generator=gen, dtype=torch.bfloat16)
        lens = torch.tensor(random_routing(rng, 0, gm, gg), device=device)

        def step():
            y = turbo_moe.grouped_gemm_fp8(x, w, lens, config=cfg, backend="triton")
            dx, dw = torch.autograd.grad(y, (x, w), dy)
            return y, dx, dw

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()  # the eager warm-up: compiles and tunes outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = step()
        for i in range(routings):
            r = random_routing(rng, i, gm, gg)
            assert sum(r) == gm and min(r) >= 0, r
            lens.copy_(torch.tensor(r))
            with torch.no_grad():
                x.copy_(torch.randn(gm, gk, device=device, generator=gen))
                dy.copy_(torch.randn(gm, gn, device=device, generator=gen))
            for t in captured:
                t.fill_(float("nan"))
            graph.replay()
            replay = [t.clone() for t in captured]
            eager = step()
            for what, a, b in zip(("y", "dx", "dW"), replay, eager):
                if not torch.equal(a, b):
                    return False, f"{granularity} routing {i} {r}: replay differs from eager in {what}"
        summary.append(f"{granularity}: {routings}/{routings} bitwise equal")
    return True, "; ".join(summary) + " (balanced/empty/skew/one-expert/single-token/random)"


# ------------------------------------------------------------------------------ runner


def all_cases(device):
    cases = []
    if device == "cuda":
        cases.append(("device_cpu_offsets_cuda_x", "ValueError naming the argument", {}))
    cases.append(("sync_checks", "clean ValueError for every bad routing and entry", {"TURBO_MOE_SYNC_CHECKS": "1"}))
    for name, _, _ in BAD_ROUTINGS:
        if device == "cuda":
            cases.append((f"assert_{name}", "error at the next synchronization", {}))
        cases.append((f"guard_kernel_{name}", "no access outside operands; equals clamped reference", {}))
        if device == "cuda":
            cases.append((f"guard_api_{name}", "no access outside operands; equals clamped run", {}))
    if device == "cuda":
        cases.append(("graph_replay", "replay == eager bit for bit for every routing", {}))
    return cases


def run_case(name: str, device: str, routings: int):
    by_name = {r[0]: r for r in BAD_ROUTINGS}
    if name == "device_cpu_offsets_cuda_x":
        return case_device(device)
    if name == "sync_checks":
        return case_sync(device)
    if name == "graph_replay":
        return case_graph_replay(device, routings)
    for prefix, fn in (("assert_", case_assert), ("guard_kernel_", case_guard_kernel), ("guard_api_", case_guard_api)):
        if name.startswith(prefix):
            return fn(device, by_name[name[len(prefix):]])
    raise KeyError(name)


def run_in_child(name: str, device: str, routings: int, env=None, timeout: int = 540) -> dict:
    """Run one case in a fresh process: {"ok", "detail", "stderr"}. A child that dies (an illegal
    memory access, a killed context) without reporting is a failure."""
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--case", name, "--device", device, "--routings", str(routings)],
        env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=timeout,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if lines:
        result = json.loads(lines[-1][len("RESULT "):])
    else:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1][:200]
        result = {"ok": False, "detail": f"child exited {proc.returncode}: {tail}"}
    result["stderr"] = proc.stderr[-3000:] if not result["ok"] else ""
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    parser.add_argument("--routings", type=int, default=100)
    parser.add_argument("--out", default=os.environ.get("OUT", ""))
    parser.add_argument("--case", help=argparse.SUPPRESS)  # child mode
    args = parser.parse_args()

    if args.case:  # child: run one case, print one JSON line
        try:
            ok, detail = run_case(args.case, args.device, args.routings)
        except Exception as e:  # noqa: BLE001  reported, not raised: the table shows it
            ok, detail = False, f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            traceback.print_exc()
        print("RESULT " + json.dumps({"ok": bool(ok), "detail": detail}), flush=True)
        return 0

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_fuzz: no CUDA device; use --device cpu with TRITON_INTERPRET=1 for the smoke run")
        return 2
    wanted = {c for c in args.cases.split(",") if c}
    rows = []
    for name, expected, env in all_cases(args.device):
        if wanted and name not in wanted:
            continue
        start = time.time()
        result = run_in_child(name, args.device, args.routings, env)
        rows.append((name, expected, "PASS" if result["ok"] else "FAIL", result["detail"], time.time() - start))
        print(f"[gpu_fuzz] {name}: {rows[-1][2]} ({rows[-1][4]:.1f}s) {result['detail']}", flush=True)
        if not result["ok"] and result.get("stderr"):
            print(result["stderr"], file=sys.stderr)

    table = ["| case | expected | result | detail |", "|---|---|---|---|"]
    table += [f"| {n} | {e} | {r} | {d} |" for n, e, r, d, _ in rows]
    text = "\n".join(table)
    print("\n" + text)
    failed = sum(r[2] != "PASS" for r in rows)
    print(f"\n{len(rows) - failed}/{len(rows)} cases passed")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gpu_fuzz.md"), "w") as f:
            f.write(text + "\n")
    return 1 if failed or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
