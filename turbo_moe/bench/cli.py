"""``python -m turbo_moe.bench``: turbo_moe's grouped GEMMs against the torch/CUTLASS/torchao peers.

See docs/benchmarks.md. Every measured output is first checked against a float32 reference
(``--no-check`` skips that); results go to ``--out`` as results.{md,json,csv,png}, rewritten after
every case so that a run cut short (``--time-budget``, SIGTERM) still leaves its numbers.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import os
import platform
import shlex
import signal
import sys
import time
from typing import List, Optional, Sequence, Tuple

import torch

from . import data
from .issue10 import (
    E2E_BUDGET_SHARE, ISSUE10_BUDGET_S, ISSUE10_GRANULARITIES, ISSUE10_PEERS, ISSUE10_REP_MS, ISSUE10_TRAIN_DEFAULTS,
    ISSUE10_WARMUP_MS, e2e_targets, issue10_entries,
)
from .end_to_end import E2E_EXTRAS, E2E_PEERS, e2e_impls, hot_path_metrics, prepare_e2e, reference_errors
from .kernel_level import KERNEL_OPS, KERNEL_PEERS, Missing, kernel_impls, prepare_case
from .recipes import RECIPES
from .report import e2e_hot_path_table, e2e_table, kernel_table, notes, plot, write_outputs
from .shapes import CPU_EXPERTS, GPU_EXPERTS, GPU_MODELS, LAYERS, ROUTINGS, Case, build_cases, make_group_sizes, parse_experts
from .timing import median_ms, synchronize
from .train_step import add_train_arguments, finish_train_args, list_train_preset, run_train_preset

__all__ = ["main", "parse_args", "select_cases"]

# --quick: a couple of shapes covering few/many experts and balanced/skewed/ragged routing.
QUICK_GPU = (
    ("deepseek-v3", "fc1", (8, 4096), "balanced"),
    ("deepseek-v3", "fc1", (8, 4096), "skewed"),
    ("gpt-oss", "fc2", (32, 512), "balanced"),
    ("qwen3-235b", "fc1", (128, 128), "dirichlet"),
)
QUICK_CPU = (
    ("tiny", "fc1", (4, 48), "balanced"),
    ("tiny", "fc2", (16, 16), "dirichlet"),
)
# --preset peers: the shapes of docs/results/h100_peers_baseline.md's kernel-level table (model, layer,
# experts), each balanced, then skewed, then with a ragged Dirichlet routing.
PEERS_SHAPES = (
    ("deepseek-v3", "fc1", 8), ("deepseek-v3", "fc2", 8), ("qwen3-235b", "fc1", 8), ("gpt-oss", "fc1", 8),
    ("deepseek-v3", "fc1", 32), ("deepseek-v3", "fc2", 32), ("qwen3-235b", "fc2", 32), ("gpt-oss", "fc2", 32),
    ("deepseek-v3", "fc1", 128), ("gpt-oss", "fc2", 128),
)
PEERS_ROUTINGS = ("balanced", "skewed", "dirichlet")

# Relative-error bounds against the float32 reference. Kernel level: the operands are already FP8,
# so only accumulation order and the bf16 output rounding remain. End to end: quantizing both
# operands of each GEMM (3 mantissa bits for e4m3, 2 for e5m2 gradients) dominates.
KERNEL_TOL = 1e-2
E2E_TOL = {"e4m3": 0.08, "hybrid": 0.15}


class _Terminated(Exception):
    pass


def _csv(value: str) -> List[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m turbo_moe.bench",
        description="Benchmark turbo_moe's FP8 grouped GEMMs (kernel level and end to end) against peers.",
    )
    p.add_argument("--device", default=None, help="cuda (default when a GPU is visible) or cpu (smoke mode, tiny shapes)")
    p.add_argument("--quick", action="store_true", help="a couple of representative shapes (same as --preset quick)")
    p.add_argument("--preset", choices=["quick", "peers", "full", "train", "issue10"], default=None,
                   help="quick: a couple of shapes; peers: the shapes of PEERS_H100.md x balanced/skewed/dirichlet; "
                        "full (default): every model x layer x experts x routing; train: a Megatron-core MoE GPT "
                        "trained with each expert implementation (see the --preset train options); issue10: "
                        "issue 10's closing-note measurements in one run (end to end at the bench shapes with every "
                        "hot-path measurement, then a shortened training step; ~6 min on an H100)")
    p.add_argument("--models", type=_csv, default=None, help="comma list of deepseek-v3,qwen3-235b,gpt-oss (tiny on cpu)")
    p.add_argument("--layers", type=_csv, default=None, help="comma list of fc1,fc2")
    p.add_argument(
        "--experts", type=parse_experts, default=None,
        help="comma list of EXPERTS[:TOKENS_PER_EXPERT] (default 8:4096,32:512,128:128; cpu 4:48,16:16)",
    )
    p.add_argument("--routings", type=_csv, default=None, help=f"comma list of {','.join(ROUTINGS)}")
    p.add_argument("--levels", type=_csv, default=["kernel", "e2e"], help="kernel,e2e")
    p.add_argument("--ops", type=_csv, default=list(KERNEL_OPS), help="kernel-level ops: fwd,dgrad,wgrad")
    p.add_argument("--backends", type=_csv, default=["auto"], help="turbo_moe backends: auto,triton,flydsl,torch")
    p.add_argument(
        "--peers", type=_csv, default=list(KERNEL_PEERS) + [p for p in E2E_PEERS if p not in KERNEL_PEERS],
        help="cutlass_fp8,bf16,dense_fp8 (kernel level), bf16,torchao_fp8 (end to end); 'none' for turbo_moe alone",
    )
    p.add_argument("--kernel-scales", choices=["rowwise", "tensorwise"], default="rowwise",
                   help="scale granularity of turbo_moe's kernel-level problems (the peers are rowwise)")
    p.add_argument("--granularity", type=_csv, default=["tensorwise", "tensorwise+wcache", "rowwise"],
                   help="Float8Config granularities of the end-to-end turbo_moe layer (tensorwise, rowwise, blockwise, mxfp8, "
                        "tensorwise-delayed: delayed scaling, a 16-cast amax history); "
                        "'+wcache' builds it with "
                        "cache_fp8_weight=True (the weight, unchanged between steps here, is quantized once)")
    p.add_argument("--format", choices=["e4m3", "hybrid"], default=None,
                   help="Float8Config format end to end (default e4m3) and in --preset train (default hybrid)")
    p.add_argument("--e2e-extras", type=_csv, default=list(E2E_EXTRAS),
                   help="end-to-end hot-path measurements: host (µs to issue a fwd+bwd), launches (GPU launches "
                        "per fwd+bwd), graph (CUDA-graph replay), microbatch (per micro-batch of a 4-micro-batch "
                        "step); 'none' for none")
    p.add_argument("--num-cu", type=int, default=None, help="cap turbo_moe's persistent grid at this many SMs/CUs")
    p.add_argument("--align", type=int, default=16, help="group sizes are multiples of this (CUTLASS FP8 wants 16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup-ms", type=float, default=None, help="do_bench warm-up (default 25 on GPU)")
    p.add_argument("--rep-ms", type=float, default=None, help="do_bench timed repetitions (default 100 on GPU)")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds; start no new case after this (the rest is listed as skipped)")
    p.add_argument("--no-check", action="store_true", help="skip the float32 reference check of every output")
    p.add_argument("--out", default="bench_out", help="output folder for results.{md,json,csv,png}")
    p.add_argument("--list", action="store_true", help="print the selected cases and exit")
    add_train_arguments(p)
    args = p.parse_args(argv)

    if args.quick:
        if args.preset not in (None, "quick"):
            p.error("--quick contradicts --preset " + args.preset)
        args.preset = "quick"
    args.preset = args.preset or "full"
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is visible to torch (use --device cpu for the smoke mode)")
    args.train_format = args.format or "hybrid"  # --preset issue10's training part
    if args.format is None:
        args.format = "hybrid" if args.preset == "train" else "e4m3"
    if args.preset == "issue10":
        _issue10_defaults(args, p)
    if args.e2e_extras == ["none"]:
        args.e2e_extras = []
    for name, allowed in (("levels", ("kernel", "e2e")), ("ops", KERNEL_OPS),
                          ("granularity", [g + c for g in RECIPES for c in ("", "+wcache")]),
                          ("e2e_extras", E2E_EXTRAS)):
        bad = [v for v in getattr(args, name) if v not in allowed]
        if bad:
            p.error(f"--{name}: {', '.join(bad)} not in {', '.join(allowed)}")
    if args.peers == ["none"]:
        args.peers = []
    bad = [v for v in args.peers if v not in KERNEL_PEERS + E2E_PEERS]
    if bad:
        p.error(f"--peers: {', '.join(bad)} not in {', '.join(dict.fromkeys(KERNEL_PEERS + E2E_PEERS))}")
    if args.align < 1:
        p.error("--align must be >= 1")
    if args.num_cu is not None and args.num_cu < 1:
        p.error("--num-cu must be >= 1")
    on_gpu = args.device.startswith("cuda")
    if args.warmup_ms is None:
        args.warmup_ms = 25.0 if on_gpu else 1.0
    if args.rep_ms is None:
        args.rep_ms = 100.0 if on_gpu else 20.0
    if args.preset == "train":
        finish_train_args(args, p)
    if args.preset == "issue10":
        finish_train_args(args, p, ISSUE10_TRAIN_DEFAULTS)
    return args


def _issue10_defaults(args: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    """--preset issue10: its own defaults where the command line left the sweep's."""
    on_gpu = args.device.startswith("cuda")
    for key, value in (("levels", ["e2e"]), ("granularity", ISSUE10_GRANULARITIES),
                       ("peers", ISSUE10_PEERS), ("e2e_extras", list(E2E_EXTRAS))):
        if getattr(args, key) == p.get_default(key):
            setattr(args, key, list(value))
    if on_gpu:
        args.warmup_ms = ISSUE10_WARMUP_MS if args.warmup_ms is None else args.warmup_ms
        args.rep_ms = ISSUE10_REP_MS if args.rep_ms is None else args.rep_ms
        args.time_budget = ISSUE10_BUDGET_S if args.time_budget is None else args.time_budget


