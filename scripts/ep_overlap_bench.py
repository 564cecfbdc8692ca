"""Expert GEMMs of chunk i beside the NCCL all-to-all of chunk i+1, swept over num_cu (issue 11).

Launch on two GPUs (every rank runs the same sweep; the all-to-all is real NCCL)::

    torchrun --standalone --nproc-per-node 2 scripts/ep_overlap_bench.py --out $OUT
    torchrun --standalone --nproc-per-node 2 scripts/ep_overlap_bench.py --cpu --out /tmp/o   # logic only (gloo)

Per rank: ``--experts`` local experts (weight [E, N, K], FP8 weight quantized once: the cached
path), ``--tokens`` tokens split into ``--chunks`` chunks, each chunk's tokens spread evenly over the
experts; the all-to-all moves ``--a2a-mb`` MB per rank in total (each chunk a share). Four
variants, each timed on the GPU with CUDA events (start and end on the compute stream, the comm
stream joined in between):

* gemm      the chunks' forward GEMMs alone (``grouped_gemm_fp8_with_offs(..., num_cu=cap)``)
* a2a       the chunks' ``all_to_all_single`` alone (on the comm stream)
* serial    per chunk: all-to-all, then its GEMMs, on one stream
* overlap   the comm stream runs a2a(0), a2a(1), ...; the compute stream runs gemm(i) once a2a(i)
            is done -- so gemm(i) co-runs with a2a(i+1)

Host-bound launches (the issue measured ~1 ms to issue 0.4 ms of GPU work) are kept out of the GPU
timing: each timed region starts behind a ``torch.cuda._sleep`` on the compute stream long enough
for the host to queue everything (``--prefill-cycles``); with ``--graph`` each variant is also captured
in a CUDA graph (NCCL included) and replayed. Every rank runs a fixed number of repetitions (the
collectives must match); times are the median over repetitions of the max over ranks.

Output under --out: ep_overlap.json, ep_overlap.md (table + verdicts), ep_overlap.png (time vs
cap per size: the four variants), and the measured best cap beside ``num_cu_for_comm``'s choice.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
# Fixed kernel configurations (as the second measurement): per-cap autotuning of every size
# would take the call's time; TURBO_MOE_TRITON_AUTOTUNE=1 in the environment turns it back on.
os.environ.setdefault("TURBO_MOE_TRITON_AUTOTUNE", "0")

from torchrun_init import init_torchrun  # noqa: E402  (this script's folder is sys.path[0])
from turbo_moe import Float8Config, num_cu_for_comm  # noqa: E402
from turbo_moe.autograd import grouped_gemm_fp8_with_offs, quantize_weight  # noqa: E402
from turbo_moe.bench.cap_verdicts import best_overlap_cap, overlap_verdict  # noqa: E402
from turbo_moe.comm_cap import comm_ctas_from_env  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="ep_overlap_out")
    p.add_argument("--cpu", action="store_true", help="gloo + torch backend, tiny shapes: checks the logic only")
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--n", type=int, default=7168)
    p.add_argument("--k", type=int, default=2048)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--a2a-mb", default="128,256,512", help="all-to-all MB per rank, comma-separated sizes")
    p.add_argument("--caps", default="all,124,116,108,100,92,84,76,66",
                   help="num_cu values ('all' = uncapped); the rule's cap is added")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--prefill-cycles", type=float, default=2e7,
                   help="GPU sleep (clock cycles; 2e7 ~ 10 ms at 2 GHz) queued before each timed region so that "
                        "the host has queued the whole region when it starts (0: none)")
    p.add_argument("--graph", action="store_true", help="also time each variant replayed from a CUDA graph")
    p.add_argument("--backend", default=None, help="turbo_moe backend (default triton on GPU, torch on CPU)")
    args = p.parse_args(argv)
    if args.cpu:
        args.experts, args.n, args.k, args.tokens = min(args.experts, 4), 64, 32, 256
        args.a2a_mb, args.reps, args.warmup, args.prefill_cycles, args.graph = "0.25", 2, 1, 0, False
    args.backend = args.backend or ("torch" if args.cpu else "triton")
    return args


class CpuTimer:
    """Wall time on the CPU run (gloo, no streams)."""

    def __init__(self):
        self.t0 = self.t1 = 0.0

    def start(self, stream=None):
        self.t0 = time.perf_counter()

    def stop(self, stream=None):
        self.t1 = time.perf_counter()

    def ms(self) -> float:
        return 1e3 * (self.t1 - self.t0)


class GpuTimer:
    """CUDA events: GPU-side time between start and stop on the compute stream."""

    def __init__(self):
        self.a, self.b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def start(self, stream):
        self.a.record(stream)

    def stop(self, stream):
        self.b.record(stream)

    def ms(self) -> float:
        self.b.synchronize()
        return self.a.elapsed_time(self.b)


class Workload:
    """One size: chunks of tokens, their offsets, the FP8-cached weight, all-to-all buffers."""

    def __init__(self, args, a2a_mb: float, device, world: int):
        gen = torch.Generator(device=device).manual_seed(1234 + dist.get_rank())  # drawn on the device: fast
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.config = Float8Config()
        self.w = torch.randn(args.experts, args.n, args.k, generator=gen, device=device).mul_(0.02).to(dtype)
        self.w_fp8 = quantize_weight(self.w, self.config, transposed=False)
        rows = args.tokens // args.chunks
        self.xs = [torch.randn(rows, args.k, generator=gen, device=device).to(dtype) for _ in range(args.chunks)]
        per_expert = torch.full((args.experts,), rows // args.experts, dtype=torch.int64)
        per_expert[-1] += rows - int(per_expert.sum())
        self.offs = torch.cat([torch.zeros(1, dtype=torch.int64), per_expert.cumsum(0)]).to(device)
        elems = max(world, int(a2a_mb * 2**20 / 2 / args.chunks) // world * world)  # bf16 elements per chunk
        self.send = [torch.randn(elems, generator=gen, device=device).to(torch.bfloat16) for _ in range(args.chunks)]
        self.recv = [torch.empty_like(s) for s in self.send]
        self.backend, self.chunks = args.backend, args.chunks

    def gemm(self, i, cap):
        return grouped_gemm_fp8_with_offs(self.xs[i], self.w, self.offs, config=self.config, num_cu=cap,
                                          backend=self.backend, w_fp8=self.w_fp8)

    def a2a(self, i):
        dist.all_to_all_single(self.recv[i], self.send[i])


def run_variant(name, work, cap, compute, comm, on_gpu):
    """Queue one variant; compute/comm are streams (None on the CPU)."""
    stream = (lambda s: torch.cuda.stream(s)) if on_gpu else (lambda s: contextlib.nullcontext())
    if name == "gemm":
        with stream(compute):
            for i in range(work.chunks):
                work.gemm(i, cap)
    elif name == "a2a":
        if on_gpu:
            comm.wait_stream(compute)
        with stream(comm):
            for i in range(work.chunks):
                work.a2a(i)
        if on_gpu:
            compute.wait_stream(comm)
    elif name == "serial":
        with stream(compute):
            for i in range(work.chunks):
                work.a2a(i)
                work.gemm(i, cap)
    elif name == "overlap":
        if not on_gpu:
            for i in range(work.chunks):
                work.a2a(i)
                work.gemm(i, cap)
            return
        comm.wait_stream(compute)
        done = [torch.cuda.Event() for _ in range(work.chunks)]
        with torch.cuda.stream(comm):
            for i in range(work.chunks):
                work.a2a(i)
                done[i].record(comm)
        with torch.cuda.stream(compute):
            for i in range(work.chunks):
                compute.wait_event(done[i])
                work.gemm(i, cap)
        compute.wait_stream(comm)
    else:
        raise ValueError(name)


def time_variant(name, work, cap, args, compute, comm, on_gpu, graph=None):
    times = []
    for rep in range(args.warmup + args.reps):
        dist.barrier()
        if on_gpu:
            torch.cuda.synchronize()
            if args.prefill_cycles > 0:
                with torch.cuda.stream(compute):
                    torch.cuda._sleep(int(args.prefill_cycles))  # the host queues the region meanwhile
        timer = GpuTimer() if on_gpu else CpuTimer()
        timer.start(compute)
        if graph is not None:
            with torch.cuda.stream(compute):
                graph.replay()
        else:
            run_variant(name, work, cap, compute, comm, on_gpu)
        timer.stop(compute)
        if rep >= args.warmup:
            times.append(timer.ms())
    t = torch.tensor(times, dtype=torch.float64)
    if on_gpu:
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slower rank decides each repetition
    return statistics.median(t.tolist())


def capture(name, work, cap, compute, comm):
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph, stream=compute):
        run_variant(name, work, cap, compute, comm, True)
    torch.cuda.synchronize()
    return graph


def sweep(args, device, on_gpu, world):
    sms = torch.cuda.get_device_properties(device).multi_processor_count if on_gpu else 132
    rule_cap = num_cu_for_comm(num_sms=sms, ep_size=world)
    caps = []
    for c in [*args.caps.split(","), str(rule_cap)]:
        c = None if c.strip() in ("all", "None") else int(c)
        c = None if c is not None and c >= sms else c
        if c not in caps:
            caps.append(c)
    compute = torch.cuda.current_stream() if on_gpu else None
    comm = torch.cuda.Stream() if on_gpu else None
    rows = []
    for mb in [float(s) for s in args.a2a_mb.split(",")]:
        work = Workload(args, mb, device, world)
        a2a_ms = time_variant("a2a", work, None, args, compute, comm, on_gpu)
        for cap in caps:
            row = {"a2a_mb": mb, "cap": cap, "a2a_ms": a2a_ms}
            for name in ("gemm", "serial", "overlap"):
                row[f"{name}_ms"] = time_variant(name, work, cap, args, compute, comm, on_gpu)
                if args.graph:
                    try:
                        g = capture(name, work, cap, compute, comm)
                        row[f"{name}_graph_ms"] = time_variant(name, work, cap, args, compute, comm, on_gpu, graph=g)
                        del g
                    except Exception as exc:  # NCCL capture needs a recent NCCL; report, keep eager times
                        row[f"{name}_graph_ms"] = None
                        row["graph_error"] = f"{type(exc).__name__}: {exc}"[:200]
            v = overlap_verdict(row["gemm_ms"], row["a2a_ms"], row["serial_ms"], row["overlap_ms"])
            row.update(ratio_to_max=v.ratio_to_max, speedup=v.speedup, ok=v.ok)
            rows.append(row)
            if dist.get_rank() == 0:
                print(f"a2a {mb:g} MB cap {cap or 'all':>4}: gemm {row['gemm_ms']:.3f} a2a {a2a_ms:.3f} serial "
                      f"{row['serial_ms']:.3f} overlap {row['overlap_ms']:.3f} ms | {v.describe()}", flush=True)
        del work
    return sms, rule_cap, caps, rows


def report(args, sms, rule_cap, rows, device_name):
    os.makedirs(args.out, exist_ok=True)
    lines = [f"# EP overlap: expert GEMMs (chunk i) beside NCCL all-to-all (chunk i+1)", "",
             f"device {device_name}, SMs {sms}, ranks {dist.get_world_size()}, experts/rank {args.experts}, "
             f"N={args.n} K={args.k}, tokens {args.tokens} in {args.chunks} chunks, FP8 tensorwise weight cached, "
             f"backend {args.backend}; GPU-side times (CUDA events, prefill {args.prefill_cycles:.0e} cycles), median of "
             f"{args.reps}, max over ranks", "",
             f"rule: num_cu_for_comm -> {rule_cap} (NCCL CTAs {comm_ctas_from_env()})", ""]
    head = "| a2a MB | cap | gemm ms | a2a ms | serial ms | overlap ms | overlap/max | serial/overlap | target |"
    lines += [head, "|" + "---|" * 9]
    for r in rows:
        lines.append(f"| {r['a2a_mb']:g} | {r['cap'] or 'all'} | {r['gemm_ms']:.3f} | {r['a2a_ms']:.3f} | "
                     f"{r['serial_ms']:.3f} | {r['overlap_ms']:.3f} | {r['ratio_to_max']:.3f} | {r['speedup']:.3f} | "
                     f"{'PASS' if r['ok'] else 'fail'} |")
    if any("gemm_graph_ms" in r for r in rows):
        lines += ["", "CUDA-graph replay (ms): gemm / serial / overlap", ""]
        for r in rows:
            g = [r.get(f"{n}_graph_ms") for n in ("gemm", "serial", "overlap")]
            lines.append(f"- {r['a2a_mb']:g} MB cap {r['cap'] or 'all'}: " + " / ".join(
                "n/a" if x is None else f"{x:.3f}" for x in g) + (f" ({r['graph_error']})" if "graph_error" in r else ""))
    lines.append("")
    for mb in sorted({r["a2a_mb"] for r in rows}):
        sub = [r for r in rows if r["a2a_mb"] == mb]
        best = best_overlap_cap({r["cap"]: r["overlap_ms"] for r in sub})
        uncapped = next((r for r in sub if r["cap"] is None), None)
        best_row = next(r for r in sub if r["cap"] == best)
        beats = uncapped is not None and best is not None and best_row["overlap_ms"] < uncapped["overlap_ms"]
        balance = min(sub[0]["a2a_ms"], best_row["gemm_ms"]) / max(sub[0]["a2a_ms"], best_row["gemm_ms"])
        lines.append(f"- {mb:g} MB: best cap {best or 'all'} (rule {rule_cap}); overlap targets "
                     f"{'PASS' if best_row['ok'] else 'FAIL'} at the best cap (overlap/max {best_row['ratio_to_max']:.3f}, "
                     f"target <= 1.15; serial/overlap {best_row['speedup']:.3f}, target >= 1.3); capped beats uncapped in overlap: {'YES' if beats else 'NO'}; "
                     f"a2a/GEMM balance {balance:.2f} (the targets apply where it is near 1)")
    md = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "ep_overlap.md"), "w") as f:
        f.write(md)
    with open(os.path.join(args.out, "ep_overlap.json"), "w") as f:
        json.dump({"sms": sms, "rule_cap": rule_cap, "device": device_name, "args": vars(args), "rows": rows}, f, indent=1)
    print(md)
    plot(args.out, rows, sms)


def plot(out, rows, sms):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    sizes = sorted({r["a2a_mb"] for r in rows})
    fig, axes = plt.subplots(1, len(sizes), figsize=(5 * len(sizes), 4), squeeze=False)
    for ax, mb in zip(axes[0], sizes):
        sub = sorted((r for r in rows if r["a2a_mb"] == mb), key=lambda r: r["cap"] or sms)
        x = [r["cap"] or sms for r in sub]
        for key, style in (("gemm_ms", "o-"), ("a2a_ms", "--"), ("serial_ms", "s-"), ("overlap_ms", "^-")):
            ax.plot(x, [r[key] for r in sub], style, label=key[:-3])
        ax.set(title=f"all-to-all {mb:g} MB/rank", xlabel="num_cu (cap)", ylabel="ms (GPU)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "ep_overlap.png"), dpi=110)


def main(argv=None):
    args = parse_args(argv)
    on_gpu = not args.cpu
    device = init_torchrun(cpu=args.cpu)
    try:
        world = dist.get_world_size()
        sms, rule_cap, caps, rows = sweep(args, device, on_gpu, world)
        if dist.get_rank() == 0:
            report(args, sms, rule_cap, rows, torch.cuda.get_device_name(device) if on_gpu else "cpu")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
