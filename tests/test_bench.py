"""The benchmark's plumbing on the CPU: routings, the reference check, tables, JSON/CSV/PNG, budgets.

The GPU numbers come from ``scripts/gpu_check.sh``; here the CLI runs its smoke mode (tiny shapes,
torch backend) so that everything but the timing of real kernels is exercised.
"""

import csv
import json
import math
import os

import pytest
import torch

from turbo_moe.backends import GemmKind, GroupedGemmProblem, get_backend
from turbo_moe.bench import cli, data, report
from turbo_moe.bench.shapes import ROUTINGS, build_cases, make_group_sizes, parse_experts

FAST = ["--device", "cpu", "--warmup-ms", "0", "--rep-ms", "1"]


# ---------------------------------------------------------------- routings and shapes


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("experts,tokens", [(1, 64), (8, 4096), (32, 512), (128, 128), (5, 37)])
@pytest.mark.parametrize("align", [1, 16])
def test_group_sizes_sum_and_alignment(routing, experts, tokens, align):
    sizes = make_group_sizes(experts, tokens, routing, seed=3, align=align)
    assert len(sizes) == experts
    assert sum(sizes) == experts * tokens
    assert min(sizes) >= 0
    if (experts * tokens) % align == 0:
        assert all(s % align == 0 for s in sizes), sizes


def test_routing_shapes():
    assert make_group_sizes(8, 4096, "balanced") == [4096] * 8
    skewed = make_group_sizes(8, 4096, "skewed")
    assert skewed[0] == 8 * 4096 // 2 and len(set(skewed[1:])) <= 2
    dirichlet = make_group_sizes(128, 128, "dirichlet")
    assert dirichlet.count(0) >= 128 // 8  # some experts get no token
    assert max(dirichlet) > 4 * 128  # and some are hot
    assert make_group_sizes(32, 512, "zipf", seed=1) != make_group_sizes(32, 512, "zipf", seed=2)
    assert make_group_sizes(32, 512, "zipf", seed=1) == make_group_sizes(32, 512, "zipf", seed=1)


def test_routing_and_experts_errors_name_the_argument():
    with pytest.raises(ValueError, match="routing 'uniform'"):
        make_group_sizes(8, 16, "uniform")
    with pytest.raises(ValueError, match="--experts"):
        parse_experts("8:lots")
    with pytest.raises(ValueError, match="--experts"):
        parse_experts("7")  # no default token count for 7 experts
    with pytest.raises(ValueError, match="--models"):
        build_cases(["llama"], ["fc1"], [(8, 16)], ["balanced"])
    assert parse_experts("8,32:100") == [(8, 4096), (32, 100)]


def test_layer_dimensions():
    fc1, fc2 = build_cases(["deepseek-v3"], ["fc1", "fc2"], [(8, 4096)], ["balanced"])
    assert (fc1.n, fc1.k, fc1.m) == (2 * 2048, 7168, 8 * 4096)
    assert (fc2.n, fc2.k) == (7168, 2048)


# ---------------------------------------------------------------- the reference check can fail


def _problem(kind, sizes, n=24, k=40, scales="rowwise", seed=0):
    gen = torch.Generator().manual_seed(seed)
    fp8 = torch.float8_e4m3fn
    m, g = sum(sizes), len(sizes)
    offs = data.group_offsets(sizes)
    if kind is GemmKind.M_GROUPED:
        a, b = data.random_fp8((m, k), fp8, "cpu", gen), data.random_fp8((g, n, k), fp8, "cpu", gen)
        sa, sb = data.random_scales((m,), "cpu", gen), data.random_scales((g, n), "cpu", gen)
    else:
        a, b = data.random_fp8((n, m), fp8, "cpu", gen), data.random_fp8((k, m), fp8, "cpu", gen)
        sa, sb = data.random_scales((g, n), "cpu", gen), data.random_scales((g, k), "cpu", gen)
    if scales == "tensorwise":
        sa, sb = data.random_scales((), "cpu", gen), data.random_scales((), "cpu", gen)
    return GroupedGemmProblem(kind, a, b, sa, sb, torch.tensor(offs), torch.bfloat16), offs


