"""Per-parameter gradient error of each FP8 recipe in a Megatron-core MoE GPT, against the same model
without FP8 (turbo_moe's unquantized experts), at one trained checkpoint and one batch.

    python scripts/recipe_gradients.py [--steps 60] [--device cpu|cuda] [--dispatcher alltoall|allgather]

Trains the unquantized model for ``--steps`` Adam steps on Python's stdlib source (the training
bench's corpus), then loads that state into one model per recipe and compares one micro-batch's
gradients with the unquantized model's: ``|g_recipe - g_ref| / |g_ref|`` for the embedding, each
layer's attention projections, router and expert fc1/fc2 weights. A recipe whose kernels or glue
mishandle a gradient stands out here long before a loss curve separates from bf16's
(docs/results/h100_loss_1000.md). On the CPU the torch backend runs (fp32 parameters); on a GPU,
the default backend with bf16 parameters, as the training bench runs them.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from turbo_moe.bench import train_model as TM  # noqa: E402
from turbo_moe.bench.text_corpus import BatchSampler, load_corpus  # noqa: E402

RECIPES = (("fp8-tensorwise", "hybrid"), ("fp8-rowwise", "hybrid"), ("fp8-blockwise", "hybrid"),
           ("fp8-mxfp8", "hybrid"), ("fp8-tensorwise", "e4m3"), ("fp8-blockwise", "e4m3"))
WATCHED = ("embedding", "linear_qkv", "linear_proj", "router", "linear_fc1", "linear_fc2")


def _gradients(model) -> dict:
    """Gradients by canonical name, float32 on the CPU (a parameter without one counts as zero)."""
    return TM.canonical_state(
        model, value=lambda p: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().float())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60, help="Adam steps of the unquantized model first")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dispatcher", choices=("alltoall", "allgather"), default=None,
                   help="Megatron's token dispatcher (default: alltoall on a GPU, allgather on the CPU, which "
                        "cannot build the alltoall one)")
    args = p.parse_args()
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    cfg = TM.TrainConfig("gradients", layers=2, hidden=256, heads=4, ffn=512, experts=8, topk=2, seq=128, mbs=4,
                         loss_curve=True, dispatcher=args.dispatcher or ("alltoall" if on_gpu else "allgather"))
    with TM.megatron_world(device):
        torch.manual_seed(0)
        sampler = BatchSampler(load_corpus(1 << 20), cfg.seq, cfg.mbs, args.steps + 2, 1, 1, device, seed=0)
        positions = torch.arange(cfg.seq, device=device).unsqueeze(0).expand(cfg.mbs, -1)
        mask = torch.triu(torch.ones(1, 1, cfg.seq, cfg.seq, dtype=torch.bool, device=device), diagonal=1)

        def loss_of(model, tokens, labels):
            return model(tokens, positions, mask, labels=labels).float().mean()

        reference = TM.build_model(cfg, "turbo-bf16", device)
        opt = torch.optim.Adam(reference.parameters(), lr=3e-3)
        start = time.time()
        for step in range(args.steps):
            opt.zero_grad()
            loss = loss_of(reference, *sampler.train(step, 0))
            loss.backward()
            opt.step()
        print(f"{cfg.describe(1)}; unquantized model trained {args.steps} steps in {time.time() - start:.0f} s, "
              f"loss {loss.item():.3f}")
        state = TM.canonical_state(reference)
        batch = sampler.train(args.steps + 1, 0)
        reference.zero_grad()
        ref_loss = loss_of(reference, *batch)
        ref_loss.backward()
        ref_grads = _gradients(reference)
        keys = [k for k in ref_grads if any(w in k for w in WATCHED)]
        short = {k: k.replace("decoder.layers.", "L").replace(".mlp.experts", "").replace(".self_attention", "")
                 .replace(".weight", "").replace("embedding.word_embeddings", "embedding") for k in keys}
        print(f"relative gradient error against the unquantized path (loss {ref_loss.item():.5f})")
        print("| recipe | format | loss | " + " | ".join(short[k] for k in keys) + " |")
        print("|---" * (3 + len(keys)) + "|")
        for variant, fmt in RECIPES:
            model = TM.build_model(cfg, variant, device, fp8_format=fmt)
            TM.load_canonical_state(model, state)
            model.zero_grad()
            loss = loss_of(model, *batch)
            loss.backward()
            grads = _gradients(model)
            errors = [((grads[k] - ref_grads[k]).norm() / ref_grads[k].norm()).item() for k in keys]
            print(f"| {variant} | {fmt} | {loss.item():.5f} | " + " | ".join(f"{e:.3f}" for e in errors) + " |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
