"""The training-step preset (``--preset train``) and the hot-path measurements, on the CPU.

The preset's smoke mode trains tiny Megatron-core MoE GPTs (torch backend) for a few steps; the
GPU numbers come from tests/test_bench_gpu.py and the preset run on the H100.
"""

import importlib.util
import json
import math

import pytest
import torch

from turbo_moe.bench import cli, report, step_metrics
from turbo_moe.bench.text_corpus import HOLDOUT_EVERY, BatchSampler, load_corpus, stdlib_source_files
from turbo_moe.bench.train_step import (
    EXPERTS_RANGE,
    attributed_events,
    expert_kernel_table,
    expert_ranges,
    expert_time_split,
)

SMALL_CORPUS = 256 << 10


# ---------------------------------------------------------------- text


def test_corpus_is_deterministic_and_holds_out_whole_files():
    a, b = load_corpus(SMALL_CORPUS), load_corpus(SMALL_CORPUS)
    assert a.sha256 == b.sha256 and torch.equal(a.train, b.train) and torch.equal(a.val, b.val)
    assert a.num_files >= HOLDOUT_EVERY and a.val.numel() > 0
    assert a.train.numel() + a.val.numel() >= SMALL_CORPUS
    # Whole files are held out: the validation split starts with one file, absent from training.
    first_val = bytes(a.val[:300].tolist())
    sources = [open(p, "rb").read() for p in stdlib_source_files()]
    assert sum(src.startswith(first_val) for src in sources) >= 1
    assert first_val not in bytes(a.train.tolist())
    with pytest.raises(ValueError, match="max_bytes"):
        load_corpus(100)


def test_batches_are_deterministic_next_byte_pairs():
    corpus = load_corpus(SMALL_CORPUS)
    s1 = BatchSampler(corpus, seq=24, mbs=3, steps=5, micro_batches=4, eval_batches=2, device=torch.device("cpu"))
    s2 = BatchSampler(corpus, seq=24, mbs=3, steps=5, micro_batches=4, eval_batches=2, device=torch.device("cpu"))
    tokens, labels = s1.train(4, 3)
    assert tokens.shape == labels.shape == (3, 24) and tokens.dtype == torch.int64
    assert torch.equal(tokens[:, 1:], labels[:, :-1])  # labels are the next byte
    assert torch.equal(tokens, s2.train(4, 3)[0]) and not torch.equal(tokens, s1.train(4, 2)[0])
    assert int(tokens.max()) < 256
    v, _ = s1.val(1)
    text = bytes(corpus.val.tolist())
    assert bytes(v[0].tolist()) in text
    with pytest.raises(IndexError, match="step 5"):
        s1.train(5, 0)
    with pytest.raises(ValueError, match="mbs"):
        BatchSampler(corpus, seq=24, mbs=0, steps=5, micro_batches=4, eval_batches=2, device=torch.device("cpu"))


# ---------------------------------------------------------------- profiler attribution


class _Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * g * x


class _Experts(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(16, 16))

    def forward(self, x):
        return _Square.apply(x @ self.w).relu()


def test_expert_attribution_takes_the_range_and_its_backward_only():
    from torch.profiler import ProfilerActivity, profile

    experts = _Experts()
    x = torch.randn(8, 16, requires_grad=True)
    with expert_ranges([experts]):
        assert experts.forward.__name__ == "forward" and "forward" in experts.__dict__
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            h = torch.tanh(x)  # before the experts
            y = experts(h)
            loss = y.sigmoid().sum()  # after them
            loss.backward()
    assert "forward" not in experts.__dict__  # the wrapper is gone
    events = list(prof.events())
    names = {e.name for e in attributed_events(events)}
    assert EXPERTS_RANGE in names and "_Square" in names and "aten::relu" in names
    for inside in ("_SquareBackward", "ReluBackward0", "MmBackward0"):
        assert f"autograd::engine::evaluate_function: {inside}" in names, names
    for outside in ("TanhBackward0", "SigmoidBackward0", "SumBackward0"):
        assert f"autograd::engine::evaluate_function: {outside}" not in names
    assert "aten::tanh" not in names and "aten::sigmoid" not in names
    split = expert_time_split(events, on_gpu=False)
    assert 0 < split["expert_ms"] < split["total_ms"]


