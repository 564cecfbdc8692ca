"""turbo_moe.megatron on CPU, checkpoints: Megatron's distributed checkpoints to and from SequentialMLP
(bit-exact), TE-named plain state dicts, optimizer-state mapping, and sharding metadata equal to
TE's per-expert layout under expert and expert-tensor parallelism (faked groups, and two real
gloo processes).
"""

from __future__ import annotations

import tempfile
import types

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from _megatron_harness import (  # noqa: E402
    TWO_RANK_MODES,
    build_sequential_moe,
    build_turbo_moe,
    make_config,
    randomize_,
    two_rank_worker,
)
from _megatron_cpu import (  # noqa: E402, F401 (world: a fixture)
    default_pg,
    needs_psutil,
    stacked,
    world,
)

tm = pytest.importorskip("turbo_moe.megatron")


@pytest.mark.parametrize("bias", [False, True])
def test_dist_checkpoint_round_trip_with_sequential_mlp(world, bias):
    """Megatron's distributed checkpoint: SequentialMLP -> ours -> SequentialMLP, bit-exact."""
    needs_psutil()
    from megatron.core import dist_checkpointing

    config = make_config(num_moe_experts=4, add_bias_linear=bias)
    seq_layer = build_sequential_moe(config)
    randomize_(seq_layer, seed=8)
    turbo_layer = build_turbo_moe(config, fp8=None)
    with tempfile.TemporaryDirectory() as d1, tempfile.TemporaryDirectory() as d2:
        dist_checkpointing.save(seq_layer.sharded_state_dict(prefix="mlp."), d1)
        loaded = dist_checkpointing.load(turbo_layer.sharded_state_dict(prefix="mlp."), d1)
        turbo_layer.load_state_dict({k[len("mlp."):]: v for k, v in loaded.items()}, strict=True)
        for name in ("linear_fc1", "linear_fc2"):
            assert torch.equal(getattr(turbo_layer.experts, name).weight, stacked(seq_layer.experts, name))
            if bias:
                assert torch.equal(getattr(turbo_layer.experts, name).bias, stacked(seq_layer.experts, name, "bias"))

        with torch.no_grad():
            for p in turbo_layer.experts.parameters():
                p.add_(torch.randn_like(p))
        dist_checkpointing.save(turbo_layer.sharded_state_dict(prefix="mlp."), d2)
        back = build_sequential_moe(config)
        loaded = dist_checkpointing.load(back.sharded_state_dict(prefix="mlp."), d2)
        back.load_state_dict({k[len("mlp."):]: v for k, v in loaded.items()}, strict=True)
        for name in ("linear_fc1", "linear_fc2"):
            assert torch.equal(stacked(back.experts, name), getattr(turbo_layer.experts, name).weight)
        hidden = torch.randn(5, 2, config.hidden_size)
        with torch.no_grad():
            assert torch.equal(back(hidden)[0], turbo_layer(hidden)[0])


def test_plain_state_dict_uses_te_names_and_round_trips(world):
    config = make_config(num_moe_experts=3, add_bias_linear=True)
    a = tm.TurboMoEGroupedMLP(3, config, pg_collection=default_pg())
    randomize_(a, seed=9)
    sd = a.state_dict()
    expected = {f"linear_fc{j}.{n}{i}" for j in (1, 2) for n in ("weight", "bias") for i in range(3)}
    assert expected <= set(sd) and "linear_fc1.weight" not in sd
    assert {"linear_fc1._extra_state", "linear_fc2._extra_state"} <= set(sd)
    assert torch.equal(sd["linear_fc1.weight2"], a.linear_fc1.weight[2])

    b = tm.TurboMoEGroupedMLP(3, config, pg_collection=default_pg())
    b.load_state_dict(sd, strict=True)
    assert torch.equal(b.linear_fc2.weight, a.linear_fc2.weight) and torch.equal(b.linear_fc1.bias, a.linear_fc1.bias)

    # TE's per-GEMM extra states and a single stacked tensor (TE's single_grouped_weight) load too.
    te_style = dict(sd)
    te_style["linear_fc1._extra_state1"] = torch.empty(0, dtype=torch.uint8)
    te_style["linear_fc2.weight"] = torch.stack([te_style.pop(f"linear_fc2.weight{i}") for i in range(3)])
    c = tm.TurboMoEGroupedMLP(3, config, pg_collection=default_pg())
    c.load_state_dict(te_style, strict=True)
    assert torch.equal(c.linear_fc2.weight, a.linear_fc2.weight)

    partial = {k: v for k, v in sd.items() if k != "linear_fc1.weight1"}
    with pytest.raises(RuntimeError, match="2 of 3 per-expert"):
        tm.TurboMoEGroupedMLP(3, config, pg_collection=default_pg()).load_state_dict(partial)


