"""Checkpoint layout of the grouped linear: TE's per-expert names in ``state_dict`` and Megatron's
``[E, out, in]`` ShardedTensors (GLU halves sharded apart) in ``sharded_state_dict``."""

from __future__ import annotations

import re
from typing import Optional

import torch
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group
from megatron.core.utils import get_pg_rank, get_pg_size

from ..delayed_scaling import is_saved_delayed_state, restore_delayed_state
from .options import warn_once

_INDEXED_EXTRA_STATE = re.compile(r"^_extra_state\d+$")


def _warn_if_te_fp8_state(state) -> None:
    """TE stores an empty tensor (or None) when it has no FP8 state; anything else is its FP8
    metadata, in TE's own layout, which turbo_moe does not read (its delayed scaling keeps its own
    histories, ``turbo_moe.delayed_scaling``)."""
    if state is None or (isinstance(state, torch.Tensor) and state.numel() == 0):
        return
    warn_once("te_extra_state", "a Transformer Engine _extra_state with FP8 metadata (scales / amax history) "
              "was dropped on load: turbo_moe's experts keep their own scaling state")


class GroupedLinearCheckpointMixin:
    """The checkpoint methods of :class:`TurboGroupedLinear` (needs its ``weight``, ``bias``,
    ``num_gemms``, ``parallel_mode``, ``tp_rank`` / ``tp_size``, ``glu_fc1`` and ``_pg_collection``)."""

    def _register_checkpoint_hooks(self) -> None:
        self.register_state_dict_post_hook(GroupedLinearCheckpointMixin._present_per_expert_tensors)
        self.register_load_state_dict_pre_hook(GroupedLinearCheckpointMixin._accept_per_expert_tensors)

    def get_extra_state(self):
        # The ``_extra_state`` key Megatron's / TE's layouts carry: the amax histories under
        # fp8_recipe="delayed" (turbo_moe.delayed_scaling), None otherwise.
        delayed = getattr(self, "fp8_delayed", None)
        return None if delayed is None else delayed.state_dict()

    def set_extra_state(self, state) -> None:
        # Our own delayed-scaling state, or None; Transformer Engine's FP8 metadata (scales, amax
        # history in its own layout) is dropped, with a warning the first time one that holds
        # something is dropped.
        delayed = getattr(self, "fp8_delayed", None)
        if not restore_delayed_state(delayed, state, type(self).__name__):
            if delayed is not None:  # TE's metadata says nothing of our histories: the next casts seed afresh
                delayed.reset()
            _warn_if_te_fp8_state(state)

    @staticmethod
    def _present_per_expert_tensors(module, state_dict, prefix, local_metadata) -> None:
        """state_dict hook: ``weight`` ``[E, out, in]`` -> ``weight0..weight{E-1}`` (TE's names)."""
        for name in ("weight", "bias"):
            key = prefix + name
            if key in state_dict:
                stacked = state_dict.pop(key)
                for e in range(module.num_gemms):
                    state_dict[f"{prefix}{name}{e}"] = stacked[e]

    @staticmethod
    def _accept_per_expert_tensors(module, state_dict, prefix, local_metadata, strict, missing_keys,
                                   unexpected_keys, error_msgs) -> None:
        """load_state_dict pre-hook: stack ``weight{i}`` / ``bias{i}`` into the fused parameters.

        Accepts TE's per-GEMM keys, a single stacked ``weight`` (TE's ``single_grouped_weight``
        and our own sharded checkpoints), and drops TE's per-GEMM ``_extra_state{i}``.
        """
        for key in [k for k in state_dict if k.startswith(prefix)]:
            if _INDEXED_EXTRA_STATE.match(key[len(prefix):]):
                extra = state_dict.pop(key)  # ours repeats ``_extra_state`` per expert: one copy is enough
                if not is_saved_delayed_state(extra):
                    _warn_if_te_fp8_state(extra)
        # A checkpoint without the extra state (a SequentialMLP layout renamed by hand, say) loads
        # strictly too: no saved histories, so delayed scaling seeds afresh.
        state_dict.setdefault(prefix + "_extra_state", None)
        for name in ("weight", "bias"):
            indexed = [f"{prefix}{name}{e}" for e in range(module.num_gemms)]
            present = [k for k in indexed if k in state_dict]
            if not present:
                continue
            if len(present) != module.num_gemms:
                missing = [k for k in indexed if k not in state_dict]
                error_msgs.append(f"{prefix}{name}: the checkpoint has {len(present)} of {module.num_gemms} "
                                  f"per-expert tensors (missing {missing[:4]})")
                continue
            if prefix + name in state_dict:
                error_msgs.append(f"{prefix}{name}: the checkpoint has both the stacked and per-expert tensors")
                continue
            state_dict[prefix + name] = torch.stack([state_dict.pop(k) for k in indexed])
        # Any other ``weight{N}`` (e.g. from a checkpoint with more local experts) is left for
        # load_state_dict to report as unexpected.

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """Megatron distributed-checkpoint entries, in the layout of TE's grouped linear.

        Sharded keys are ``{prefix}weight`` / ``{prefix}bias`` (``TEGroupedMLP`` then renames the
        prefix to ``...experts.linear_fc{1,2}.``) with global shape ``[E_global, out, in]``. This
        rank holds experts ``[ep_rank*E_local, (ep_rank+1)*E_local)`` and its ETP shard. The
        data of the weight entry is the Parameter itself, so Megatron's optimizer checkpointing
        finds it. Under ``singleton_local_shards`` each expert is its own entry, as in TE.
        """
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        singleton = metadata.get("singleton_local_shards", False)
        ep_group = self._pg_collection.ep
        ep_size, ep_rank = get_pg_size(ep_group), get_pg_rank(ep_group)
        edp_rank = get_pg_rank(self._pg_collection.expt_dp)
        num_global = ep_size * self.num_gemms
        first_global = ep_rank * self.num_gemms
        prepend = len(sharded_offsets)
        out = {}
        for name in ("weight", "bias"):
            param = getattr(self, name)
            if param is None:
                continue
            # Axis of the per-expert tensor that ETP shards (None: replicated, the row bias).
            tp_axis = 0 if self.parallel_mode == "column" else (1 if name == "weight" and self.parallel_mode == "row" else None)
            replica_id = (0, 0 if tp_axis is not None else self.tp_rank, edp_rank)
            if singleton:
                for e in range(self.num_gemms):
                    offsets = list(sharded_offsets)
                    if tp_axis is not None:
                        offsets.append((prepend + tp_axis, self.tp_rank, self.tp_size))
                    out[f"{prefix}{name}{e}"] = ShardedTensor.from_rank_offsets(
                        f"{first_global + e}.{prefix}{name}", param[e], *offsets,
                        replica_id=replica_id, prepend_axis_num=prepend,
                    )
                continue
            expert_offset = (prepend, ep_rank, ep_size)
            if self.glu_fc1:
                out[f"{prefix}{name}"] = self._glu_sharded_factory(
                    f"{prefix}{name}", param, sharded_offsets, expert_offset, replica_id
                )
                continue
            offsets = [*sharded_offsets, expert_offset]
            if tp_axis is not None:
                offsets.append((prepend + 1 + tp_axis, self.tp_rank, self.tp_size))
            out[f"{prefix}{name}"] = ShardedTensor.from_rank_offsets(
                f"{prefix}{name}", param, *offsets, replica_id=replica_id, prepend_axis_num=prepend
            )
        extra = self.get_extra_state()
        for e in range(self.num_gemms):
            global_e = first_global + e
            if singleton:
                key, offsets = f"{global_e}.{prefix}_extra_state", tuple(sharded_offsets)
            else:
                key, offsets = f"{prefix}_extra_state", (*sharded_offsets, (prepend, global_e, num_global))
            if offsets:
                shape = tuple(frag for _, _, frag in sorted(offsets))
                offset = tuple(off for _, off, _ in sorted(offsets))
            else:
                shape, offset = (1,), (0,)
            out[f"{prefix}_extra_state{'' if e == 0 else e}"] = ShardedObject(
                key, extra, shape, offset, replica_id=(0, self.tp_rank, edp_rank)
            )
        return out

    def _glu_sharded_factory(self, key, param, sharded_offsets, expert_offset, replica_id):
        """Gate and linear halves of a GLU fc1 as separately sharded blocks (Megatron's layout).

        The local ``[E, 2F/t, in]`` tensor is ``[gate_r; linear_r]`` along dim 1; the checkpoint's
        global ``[E, 2F, in]`` is ``[gate; linear]``, so ETP rank r's gate block is chunk r and its
        linear block chunk t + r of 2t along that axis.
        """
        prepend = len(sharded_offsets)
        tp_rank, tp_size = self.tp_rank, self.tp_size
        axis = prepend + 1

        @torch.no_grad()
        def build(key, t, replica_id, flattened_range):
            gate, lin = torch.chunk(t, 2, dim=1)
            return [
                ShardedTensor.from_rank_offsets(key, gate, *sharded_offsets, expert_offset,
                                                (axis, tp_rank, 2 * tp_size), replica_id=replica_id,
                                                prepend_axis_num=prepend),
                ShardedTensor.from_rank_offsets(key, lin, *sharded_offsets, expert_offset,
                                                (axis, tp_size + tp_rank, 2 * tp_size), replica_id=replica_id,
                                                prepend_axis_num=prepend),
            ]

        def merge(sub_state_dict):
            with torch.no_grad():
                return torch.cat(sub_state_dict, dim=1)

        return ShardedTensorFactory(key, param, build, merge, replica_id)
