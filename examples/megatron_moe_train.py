"""Train a tiny Megatron-core MoE GPT for a few steps with Megatron's experts and with turbo_moe's.

Both runs start from the same weights: Megatron's model is built from its own layer spec, saved
as a Megatron distributed checkpoint, and loaded into the turbo_moe model (whose spec differs by
one line, ``use_turbo_moe_experts``). Each step trains both on the same synthetic batch; the losses
are printed side by side.

    python examples/megatron_moe_train.py                 # CPU (gloo), FP8 on turbo_moe's torch backend
    python examples/megatron_moe_train.py --fp8 none      # turbo_moe's high-precision path
    python examples/megatron_moe_train.py --steps 50      # on a GPU machine it runs there (Triton backend)

Needs megatron-core 0.19.2 (+ numpy, packaging, psutil for the checkpoint step).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import tempfile
import time
import warnings

import torch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def megatron_process(use_gpu: bool):
    """A one-process Megatron world; on a CPU, point Megatron's few CUDA assumptions at the CPU."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    saved = (torch.cuda.current_device, torch.cuda.synchronize)
    if use_gpu:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", rank=0, world_size=1)
    else:
        # Megatron puts the router on torch.cuda.current_device() and synchronizes around
        # checkpoints; dropout forks its CUDA RNG tracker (no dropout runs here).
        torch.cuda.current_device = lambda: torch.device("cpu")
        torch.cuda.synchronize = lambda *a, **k: None
        dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    if use_gpu:
        model_parallel_cuda_manual_seed(1234)
    else:
        get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
        torch.cuda.current_device, torch.cuda.synchronize = saved


def build_config(args, use_gpu: bool):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=4, ffn_hidden_size=args.ffn,
        num_moe_experts=args.experts, moe_ffn_hidden_size=args.ffn, moe_router_topk=2,
        moe_token_dispatcher_type="allgather", moe_router_dtype="fp32", moe_aux_loss_coeff=1e-2,
        moe_router_load_balancing_type="aux_loss",
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=not use_gpu,
        params_dtype=torch.bfloat16 if use_gpu else torch.float32, bf16=use_gpu,
    )


def build_model(config, args, turbo: bool):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=args.experts, moe_grouped_gemm=True)
    if turbo:
        from turbo_moe.megatron import use_turbo_moe_experts

        fp8 = None if args.fp8 == "none" else args.fp8
        spec = use_turbo_moe_experts(spec, fp8=fp8, granularity=args.granularity)  # the one-line change
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.vocab,
                    max_sequence_length=args.seq, position_embedding_type="rope")


def copy_through_checkpoint(src, dst) -> None:
    """Megatron distributed checkpoint: save src (SequentialMLP experts), load into dst (ours)."""
    from megatron.core import dist_checkpointing

    with tempfile.TemporaryDirectory() as ckpt:
        dist_checkpointing.save(src.sharded_state_dict(), ckpt)
        dst.load_state_dict(dist_checkpointing.load(dst.sharded_state_dict(), ckpt), strict=True)


def synthetic_batch(step, args, device):
    """Next-token data with structure: each sequence repeats one of 16 fixed 8-token motifs."""
    motifs = torch.randint(0, args.vocab, (16, 8), generator=torch.Generator().manual_seed(0))
    pick = torch.randint(0, 16, (args.batch,), generator=torch.Generator().manual_seed(1000 + step))
    motif = motifs[pick]
    tokens = motif.repeat(1, args.seq // 8 + 2)[:, : args.seq + 1]
    tokens, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    positions = torch.arange(args.seq).unsqueeze(0).expand(args.batch, -1)
    causal = torch.triu(torch.ones(1, 1, args.seq, args.seq, dtype=torch.bool), diagonal=1)
    return tokens.to(device), positions.to(device), causal.to(device), labels.to(device)


def train_step(model, optimizer, batch):
    tokens, positions, mask, labels = batch
    optimizer.zero_grad(set_to_none=True)
    loss = model(tokens, positions, mask, labels=labels).float().mean()
    loss.backward()
    optimizer.step()
    return loss.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--fp8", choices=["e4m3", "hybrid", "none"], default="hybrid")
    parser.add_argument("--granularity", choices=["tensorwise", "rowwise"], default="tensorwise")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--ffn", type=int, default=96)
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--cpu", action="store_true", help="stay on the CPU even if a GPU is present")
    args = parser.parse_args()
    use_gpu = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda") if use_gpu else torch.device("cpu")
    warnings.filterwarnings("ignore", module="megatron")

    with megatron_process(use_gpu):
        from megatron.core.transformer.module import Float16Module

        config = build_config(args, use_gpu)
        torch.manual_seed(0)
        megatron_core_model = build_model(config, args, turbo=False).to(device)
        turbo_core_model = build_model(config, args, turbo=True).to(device)
        copy_through_checkpoint(megatron_core_model, turbo_core_model)
        # With bf16 parameters Megatron trains the model inside Float16Module, which casts it and its
        # inputs to bf16: Megatron's torch LayerNorms are built in fp32 whatever params_dtype says.
        megatron_model, turbo_model = (
            (Float16Module(config, megatron_core_model), Float16Module(config, turbo_core_model)) if config.bf16
            else (megatron_core_model, turbo_core_model)
        )
        experts = turbo_core_model.decoder.layers[0].mlp.experts
        print(f"device={device.type} experts: Megatron {type(megatron_core_model.decoder.layers[0].mlp.experts).__name__} "
              f"vs turbo_moe {type(experts).__name__} fp8={args.fp8}/{args.granularity}")
        opt_megatron = torch.optim.Adam(megatron_model.parameters(), lr=args.lr)
        opt_turbo = torch.optim.Adam(turbo_model.parameters(), lr=args.lr)
        print(f"{'step':>4}  {'megatron':>9}  {'turbo_moe':>9}  {'diff':>8}")
        times = {"megatron": 0.0, "turbo_moe": 0.0}
        for step in range(args.steps):
            batch = synthetic_batch(step, args, device)
            t0 = time.perf_counter()
            loss_m = train_step(megatron_model, opt_megatron, batch)
            t1 = time.perf_counter()
            loss_t = train_step(turbo_model, opt_turbo, batch)
            t2 = time.perf_counter()
            times["megatron"] += t1 - t0
            times["turbo_moe"] += t2 - t1
            print(f"{step:>4}  {loss_m:9.4f}  {loss_t:9.4f}  {loss_t - loss_m:+8.4f}")
        print(f"wall time per step: megatron {1e3 * times['megatron'] / args.steps:.1f} ms, "
              f"turbo_moe {1e3 * times['turbo_moe'] / args.steps:.1f} ms "
              f"(tiny shapes: dominated by Python overhead, not a kernel benchmark)")


if __name__ == "__main__":
    main()
