"""Shared set-up for the Megatron tests: a one-process (gloo) Megatron world and model builders.

Megatron-core assumes CUDA in a few places (``torch.cuda.current_device()`` for the router's
weight, ``torch.cuda.synchronize()`` in distributed checkpointing, the CUDA RNG state in activation
recompute); on a CPU-only machine
:func:`megatron_world` points those at the CPU for the duration of the tests that use it.
"""

from __future__ import annotations

import contextlib
import os
import socket

import pytest
import torch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def megatron_world(device: str = "cpu"):
    """A world-size-1 Megatron model-parallel state (gloo on CPU, nccl on CUDA)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    created = False
    with pytest.MonkeyPatch.context() as mp:
        if device == "cpu":
            # Megatron moves the router's weight to torch.cuda.current_device(): keep it on the CPU,
            # also on a machine that has a GPU.
            mp.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))
            if not torch.cuda.is_available():
                mp.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
                # Megatron's activation recompute (CheckpointWithoutOutput) saves and restores the
                # CUDA RNG state beside the CPU one: there is none on a CPU-only machine.
                import megatron.core.tensor_parallel.random as megatron_random

                mp.setattr(megatron_random, "_get_cuda_rng_state", lambda *a, **k: None)
                mp.setattr(megatron_random, "_set_cuda_rng_state", lambda *a, **k: None)
        else:
            torch.cuda.set_device(0)
        if not dist.is_initialized():
            mp.setenv("MASTER_ADDR", "127.0.0.1")
            mp.setenv("MASTER_PORT", str(_free_port()))
            dist.init_process_group("gloo" if device == "cpu" else "nccl", rank=0, world_size=1)
            created = True
        parallel_state.initialize_model_parallel()
        if device == "cuda":
            model_parallel_cuda_manual_seed(1234)
        try:
            yield
        finally:
            parallel_state.destroy_model_parallel()
            if created:
                dist.destroy_process_group()


def make_config(**overrides):
    """A small MoE TransformerConfig that Megatron runs without TE (allgather dispatcher)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    params = dict(
        num_layers=1, hidden_size=40, num_attention_heads=4, num_moe_experts=4, moe_ffn_hidden_size=56,
        ffn_hidden_size=56, moe_router_topk=2, moe_token_dispatcher_type="allgather", add_bias_linear=False,
        use_cpu_initialization=True, gated_linear_unit=True, bias_activation_fusion=False,
        bias_dropout_fusion=False, gradient_accumulation_fusion=False, moe_router_dtype="fp32",
        params_dtype=torch.float32, activation_func=torch.nn.functional.silu,
    )
    params.update(overrides)
    return TransformerConfig(**params)


def build_sequential_moe(config):
    """Megatron's own MoELayer with SequentialMLP experts (the TE-free reference)."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    return get_moe_module_spec(use_te=False, num_experts=config.num_moe_experts, moe_grouped_gemm=True)(config=config)


def build_turbo_moe(config, **options):
    from turbo_moe.megatron import get_turbo_moe_module_spec

    return get_turbo_moe_module_spec(num_experts=config.num_moe_experts, **options)(config=config)


def randomize_(module, scale: float = 0.2, seed: int = 0) -> None:
    """Fresh random values in every parameter (biases included, which Megatron zero-initialises)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_((torch.randn(p.shape, generator=gen) * scale).to(p.dtype))


def copy_sequential_into_turbo(sequential_layer, turbo_layer) -> None:
    """Copy a SequentialMLP MoELayer's weights into a turbo_moe MoELayer (same router)."""
    with torch.no_grad():
        turbo_layer.router.weight.copy_(sequential_layer.router.weight)
        for e, expert in enumerate(sequential_layer.experts.local_experts):
            for name in ("linear_fc1", "linear_fc2"):
                src, dst = getattr(expert, name), getattr(turbo_layer.experts, name)
                dst.weight[e].copy_(src.weight)
                if src.bias is not None:
                    dst.bias[e].copy_(src.bias)