def test_optimizer_state_maps_onto_our_sharded_entries(world):
    """Megatron's optimizer checkpointing finds model shards by parameter identity: ours are found."""
    from megatron.core.dist_checkpointing.optimizer import get_param_id_to_sharded_param_map

    config = make_config(num_moe_experts=4, add_bias_linear=True)
    layer = build_turbo_moe(config, fp8=None)
    params = list(layer.parameters())
    mapping = get_param_id_to_sharded_param_map(layer.sharded_state_dict(prefix="mlp."), params)
    ids = {id(p): i for i, p in enumerate(params)}
    for name in ("linear_fc1", "linear_fc2"):
        for attr in ("weight", "bias"):
            param = getattr(getattr(layer.experts, name), attr)
            assert ids[id(param)] in mapping, f"{name}.{attr} has no sharded entry for its optimizer state"
            assert mapping[ids[id(param)]].key == f"mlp.experts.experts.{name}.{attr}"


class _FakeGroup:
    """A process group stand-in for sharding metadata: only size() and rank() are read."""

    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


def _fake_pg(ep=(2, 1), etp=(2, 1), edp=(1, 0)):
    return types.SimpleNamespace(ep=_FakeGroup(*ep), expt_tp=_FakeGroup(*etp), expt_dp=_FakeGroup(*edp),
                                 expt_dp_gtp_remat=_FakeGroup(*edp), tp=_FakeGroup(1, 0))


def _te_reference_shards(param_2d_list, tp_axis, glu, pg, prefix, sharded_offsets):
    """The ShardedTensors TE's grouped linear + TEGroupedMLP make, rebuilt with Megatron's helpers.

    From megatron/core/extensions/transformer_engine.py (_sharded_state_dict_grouped): one
    2-D tensor per local expert, ``make_sharded_tensors_for_checkpoint`` with the TP axis and an
    extra (ep_axis, global_expert, num_global) offset; TEGroupedMLP.sharded_state_dict wraps fc1
    weights with ``apply_swiglu_sharded_factory`` under gated linear units.
    """
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    ep_size, ep_rank = pg.ep.size(), pg.ep.rank()
    e_local = len(param_2d_list)
    out = []
    for i, t in enumerate(param_2d_list):
        offsets = (*sharded_offsets, (len(sharded_offsets), ep_rank * e_local + i, ep_size * e_local))
        sd = make_sharded_tensors_for_checkpoint({f"{i}.weight": t}, "", {f"{i}.weight": tp_axis}, offsets,
                                                 tp_group=pg.expt_tp, dp_cp_group=pg.expt_dp)
        sh = sd[f"{i}.weight"]
        sh.key = f"{prefix}weight"
        if glu:
            out.extend(apply_swiglu_sharded_factory(sh, offsets, tp_group=pg.expt_tp, dp_group=pg.expt_dp)
                       .build())
        else:
            out.append(sh)
    return out


def _chunks(entry):
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    return entry.build() if isinstance(entry, ShardedTensorFactory) else [entry]