@pytest.mark.parametrize("kind", list(GemmKind))
@pytest.mark.parametrize("scales", ["rowwise", "tensorwise"])
def test_reference_error_accepts_correct_and_flags_wrong(kind, scales):
    sizes = [5, 0, 17, 1, 9]  # an empty group, a one-token group, ragged sizes
    problem, offs = _problem(kind, sizes, scales=scales)
    out = get_backend("torch").run(problem)
    args = (kind, problem.a, problem.b, problem.a_scale, problem.b_scale, offs)
    assert data.grouped_reference_error(*args, out) < 5e-3  # bf16 output rounding only

    swapped = out.clone()  # a group's result written with another group's weights
    if kind is GemmKind.M_GROUPED:
        swapped[offs[2]:offs[3]] = get_backend("torch").run(_problem(kind, sizes, seed=1)[0])[offs[2]:offs[3]]
    else:
        swapped[2] = swapped[4]
    assert data.grouped_reference_error(*args, swapped) > 0.1

    unwritten = out.clone()
    unwritten.view(-1)[7] = float("nan")
    assert data.grouped_reference_error(*args, unwritten) == math.inf

    if kind is GemmKind.K_GROUPED:  # the empty group's dW must be exactly zero
        nonzero = out.clone()
        nonzero[1] = 1e-3
        assert data.grouped_reference_error(*args, nonzero) > 0


def test_poison_allocator_is_harmless_on_cpu():
    data.poison_allocator(0, torch.bfloat16, torch.device("cpu"))
    data.poison_allocator(10, torch.bfloat16, torch.device("cpu"))


# ---------------------------------------------------------------- the CLI end to end (smoke mode)


def _load(out_dir):
    with open(os.path.join(out_dir, "results.json")) as f:
        return json.load(f)