def _preset_entries(args: argparse.Namespace):
    on_gpu = args.device.startswith("cuda")
    if args.preset == "quick":
        return list(QUICK_GPU if on_gpu else QUICK_CPU)
    if args.preset == "issue10":
        return issue10_entries(on_gpu)
    if not on_gpu:  # the peers' shapes are GPU-sized; the CPU smoke mode has its tiny ones
        return [("tiny", layer, ex, r) for r in PEERS_ROUTINGS for ex in CPU_EXPERTS for layer in LAYERS]
    tokens = dict(GPU_EXPERTS)
    return [(m, layer, (e, tokens[e]), r) for r in PEERS_ROUTINGS for m, layer, e in PEERS_SHAPES]


def select_cases(args: argparse.Namespace) -> List[Case]:
    """The preset's cases; --models/--layers/--experts/--routings narrow a preset, or span the full sweep."""
    on_gpu = args.device.startswith("cuda")
    if args.preset in ("quick", "peers", "issue10"):
        cases = []
        for model, layer, (experts, tpe), routing in _preset_entries(args):
            if args.models and model not in args.models:
                continue
            if args.layers and layer not in args.layers:
                continue
            if args.experts and experts not in {e for e, _ in args.experts}:
                continue
            if args.routings and routing not in args.routings:
                continue
            sizes = make_group_sizes(experts, tpe, routing, args.seed, args.align)
            cases.append(Case(model, layer, experts, tpe, routing, tuple(sizes)))
        return cases
    return build_cases(
        args.models or (list(GPU_MODELS) if on_gpu else ["tiny"]),
        args.layers or list(LAYERS),
        args.experts or list(GPU_EXPERTS if on_gpu else CPU_EXPERTS),
        args.routings or list(ROUTINGS),
        args.seed,
        args.align,
    )


