"""Fast vs promoted FP8 accumulation on Hopper: speed and accuracy of the Triton kernels.

    python scripts/bench_accumulation.py [--out table.md]

For each DeepSeek-V3 fc1 shape (8 x 4096, 32 x 512, 128 x 128 tokens per expert; K = 7168,
N = 4096) and each GEMM (fwd M-grouped, dgrad M-grouped over W^T, wgrad K-grouped), times the
kernel alone on FP8 operands (``triton.testing.do_bench``, median ms) with
``Float8Config(accumulation="fast")`` and ``"promoted"`` (``GroupedGemmProblem.promote_accumulation``)
in the same process, and measures each one's relative error (Frobenius) against a float64
product of the same FP8 operands on the first group. Prints TFLOPS, the promoted/fast time ratio
and both errors: the numbers that decide the default.
"""

from __future__ import annotations

import argparse

import torch

SHAPES = [(8, 4096), (32, 512), (128, 128)]  # (experts, tokens per expert)
N, K = 4096, 7168


def _rel_err(out, ref):
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm())


def main(argv=None):
    import triton.testing

    from turbo_moe.backends.base import GemmKind, GroupedGemmProblem
    from turbo_moe.backends.triton_backend import BACKEND

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    lines = [f"device: {torch.cuda.get_device_name()}", "",
             "| shape | gemm | fast TFLOPS | promoted TFLOPS | promoted / fast time | fast rel err | promoted rel err |",
             "|---|---|---|---|---|---|---|"]
    one = torch.tensor(1.0, device=dev)
    for g, t in SHAPES:
        m = g * t
        offs = torch.arange(0, m + 1, t, device=dev, dtype=torch.int64)
        x = (torch.randn(m, K, device=dev, generator=gen) * 2).to(torch.float8_e4m3fn)
        w = (torch.randn(g, N, K, device=dev, generator=gen) * 2).to(torch.float8_e4m3fn)
        dy = (torch.randn(m, N, device=dev, generator=gen) * 2).to(torch.float8_e5m2)
        problems = {
            "fwd": (GemmKind.M_GROUPED, x, w, lambda: x[:t].double() @ w[0].double().T, lambda o: o[:t]),
            "dgrad": (GemmKind.M_GROUPED, dy, w.transpose(1, 2).contiguous(), lambda: dy[:t].double() @ w[0].double(),
                      lambda o: o[:t]),
            "wgrad": (GemmKind.K_GROUPED, dy.t().contiguous(), x.t().contiguous(),
                      lambda: dy[:t].double().T @ x[:t].double(), lambda o: o[0]),
        }
        for name, (kind, a, b, reference, first) in problems.items():
            ref = reference()
            row = {}
            for promote in (False, True):
                prob = GroupedGemmProblem(kind, a, b, one, one, offs, torch.float32, role=name,
                                          promote_accumulation=promote)
                out = BACKEND.run(prob)
                ms = triton.testing.do_bench(lambda: BACKEND.run(prob), warmup=25, rep=100)
                row[promote] = (2.0 * m * N * K / ms / 1e9, ms, _rel_err(first(out), ref))
            (tf_f, ms_f, err_f), (tf_p, ms_p, err_p) = row[False], row[True]
            lines.append(f"| {g} x {t} | {name} | {tf_f:.0f} | {tf_p:.0f} | {ms_p / ms_f:.3f} | {err_f:.2e} | {err_p:.2e} |")
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
