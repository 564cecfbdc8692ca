"""``python -m turbo_moe.bench --preset train``: train a Megatron-core MoE GPT on one device and
compare its experts: FP8 tensorwise and rowwise (turbo_moe), bf16 (turbo_moe's ``fp8=None`` path,
``torch._grouped_mm``) and Megatron's own (``SequentialMLP``, see train_model.py).

Every variant starts from the same weights and sees the same byte-level text (Python's stdlib
source, text_corpus.py) in the same order; an optimizer step is ``--micro-batches`` micro-batches
of gradient accumulation and one mixed-precision Adam update. Per variant: the step time (CUDA
events around each step, steps issued back to back, median after ``--warmup-steps``), host time
per step (host clock around the same steps), peak memory, the training loss of every step, the
held-out loss every ``--eval-interval`` steps, and one profiled step: the experts' share of the
step's GPU time (:func:`expert_time_split`). Results: ``--out``/results.{md,json,csv} rewritten
after every variant, and results.png, the loss curves.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from typing import Dict, Iterable, Iterator, List, Optional, Tuple

import torch

from .step_metrics import gpu_activities
from .text_corpus import BatchSampler, TextCorpus
from .train_model import (
    TrainConfig, MasterWeightAdam, build_model, canonical_state, experts_of, load_canonical_state,
)

__all__ = ["EXPERTS_RANGE", "expert_ranges", "attributed_events", "expert_time_split", "train_variant",
           "add_train_arguments", "finish_train_args", "list_train_preset", "run_train_preset"]

EXPERTS_RANGE = "turbo_moe.bench::experts"
_EVALUATE = "autograd::engine::evaluate_function: "


# ------------------------------------------------------------------------------ profiler attribution


@contextlib.contextmanager
def expert_ranges(modules: Iterable[torch.nn.Module], name: str = EXPERTS_RANGE) -> Iterator[None]:
    """Run every module's forward inside ``torch.profiler.record_function(name)`` (while in the block)."""
    wrapped = []
    for module in modules:
        inner = module.forward

        def forward(*args, __inner=inner, **kwargs):
            with torch.profiler.record_function(name):
                return __inner(*args, **kwargs)

        module.forward = forward
        wrapped.append(module)
    try:
        yield
    finally:
        for module in wrapped:
            del module.forward  # back to the class's forward


def attributed_events(events: Iterable, range_name: str = EXPERTS_RANGE) -> List:
    """The profiler's CPU events that belong to the ranges' forward and to its backward.

    Forward: every op inside a ``range_name`` range. Backward: the autograd engine runs each
    node under ``autograd::engine::evaluate_function: <Node>``, an event carrying the sequence
    number of the forward op that created the node; the evaluations whose sequence number is one
    of the forward ops' are the ranges' backward, with all that runs inside them. Not included:
    ``AccumulateGrad`` into ``.grad`` (leaf nodes have no sequence number) and the optimizer.
    """
    events = [e for e in events if getattr(e, "device_type", None) is None or e.device_type.name == "CPU"]
    chosen: Dict[int, object] = {}
    seqs = set()

    def take(evt, collect_seq: bool) -> None:
        stack = [evt]
        while stack:
            e = stack.pop()
            if id(e) in chosen:
                continue
            chosen[id(e)] = e
            if collect_seq and e.sequence_nr >= 0:
                seqs.add(e.sequence_nr)
            stack.extend(e.cpu_children)

    for evt in events:
        if evt.name == range_name:
            take(evt, collect_seq=True)
    for evt in events:
        if evt.name.startswith(_EVALUATE) and evt.sequence_nr in seqs:
            take(evt, collect_seq=False)
    return list(chosen.values())