def _environment(device: torch.device) -> dict:
    meta = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m turbo_moe.bench " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
    }
    try:
        import triton

        meta["triton"] = triton.__version__
    except Exception as exc:
        meta["triton"] = f"not importable ({type(exc).__name__})"
    try:
        import turbo_moe

        meta["turbo_moe"] = turbo_moe.__version__
        meta["backends"] = turbo_moe.available_backends()
    except Exception as exc:  # reported, the peers still run
        meta["turbo_moe"] = f"not importable: {type(exc).__name__}: {exc}"
    if device.type == "cuda":
        from turbo_moe.backends.triton_backend import ptxas_description

        meta["ptxas"] = ptxas_description()  # Triton 3.6's own is 12.8: its code differs from 12.9+'s
        props = torch.cuda.get_device_properties(device)
        meta["device_name"] = props.name
        meta["device"] = f"{props.name}, {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB"
    else:
        meta["device_name"] = f"cpu {platform.machine()}"
        meta["device"] = f"cpu {platform.machine()}, {os.cpu_count()} cores"
    return meta


def _progress(msg: str) -> None:
    print(msg, flush=True)


def _check_device_alive(device: torch.device) -> None:
    """After an error, a failing synchronize means the CUDA context is gone: stop the run."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _run_kernel_case(case: Case, args, device: torch.device, records: list, label: str) -> None:
    inputs = prepare_case(case, device, args.seed)
    flops = 2.0 * case.m * case.n * case.k
    try:
        for op in args.ops:
            op_inputs = inputs[op]
            for name, impl in kernel_impls(op_inputs, args.backends, args.peers, args.kernel_scales, args.num_cu):
                rec = dict(case.as_dict(), level="kernel", op=op, impl=name, status="ok", ms=None, tflops=None,
                           rel_err=None, reason="")
                records.append(rec)
                if isinstance(impl, Missing):
                    rec.update(status="missing", reason=str(impl))
                    continue
                try:
                    if not args.no_check and impl.reference is not None:
                        data.poison_allocator(impl.out_numel, impl.out_dtype, device)
                        out = impl.fn()
                        synchronize(device)
                        rec["rel_err"] = data.grouped_reference_error(*impl.reference, op_inputs.offs_host, out)
                        del out
                    ms = median_ms(impl.fn, device, args.warmup_ms, args.rep_ms)
                    rec.update(ms=ms, tflops=flops / (ms * 1e-3) / 1e12)
                    if rec["rel_err"] is not None and not rec["rel_err"] <= KERNEL_TOL:
                        rec.update(status="wrong", reason=f"rel err {rec['rel_err']:.3g} > {KERNEL_TOL}")
                except Exception as exc:
                    rec.update(status="error", reason=f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
                    _check_device_alive(device)
                err = "" if rec["rel_err"] is None else f" err {rec['rel_err']:.1e}"
                timing = f"{rec['ms']:.3f} ms {rec['tflops']:7.1f} TF" if rec["ms"] is not None else rec["reason"][:120]
                _progress(f"{label} kernel {op:5s} {name:14s} {rec['status']:7s} {timing}{err}")
    finally:
        del inputs
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _resolved_turbo_label(name: str) -> str:
    """``turbo:auto:<granularity>`` -> ``turbo:<backend that ran>:<granularity>`` (fwd, dgrad, wgrad)."""
    from turbo_moe.backends import recent_dispatches

    chosen = list(dict.fromkeys(r.chosen for r in recent_dispatches()[-3:]))
    return name.replace(":auto:", ":" + "+".join(chosen) + ":") if chosen else name


# Calls before the measured one: the first compiles and tunes, the second records turbo_moe's host
# launch plans (turbo_moe/host_plan.py): the peak memory and errors are a steady-state call's.
_WARM_CALLS = 2


def _activation_input_peak_mb(step, device: torch.device) -> float:
    """Peak MB of one fwd+bwd whose x and dy are activations (``end_to_end``'s module docstring)."""
    _release_device_memory(device)
    torch.cuda.reset_peak_memory_stats(device)
    outs = step.on_activation()
    synchronize(device)
    del outs
    return torch.cuda.max_memory_allocated(device) / 2**20


def _run_e2e_case(case: Case, args, device: torch.device, records: list, label: str) -> None:
    inputs = prepare_e2e(case, device, args.seed)
    flops = 6.0 * case.m * case.n * case.k
    tol = E2E_TOL[args.format]
    peers = [p for p in args.peers if p in E2E_PEERS]
    impls = e2e_impls(inputs, args.backends, args.granularity, args.format, peers, args.num_cu)
    try:
        while impls:
            # Each implementation is dropped once measured: a layer's FP8 weight cache (made by its
            # first call) must not stay allocated into the next one's peak memory. Steps not yet
            # called hold no device memory (layers are built on the meta device).
            name, step = impls.pop(0)
            _release_device_memory(device)
            rec = dict(case.as_dict(), level="e2e", op="fwd+bwd", impl=name, status="ok", ms=None, tflops=None,
                       err_y=None, err_dx=None, err_dw=None, peak_mb=None, peak_act_mb=None, extra_mb=None, host_us=None,
                       launches=None, graph_ms=None, mb4_ms=None, mb1_ms=None, reason="")
            records.append(rec)
            if isinstance(step, Missing):
                rec.update(status="missing", reason=str(step))
                continue
            try:
                for _ in range(_WARM_CALLS):  # compile / autotune, then turbo_moe's host-plan recording
                    step()  # its outputs are dropped at once
                if name.startswith("turbo:auto:"):
                    rec["impl"] = name = _resolved_turbo_label(name)
                synchronize(device)
                if device.type == "cuda":
                    _release_device_memory(device)
                    torch.cuda.reset_peak_memory_stats(device)
                    before = torch.cuda.memory_allocated(device)
                y, dx, dw = step()
                synchronize(device)
                if device.type == "cuda":
                    peak = torch.cuda.max_memory_allocated(device)
                    rec.update(peak_mb=peak / 2**20, extra_mb=(peak - before) / 2**20)
                    rec["peak_act_mb"] = _activation_input_peak_mb(step, device)
                if not args.no_check:
                    errs = reference_errors(inputs, y, dx, dw)
                    rec.update(err_y=errs["y"], err_dx=errs["dx"], err_dw=errs["dw"])
                del y, dx, dw
                ms = median_ms(step, device, args.warmup_ms, args.rep_ms)
                rec.update(ms=ms, tflops=flops / (ms * 1e-3) / 1e12)
                if args.e2e_extras:
                    rec.update(hot_path_metrics(name, step, inputs, device, args.e2e_extras, ms,
                                                args.warmup_ms, args.rep_ms))
                if not args.no_check:
                    worst = max(rec["err_y"], rec["err_dx"], rec["err_dw"])
                    if not worst <= tol:
                        rec.update(status="wrong", reason=(
                            f"rel err y {rec['err_y']:.3g} dx {rec['err_dx']:.3g} dW {rec['err_dw']:.3g} > {tol}"))
            except Exception as exc:
                rec.update(status="error", reason=f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
                _check_device_alive(device)
            timing = f"{rec['ms']:.3f} ms {rec['tflops']:7.1f} TF" if rec["ms"] is not None else rec["reason"][:120]
            mem = (f" peak {rec['peak_mb']:.0f} MB (x and dy activations: {rec['peak_act_mb']:.0f})"
                   if rec["peak_mb"] is not None else "")
            errs = (f" err y/dx/dW {rec['err_y']:.1e}/{rec['err_dx']:.1e}/{rec['err_dw']:.1e}"
                    if rec["err_y"] is not None else "")
            hot = "".join(f" {label_} {rec[key]:{fmt}}" for key, label_, fmt in (
                ("host_us", "host µs", ".0f"), ("launches", "launches", "d"), ("graph_ms", "graph ms", ".3f"),
                ("mb4_ms", "ms/µb of 4", ".3f")) if rec.get(key) is not None)
            _progress(f"{label} e2e    {name:24s} {rec['status']:7s} {timing}{mem}{errs}{hot}")
    finally:
        del inputs, impls
        step = None  # this frame's last reference to the last implementation: freed before the release
        _release_device_memory(device)


def _release_device_memory(device: torch.device) -> None:
    """Free what nothing references any more (the previous implementation's layer and caches)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if args.preset == "train":
        if args.list:
            return list_train_preset(args)
        return _run_train(args, device)
    if args.preset == "issue10":
        return _run_issue10(args, device)
    cases = select_cases(args)
    if args.list:
        for case in cases:
            print(f"{case.name:44s} M={case.m} N={case.n} K={case.k} {case.routing_summary()}")
        return 0
    if not cases:
        print("no case matches the selection", file=sys.stderr)
        return 2
    return _run_cases(args, cases, device)[0]


def _run_train(args: argparse.Namespace, device: torch.device) -> int:
    meta = _environment(device)
    meta["args"] = {k: v for k, v in vars(args).items()}
    return run_train_preset(args, meta, _progress)


def _run_issue10(args: argparse.Namespace, device: torch.device) -> int:
    """End to end at the bench shapes (``--out``), then the shortened training step (``--out``/train),
    within one ``--time-budget`` (the end-to-end part starts no case after E2E_BUDGET_SHARE of it)."""
    started = time.monotonic()
    e2e_args = copy.copy(args)
    e2e_args.time_budget = None if args.time_budget is None else args.time_budget * E2E_BUDGET_SHARE
    train_args = copy.copy(args)
    train_args.format, train_args.out = args.train_format, os.path.join(args.out, "train")
    if args.list:
        for case in select_cases(args):
            print(f"e2e   {case.name:44s} M={case.m} N={case.n} K={case.k} {case.routing_summary()}")
        return list_train_preset(train_args)
    rc, interrupted = _run_cases(e2e_args, select_cases(args), device)
    if interrupted:
        return rc
    if args.time_budget is not None:
        train_args.time_budget = max(args.time_budget - (time.monotonic() - started), 0.0)
    _progress(f"\n# training step ({time.monotonic() - started:.0f} s so far) -> {train_args.out}")
    return max(rc, _run_train(train_args, device))


def _run_cases(args: argparse.Namespace, cases: List[Case], device: torch.device) -> Tuple[int, bool]:
    """Kernel-level and end-to-end cases; returns (exit status, interrupted by a signal)."""
    meta = _environment(device)
    meta["args"] = {k: v for k, v in vars(args).items()}
    meta["timing"] = (
        f"triton.testing.do_bench median, warm-up {args.warmup_ms:g} ms, {args.rep_ms:g} ms of repetitions, "
        "L2 flushed before every call" if device.type == "cuda" else "host clock, median of a few calls"
    )
    meta["skipped_cases"] = []
    records: List[dict] = []
    started = time.monotonic()

    def on_sigterm(signum, frame):
        raise _Terminated(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    print(f"# {meta['device']} | torch {meta['torch']} | triton {meta['triton']} | {len(cases)} cases -> {args.out}",
          flush=True)
    fatal = None
    interrupted = False
    try:
        for i, case in enumerate(cases):
            if args.time_budget is not None and time.monotonic() - started > args.time_budget:
                meta["skipped_cases"].append(case.name)
                continue
            label = f"[{i + 1}/{len(cases)}] {case.name} (M={case.m} N={case.n} K={case.k}; {case.routing_summary()})"
            _progress(label)
            case_started = time.monotonic()
            if "kernel" in args.levels:
                _run_kernel_case(case, args, device, records, f"  [{i + 1}]")
            if "e2e" in args.levels:
                _run_e2e_case(case, args, device, records, f"  [{i + 1}]")
            _progress(f"  [{i + 1}] case done in {time.monotonic() - case_started:.1f} s "
                      f"(first calls compile/autotune; {time.monotonic() - started:.0f} s so far)")
            meta["elapsed_s"] = round(time.monotonic() - started, 1)
            write_outputs(args.out, meta, records)
    except (_Terminated, KeyboardInterrupt) as exc:
        fatal = f"interrupted ({exc or type(exc).__name__}); results so far are kept"
        interrupted = True
    except Exception as exc:  # e.g. a dead CUDA context: keep what was measured
        fatal = f"{type(exc).__name__}: {exc}"
    finally:
        signal.signal(signal.SIGTERM, previous)
        meta["elapsed_s"] = round(time.monotonic() - started, 1)
        if fatal:
            meta["aborted"] = fatal
        if meta["skipped_cases"]:
            meta["note"] = f"{len(meta['skipped_cases'])} cases skipped: time budget of {args.time_budget:g} s spent"
        paths = write_outputs(args.out, meta, records)
        why_no_plot = plot(os.path.join(args.out, "results.png"), records, title=meta["device_name"])
        if why_no_plot:
            meta["plot"] = why_no_plot
            paths = write_outputs(args.out, meta, records)
    print()
    for lines in (kernel_table(records), e2e_table(records), e2e_hot_path_table(records)):
        if lines:
            print("\n".join(lines))
            print()
    if args.preset == "issue10":
        for line in e2e_targets(records):
            print(line)
    for line in notes(records):
        print(line)
    if meta.get("note"):
        print(meta["note"])
    if fatal:
        print(f"ABORTED: {fatal}", file=sys.stderr)
    print(f"results: {', '.join(sorted(paths.values()))}" + ("" if meta.get("plot") else f", {os.path.join(args.out, 'results.png')}"))
    wrong = [r for r in records if r["status"] in ("wrong", "error")]
    return (1 if fatal or wrong else 0), interrupted


if __name__ == "__main__":
    sys.exit(main())