def test_expert_kernel_table_sums_the_experts_kernels_by_name():
    from types import SimpleNamespace as NS

    def op(name, kernels=(), children=(), seq=-1):
        return NS(name=name, device_type=None, sequence_nr=seq, cpu_children=list(children),
                  kernels=[NS(name=k, duration=us) for k, us in kernels])

    gemm = op("aten::mm", [("gemm", 300.0)], seq=7)
    cast = op("cast", [("cast_kernel", 50.0), ("cast_kernel", 25.0)])
    outside = op("aten::tanh", [("tanh_kernel", 999.0)])
    backward = op("autograd::engine::evaluate_function: MmBackward0", [("gemm", 600.0)], seq=7)
    other_backward = op("autograd::engine::evaluate_function: TanhBackward0", [("tanh_kernel", 999.0)], seq=3)
    events = [op(EXPERTS_RANGE, children=[gemm, cast]), gemm, cast, outside, backward, other_backward]
    table = expert_kernel_table(events)
    assert [(name, n) for name, _, n in table] == [("gemm", 2), ("cast_kernel", 2)]  # the tanh kernels are not the experts'
    assert [ms for _, ms, _ in table] == pytest.approx([0.9, 0.075])
    assert [name for name, _, _ in expert_kernel_table(events, top=1)] == ["gemm"]


# ---------------------------------------------------------------- hot-path helpers on the CPU


def test_microbatch_ms_bumps_the_weight_once_per_optimizer_step():
    w = torch.nn.Parameter(torch.randn(4))
    seen = []
    step = lambda: seen.append(w._version)  # noqa: E731
    ms = step_metrics.microbatch_ms(step, w, 4, torch.device("cpu"), warmup_ms=0, rep_ms=1)
    assert ms >= 0 and len(seen) % 4 == 0 and len(seen) >= 8
    groups = [seen[i:i + 4] for i in range(0, len(seen), 4)]
    assert all(len(set(g)) == 1 for g in groups)  # unchanged within an optimizer step
    assert len({g[0] for g in groups}) == len(groups)  # changed between steps
    with pytest.raises(ValueError, match="micro_batches"):
        step_metrics.microbatch_ms(step, w, 0, torch.device("cpu"))


def test_gpu_only_measurements_say_why_on_cpu():
    cpu = torch.device("cpu")
    for fn in (lambda: step_metrics.count_kernel_launches(lambda: None, cpu),
               lambda: step_metrics.cuda_graph_ms(lambda: None, cpu)):
        with pytest.raises(step_metrics.NotAvailable, match="CUDA"):
            fn()
    res = step_metrics.host_issue_us(lambda: torch.randn(64, 64) @ torch.randn(64, 64), cpu)
    assert res["us"] > 0 and not res["synchronizes"]
    assert [step_metrics.classify_gpu_activity(n) for n in
            ("Memcpy DtoD (Device -> Device)", "Memset (Device)", "_grouped_gemm_fwd_kernel", "fp8_cast_kernel",
             "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>(int, ...)")] == [
        "memcpy", "memset", "gemm", "quant", "kernel"]


def test_e2e_records_carry_the_hot_path_columns(tmp_path):
    out = tmp_path / "e2e"
    rc = cli.main(["--quick", "--device", "cpu", "--warmup-ms", "0", "--rep-ms", "1", "--levels", "e2e",
                   "--models", "tiny", "--layers", "fc1", "--peers", "bf16", "--granularity", "tensorwise+wcache",
                   "--out", str(out)])
    assert rc == 0
    with open(out / "results.json") as f:
        records = json.load(f)["records"]
    by = {r["impl"]: r for r in records}
    turbo, bf16 = by["turbo:torch:tensorwise+wcache"], by["bf16"]
    for r in (turbo, bf16):
        assert r["host_us"] > 0 and r["mb4_ms"] > 0 and r["mb1_ms"] > 0
        assert r["launches"] is None and r["graph_ms"] is None and "CUDA" in r["hot_path_notes"]
    assert bf16["mb1_ms"] == bf16["ms"]  # no cache: one micro-batch is the timed call
    md = (out / "results.md").read_text()
    assert "## End to end: hot path" in md and "ms/µb of 4" in md and "hot path n/a for" in md
    assert cli.parse_args(["--device", "cpu", "--e2e-extras", "none"]).e2e_extras == []
    with pytest.raises(SystemExit):
        cli.parse_args(["--device", "cpu", "--e2e-extras", "host,cycles"])