def test_cli_quick_cpu_writes_table_json_csv_plot(tmp_path, capsys):
    out = tmp_path / "bench"
    rc = cli.main(["--quick", *FAST, "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    result = _load(out)
    records = result["records"]
    assert result["meta"]["device"].startswith("cpu")
    cases = {r["case"] for r in records}
    assert cases == {"tiny fc1 4x48 balanced", "tiny fc2 16x16 dirichlet"}

    kernel = [r for r in records if r["level"] == "kernel"]
    by = {(r["case"], r["op"], r["impl"]): r for r in kernel}
    for case in cases:
        for op in ("fwd", "dgrad", "wgrad"):
            turbo = by[(case, op, "turbo:torch")]
            assert turbo["status"] == "ok" and turbo["ms"] > 0 and turbo["rel_err"] < 5e-3
            assert math.isclose(turbo["tflops"], 2 * turbo["M"] * turbo["N"] * turbo["K"] / turbo["ms"] / 1e9)
            assert by[(case, op, "bf16")]["status"] == "ok"
            assert by[(case, op, "dense_fp8")]["status"] == "ok"
            # A peer that cannot run here is reported, not a crash.
            assert by[(case, op, "cutlass_fp8")]["status"] == "missing"
            assert "CUDA" in by[(case, op, "cutlass_fp8")]["reason"]

    e2e = [r for r in records if r["level"] == "e2e"]
    impls = {r["impl"] for r in e2e}
    assert {"turbo:torch:rowwise", "turbo:torch:tensorwise", "bf16", "torchao_fp8"} <= impls
    for r in e2e:
        if r["impl"].startswith("turbo:"):
            assert r["status"] == "ok"
            # FP8 quantization error: visible, but within what e4m3 explains.
            assert 5e-3 < r["err_y"] < 0.08 and 5e-3 < r["err_dx"] < 0.08 and 5e-3 < r["err_dw"] < 0.08
        elif r["impl"] == "bf16":
            assert r["status"] == "ok" and r["err_dw"] < 1e-2
        else:
            assert r["status"] == "missing"

    md = (out / "results.md").read_text()
    assert "## Kernel level" in md and "## End to end" in md and "turbo:torch vs bf16" in md
    assert "tiny fc2 16x16 dirichlet" in printed and "turbo:torch vs cutlass_fp8" in printed
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(records)
    pytest.importorskip("matplotlib")
    png = out / "results.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_flags_a_wrong_kernel(tmp_path, monkeypatch):
    """A backend that returns a wrong answer is marked WRONG and fails the run."""
    from turbo_moe.backends.torch_backend import TorchBackend

    honest = TorchBackend.run
    monkeypatch.setattr(TorchBackend, "run", lambda self, problem: honest(self, problem) * 1.05)
    out = tmp_path / "wrong"
    rc = cli.main(["--quick", *FAST, "--levels", "kernel", "--ops", "wgrad", "--models", "tiny",
                   "--routings", "balanced", "--peers", "none", "--out", str(out)])
    assert rc == 1
    (rec,) = _load(out)["records"]
    assert rec["impl"] == "turbo:torch" and rec["status"] == "wrong" and rec["rel_err"] > 0.04
    assert "WRONG" in (out / "results.md").read_text()


def test_cli_time_budget_skips_cases(tmp_path):
    out = tmp_path / "budget"
    rc = cli.main(["--quick", *FAST, "--time-budget", "0", "--out", str(out)])
    assert rc == 0
    result = _load(out)
    assert result["records"] == []
    assert len(result["meta"]["skipped_cases"]) == 2


def test_cli_rejects_bad_arguments(capsys):
    for argv in (["--ops", "fwd,bwd"], ["--peers", "cublas"], ["--experts", "8:x"], ["--align", "0"]):
        with pytest.raises(SystemExit):
            cli.parse_args(["--device", "cpu", *argv])
    err = capsys.readouterr().err
    assert "--ops" in err and "--peers" in err and "--experts" in err and "--align" in err


def test_gpu_presets_select_the_peer_shapes():
    args = cli.parse_args(["--device", "cpu", "--preset", "peers"])
    args.device = "cuda"  # case selection only: nothing runs
    cases = cli.select_cases(args)
    assert len(cases) == len(cli.PEERS_SHAPES) * len(cli.PEERS_ROUTINGS)
    assert cases[0].routing == "balanced" and cases[-1].routing == "dirichlet"
    assert {(c.model, c.layer, c.num_experts) for c in cases} == set(cli.PEERS_SHAPES)
    args.preset, args.routings = "full", None
    full = cli.select_cases(args)
    assert len(full) == 3 * 2 * 3 * len(ROUTINGS)
    assert all(c.m == c.num_experts * c.tokens_per_expert for c in full)


# ---------------------------------------------------------------- tables


def _rec(case, op, impl, ms, status="ok", level="kernel"):
    return dict(level=level, case=case, op=op, impl=impl, status=status, ms=ms,
                tflops=None if ms is None else 1.0 / ms, reason="why" if status != "ok" else "")


def test_tables_ratios_and_missing():
    records = [
        _rec("a", "fwd", "turbo:triton", 2.0), _rec("a", "fwd", "cutlass_fp8", 3.0),
        _rec("a", "fwd", "bf16", None, status="missing"),
        _rec("b", "fwd", "turbo:triton", 1.0), _rec("b", "fwd", "cutlass_fp8", 0.75),
        _rec("b", "fwd", "bf16", 2.0),
    ]
    text = "\n".join(report.kernel_table(records))
    assert "1.50x" in text and "0.75x" in text and "2.00x" in text and "n/a" in text
    assert f"{math.sqrt(1.5 * 0.75):.2f}x" in text  # geomean over the cases where both ran
    e2e = [dict(_rec("a", "fwd+bwd", "turbo:triton:rowwise", 4.0, level="e2e"), peak_mb=1234.0),
           dict(_rec("a", "fwd+bwd", "bf16", 5.0, level="e2e"), peak_mb=1000.0)]
    text = "\n".join(report.e2e_table(e2e))
    assert "1234 MB" in text and "1.25x" in text
    assert report.notes(records) == ["- bf16 missing: why"]


def test_e2e_drops_each_implementation_before_the_next(monkeypatch, tmp_path):
    """A measured layer (and its FP8 weight cache) is released before the next implementation runs,
    so that no implementation's peak memory counts another's cache."""
    import weakref

    from turbo_moe.bench import cli
    from turbo_moe.bench.kernel_level import Missing

    refs, alive_when_called = [], []

    class Tracked:
        def __init__(self, index, step):
            self.index, self.step = index, step

        def __call__(self):
            alive_when_called.append([r() is not None for r in refs[:self.index]])
            return self.step()

    real = cli.e2e_impls

    def tracked_impls(*args, **kwargs):
        out = []
        for i, (name, step) in enumerate(real(*args, **kwargs)):
            if isinstance(step, Missing):
                refs.append(lambda: None)
                out.append((name, step))
            else:
                wrapped = Tracked(i, step)
                refs.append(weakref.ref(wrapped))
                out.append((name, wrapped))
        return out

    monkeypatch.setattr(cli, "e2e_impls", tracked_impls)
    argv = ["--levels", "e2e", "--device", "cpu", "--models", "tiny", "--layers", "fc1", "--experts", "4:48",
            "--routings", "balanced", "--granularity", "tensorwise+wcache,tensorwise-delayed+wcache",
            "--peers", "bf16", "--warmup-ms", "0", "--rep-ms", "1", "--e2e-extras", "none", "--out", str(tmp_path)]
    assert cli.main(argv) == 0
    assert len(refs) == 3 and len(alive_when_called) >= 3
    assert not any(any(alive) for alive in alive_when_called), alive_when_called