@pytest.mark.parametrize("glu", [True, False])
@pytest.mark.parametrize("sharded_offsets", [(), ((0, 3, 8),)])
def test_sharding_metadata_matches_te_layout_under_ep_and_etp(world, glu, sharded_offsets):
    """EP=2 (rank 1) x ETP=2 (rank 1): global shapes, offsets and keys equal TE's per-expert ones."""
    act = torch.nn.functional.silu if glu else torch.nn.functional.gelu
    config = make_config(num_moe_experts=4, moe_ffn_hidden_size=16, gated_linear_unit=glu, activation_func=act,
                         expert_model_parallel_size=1)
    pg = _fake_pg()
    fc1_out = 32 if glu else 16
    fc1 = tm.TurboColumnParallelGroupedLinear(2, config.hidden_size, fc1_out, config=config, init_method=config.init_method,
                                              bias=False, skip_bias_add=False, is_expert=True, pg_collection=pg)
    fc2 = tm.TurboRowParallelGroupedLinear(2, 16, config.hidden_size, config=config, init_method=config.init_method,
                                           bias=False, skip_bias_add=True, is_expert=True, pg_collection=pg)
    assert fc1.weight.shape == (2, fc1_out // 2, config.hidden_size)  # this ETP rank's rows
    assert fc2.weight.shape == (2, config.hidden_size, 8)  # this ETP rank's columns
    p = len(sharded_offsets)
    for layer, tp_axis, is_glu in ((fc1, 0, glu), (fc2, 1, False)):
        ours = [c for c in _chunks(layer.sharded_state_dict("fc.", sharded_offsets)["fc.weight"])]
        theirs = _te_reference_shards([layer.weight[e] for e in range(2)], tp_axis, is_glu, pg, "fc.", sharded_offsets)
        assert len(ours) == (2 if is_glu else 1) and len(theirs) == 2 * len(ours)
        for t in theirs:
            # Each TE per-expert block lies inside one of ours, with the same key and global shape.
            matches = [o for o in ours if o.key == t.key and o.global_shape == t.global_shape
                       and o.global_offset[p] <= t.global_offset[p] < o.global_offset[p] + o.local_shape[p]
                       and o.global_offset[p + 1:] == t.global_offset[p + 1:]
                       # TE's blocks are 2-D with the expert axis prepended; ours are 3-D.
                       and tuple(o.local_shape[1:]) == tuple(t.local_shape)]
            assert len(matches) == 1, (t.global_offset, [o.global_offset for o in ours])
            o = matches[0]
            e = t.global_offset[p] - o.global_offset[p]
            assert torch.equal(o.data[e], t.data)
            assert o.replica_id == t.replica_id
        # Global [E, out, in] with E = EP x local experts; this rank's experts are 2 and 3.
        assert ours[0].global_shape[p] == 4 and ours[0].global_offset[p] == 2
    assert all(p_.allreduce is False for p_ in (fc1.weight, fc2.weight))  # expert-DP reduction
    assert fc1.weight.partition_dim == 1 and fc2.weight.partition_dim == 2


def test_singleton_local_shards_match_te_keys(world):
    config = make_config(num_moe_experts=4, gated_linear_unit=False, activation_func=torch.nn.functional.gelu)
    pg = _fake_pg(etp=(1, 0))
    fc2 = tm.TurboRowParallelGroupedLinear(2, config.moe_ffn_hidden_size, config.hidden_size, config=config,
                                           init_method=config.init_method, bias=False, skip_bias_add=True,
                                           is_expert=True, pg_collection=pg)
    sd = fc2.sharded_state_dict("linear_fc2.", (), {"singleton_local_shards": True, "dp_cp_group": None})
    assert sd["linear_fc2.weight1"].key == "3.linear_fc2.weight"  # TE: f"{global_expert}.{prefix}"
    assert torch.equal(sd["linear_fc2.weight1"].data, fc2.weight[1])
    assert sd["linear_fc2._extra_state1"].key == "3.linear_fc2._extra_state"


def test_two_processes_expert_parallel_and_expert_tensor_parallel(world):
    """EP=2 and ETP=2 on two gloo processes, then their checkpoints resharded into one process.

    In the workers: SequentialMLP's checkpoint loads into ours shard by shard and the real
    MoELayer matches exactly (see two_rank_worker). Here: the checkpoint *ours* saved at EP=2 /
    ETP=2 loads into Megatron's SequentialMLP at EP=1 and every expert equals the shards the
    ranks held -- for ETP with SwiGLU, gate rows from both ranks first, then the linear rows.
    """
    needs_psutil()
    import os
    import socket

    import torch.multiprocessing as mp
    from megatron.core import dist_checkpointing

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as root:
        mp.spawn(two_rank_worker, args=(2, port, root), nprocs=2, join=True)
        for mode in TWO_RANK_MODES:
            shards = [torch.load(os.path.join(root, f"{mode}_rank{r}.pt")) for r in range(2)]
            config = make_config(num_moe_experts=4)
            seq_layer = build_sequential_moe(config)
            loaded = dist_checkpointing.load(seq_layer.sharded_state_dict(prefix="mlp."), os.path.join(root, f"{mode}_ours"))
            seq_layer.load_state_dict({k[len("mlp."):]: v for k, v in loaded.items()}, strict=True)
            fc1 = stacked(seq_layer.experts, "linear_fc1")
            fc2 = stacked(seq_layer.experts, "linear_fc2")
            if mode == "ep":  # rank r held experts 2r, 2r+1 whole
                assert torch.equal(fc1, torch.cat([s["linear_fc1"] for s in shards]))
                assert torch.equal(fc2, torch.cat([s["linear_fc2"] for s in shards]))
            else:  # rank r held [gate_r; linear_r] rows of fc1 and a column block of fc2
                f = config.moe_ffn_hidden_size // 2
                gate = torch.cat([s["linear_fc1"][:, :f] for s in shards], dim=1)
                linear = torch.cat([s["linear_fc1"][:, f:] for s in shards], dim=1)
                assert torch.equal(fc1, torch.cat([gate, linear], dim=1))
                assert torch.equal(fc2, torch.cat([s["linear_fc2"] for s in shards], dim=2))


def test_delayed_histories_travel_with_plain_and_distributed_checkpoints(world, recwarn):
    """fp8_recipe="delayed": the amax histories are the layers' _extra_state (as TE's FP8 metadata
    is), in a plain state_dict and in Megatron's distributed checkpoint, and load back exactly."""
    needs_psutil()
    from megatron.core import dist_checkpointing

    from turbo_moe import Float8Config

    config = make_config(num_moe_experts=4)
    options = tm.TurboMoEOptions(fp8=Float8Config(strategy="delayed", amax_history_len=3))

    def build():
        return tm.TurboMoEGroupedMLP(4, config, pg_collection=default_pg(), options=options)

    def histories(experts):
        return [getattr(experts, n).fp8_delayed.input.state for n in ("linear_fc1", "linear_fc2")] + \
            [getattr(experts, n).fp8_delayed.grad_output.state for n in ("linear_fc1", "linear_fc2")]

    src = build()
    randomize_(src, seed=5)
    for mag in (1.0, 3.0, 0.5):
        y, _ = src(torch.randn(10, config.hidden_size) * mag, torch.tensor([3, 0, 5, 2]), torch.rand(10))
        y.sum().backward()
    want = [h.clone() for h in histories(src)]
    assert all(h is not None and (h[2:] > 0).all() for h in want)

    plain = build()
    plain.load_state_dict(src.state_dict(), strict=True)
    assert all(torch.equal(g, w) for g, w in zip(histories(plain), want))

    with tempfile.TemporaryDirectory() as d:
        dist_checkpointing.save(src.sharded_state_dict(prefix="experts."), d)
        dist = build()
        loaded = dist_checkpointing.load(dist.sharded_state_dict(prefix="experts."), d)
        dist.load_state_dict({k[len("experts."):]: v for k, v in loaded.items()}, strict=True)
    assert all(torch.equal(g, w) for g, w in zip(histories(dist), want))
    assert not [w for w in recwarn if "_extra_state" in str(w.message)]  # ours is not TE's metadata
    # TE's (empty) extra state in their place: nothing of ours to restore, so the histories reset
    te_style = {k: (torch.empty(0, dtype=torch.uint8) if k.endswith("_extra_state") else v)
                for k, v in src.state_dict().items()}
    dist.load_state_dict(te_style, strict=True)
    assert all(h is None for h in histories(dist))