# ---------------------------------------------------------------- the train preset (smoke mode)

needs_megatron = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed")


@needs_megatron
def test_canonical_init_is_shared_by_turbo_and_sequential_experts():
    from turbo_moe.bench.train_model import CPU_CONFIGS, build_model, canonical_state, load_canonical_state, megatron_world

    cfg = CPU_CONFIGS["expert-dominated"]
    cpu = torch.device("cpu")
    with megatron_world(cpu):
        torch.manual_seed(0)
        seq = build_model(cfg, "megatron", cpu)
        torch.manual_seed(1)
        turbo = build_model(cfg, "turbo-bf16", cpu)
        state = canonical_state(seq)
        assert state["decoder.layers.0.mlp.experts.linear_fc1.weight"].shape == (cfg.experts, 2 * cfg.ffn, cfg.hidden)
        load_canonical_state(turbo, state)
        tokens = torch.randint(0, 256, (2, cfg.seq), generator=torch.Generator().manual_seed(0))
        pos = torch.arange(cfg.seq).unsqueeze(0).expand(2, -1)
        mask = torch.triu(torch.ones(1, 1, cfg.seq, cfg.seq, dtype=torch.bool), diagonal=1)
        with torch.no_grad():
            a, b = seq(tokens, pos, mask), turbo(tokens, pos, mask)
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
        # And back: the turbo layout loads into SequentialMLP.
        load_canonical_state(seq, canonical_state(turbo))
        bad = dict(state)
        bad.pop("decoder.layers.0.mlp.experts.linear_fc2.weight")
        with pytest.raises(KeyError, match="linear_fc2"):
            load_canonical_state(turbo, bad)


