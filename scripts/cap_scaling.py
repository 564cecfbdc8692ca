"""Capped kernels that scale (issue 11, item 3): time(num_cu) of the three grouped GEMMs.

For each kernel (fwd, dgrad, wgrad) of each shape, times the turbo_moe backend's kernel alone on
FP8 operands prepared once (the kernel-level benchmark's inputs and launch: ``prepare_case``,
``turbo_impl``; CUDA events, L2 flushed, median) at caps from all SMs down to a quarter, and
judges with ``turbo_moe.bench.cap_verdicts.scaling_verdict``:

* monotone non-increasing in the cap within ``--noise`` (default 5%);
* time(k) <= 1.1 x time(all) x SMs / k at caps k >= SMs / 2.

    python scripts/cap_scaling.py --out $OUT            # one GPU; prints a table and CAP_SCALING PASS/FAIL
    python scripts/cap_scaling.py --cpu                  # tiny shapes, torch backend: the logic only

Writes cap_scaling.json / cap_scaling.md (and cap_scaling.png with matplotlib) under --out.
Exit status 0 only when every kernel of every shape passes both checks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from turbo_moe.bench.cap_verdicts import scaling_verdict  # noqa: E402
from turbo_moe.bench.kernel_level import KERNEL_OPS, prepare_case, turbo_impl  # noqa: E402
from turbo_moe.bench.shapes import Case, make_group_sizes  # noqa: E402
from turbo_moe.bench.timing import median_ms  # noqa: E402

# (model, experts, tokens/expert): the EP shape (16 local experts, DeepSeek-V3 fc2-sized,
# 16k tokens) and a many-small-experts one.
GPU_SHAPES = (("deepseek-v3", "fc1", 16, 1024), ("qwen3-235b", "fc1", 32, 512))
CPU_SHAPES = (("tiny", "fc1", 4, 48),)


def caps_for(num_sms: int, count: int) -> list:
    """All SMs, then evenly spaced even caps down to a quarter of the SMs (half and the rule's cap included)."""
    from turbo_moe import num_cu_for_comm

    caps = {num_sms, num_sms // 2, num_sms // 4, num_cu_for_comm(num_sms=num_sms, env={})}
    step = max(2, (num_sms - num_sms // 4) // max(1, count - 1) // 2 * 2)
    caps.update(range(num_sms, num_sms // 4, -step))
    return sorted((c for c in caps if c >= 1), reverse=True)


def measure(args, device, num_sms):
    rows = []
    for model, layer, experts, tpe in (CPU_SHAPES if args.cpu else GPU_SHAPES):
        case = Case(model, layer, experts, tpe, "balanced", tuple(make_group_sizes(experts, tpe, "balanced")))
        inputs = prepare_case(case, device, seed=0)
        for op in KERNEL_OPS:
            impls = {cap: turbo_impl(inputs[op], args.backend, "tensorwise", None if cap == num_sms else cap)
                     for cap in caps_for(num_sms, args.points)}
            for impl in impls.values():  # compile / tune every cap first: no first-call cost in any timing
                impl.fn()
            times = {cap: median_ms(impl.fn, device, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
                     for cap, impl in impls.items()}
            verdict = scaling_verdict(times, num_sms, noise=args.noise)
            rows.append({"case": case.name, "op": op, "times_ms": times, "monotone": verdict.monotone,
                         "bounded": verdict.bounded, "problems": verdict.problems})
            print(f"{case.name} {op}: " + " ".join(f"{c}:{t:.3f}" for c, t in sorted(times.items(), reverse=True))
                  + f" | monotone {verdict.monotone} bounded {verdict.bounded}", flush=True)
            for p in verdict.problems:
                print("   ", p)
        del inputs
    return rows


def write(args, rows, num_sms, device_name):
    os.makedirs(args.out, exist_ok=True)
    lines = [f"# Capped-kernel scaling ({device_name}, {num_sms} SMs, backend {args.backend}, "
             f"TURBO_MOE_TRITON_AUTOTUNE={os.environ.get('TURBO_MOE_TRITON_AUTOTUNE', '(default)')})", "",
             "| case | op | " + " | ".join(f"cap {c}" for c in sorted(rows[0]["times_ms"], reverse=True))
             + " | monotone | <= 1.1 x SMs/k |", "|" + "---|" * (4 + len(rows[0]["times_ms"]))]
    for r in rows:
        t = r["times_ms"]
        lines.append(f"| {r['case']} | {r['op']} | " + " | ".join(f"{t[c]:.3f}" for c in sorted(t, reverse=True))
                     + f" | {'yes' if r['monotone'] else 'NO'} | {'yes' if r['bounded'] else 'NO'} |")
    ok = all(r["monotone"] and r["bounded"] for r in rows)
    lines += ["", f"CAP_SCALING {'PASS' if ok else 'FAIL'}"]
    text = "\n".join(lines) + "\n"
    print(text)
    with open(os.path.join(args.out, "cap_scaling.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "cap_scaling.json"), "w") as f:
        json.dump({"sms": num_sms, "device": device_name, "rows": rows}, f, indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.5))
        for r in rows:
            caps = sorted(r["times_ms"])
            full = r["times_ms"][num_sms]
            ax.plot(caps, [r["times_ms"][c] / full for c in caps], "o-", label=f"{r['case']} {r['op']}")
        xs = list(range(num_sms // 2, num_sms + 1))
        ax.plot(xs, [1.1 * num_sms / k for k in xs], "k--", label="1.1 x SMs/k")
        ax.set(xlabel="num_cu", ylabel="time / time(all SMs)", title="capped kernel scaling")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, "cap_scaling.png"), dpi=110)
    except ImportError:
        pass
    return ok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="cap_scaling_out")
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--backend", default=None)
    p.add_argument("--points", type=int, default=8, help="caps between all SMs and a quarter of them")
    p.add_argument("--noise", type=float, default=0.05)
    p.add_argument("--warmup-ms", type=float, default=25.0)
    p.add_argument("--rep-ms", type=float, default=100.0)
    args = p.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        p.error("no CUDA device: run with --cpu")
    args.backend = args.backend or ("torch" if args.cpu else "triton")
    device = torch.device("cpu" if args.cpu else "cuda")
    num_sms = 8 if args.cpu else torch.cuda.get_device_properties(device).multi_processor_count
    rows = measure(args, device, num_sms)
    ok = write(args, rows, num_sms, "cpu" if args.cpu else torch.cuda.get_device_name(device))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
