"""Quickstart: a small MoE block whose experts are GroupedLinearFP8, trained for a few steps.

Runs on the default backend (torch reference on a CPU, Triton on an NVIDIA GPU, FlyDSL on MI355X)
and trains the same model twice from the same initial weights on the same data: once with FP8
experts and once with the high-precision ``turbo_moe.grouped_gemm`` in bf16. It prints both loss
curves, the FP8-vs-bf16 output error and which backend ran each GEMM.

    python examples/quickstart.py [--steps 20] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.nn.functional as F
from torch import nn

import turbo_moe
from turbo_moe import Float8Config, GroupedLinearFP8


class MoEBlock(nn.Module):
    """Router (top-k softmax) -> permute tokens by expert -> SwiGLU experts -> combine."""

    def __init__(self, hidden: int, ffn: int, num_experts: int, top_k: int, config: Float8Config):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.fc1 = GroupedLinearFP8(num_experts, hidden, 2 * ffn, config=config)  # gate and up, fused
        self.fc2 = GroupedLinearFP8(num_experts, ffn, hidden, config=config)
        self.fp8 = True

    def experts(self, layer: GroupedLinearFP8, x: torch.Tensor, group_lens: torch.Tensor) -> torch.Tensor:
        if self.fp8:
            return layer(x, group_lens)
        # The high-precision twin: same weights, bf16 grouped GEMM.
        return turbo_moe.grouped_gemm(x.bfloat16(), layer.weight.bfloat16(), group_lens).float()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        probs = F.softmax(self.router(tokens), dim=-1)
        top_p, top_e = probs.topk(self.top_k, dim=-1)
        flat_e = top_e.reshape(-1)
        order = torch.argsort(flat_e, stable=True)  # tokens sorted by expert
        group_lens = torch.zeros(self.num_experts, dtype=torch.int64, device=tokens.device)
        group_lens.scatter_add_(0, flat_e, torch.ones_like(flat_e))  # no host sync
        x = tokens.repeat_interleave(self.top_k, dim=0)[order]
        gate, up = self.experts(self.fc1, x, group_lens).chunk(2, dim=-1)
        h = self.experts(self.fc2, F.silu(gate) * up, group_lens)
        out = torch.zeros_like(h).index_copy_(0, order, h)  # back to (token, k) order
        return (out.view(tokens.shape[0], self.top_k, -1) * top_p[..., None]).sum(1)


def train(model: MoEBlock, data, steps: int, lr: float):
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        x, y = data[step % len(data)]
        loss = F.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--ffn", type=int, default=256)
    parser.add_argument("--experts", type=int, default=20)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--format", default="e4m3", choices=["e4m3", "hybrid"])
    args = parser.parse_args()

    torch.manual_seed(0)
    device = torch.device(args.device)
    fp8_model = MoEBlock(args.hidden, args.ffn, args.experts, args.top_k, Float8Config(format=args.format)).to(device)
    bf16_model = copy.deepcopy(fp8_model)
    bf16_model.fp8 = False
    teacher = nn.Sequential(nn.Linear(args.hidden, args.hidden), nn.Tanh()).to(device)
    data = []
    for _ in range(4):
        x = torch.randn(args.tokens, args.hidden, device=device)
        with torch.no_grad():
            data.append((x, teacher(x)))

    with torch.no_grad():
        y8, y16 = fp8_model(data[0][0]), bf16_model(data[0][0])
    rel_err = ((y8 - y16).norm() / y16.norm()).item()

    t0 = time.perf_counter()
    fp8_losses = train(fp8_model, data, args.steps, lr=args.lr)
    t_fp8 = time.perf_counter() - t0
    bf16_losses = train(bf16_model, data, args.steps, lr=args.lr)

    used = sorted({(r.problem.split()[0], r.chosen) for r in turbo_moe.recent_dispatches()})
    print(f"turbo_moe {turbo_moe.__version__}: MoE block, {args.experts} experts x top-{args.top_k}, "
          f"hidden {args.hidden}, ffn {args.ffn}, {args.tokens} tokens, FP8 format {args.format}, device {device}")
    print("backend per GEMM: " + ", ".join(f"{op} -> {name}" for op, name in used))
    print(f"first-step output, FP8 vs bf16 experts: relative error {rel_err:.4f}")
    print(f"{'step':>4}  {'loss (FP8)':>12}  {'loss (bf16)':>12}")
    for i, (a, b) in enumerate(zip(fp8_losses, bf16_losses)):
        print(f"{i:>4}  {a:>12.6f}  {b:>12.6f}")
    print(f"FP8 training: {args.steps} steps in {t_fp8:.2f} s; loss {fp8_losses[0]:.4f} -> {fp8_losses[-1]:.4f} "
          f"(bf16: {bf16_losses[0]:.4f} -> {bf16_losses[-1]:.4f})")


if __name__ == "__main__":
    main()