def expert_mlp_reference(x, tokens_per_expert, probs, w1, w2, b1=None, b2=None, glu=True):
    """float64 oracle of the expert MLP: per expert, (act(x W1^T + b1) * p) W2^T + b2 * p."""
    x, probs = x.double(), probs.double()
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    start = 0
    for e, n in enumerate(tokens_per_expert):
        rows = slice(start, start + n)
        h = x[rows] @ w1[e].double().T
        if b1 is not None:
            h = h + b1[e].double()
        if glu:
            gate, lin = h.chunk(2, dim=-1)
            h = torch.nn.functional.silu(gate) * lin
        else:
            h = torch.nn.functional.gelu(h)
        h = h * probs[rows, None]
        y = h @ w2[e].double().T
        if b2 is not None:
            y = y + b2[e].double() * probs[rows, None]
        out[rows] = y
        start += n
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# Expert-parallel (EP=2) and expert-tensor-parallel (ETP=2) runs on two CPU processes.
TWO_RANK_MODES = {
    "ep": dict(expert_model_parallel_size=2),
    "etp": dict(expert_tensor_parallel_size=2),
}


def two_rank_worker(rank: int, world_size: int, port: int, ckpt_root: str) -> None:
    """One of two gloo ranks: Megatron's SequentialMLP vs ours under EP=2, then ETP=2.

    Per mode: a distributed checkpoint of SequentialMLP loads into ours shard by shard (bit-exact),
    a forward+backward through the real MoELayer (router, allgather dispatcher across the two
    ranks) matches exactly, and ours saves a checkpoint (plus its local shards, for the parent
    process to check after loading that checkpoint into a one-process SequentialMLP).
    """
    import os

    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.cuda.current_device = lambda: torch.device("cpu")
    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda *a, **k: None
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        for mode, parallel in TWO_RANK_MODES.items():
            parallel_state.initialize_model_parallel(**parallel)
            config = make_config(num_moe_experts=4, **parallel)
            seq_layer = build_sequential_moe(config)
            randomize_(seq_layer, seed=31 + rank)
            with torch.no_grad():  # the router is replicated: the same on both ranks
                seq_layer.router.weight.copy_(torch.randn(seq_layer.router.weight.shape,
                                                          generator=torch.Generator().manual_seed(30)) * 0.2)
            turbo_layer = build_turbo_moe(config, fp8=None)
            seq_dir, ours_dir = os.path.join(ckpt_root, f"{mode}_seq"), os.path.join(ckpt_root, f"{mode}_ours")
            if rank == 0:
                os.makedirs(seq_dir), os.makedirs(ours_dir)
            dist.barrier()
            dist_checkpointing.save(seq_layer.sharded_state_dict(prefix="mlp."), seq_dir)
            loaded = dist_checkpointing.load(turbo_layer.sharded_state_dict(prefix="mlp."), seq_dir)
            turbo_layer.load_state_dict({k[len("mlp."):]: v for k, v in loaded.items()}, strict=True)
            local = turbo_layer.experts.num_local_experts
            assert local == (2 if mode == "ep" else 4), (mode, local)
            for name in ("linear_fc1", "linear_fc2"):
                theirs = torch.stack([getattr(e, name).weight for e in seq_layer.experts.local_experts])
                assert torch.equal(getattr(turbo_layer.experts, name).weight, theirs), (mode, rank, name)

            hidden = torch.randn(6, 2, config.hidden_size, generator=torch.Generator().manual_seed(40 + rank))
            h_seq, h_tm = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
            out_seq, _ = seq_layer(h_seq)
            out_tm, _ = turbo_layer(h_tm)
            assert torch.equal(out_tm, out_seq), (mode, rank)
            grad = torch.randn(out_seq.shape, generator=torch.Generator().manual_seed(50 + rank))
            out_seq.backward(grad)
            out_tm.backward(grad)
            assert torch.equal(h_tm.grad, h_seq.grad), (mode, rank)
            for name in ("linear_fc1", "linear_fc2"):
                theirs = torch.stack([getattr(e, name).weight.grad for e in seq_layer.experts.local_experts])
                torch.testing.assert_close(getattr(turbo_layer.experts, name).weight.grad, theirs, rtol=1e-6, atol=1e-6)

            with torch.no_grad():
                for p in turbo_layer.experts.parameters():
                    p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(60 + rank)))
            dist_checkpointing.save(turbo_layer.sharded_state_dict(prefix="mlp."), ours_dir)
            torch.save({n: getattr(turbo_layer.experts, n).weight.detach().clone() for n in ("linear_fc1", "linear_fc2")},
                       os.path.join(ckpt_root, f"{mode}_rank{rank}.pt"))
            dist.barrier()
            parallel_state.destroy_model_parallel()
    finally:
        dist.destroy_process_group()