def expert_time_split(events, on_gpu: bool, range_name: str = EXPERTS_RANGE) -> Dict[str, float]:
    """``{"expert_ms", "total_ms", "unattributed_ms", "launches", "expert_launches"}`` of one profiled step.

    GPU: ``total_ms`` is the summed duration of every GPU activity (kernels, memsets, copies);
    ``expert_ms`` the kernels launched by :func:`attributed_events` (``self_device_time_total``);
    ``unattributed_ms`` the GPU time the profiler could not tie to any CPU op (e.g. a launch
    outside every recorded op): it is in the total but in no range, so a large value bounds the
    error of the share. ``launches``: GPU activities in the step; ``expert_launches``: those of the
    experts (None on a CPU). CPU (smoke mode): CPU op time stands in for GPU time.
    """
    events = list(events)
    mine = attributed_events(events, range_name)
    cpu = [e for e in events if e.device_type.name == "CPU" and not e.is_async]
    launches = expert_launches = None
    if on_gpu:
        device = gpu_activities(events)
        total = sum(e.time_range.elapsed_us() for e in device)
        linked = sum(e.self_device_time_total for e in cpu)
        expert = sum(e.self_device_time_total for e in mine)
        launches, expert_launches = len(device), sum(len(e.kernels) for e in mine)
    else:
        total = linked = sum(e.self_cpu_time_total for e in cpu)
        expert = sum(e.self_cpu_time_total for e in mine)
    return {"expert_ms": expert / 1e3, "total_ms": total / 1e3, "unattributed_ms": max(total - linked, 0.0) / 1e3,
            "launches": launches, "expert_launches": expert_launches}


def expert_kernel_table(events, range_name: str = EXPERTS_RANGE, top: int = 12) -> List[Tuple[str, float, int]]:
    """``(kernel name, ms, launches)`` of the experts' GPU kernels in one profiled step, most time first:
    which kernels the expert share is made of (GEMMs, casts, the activation, gradient adds)."""
    by_name: Dict[str, List[float]] = {}
    for evt in attributed_events(events, range_name):
        for kernel in getattr(evt, "kernels", ()):
            acc = by_name.setdefault(kernel.name, [0.0, 0])
            acc[0] += kernel.duration / 1e3
            acc[1] += 1
    rows = sorted(((name, ms, int(n)) for name, (ms, n) in by_name.items()), key=lambda r: -r[1])
    return rows[:top]


# ------------------------------------------------------------------------------ training


class _Inputs:
    def __init__(self, cfg: TrainConfig, device: torch.device):
        self.positions = torch.arange(cfg.seq, device=device).unsqueeze(0).expand(cfg.mbs, -1)
        self.mask = torch.triu(torch.ones(1, 1, cfg.seq, cfg.seq, dtype=torch.bool, device=device), diagonal=1)


def _loss(model, tokens, labels, inputs: _Inputs) -> torch.Tensor:
    return model(tokens, inputs.positions, inputs.mask, labels=labels).float().mean()


def _optimizer_step(model, opt, sampler: BatchSampler, step: int, inputs: _Inputs, loss_out: torch.Tensor) -> None:
    """One optimizer step: micro-batches of gradient accumulation, then Adam. No host sync here."""
    opt.zero_grad()
    _set_first_microbatch(model)
    micro = sampler.micro_batches
    for j in range(micro):
        tokens, labels = sampler.train(step, j)
        loss = _loss(model, tokens, labels, inputs)
        (loss / micro).backward()
        loss_out.add_(loss.detach() / micro)
    opt.step()


def _set_first_microbatch(model) -> None:
    """What Megatron's schedules do at each step's first micro-batch of an FP8 run
    (``MegatronModule.set_is_first_microbatch``): layers that keep FP8 weights across micro-batches
    (turbo_moe's ``cache_fp8_weight="auto"``, TE) refresh them now. Megatron's method acts only
    when ``config.fp8`` is set; turbo_moe's experts are FP8 by their own options here, so the flag
    is set directly, on the same modules."""
    modules = getattr(model, "_bench_first_microbatch_modules", None)
    if modules is None:
        modules = [m for m in model.modules() if hasattr(m, "is_first_microbatch")]
        model._bench_first_microbatch_modules = modules
    for m in modules:
        m.is_first_microbatch = True


@torch.no_grad()
def _held_out_loss(model, sampler: BatchSampler, inputs: _Inputs) -> torch.Tensor:
    total = torch.zeros((), device=inputs.mask.device)
    for i in range(sampler.eval_batches):
        tokens, labels = sampler.val(i)
        total += _loss(model, tokens, labels, inputs)
    return total / max(sampler.eval_batches, 1)


