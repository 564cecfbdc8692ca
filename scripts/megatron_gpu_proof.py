"""Megatron GPT with turbo_moe experts vs Megatron's SequentialMLP, trained the way Megatron trains.

Both models: Megatron's ``GPTModel`` (local spec), the alltoall token dispatcher, Megatron's
``DistributedDataParallel`` (fp32 grad buffers, ``main_grad``) and Megatron's optimizer (the
distributed optimizer on a GPU), ``forward_backward_func`` over several micro-batches per step,
``finalize_model_grads``. They start from the same weights (Megatron distributed checkpoint of the
SequentialMLP model loaded into the turbo_moe one) and see the same batches.

turbo_moe's experts run FP8 (``--fp8``) on the Triton backend (GPU) with
``gradient_accumulation_fusion`` (the wgrad kernel adds its fp32 result into ``main_grad``) and
``cache_fp8_weight`` (each expert weight quantized once per optimizer step, not per micro-batch).

    python scripts/megatron_gpu_proof.py            # one GPU (H100): ~1-2 min after start-up
    python scripts/megatron_gpu_proof.py --cpu      # CPU (gloo, torch backend, allgather dispatcher,
                                                    # non-distributed optimizer, tiny shapes; < 1 min)

Prints the loss table (both curves), the FP8 weight quantizations per optimizer step (counted by
wrapping ``turbo_moe.autograd.quantize_weight``), the backends that ran, and a verdict line.

Note: Megatron's own dense linears implement ``gradient_accumulation_fusion`` with APEX's
``fused_weight_gradient_mlp_cuda`` extension; so that this script runs without APEX, the config
has it off while the models are built (the dense layers and SequentialMLP's experts read it then)
and on afterwards (turbo_moe's experts read it at each forward).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import socket
import tempfile
import time
import warnings

import torch

os.environ.setdefault("TURBO_MOE_TRITON_AUTOTUNE", "0")  # no per-shape benchmarking: start-up time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def megatron_process(use_gpu: bool):
    """A one-process Megatron world; on a CPU, Megatron's few CUDA assumptions point at the CPU."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as megatron_random

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    if use_gpu:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", rank=0, world_size=1)
    else:
        torch.cuda.current_device = lambda: torch.device("cpu")  # router weight, DDP buffers
        torch.cuda.synchronize = lambda *a, **k: None  # dist_checkpointing
        megatron_random._get_cuda_rng_state = lambda *a, **k: None
        megatron_random._set_cuda_rng_state = lambda *a, **k: None
        megatron_random.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()  # dropout
        dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    if use_gpu:
        megatron_random.model_parallel_cuda_manual_seed(1234)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def build_config(args, use_gpu: bool):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=4, ffn_hidden_size=args.ffn,
        num_moe_experts=args.experts, moe_ffn_hidden_size=args.ffn, moe_router_topk=2, moe_grouped_gemm=True,
        # alltoall creates CUDA streams in its constructor: the CPU run uses allgather.
        moe_token_dispatcher_type="alltoall" if use_gpu else "allgather", moe_router_dtype="fp32", moe_aux_loss_coeff=1e-2,
        moe_router_load_balancing_type="aux_loss",
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=not use_gpu,
        params_dtype=torch.bfloat16 if use_gpu else torch.float32, bf16=use_gpu,
    )


def build(args, use_gpu: bool, turbo: bool):
    """(DDP-wrapped GPT, Megatron optimizer, config)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = build_config(args, use_gpu)
    spec = get_gpt_layer_local_spec(num_experts=args.experts, moe_grouped_gemm=True)
    if turbo:
        from turbo_moe.megatron import use_turbo_moe_experts

        spec = use_turbo_moe_experts(spec, fp8=args.fp8, granularity=args.granularity, backend=args.backend,
                                     cache_fp8_weight=True)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.vocab,
                     max_sequence_length=args.seq, position_embedding_type="rope")
    if use_gpu:
        model = model.cuda()
    config.gradient_accumulation_fusion = True  # read by turbo_moe's experts at forward (see the docstring)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=use_gpu)
    ddp = DistributedDataParallel(config, ddp_config, model)
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp.no_sync
    if use_gpu:
        opt_config = OptimizerConfig(optimizer="adam", lr=args.lr, weight_decay=0.0, clip_grad=1.0, bf16=True,
                                     params_dtype=config.params_dtype, use_distributed_optimizer=True)
        optimizer = get_megatron_optimizer(opt_config, [ddp])
    else:
        optimizer = CpuMainGradAdam(ddp.parameters(), args.lr)
    if turbo:
        from turbo_moe.megatron import invalidate_fp8_weight_cache_on_step

        invalidate_fp8_weight_cache_on_step(optimizer)
    return ddp, optimizer, config


class CpuMainGradAdam:
    """CPU stand-in for Megatron's optimizer (whose constructors allocate on CUDA): Adam on the
    fp32 parameters, reading the gradients from DDP's ``main_grad`` buffers, clipped at 1.0."""

    def __init__(self, params, lr):
        self.params = [p for p in params if p.requires_grad]
        self.inner = torch.optim.Adam(self.params, lr=lr)

    def zero_grad(self):
        self.inner.zero_grad(set_to_none=True)

    def step(self):
        for p in self.params:
            p.grad = p.main_grad
        norm = torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.inner.step()
        return True, norm, None


