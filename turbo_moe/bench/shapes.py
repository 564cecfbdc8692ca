"""MoE shapes and token routings the benchmark sweeps.

A *case* is one expert linear layer of one model (fc1 or fc2), a number of local experts with a
nominal token count per expert, and a routing that splits the tokens among the experts.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

__all__ = [
    "MODELS",
    "GPU_EXPERTS",
    "CPU_EXPERTS",
    "ROUTINGS",
    "LAYERS",
    "Case",
    "parse_experts",
    "make_group_sizes",
    "build_cases",
]

# name -> (hidden size, expert FFN size)
MODELS: Dict[str, Tuple[int, int]] = {
    "deepseek-v3": (7168, 2048),
    "qwen3-235b": (4096, 1536),
    "gpt-oss": (2880, 2880),
    # CPU smoke shapes: neither dimension is a multiple of 128 (nor of 64), so tile tails are hit.
    "tiny": (160, 96),
}
GPU_MODELS = ("deepseek-v3", "qwen3-235b", "gpt-oss")

# experts -> tokens per expert, as the peers were measured (docs/results/h100_peers_baseline.md).
GPU_EXPERTS: Tuple[Tuple[int, int], ...] = ((8, 4096), (32, 512), (128, 128))
CPU_EXPERTS: Tuple[Tuple[int, int], ...] = ((4, 48), (16, 16))

ROUTINGS = ("balanced", "skewed", "dirichlet", "zipf")
LAYERS = ("fc1", "fc2")


@dataclass(frozen=True)
class Case:
    model: str
    layer: str
    num_experts: int
    tokens_per_expert: int
    routing: str
    group_sizes: Tuple[int, ...]

    @property
    def hidden(self) -> int:
        return MODELS[self.model][0]

    @property
    def ffn(self) -> int:
        return MODELS[self.model][1]

    @property
    def n(self) -> int:
        """Output features of the layer (fc1: gate+up = 2*FFN; fc2: hidden)."""
        return 2 * self.ffn if self.layer == "fc1" else self.hidden

    @property
    def k(self) -> int:
        """Input features of the layer (fc1: hidden; fc2: FFN)."""
        return self.hidden if self.layer == "fc1" else self.ffn

    @property
    def m(self) -> int:
        return sum(self.group_sizes)

    @property
    def name(self) -> str:
        return f"{self.model} {self.layer} {self.num_experts}x{self.tokens_per_expert} {self.routing}"

    def routing_summary(self) -> str:
        sizes = self.group_sizes
        empty = sum(1 for s in sizes if s == 0)
        return f"min {min(sizes)} max {max(sizes)} empty {empty}"

    def as_dict(self) -> dict:
        return {
            "case": self.name,
            "model": self.model,
            "layer": self.layer,
            "num_experts": self.num_experts,
            "tokens_per_expert": self.tokens_per_expert,
            "routing": self.routing,
            "M": self.m,
            "N": self.n,
            "K": self.k,
            "group_sizes_min": min(self.group_sizes),
            "group_sizes_max": max(self.group_sizes),
            "empty_groups": sum(1 for s in self.group_sizes if s == 0),
        }


def parse_experts(spec: str) -> List[Tuple[int, int]]:
    """``"8,32:512,128"`` -> [(8, 4096), (32, 512), (128, 128)]; a bare count takes its default tokens."""
    defaults = dict(GPU_EXPERTS)
    out = []
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        count, _, tokens = item.partition(":")
        try:
            experts = int(count)
            tpe = int(tokens) if tokens else defaults.get(experts)
        except ValueError:
            raise ValueError(f"--experts: {item!r} is not EXPERTS or EXPERTS:TOKENS_PER_EXPERT") from None
        if tpe is None:
            raise ValueError(
                f"--experts: no default tokens per expert for {experts} experts; write {experts}:TOKENS"
            )
        if experts < 1 or tpe < 0:
            raise ValueError(f"--experts: {item!r} needs experts >= 1 and tokens >= 0")
        out.append((experts, tpe))
    if not out:
        raise ValueError("--experts is empty")
    return out


def _split_by_weights(total: int, weights: Sequence[float], align: int) -> List[int]:
    """Split ``total`` tokens in proportion to ``weights``, in multiples of ``align`` where possible.

    Largest-remainder rounding on units of ``align`` tokens; the tokens left over when ``total``
    is not a multiple of ``align`` go to the largest group, so the sizes always sum to ``total``.
    """
    units_total, leftover = divmod(total, align)
    weight_sum = float(sum(weights))
    exact = [units_total * w / weight_sum for w in weights]
    units = [int(e) for e in exact]
    order = sorted(range(len(weights)), key=lambda i: exact[i] - units[i], reverse=True)
    for i in order[: units_total - sum(units)]:
        units[i] += 1
    sizes = [u * align for u in units]
    sizes[max(range(len(sizes)), key=lambda i: sizes[i])] += leftover
    return sizes


def make_group_sizes(num_experts: int, tokens_per_expert: int, routing: str, seed: int = 0, align: int = 16) -> List[int]:
    """Tokens routed to each expert; they sum to ``num_experts * tokens_per_expert``.

    * ``balanced``: every expert gets ``tokens_per_expert``;
    * ``skewed``: expert 0 gets half of all tokens, the others split the rest evenly;
    * ``dirichlet``: a seeded Dirichlet(0.3) split with the smallest eighth of the experts (at least
      one, when there are 4 or more) forced empty -- what a router early in training looks like;
    * ``zipf``: a seeded permutation of Zipf(1.1) shares (a few hot experts, a long cold tail).

    Group sizes are multiples of ``align`` (16 by default: CUTLASS's FP8 grouped GEMM, which the
    peers use, wants 16-token groups, as Megatron's FP8 padding provides); ``align=1`` gives
    arbitrary ragged sizes.
    """
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if align < 1:
        raise ValueError(f"align must be >= 1, got {align}")
    total = num_experts * tokens_per_expert
    rng = random.Random(f"{seed}-{routing}-{num_experts}-{tokens_per_expert}")
    if routing == "balanced":
        return [tokens_per_expert] * num_experts
    if routing == "skewed":
        if num_experts == 1:
            return [total]
        hot = (total // 2) // align * align
        rest = _split_by_weights(total - hot, [1.0] * (num_experts - 1), align)
        return [hot] + rest
    if routing == "dirichlet":
        weights = [rng.gammavariate(0.3, 1.0) for _ in range(num_experts)]
        num_empty = num_experts // 8 if num_experts >= 8 else (1 if num_experts >= 4 else 0)
        for i in sorted(range(num_experts), key=lambda i: weights[i])[:num_empty]:
            weights[i] = 0.0
        return _split_by_weights(total, weights, align)
    if routing == "zipf":
        weights = [1.0 / (rank + 1) ** 1.1 for rank in range(num_experts)]
        rng.shuffle(weights)
        return _split_by_weights(total, weights, align)
    raise ValueError(f"routing {routing!r} is not one of {', '.join(ROUTINGS)}")


def build_cases(
    models: Sequence[str],
    layers: Sequence[str],
    experts: Sequence[Tuple[int, int]],
    routings: Sequence[str],
    seed: int = 0,
    align: int = 16,
) -> List[Case]:
    """Every combination, routing outermost: a run cut short by its time budget has covered every
    shape with balanced routing before it starts on the skewed ones, and so on."""
    for name, values, allowed in (("models", models, MODELS), ("layers", layers, LAYERS), ("routings", routings, ROUTINGS)):
        bad = [v for v in values if v not in allowed]
        if bad:
            raise ValueError(f"--{name}: {', '.join(map(repr, bad))} not in {', '.join(allowed)}")
    cases = []
    for routing in routings:
        for num_experts, tpe in experts:
            for model in models:
                for layer in layers:
                    sizes = make_group_sizes(num_experts, tpe, routing, seed, align)
                    cases.append(Case(model, layer, num_experts, tpe, routing, tuple(sizes)))
    return cases
