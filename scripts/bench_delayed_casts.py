"""The FP8 casts of an expert MLP, current scaling against delayed scaling, one call each.

    python scripts/bench_delayed_casts.py [--tokens 98304] [--hidden 1024] [--ffn 2048]

Current scaling (``Float8Config()``) runs an amax pass and then the cast; delayed scaling
(``Float8Config(strategy="delayed")``, ``kernels/triton/amax_history.py``) casts with the scale of
its amax history and records the amax in the same launch. For the training-step bench's
expert-dominated layer (rows = tokens x top-k routed to the experts), each of the three casts a
layer's fwd+bwd makes per micro-batch: ``x`` (and ``dy``) to both FP8 layouts, the SwiGLU forward
straight to ``a``'s FP8 layouts, the SwiGLU backward straight to ``dh``'s FP8 layouts plus
``dprobs``. Times: CUDA-event medians of 30 x 5 calls, both in the same process. Before timing,
each delayed result is checked against the same cast with the scale its history held.
"""

from __future__ import annotations

import argparse

import torch

from turbo_moe.bench.timing import warm_median_ms as _median_ms


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=98304, help="routed rows (tokens x top-k)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=2048, help="expert FFN width F (fc1 writes 2F: SwiGLU)")
    parser.add_argument("--history", type=int, default=16)
    args = parser.parse_args(argv)

    from turbo_moe.delayed_scaling import AmaxHistory
    from turbo_moe.kernels.triton import amax_history, fp8_cast, swiglu_fp8

    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    m, k, f, hist_len = args.tokens, args.hidden, args.ffn, args.history
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    h = torch.randn(m, 2 * f, device="cuda", dtype=torch.bfloat16, generator=gen)
    da = torch.randn(m, f, device="cuda", dtype=torch.bfloat16, generator=gen)
    probs = torch.rand(m, device="cuda", generator=gen)

    def history(amax_of, fp8_dtype):
        return AmaxHistory(hist_len, False).prepare(x.device, fp8_dtype, 0, amax_of)

    hx = history(lambda: x.abs().max().float(), e4m3)
    ha = history(lambda: swiglu_fp8.swiglu_amax(h, probs), e4m3)
    hd = history(lambda: swiglu_fp8.swiglu_backward_dh_amax(h, probs, da), e5m2)
    cases = [
        (f"x [{m}, {k}] rows + transposed",
         lambda: fp8_cast.fp8_tensorwise_cast(x, e4m3, 448.0, 0, True, True),
         lambda: amax_history.fp8_tensorwise_cast_delayed(x, hx.state, hx.ticket, hist_len, False, e4m3, 448.0, 0,
                                                          True, True)),
        (f"SwiGLU forward, a [{m}, {f}] both layouts",
         lambda: swiglu_fp8.swiglu_fp8_tensorwise(h, probs, e4m3, 448.0, 0, True, True),
         lambda: swiglu_fp8.swiglu_fp8_delayed(h, probs, ha.state, ha.ticket, hist_len, False, e4m3, 448.0, 0, True,
                                               True)),
        (f"SwiGLU backward, dh [{m}, {2 * f}] both layouts + dprobs",
         lambda: swiglu_fp8.swiglu_backward_fp8_tensorwise(h, probs, da, e5m2, 57344.0, 0, torch.float32, True, True),
         lambda: swiglu_fp8.swiglu_backward_fp8_delayed(h, probs, da, hd.state, hd.ticket, hist_len, False, e5m2,
                                                        57344.0, 0, torch.float32, True, True)),
    ]
    print(f"# {torch.cuda.get_device_name()}, history {hist_len} (max)")
    print("| cast | current (amax + cast) | delayed | delayed / current |")
    print("|---|---|---|---|")
    for label, current, delayed in cases:
        # The delayed cast at a scale its history held must equal the current cast of the same
        # data: the history was seeded with this data's amax, so the scales agree.
        want, got = current(), delayed()
        assert torch.equal(want[2], got[2]), (label, want[2], got[2])
        for w, g in zip(want[:2], got[:2]):
            assert torch.equal(w.view(torch.uint8), g.view(torch.uint8)), label
        t_cur, t_del = _median_ms(current), _median_ms(delayed)
        print(f"| {label} | {t_cur:.3f} ms | {t_del:.3f} ms | {t_del / t_cur:.2f}x |")


if __name__ == "__main__":
    main()