def test_master_weight_adam_matches_float32_adam():
    from turbo_moe.bench.train_model import MasterWeightAdam

    start = torch.randn(32, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    ref = torch.nn.Parameter(start.float())
    low = torch.nn.Parameter(start.clone())
    unused = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    opt_ref = torch.optim.Adam([ref], lr=1e-2, betas=(0.9, 0.95))
    opt = MasterWeightAdam([low, unused], lr=1e-2, clip_grad=None)
    for i in range(3):
        # bf16-exact gradients: the float32 masters then follow float32 Adam bit for bit.
        grad = torch.randn(32, generator=torch.Generator().manual_seed(10 + i)).to(torch.bfloat16)
        ref.grad, low.grad = grad.float(), grad.clone()
        opt_ref.step()
        opt.step()
        opt.zero_grad()
        assert low.grad is None
    assert torch.equal(opt.masters[0], ref.detach())
    assert torch.equal(low.detach(), ref.detach().to(torch.bfloat16))
    assert not torch.equal(low.detach(), start)
    assert torch.equal(unused.detach(), torch.ones(3, dtype=torch.bfloat16))  # zero gradient: Adam leaves it


@needs_megatron
def test_train_preset_cpu_smoke(tmp_path):
    out = tmp_path / "train"
    rc = cli.main(["--preset", "train", "--device", "cpu", "--corpus-bytes", str(SMALL_CORPUS), "--out", str(out)])
    assert rc == 0
    with open(out / "results.json") as f:
        result = json.load(f)
    records = result["records"]
    assert "stdlib source" in result["meta"]["corpus"] and result["meta"]["args"]["format"] == "hybrid"
    assert [(r["config"], r["impl"]) for r in records] == [
        (c, v) for c in ("expert-dominated", "moderate") for v in ("turbo-bf16", "fp8-tensorwise", "fp8-rowwise", "megatron")]
    by = {(r["config"], r["impl"]): r for r in records}
    for r in records:
        assert r["status"] == "ok", r["reason"]
        assert r["experts"] == ("SequentialMLP" if r["impl"] == "megatron" else "TurboMoEGroupedMLP")
        assert r["steps"] == (4 if r["config"] == "moderate" else 3) == len(r["loss_curve"])
        assert all(math.isfinite(x) for x in r["loss_curve"]) and r["step_ms"] > 0 and r["host_ms"] > 0
        assert abs(r["loss_curve"][0] - math.log(256)) < 0.1  # a fresh byte-level model: ~uniform
        assert r["val_curve"] and r["val_curve"][-1][0] == r["steps"] and math.isfinite(r["val_loss"])
        assert 0 < r["expert_share"] < 1 and r["expert_gpu_ms"] > 0
    for cfg in ("expert-dominated", "moderate"):
        bf16, seq = by[(cfg, "turbo-bf16")], by[(cfg, "megatron")]
        # Same weights, same data, same float32 math on the CPU: Megatron's experts and the bf16 path agree.
        assert abs(seq["loss_curve"][0] - bf16["loss_curve"][0]) < 1e-4
        for fp8 in ("fp8-tensorwise", "fp8-rowwise"):
            curve = by[(cfg, fp8)]["loss_curve"]
            assert curve != bf16["loss_curve"]  # FP8 really ran
            assert all(abs(a / b - 1) < 0.01 for a, b in zip(curve, bf16["loss_curve"]))
    moderate = by[("moderate", "turbo-bf16")]["loss_curve"]
    assert moderate[-1] < moderate[0]  # it learns
    md = (out / "results.md").read_text()
    assert "## Training step" in md and "SequentialMLP" in md and "corpus" in md
    pytest.importorskip("matplotlib")
    assert (out / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_train_preset_rounds_run_the_variants_in_turn(tmp_path):
    out = tmp_path / "rounds"
    rc = cli.main(["--preset", "train", "--device", "cpu", "--corpus-bytes", str(SMALL_CORPUS), "--out", str(out),
                   "--train-configs", "expert-dominated", "--variants", "turbo-bf16,fp8-tensorwise",
                   "--train-rounds", "2", "--timed-steps", "1", "--warmup-steps", "0"])
    assert rc == 0
    with open(out / "results.json") as f:
        records = json.load(f)["records"]
    assert [(r["impl"], r["round"]) for r in records] == [
        ("turbo-bf16", 0), ("fp8-tensorwise", 0), ("turbo-bf16", 1), ("fp8-tensorwise", 1)]
    assert all(r["status"] == "ok" for r in records)
    # the same seed and start: each round trains the same steps to the same loss
    assert records[0]["loss_curve"] == records[2]["loss_curve"] and records[1]["loss_curve"] == records[3]["loss_curve"]
    md = (out / "results.md").read_text()
    assert "### Over the rounds" in md and "fp8-tensorwise" in md
    with pytest.raises(SystemExit):
        cli.parse_args(["--device", "cpu", "--preset", "train", "--train-rounds", "0"])


@needs_megatron
def test_main_grad_fusion_accumulates_expert_weights_in_main_grad():
    """``--train-main-grad``: the expert weights' gradients accumulate in float32 main_grad (their
    placeholder .grad dropped, as Megatron's DDP does); the other parameters keep .grad; one
    optimizer step gives the same parameters as without it (float32 on the CPU: the same sums)."""
    from turbo_moe.bench.text_corpus import BatchSampler, load_corpus
    from turbo_moe.bench.train_model import (CPU_CONFIGS, MasterWeightAdam, build_model, canonical_state,
                                             experts_of, load_canonical_state, megatron_world)
    from turbo_moe.bench.train_step import _Inputs, _optimizer_step

    cfg = CPU_CONFIGS["moderate"]
    cpu = torch.device("cpu")
    corpus = load_corpus(SMALL_CORPUS)
    results = {}
    with megatron_world(cpu):
        state = None
        for fused in (False, True):
            torch.manual_seed(0)
            model = build_model(cfg, "fp8-tensorwise", cpu, backend="torch", main_grad_fusion=fused)
            if state is None:
                state = canonical_state(model)
            load_canonical_state(model, state)
            opt = MasterWeightAdam(model.parameters(), lr=1e-3, main_grads=fused)
            sampler = BatchSampler(corpus, cfg.seq, cfg.mbs, 1, 3, 1, cpu, seed=0)
            opt.zero_grad()
            opt.step = lambda: None  # look at the gradients before the update
            _optimizer_step(model, opt, sampler, 0, _Inputs(cfg, cpu), torch.zeros(()))
            weights = [e.linear_fc1.weight for e in experts_of(model)] + [e.linear_fc2.weight for e in experts_of(model)]
            if fused:
                for w in weights:
                    assert w.grad_added_to_main_grad and w.grad is None and w.main_grad.abs().sum() > 0
                others = [p for p in model.parameters() if all(p is not w for w in weights)]
                assert all(not p.grad_added_to_main_grad for p in others) and any(p.grad is not None for p in others)
                results[fused] = [w.main_grad.clone() for w in weights]
            else:
                results[fused] = [w.grad.clone() for w in weights]
    for a, b in zip(results[False], results[True]):
        assert torch.equal(a, b)


@needs_megatron
def test_main_grad_training_quantizes_each_expert_weight_once_per_step(monkeypatch):
    """Under --train-main-grad the expert weights are DDP-like (main_grad, updated behind the
    cache's back as Megatron's optimizer does); the bench drives is_first_microbatch as Megatron's
    schedules do, so "auto" caching quantizes every micro-batch in the first step (the flag not yet
    seen driven) and once per step after that."""
    import turbo_moe.autograd as autograd_module
    from turbo_moe.bench.text_corpus import BatchSampler, load_corpus
    from turbo_moe.bench.train_model import CPU_CONFIGS, MasterWeightAdam, build_model, experts_of, megatron_world
    from turbo_moe.bench.train_step import _Inputs, _optimizer_step

    cfg = CPU_CONFIGS["moderate"]
    cpu = torch.device("cpu")
    calls = []
    real = autograd_module.quantize_weight
    monkeypatch.setattr(autograd_module, "quantize_weight", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    with megatron_world(cpu):
        torch.manual_seed(0)
        model = build_model(cfg, "fp8-tensorwise", cpu, backend="torch", main_grad_fusion=True)
        linears = 2 * len(experts_of(model))
        opt = MasterWeightAdam(model.parameters(), lr=1e-3, main_grads=True)
        micro = 3
        sampler = BatchSampler(load_corpus(SMALL_CORPUS), cfg.seq, cfg.mbs, 3, micro, 1, cpu, seed=0)
        per_step = []
        for step in range(3):
            calls.clear()
            _optimizer_step(model, opt, sampler, step, _Inputs(cfg, cpu), torch.zeros(()))
            per_step.append(len(calls))
    assert per_step == [micro * linears, linears, linears], per_step


@needs_megatron
def test_train_preset_with_main_grad_runs_every_recipe(tmp_path):
    out = tmp_path / "main_grad"
    rc = cli.main(["--preset", "train", "--device", "cpu", "--corpus-bytes", str(SMALL_CORPUS), "--out", str(out),
                   "--train-configs", "moderate", "--variants", "turbo-bf16,fp8-tensorwise,fp8-mxfp8",
                   "--train-main-grad", "--train-steps", "2", "--no-profile"])
    assert rc == 0
    result = json.loads((out / "results.json").read_text())
    assert result["meta"]["args"]["train_main_grad"] is True
    for r in result["records"]:
        assert r["status"] == "ok" and r["main_grad"] is True and all(math.isfinite(x) for x in r["loss_curve"]), r


@needs_megatron
def test_train_preset_host_profile_and_dispatcher_override(tmp_path, capsys):
    """--host-profile N: each variant's record carries its cProfile table (ms per optimizer step);
    --train-override CONFIG.dispatcher picks Megatron's token dispatcher."""
    from turbo_moe.bench.train_model import GPU_CONFIGS, apply_overrides

    assert GPU_CONFIGS["moderate"].dispatcher == "alltoall"  # what multi-GPU runs use: no host sync per layer
    assert apply_overrides(GPU_CONFIGS, ["moderate.dispatcher=allgather"])["moderate"].dispatcher == "allgather"
    out = tmp_path / "host_profile"
    rc = cli.main(["--preset", "train", "--device", "cpu", "--corpus-bytes", str(SMALL_CORPUS), "--out", str(out),
                   "--train-configs", "moderate", "--variants", "fp8-tensorwise", "--train-steps", "2",
                   "--no-profile", "--host-profile", "1"])
    assert rc == 0
    (record,) = json.loads((out / "results.json").read_text())["records"]
    table = record["host_profile"].splitlines()
    assert table[0].split()[:2] == ["own", "ms/step"] and len(table) > 5
    assert any("turbo_moe/" in line for line in table[1:])  # the FP8 layer's own Python is in the profile
    assert "host profile (1 steps)" in capsys.readouterr().out


@needs_megatron
def test_train_preset_time_budget_and_bad_arguments(tmp_path, capsys):
    out = tmp_path / "budget"
    rc = cli.main(["--preset", "train", "--device", "cpu", "--corpus-bytes", str(SMALL_CORPUS), "--time-budget", "0",
                   "--train-configs", "moderate", "--out", str(out)])
    assert rc == 0
    with open(out / "results.json") as f:
        records = json.load(f)["records"]
    assert [r["status"] for r in records] == ["skipped"] * 4
    for argv in (["--variants", "fp16"], ["--train-configs", "huge"], ["--train-override", "moderate.width=3"],
                 ["--train-override", "moderate.dispatcher=flex"], ["--micro-batches", "0"]):
        with pytest.raises(SystemExit):
            cli.parse_args(["--device", "cpu", "--preset", "train", *argv])
    err = capsys.readouterr().err
    assert "--variants" in err and "--train-configs" in err and "--train-override" in err and "--micro-batches" in err


def test_train_table_ratios_and_targets():
    base = dict(level="train", op="step", status="ok", reason="", experts="X", steps=10, config="expert-dominated",
                case="train expert-dominated", peak_mb=100.0, host_ms=1.0, gpu_ms=10.0, train_loss=2.0)
    records = [
        dict(base, impl="turbo-bf16", step_ms=10.0, expert_gpu_ms=6.0, expert_share=0.6, val_loss=2.0),
        dict(base, impl="fp8-tensorwise", step_ms=8.0, expert_gpu_ms=3.0, expert_share=0.4, val_loss=2.01,
             gpu_ms=7.25, launches=900, expert_launches=120),
        dict(base, impl="fp8-rowwise", step_ms=9.0, expert_gpu_ms=4.2, expert_share=0.45, val_loss=2.05),
    ]
    text = "\n".join(report.train_table(records))
    assert "0.80x" in text and "0.50x" in text and "+0.50%" in text and "+2.50%" in text
    assert "900 (120)" in text and "| 0.750 " in text  # GPU idle = step - GPU busy, on a GPU only
    assert "GPU / bf16" in text and "| 0.72x " in text  # the GPU busy time against bf16's: 7.25 / 10
    targets = report.train_targets(records)
    assert "- n/a expert-dominated fp8-tensorwise: the step's GPU busy time 0.72x bf16 (the step ratio adds the " \
           "host's idle gaps)" in targets
    assert "- PASS expert-dominated: bf16 experts are 60% of the step's GPU time (config wants >= 50%)" in targets
    assert "- PASS expert-dominated fp8-tensorwise: expert GPU time 0.50x bf16 (<= 0.65x)" in targets
    assert "- MISS expert-dominated fp8-rowwise: expert GPU time 0.70x bf16 (<= 0.65x)" in targets
    assert "- PASS expert-dominated fp8-tensorwise: step 0.80x bf16 (<= 0.85x)" in targets
    assert "- MISS expert-dominated fp8-rowwise: step 0.90x bf16 (<= 0.85x)" in targets
    # 10 steps: the loss gap is shown, not judged against 1%.
    assert any(t.startswith("- n/a expert-dominated fp8-rowwise: held-out loss +2.50% vs bf16, not judged: 10 steps")
               for t in targets)
    assert not any(t.startswith(("- PASS", "- MISS")) and "loss" in t for t in targets)


def test_train_rounds_compare_each_variant_with_its_own_rounds_bf16():
    """``--train-rounds``: each round's FP8 run against that round's bf16 run (the host drifts
    between rounds), the medians and ranges over the rounds, a round column, targets per round."""
    base = dict(level="train", op="step", status="ok", reason="", experts="X", steps=10, config="expert-dominated",
                case="train expert-dominated", peak_mb=100.0, train_loss=2.0, expert_share=0.6)
    records = []
    # the host slows down round after round: bf16 10, 12, 14 ms; FP8 always 0.9x of its round's
    for round_, (bf16, fp8) in enumerate(((10.0, 9.0), (12.0, 10.8), (14.0, 12.6))):
        records.append(dict(base, impl="turbo-bf16", round=round_, step_ms=bf16, host_ms=bf16, gpu_ms=8.0,
                            expert_gpu_ms=4.0))
        records.append(dict(base, impl="fp8-blockwise", round=round_, step_ms=fp8, host_ms=fp8, gpu_ms=7.6,
                            expert_gpu_ms=3.4 + 0.2 * round_))
    rows = report.train_rounds_table(records)
    text = "\n".join(rows)
    line = next(r for r in rows if "fp8-blockwise" in r)
    assert "| 3 " in line and "0.90x (0.90-0.90)" in line and "0.95x (0.95-0.95)" in line, line
    assert "0.90x (0.85-0.95)" in line, line  # experts 3.4, 3.6, 3.8 over 4.0: median 0.90
    assert "step / bf16" in text
    # the full table: a round column, and each row's ratio against its own round (a pooled
    # baseline would give 12.6 / 10 = 1.26x in round 2)
    table = "\n".join(report.train_table(records))
    assert "round" in table.splitlines()[0] and "1.26x" not in table and table.count("0.90x") >= 3
    targets = report.train_targets(records)
    assert sum("(round " in t and "fp8-blockwise" in t and "step 0.90x" in t for t in targets) == 3, targets
    assert sum("bf16 experts are" in t for t in targets) == 1  # the config's share line once
    # one round: no round column, no rounds table
    single = [r for r in records if r["round"] == 0]
    assert report.train_rounds_table(single) == [] and "round" not in report.train_table(single)[0]


def test_loss_summary_averages_the_tail_of_the_run():
    from turbo_moe.bench.train_step import loss_summary

    curve = [float(i) for i in range(200)]  # step i's loss is i
    val = [[50, 5.0], [100, 4.0], [150, 3.0], [200, 9.0]]
    s = loss_summary(curve, val)
    assert s["train_loss"] == sum(range(190, 200)) / 10  # the last 10 steps, as printed during the run
    assert s["train_loss_tail"] == sum(range(180, 200)) / 20  # the last 10% of 200 steps
    assert s["val_loss"] == 9.0 and s["val_loss_tail"] == (4.0 + 3.0 + 9.0) / 3
    short = loss_summary([3.0, 1.0], [[2, 7.0]])  # fewer steps than the windows: all of them
    assert short == dict(train_loss=2.0, val_loss=7.0, train_loss_tail=2.0, val_loss_tail=7.0)
    assert loss_summary([], []) == dict(train_loss=None, val_loss=None, train_loss_tail=None, val_loss_tail=None)


def test_train_loss_targets_read_the_averages():
    """A last held-out point off by 14% (a spike) does not decide the 1% line when the averages
    over the run's tail hold; a variant whose averages are off is a MISS on each."""
    base = dict(level="train", op="step", status="ok", reason="", experts="X", steps=1000, config="moderate",
                case="train moderate", peak_mb=1.0, host_ms=1.0, step_ms=10.0, train_loss=1.25)
    records = [
        dict(base, impl="turbo-bf16", val_loss=1.0, train_loss_tail=1.25, val_loss_tail=1.06),
        dict(base, impl="fp8-tensorwise", val_loss=1.146, train_loss_tail=1.26, val_loss_tail=1.0653),
        dict(base, impl="fp8-blockwise", val_loss=1.005, train_loss_tail=1.28, val_loss_tail=1.09),
        dict(base, impl="fp8-rowwise", val_loss=1.005, train_loss_tail=1.26, val_loss_tail=1.06, steps=900),
    ]
    text = "\n".join(report.train_table(records))
    assert "+14.60%" in text and "+0.80%" in text and "+0.50%" in text  # last point, train tail, held-out tail
    targets = report.train_targets(records)
    assert "- PASS moderate fp8-tensorwise: training loss over the last 10% of steps +0.80% vs bf16 (within 1%)" in targets
    assert "- PASS moderate fp8-tensorwise: held-out loss over the last 3 evaluations +0.50% vs bf16 (within 1%)" in targets
    assert not any("fp8-tensorwise: held-out loss +" in t for t in targets)  # the spiky last point is not a target
    assert "- MISS moderate fp8-blockwise: training loss over the last 10% of steps +2.40% vs bf16 (within 1%)" in targets
    assert "- MISS moderate fp8-blockwise: held-out loss over the last 3 evaluations +2.83% vs bf16 (within 1%)" in targets
    assert not any("fp8-rowwise" in t and "loss" in t for t in targets)  # other step counts: no comparison