def copy_through_checkpoint(src, dst) -> None:
    """Megatron distributed checkpoint (spawns a writer process: hence the __main__ guard below)."""
    from megatron.core import dist_checkpointing

    with tempfile.TemporaryDirectory() as ckpt:
        dist_checkpointing.save(src.sharded_state_dict(), ckpt)
        dst.load_state_dict(dist_checkpointing.load(dst.sharded_state_dict(), ckpt), strict=True)


def micro_batches(step, args, device):
    """Next-token data with structure: each sequence repeats one of 16 fixed 8-token motifs."""
    motifs = torch.randint(0, args.vocab, (16, 8), generator=torch.Generator().manual_seed(0))
    out = []
    for mb in range(args.micro_batches):
        pick = torch.randint(0, 16, (args.mbs,), generator=torch.Generator().manual_seed(1000 * step + mb))
        tokens = motifs[pick].repeat(1, args.seq // 8 + 2)[:, : args.seq + 1]
        positions = torch.arange(args.seq).unsqueeze(0).expand(args.mbs, -1)
        causal = torch.triu(torch.ones(1, 1, args.seq, args.seq, dtype=torch.bool), diagonal=1)
        out.append(tuple(t.to(device) for t in (tokens[:, :-1].contiguous(), positions, causal,
                                                  tokens[:, 1:].contiguous())))
    return out


def forward_step(data_iterator, model):
    tokens, positions, mask, labels = next(data_iterator)
    output = model(tokens, positions, mask, labels=labels)

    def loss_func(output_tensor):
        loss = output_tensor.float().mean()
        return loss, {"lm loss": loss.detach()}

    return output, loss_func


def cpu_no_pipelining(*, forward_step_func, data_iterator, model, num_microbatches, **_):
    """CPU stand-in for Megatron's forward_backward_no_pipelining (which allocates on CUDA): the
    same order -- grad sync off for all but the last micro-batch, each loss / num_microbatches.
    finalize_model_grads is skipped: its grad sync uses CUDA streams, and one rank has nothing to
    reduce (the gradients are already in main_grad)."""
    (ddp,) = model
    losses = []
    for i in range(num_microbatches):
        with ddp.no_sync() if i < num_microbatches - 1 else contextlib.nullcontext():
            output, loss_func = forward_step_func(data_iterator, ddp)
            loss, reduced = loss_func(output)
            (loss / num_microbatches).backward()
            losses.append(reduced)
    return losses


def train_step(ddp, optimizer, batches, args):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    schedule = get_forward_backward_func() if torch.cuda.is_available() and not args.cpu else cpu_no_pipelining
    losses = schedule(
        forward_step_func=forward_step, data_iterator=iter(batches), model=[ddp],
        num_microbatches=len(batches), seq_length=args.seq, micro_batch_size=args.mbs, forward_only=False,
    )
    ok, grad_norm, _ = optimizer.step()
    assert ok, "optimizer step skipped"
    return sum(float(d["lm loss"]) for d in losses) / len(losses), float(grad_norm)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", "--tiny", dest="cpu", action="store_true", help="CPU, tiny shapes, torch backend")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--fp8", choices=["e4m3", "hybrid"], default="hybrid")
    parser.add_argument("--granularity", choices=["tensorwise", "rowwise"], default="tensorwise")
    parser.add_argument("--lr", type=float, default=2e-3)
    args = parser.parse_args(argv)
    use_gpu = not args.cpu
    if use_gpu and not torch.cuda.is_available():
        parser.error("no CUDA device: run with --cpu")
    shape = dict(layers=1, hidden=32, ffn=48, experts=4, vocab=64, seq=16, mbs=2) if args.cpu else \
        dict(layers=2, hidden=256, ffn=512, experts=8, vocab=512, seq=256, mbs=4)
    for k, v in shape.items():
        setattr(args, k, v)
    args.steps = args.steps or (4 if args.cpu else 30)
    args.backend = "torch" if args.cpu else "triton"
    device = torch.device("cuda" if use_gpu else "cpu")
    warnings.filterwarnings("ignore", module="megatron")

    import turbo_moe.autograd as tm_autograd
    from turbo_moe.backends import clear_recent_dispatches, recent_dispatches

    quantizations = [0]
    real_quantize_weight = tm_autograd.quantize_weight

    @functools.wraps(real_quantize_weight)
    def counting_quantize_weight(*a, **k):
        quantizations[0] += 1
        return real_quantize_weight(*a, **k)

    tm_autograd.quantize_weight = counting_quantize_weight

    with megatron_process(use_gpu):
        torch.manual_seed(0)
        ref, ref_opt, _ = build(args, use_gpu, turbo=False)
        tur, tur_opt, _ = build(args, use_gpu, turbo=True)
        copy_through_checkpoint(ref.module, tur.module)
        layer = tur.module.decoder.layers[0].mlp
        print(f"device={device.type} dispatcher={type(layer.token_dispatcher).__name__} "
              f"optimizer={type(tur_opt).__name__} experts: {type(ref.module.decoder.layers[0].mlp.experts).__name__} "
              f"vs {type(layer.experts).__name__} fp8={args.fp8}/{args.granularity} backend={args.backend} "
              f"micro-batches/step={args.micro_batches}")
        moe_layers = args.layers
        print(f"{'step':>4} {'SequentialMLP':>13} {'turbo_moe':>10} {'diff':>8} {'W quant/step':>12}")
        rows, t_ref, t_tur = [], 0.0, 0.0
        for step in range(args.steps):
            batches = micro_batches(step, args, device)
            t0 = time.perf_counter()
            loss_ref, _ = train_step(ref, ref_opt, batches, args)
            t1 = time.perf_counter()
            quantizations[0] = 0
            clear_recent_dispatches()
            loss_tur, _ = train_step(tur, tur_opt, batches, args)
            t2 = time.perf_counter()
            t_ref, t_tur = t_ref + t1 - t0, t_tur + t2 - t1
            rows.append((loss_ref, loss_tur, quantizations[0]))
            print(f"{step:>4} {loss_ref:13.4f} {loss_tur:10.4f} {loss_tur - loss_ref:+8.4f} {quantizations[0]:>12}")
        wgrad = [r for r in recent_dispatches() if r.problem.startswith("wgrad")]
        print(f"last step's wgrad GEMMs: {len(wgrad)}, e.g. {wgrad[0] if wgrad else None}")
        expected = 2 * moe_layers  # fc1 and fc2 of each MoE layer, once per optimizer step
        print(f"FP8 weight quantizations per optimizer step: {sorted({r[2] for r in rows})} "
              f"(cache: {expected} = 2 linears x {moe_layers} layers; without it {expected * args.micro_batches})")
        first, last = rows[0], rows[-1]
        max_rel = max(abs(t - r) / abs(r) for r, t, _ in rows)
        print(f"ms/step: SequentialMLP {1e3 * t_ref / args.steps:.0f}, turbo_moe {1e3 * t_tur / args.steps:.0f} "
              "(small shapes: not a benchmark)")
        ok = (all(r[2] == expected for r in rows) and all(w.problem.find("+= float32") >= 0 for w in wgrad) and wgrad
              and last[0] < first[0] and last[1] < first[1] and max_rel < 0.05)
        print(f"VERDICT {'PASS' if ok else 'FAIL'}: losses fall ({first[0]:.3f}->{last[0]:.3f} vs "
              f"{first[1]:.3f}->{last[1]:.3f}), max relative loss gap {max_rel:.4f} (< 0.05), "
              f"{expected} weight quantizations every step, wgrad accumulates into fp32 main_grad")
    return 0 if ok else 1


if __name__ == "__main__":  # dist_checkpointing.save spawns a process: the guard is required
    raise SystemExit(main())