def _lr_at(step: int, steps: int, lr: float) -> float:
    warmup = max(1, steps // 10)  # linear warm-up over the first 10% of the steps, then constant
    return lr * min(1.0, (step + 1) / warmup)


# How many held-out evaluations, and what share of the steps, the steadier loss measures average.
# One held-out point moved a 1000-step run's FP8-vs-bf16 gap from -1.7% to +14.6% between two
# evaluations 100 steps apart, while its training loss over the last 100 steps stayed at +0.8%
# (docs/results/h100_loss_1000.md): a 1% comparison needs averages.
VAL_TAIL_POINTS = 3
TRAIN_TAIL_SHARE = 0.1


def loss_summary(curve: List[float], val_curve: List[List[float]]) -> dict:
    """The record's loss fields from the per-step training losses and the (step, held-out loss) points:
    ``train_loss`` (mean of the last 10 steps) and ``val_loss`` (the last evaluation), as printed
    during the run; ``train_loss_tail`` (mean of the last ``TRAIN_TAIL_SHARE`` of the steps, at least
    10) and ``val_loss_tail`` (mean of the last ``VAL_TAIL_POINTS`` evaluations), what the bf16
    comparison uses."""
    out = dict(train_loss=None, val_loss=None, train_loss_tail=None, val_loss_tail=None)
    if curve:
        last10 = curve[-min(10, len(curve)):]
        out["train_loss"] = sum(last10) / len(last10)
        tail = curve[-min(len(curve), max(10, int(len(curve) * TRAIN_TAIL_SHARE))):]
        out["train_loss_tail"] = sum(tail) / len(tail)
    if val_curve:
        out["val_loss"] = val_curve[-1][1]
        points = [v for _, v in val_curve[-VAL_TAIL_POINTS:]]
        out["val_loss_tail"] = sum(points) / len(points)
    return out


def train_variant(cfg: TrainConfig, variant: str, corpus: TextCorpus, args, device: torch.device,
                  init_states: Dict[str, dict], deadline: Optional[float], progress=print) -> dict:
    """Train one variant on one config; returns its benchmark record (``level="train"``)."""
    steps = args.train_steps if cfg.loss_curve else args.warmup_steps + args.timed_steps
    steps = max(steps, 1)
    rec = dict(level="train", case=f"train {cfg.name}", config=cfg.name, op="step", impl=variant, status="ok",
               reason="", experts=None, steps=0, steps_planned=steps, micro_batches=args.micro_batches,
               tokens_per_step=cfg.tokens_per_step(args.micro_batches), ms=None, step_ms=None, host_ms=None,
               tflops=None, gpu_ms=None, expert_gpu_ms=None, expert_share=None, unattributed_ms=None,
               launches=None, expert_launches=None,
               peak_mb=None, base_mb=None, train_loss=None, val_loss=None, train_loss_tail=None, val_loss_tail=None,
               loss_curve=[], val_curve=[])
    on_gpu = device.type == "cuda"
    model = opt = sampler = None
    tuned_before = set(_triton_backend().tuned_configs()) if _triton_backend() is not None else set()
    try:
        torch.manual_seed(args.seed)
        main_grad = bool(getattr(args, "train_main_grad", False))
        rec["main_grad"] = main_grad
        model = build_model(cfg, variant, device, fp8_format=args.format, backend=args.backends[0],
                            main_grad_fusion=main_grad)
        rec["experts"] = type(experts_of(model)[0]).__name__
        if cfg.name in init_states:
            load_canonical_state(model, init_states[cfg.name])
        else:
            init_states[cfg.name] = canonical_state(model)
        opt = MasterWeightAdam(model.parameters(), lr=args.lr, main_grads=main_grad)
        sampler = BatchSampler(corpus, cfg.seq, cfg.mbs, steps, args.micro_batches, args.eval_batches, device,
                               seed=args.seed)
        inputs = _Inputs(cfg, device)
        losses = torch.zeros(steps, device=device)
        val_points = []
        events, host_s = [], []
        planned_before = None
        for step in range(steps):
            if deadline is not None and time.monotonic() > deadline:
                rec["reason"] = f"time budget: stopped after {step} of {steps} steps"
                break
            if step == args.warmup_steps and on_gpu:
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                rec["base_mb"] = torch.cuda.memory_allocated(device) / 2**20
            if step == args.warmup_steps:
                planned_before = _planned_counts()
            opt.set_lr(_lr_at(step, steps, args.lr))
            t0 = time.perf_counter()
            if on_gpu:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            _optimizer_step(model, opt, sampler, step, inputs, losses[step])
            if on_gpu:
                end.record()
                events.append((start, end))
            host_s.append(time.perf_counter() - t0)
            rec["steps"] = step + 1
            if (step + 1) % args.eval_interval == 0 or step + 1 == steps:
                val_points.append((step + 1, _held_out_loss(model, sampler, inputs)))
        done = rec["steps"]
        if planned_before is not None:  # expert calls from the first timed step on (held-out evaluations
            # included) that ran as one C++ node, and their backwards that fell back to the Python path
            # (turbo_moe.planned_layer / planned_mlp)
            rec["planned_calls"], rec["planned_fallbacks"] = (
                now - before for now, before in zip(_planned_counts(), planned_before))
        if on_gpu:
            torch.cuda.synchronize(device)
            step_ms = [s.elapsed_time(e) for s, e in events]
            if done > args.warmup_steps:
                rec["peak_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
        else:
            step_ms = [t * 1e3 for t in host_s]
        timed = slice(args.warmup_steps, None) if done > args.warmup_steps else slice(None)
        if step_ms:
            rec["step_ms"] = rec["ms"] = statistics.median(step_ms[timed])
            rec["host_ms"] = statistics.median(host_s[timed]) * 1e3
            rec["tokens_per_s"] = rec["tokens_per_step"] / (rec["step_ms"] * 1e-3)
        curve = losses[:done].tolist()
        rec["loss_curve"] = curve
        rec["val_curve"] = [[s, float(v)] for s, v in val_points]
        rec.update(loss_summary(curve, rec["val_curve"]))
        if args.profile and done and (deadline is None or time.monotonic() < deadline):
            rec.update(_profile_step(model, opt, sampler, done - 1, inputs, device))
        if getattr(args, "host_profile", 0) and done and (deadline is None or time.monotonic() < deadline):
            rec["host_profile"] = _host_profile(model, opt, sampler, done - 1, inputs, args.host_profile)
            progress(f"    {variant} host profile ({args.host_profile} steps), by own time:\n{rec['host_profile']}")
        if done < args.warmup_steps + 1:
            rec["reason"] = (rec["reason"] + "; " if rec["reason"] else "") + "no step after the warm-up: times include it"
        # Tuning picks a config per shape class at the first eager call, and a noisy pick moves the
        # expert time: say which kernels this variant's GEMMs ran.
        backend = _triton_backend()
        rec["gemm_configs"] = [] if backend is None else [
            line for key, line in backend.describe_tuned().items() if key not in tuned_before]
        progress(_summary(rec))
    except Exception as exc:
        rec.update(status="error", reason=f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}")
        progress(f"    {variant:15s} error: {rec['reason']}")
        if on_gpu:
            torch.cuda.synchronize(device)  # a dead CUDA context stops the run here
    finally:
        del model, opt, sampler
        gc.collect()
        if on_gpu:
            torch.cuda.empty_cache()
    return rec


def _profile_step(model, opt, sampler, step: int, inputs: _Inputs, device: torch.device) -> dict:
    """One more optimizer step under torch.profiler, the experts inside :data:`EXPERTS_RANGE`."""
    from torch.profiler import ProfilerActivity, profile

    on_gpu = device.type == "cuda"
    scratch = torch.zeros((), device=device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with expert_ranges(experts_of(model)):
        if on_gpu:
            torch.cuda.synchronize(device)
        with profile(activities=activities) as prof:
            _optimizer_step(model, opt, sampler, step, inputs, scratch)
            if on_gpu:
                torch.cuda.synchronize(device)
    split = expert_time_split(prof.events(), on_gpu)
    kernels = expert_kernel_table(prof.events()) if on_gpu else []
    return {"expert_kernels": kernels, "gpu_ms": split["total_ms"], "expert_gpu_ms": split["expert_ms"],
            "expert_share": split["expert_ms"] / split["total_ms"] if split["total_ms"] > 0 else None,
            "unattributed_ms": split["unattributed_ms"], "launches": split["launches"],
            "expert_launches": split["expert_launches"]}


def _host_profile(model, opt, sampler, step: int, inputs: _Inputs, steps: int, top: int = 30) -> str:
    """cProfile ``steps`` more optimizer steps: the ``top`` functions by own time, in ms per step
    (where a host-bound step's Python goes; cProfile itself roughly doubles it)."""
    import cProfile
    import io
    import pstats

    scratch = torch.zeros((), device=next(model.parameters()).device)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        _optimizer_step(model, opt, sampler, step, inputs, scratch)
    prof.disable()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    items = stats.stats.items()  # (file, line, name) -> (cc, nc, tt, ct, callers)
    header = f"{'own ms/step':>12s} {'cum ms/step':>12s} {'calls/step':>11s}  function"

    def row(key, value):
        (filename, line, name), (_, ncalls, tottime, cumtime, _) = key, value
        where = filename.split("site-packages/")[-1].split("/work/")[-1]
        return f"{tottime * 1e3 / steps:12.2f} {cumtime * 1e3 / steps:12.2f} {ncalls / steps:11.0f}  {where}:{line}({name})"

    lines = [header] + [row(k, v) for k, v in sorted(items, key=lambda item: -item[1][2])[:top]]
    # Where the experts' own Python goes (turbo_moe's functions, by cumulative time).
    ours = [(k, v) for k, v in items if "turbo_moe" in k[0] and "/bench/" not in k[0]]
    lines += ["turbo_moe's functions by cumulative time:", header]
    lines += [row(k, v) for k, v in sorted(ours, key=lambda item: -item[1][3])[:top]]
    return "\n".join(lines)


def _triton_backend():
    """The Triton backend if something imported it (then its tuning table may hold entries)."""
    import sys

    module = sys.modules.get("turbo_moe.backends.triton_backend")
    return None if module is None else module.BACKEND


def _planned_counts() -> Tuple[int, int]:
    from .. import planned_layer, planned_mlp

    return planned_layer.calls + planned_mlp.calls, planned_layer.fallbacks


def _summary(rec: dict) -> str:
    parts = [f"    {rec['impl']:15s} {rec['experts'] or '':22s} {rec['steps']:4d} steps"]
    if rec["step_ms"] is not None:
        parts.append(f"step {rec['step_ms']:8.2f} ms host {rec['host_ms']:8.2f} ms")
    if rec["expert_share"] is not None:
        parts.append(f"experts {rec['expert_gpu_ms']:.2f}/{rec['gpu_ms']:.2f} ms ({100 * rec['expert_share']:.0f}%)")
    if rec["peak_mb"] is not None:
        parts.append(f"peak {rec['peak_mb']:.0f} MB")
    if rec.get("planned_calls") is not None:
        parts.append(f"planned calls {rec['planned_calls']} (backward fallbacks {rec['planned_fallbacks']})")
    if rec.get("expert_kernels"):
        parts.append("expert kernels: " + "; ".join(f"{name[:60]} {ms:.2f} ms x{n}"
                                                      for name, ms, n in rec["expert_kernels"]))
    if rec.get("gemm_configs"):
        parts.append("tuned: " + "; ".join(rec["gemm_configs"]))
    if rec["train_loss"] is not None:
        parts.append(f"loss {rec['train_loss']:.4f}")
    if rec["val_loss"] is not None:
        parts.append(f"held-out {rec['val_loss']:.4f}")
    return " | ".join(parts)


# ------------------------------------------------------------------------------ the preset


def add_train_arguments(parser) -> None:
    from .train_model import DEFAULT_TRAIN_VARIANTS, TRAIN_VARIANTS

    g = parser.add_argument_group("--preset train (a Megatron-core MoE GPT trained on one device)")
    g.add_argument("--train-configs", type=_csv, default=["expert-dominated", "moderate"],
                   help="comma list of expert-dominated,moderate (see docs/benchmarks.md)")
    g.add_argument("--variants", "--train-variants", dest="variants", type=_csv, default=list(DEFAULT_TRAIN_VARIANTS),
                   help=f"comma list of {','.join(TRAIN_VARIANTS)} (default {','.join(DEFAULT_TRAIN_VARIANTS)}; "
                        "the fine-grained fp8-blockwise and fp8-mxfp8 are opt-in)")
    g.add_argument("--train-main-grad", action="store_true",
                   help="as under Megatron's DDP: float32 main_grad buffers, gradient_accumulation_fusion on for "
                        "turbo_moe's expert linears (their wgrad adds into main_grad; the FP8 weight cache follows "
                        "Megatron's first-micro-batch flag)")
    g.add_argument("--train-steps", type=int, default=None,
                   help="optimizer steps of the loss-curve configs (moderate); default 200 (cpu 4)")
    g.add_argument("--timed-steps", type=int, default=None, help="timed steps of the other configs; default 30 (cpu 2)")
    g.add_argument("--warmup-steps", type=int, default=None,
                   help="first steps left out of the step time (compile, autotune); default 5 (cpu 1)")
    g.add_argument("--micro-batches", type=int, default=4, help="micro-batches of gradient accumulation per step")
    g.add_argument("--train-rounds", type=int, default=1,
                   help="run the variants this many times in turn (bf16, fp8, bf16, fp8, ...), each round's ratios "
                        "against its own bf16 run, and report their medians: a host-bound step drifts between "
                        "minutes by more than a kernel change")
    g.add_argument("--eval-interval", type=int, default=None, help="held-out loss every N steps; default 50 (cpu 2)")
    g.add_argument("--eval-batches", type=int, default=None, help="held-out micro-batches per evaluation; default 8 (cpu 1)")
    g.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (linear warm-up over 10%% of the steps)")
    g.add_argument("--corpus-bytes", type=int, default=None, help="bytes of stdlib source read; default 16 MiB (cpu 1 MiB)")
    g.add_argument("--train-override", action="append", default=[], metavar="CONFIG.FIELD=VALUE",
                   help="change a config, e.g. expert-dominated.mbs=64 (repeatable)")
    g.add_argument("--no-profile", dest="profile", action="store_false", help="skip the profiled step (expert share)")
    g.add_argument("--host-profile", type=int, default=0, metavar="N",
                   help="also cProfile N more optimizer steps per variant and print the functions by own time "
                        "(where a host-bound step's Python goes)")


def _csv(value: str) -> List[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


# (GPU, CPU) defaults of the step counts and corpus size; --preset issue10 passes shorter ones.
TRAIN_DEFAULTS = dict(train_steps=(200, 4), timed_steps=(30, 2), warmup_steps=(5, 1), eval_interval=(50, 2),
                      eval_batches=(8, 1), corpus_bytes=(16 << 20, 1 << 20))


def finish_train_args(args, parser, defaults: Optional[dict] = None) -> None:
    """Fill the unset step counts from ``defaults`` (:data:`TRAIN_DEFAULTS`) and check the values."""
    from .train_model import CPU_CONFIGS, TRAIN_VARIANTS

    on_gpu = args.device.startswith("cuda")
    defaults = TRAIN_DEFAULTS if defaults is None else defaults
    for key, (gpu, cpu) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, gpu if on_gpu else cpu)
    for key in ("train_steps", "timed_steps", "micro_batches", "eval_interval", "eval_batches", "train_rounds"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be >= 1")
    if args.warmup_steps < 0:
        parser.error("--warmup-steps must be >= 0")
    for name, allowed in (("train_configs", CPU_CONFIGS), ("variants", TRAIN_VARIANTS)):
        bad = [v for v in getattr(args, name) if v not in allowed]
        if bad or not getattr(args, name):
            parser.error(f"--{name.replace('_', '-')}: {', '.join(bad) or 'empty'} not in {', '.join(allowed)}")
    if len(args.backends) != 1:
        parser.error("--preset train takes one --backends value")
    try:
        from .train_model import apply_overrides

        apply_overrides(CPU_CONFIGS, args.train_override)
    except ValueError as exc:
        parser.error(str(exc))


def _selected_configs(args) -> List[TrainConfig]:
    from .train_model import CPU_CONFIGS, GPU_CONFIGS, apply_overrides

    configs = apply_overrides(GPU_CONFIGS if args.device.startswith("cuda") else CPU_CONFIGS, args.train_override)
    return [configs[name] for name in args.train_configs]


def list_train_preset(args) -> int:
    rounds = getattr(args, "train_rounds", 1)
    for cfg in _selected_configs(args):
        steps = args.train_steps if cfg.loss_curve else args.warmup_steps + args.timed_steps
        print(f"{cfg.name:18s} {steps} steps x {', '.join(args.variants)}{f' x {rounds} rounds' if rounds > 1 else ''}: "
              f"{cfg.describe(args.micro_batches)}")
    return 0


def run_train_preset(args, meta: dict, progress=print) -> int:
    """Every selected (config, variant); results rewritten after each. Returns the exit status."""
    import os
    import signal
    import warnings

    from .report import notes, plot_loss_curves, train_rounds_table, train_table, write_outputs
    from .text_corpus import load_corpus
    from .train_model import megatron_world

    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    selected = _selected_configs(args)
    meta["configs"] = {c.name: c.describe(args.micro_batches) for c in selected}
    meta["timing"] = (
        "step: CUDA events around each optimizer step, steps issued back to back, median after the warm-up "
        "steps; host: host clock around the same steps (no synchronization added); experts: one profiled step"
        if on_gpu else "host clock per step (CPU smoke mode: the numbers mean nothing)")
    records: List[dict] = []
    started = time.monotonic()
    deadline = None if args.time_budget is None else started + args.time_budget
    fatal = None

    def on_sigterm(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        corpus = load_corpus(args.corpus_bytes)
        meta["corpus"] = corpus.describe()
        progress(f"# {meta['device']} | {meta['corpus']}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with megatron_world(device, seed=args.seed):
                for cfg in selected:
                    progress(f"[{cfg.name}] {meta['configs'][cfg.name]}")
                    init_states: Dict[str, dict] = {}
                    rounds = getattr(args, "train_rounds", 1)
                    for round_ in range(rounds):
                        if rounds > 1:
                            progress(f"  round {round_ + 1} of {rounds}")
                        for variant in args.variants:
                            if deadline is not None and time.monotonic() > deadline:
                                records.append(dict(level="train", case=f"train {cfg.name}", config=cfg.name, op="step",
                                                    impl=variant, status="skipped", reason="time budget spent",
                                                    round=round_))
                                continue
                            rec = train_variant(cfg, variant, corpus, args, device, init_states, deadline, progress)
                            rec["round"] = round_
                            records.append(rec)
                            meta["elapsed_s"] = round(time.monotonic() - started, 1)
                            write_outputs(args.out, meta, records)
    except KeyboardInterrupt as exc:
        fatal = f"interrupted ({exc or 'KeyboardInterrupt'}); results so far are kept"
    except Exception as exc:  # megatron-core missing, a dead CUDA context: keep what was measured
        fatal = f"{type(exc).__name__}: {exc}"
    finally:
        signal.signal(signal.SIGTERM, previous)
        meta["elapsed_s"] = round(time.monotonic() - started, 1)
        if fatal:
            meta["aborted"] = fatal
        why_no_plot = plot_loss_curves(os.path.join(args.out, "results.png"), records, title=meta.get("device_name", ""))
        if why_no_plot:
            meta["plot"] = why_no_plot
        paths = write_outputs(args.out, meta, records)
    lines = train_table(records)
    if lines:
        progress("\n" + "\n".join(lines))
    lines = train_rounds_table(records)
    if lines:
        progress("\nOver the rounds (median of each round's ratio to its own bf16 run; range):\n" + "\n".join(lines))
    for line in notes(records):
        progress(line)
    if fatal:
        print(f"ABORTED: {fatal}", flush=True)
    progress(f"results: {', '.join(sorted(paths.values()))}" + ("" if meta.get("plot") else f", {os.path.join(args.out, 'results.png')}"))
    return 1 if fatal or any(r["status"] == "error" for r in records) else 0
