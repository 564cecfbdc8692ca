"""Delayed scaling: each FP8 cast takes its scale from the amaxes of earlier casts of the same tensor.

``Float8Config(strategy="delayed")`` (Megatron's ``fp8_recipe="delayed"``, Transformer Engine's
``DelayedScaling``): the activations and gradients a GEMM quantizes (its input ``x`` in the forward,
its output gradient ``dy`` in the backward) are cast with ``fp8_max / amax_h * 2**-margin``, where
``amax_h`` is the newest (``amax_compute_algo="most_recent"``) or largest (``"max"``) of the last
``amax_history_len`` amaxes recorded for that tensor role, and each cast records its own amax. The
cast then needs no amax pass before it: one read of the tensor and one launch instead of two
(``kernels/triton/amax_history.py``), which is what makes it faster than current scaling. The
price is the usual one: a tensor whose amax outgrows its history's saturates at ``fp8_max`` (values
are clamped, never inf) until the next cast adapts.

Weights keep current scaling: they are quantized once per optimizer step (the FP8 weight cache), so
an amax pass over them costs little, and a delayed weight scale could only saturate after an update.

State: an :class:`AmaxHistory` per tensor role, two device buffers (the layout is
``amax_history``'s module docstring). :class:`DelayedScalingState` holds a GEMM's two roles;
``GroupedLinearFP8`` owns one per layer. The first cast of a role (or the first on a new device)
seeds the history with that tensor's own amax, so the first step is current-scaled rather than
cast with an arbitrary scale (Transformer Engine starts from scale 1). Warm a layer up before
capturing it in a CUDA graph: a seed captured in the graph would run on every replay (correct,
but current scaling again). The histories travel with the layer's ``state_dict`` (its
``_extra_state``: :meth:`DelayedScalingState.state_dict`, as Transformer Engine keeps its FP8
metadata there), so a resumed run casts with the scales the interrupted one would have used.

Where it differs from TE: weights current-scaled (above); an empty tensor records nothing; each
rank keeps its own histories (TE reduces amaxes over the data-parallel group, so its ranks share
scales; here each rank's scales fit its own tensors). Everything runs on the device; on a CPU the
torch ops below apply the same steps with the same float32 math.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ._triton_kernels import triton_kernels
from .config import Float8Config, fp8_max

__all__ = ["AmaxHistory", "DelayedScalingState", "delayed_state_for", "is_saved_delayed_state",
           "restore_delayed_state"]

# A saved DelayedScalingState is one float32 tensor (tensor-only, as TE's own extra state is, so
# that checkpoint formats holding tensors alone take it): a header of _HEADER values, then each
# role's AmaxHistory.saved() values. The header starts with a marker and the format version: what
# tells it from TE's FP8 metadata (a uint8 tensor) or anything else.
_MARKER, _VERSION, _HEADER = 7321.0, 1.0, 6


class AmaxHistory:
    """One tensor role's delayed-scaling state: ``state [2 + H]`` float32 (next scale, running amax
    of the cast in flight, then the history, newest first) and ``ticket [1]`` int32, on the device
    of the tensors it scales (allocated, and seeded, at their first cast)."""

    __slots__ = ("history_len", "most_recent", "state", "ticket")

    def __init__(self, history_len: int, most_recent: bool) -> None:
        self.history_len = history_len
        self.most_recent = most_recent
        self.state: Optional[torch.Tensor] = None
        self.ticket: Optional[torch.Tensor] = None

    @property
    def scale(self) -> Optional[torch.Tensor]:
        """The quantization scale the next cast will use (a 0-dim view), or None before the first."""
        return None if self.state is None else self.state[0]

    @property
    def history(self) -> Optional[torch.Tensor]:
        """The recorded amaxes, newest first (a view), or None before the first cast."""
        return None if self.state is None else self.state[2:]

    def reset(self) -> None:
        """Forget the history: the next cast seeds it again."""
        self.state = self.ticket = None

    def prepare(self, device: torch.device, fp8_dtype: torch.dtype, margin: int, amax_of: Callable[[], torch.Tensor]):
        """Allocate and seed the state on its first use, with ``amax_of()``, the amax of the tensor
        about to be cast: that first cast is current-scaled. A state on another device (a loaded
        one, or the layer moved) is moved, not re-seeded. Returns self."""
        if self.state is not None:
            if self.state.device != device:
                self.state = self.state.to(device)
                self.ticket = torch.zeros(1, dtype=torch.int32, device=device)
            return self
        from .quantize import _quant_scale

        amax = amax_of().float()
        scale = _quant_scale(amax, fp8_dtype, margin)
        state = torch.zeros(2 + self.history_len, dtype=torch.float32, device=device)
        state[0] = torch.where(torch.isfinite(amax) & (amax > 0), scale, torch.ones_like(scale))
        state[2] = amax
        self.state = state
        self.ticket = torch.zeros(1, dtype=torch.int32, device=device)
        return self

    def saved(self) -> Optional[torch.Tensor]:
        """A CPU copy of ``[scale, history...]`` (``1 + history_len`` float32), or None before the
        first cast. Reads the device (a sync): for checkpoints, not the step."""
        if self.state is None:
            return None
        state = self.state.detach().cpu()
        return torch.cat((state[:1], state[2:]))

    def load(self, saved: Optional[torch.Tensor]) -> None:
        """Restore :meth:`saved`'s ``[scale, history...]``; None forgets the history (the next cast
        seeds it). A saved history of another length keeps its newest entries (padded with zeros,
        which neither reduction picks over a recorded amax). Loads in place when the state already
        lives on a device, so a captured CUDA graph keeps reading it."""
        if saved is None:
            self.reset()
            return
        saved = saved.detach().to("cpu", torch.float32).reshape(-1)
        if saved.numel() < 2:
            raise ValueError(f"a saved amax history holds a scale and at least one amax, got {saved.numel()} values")
        fresh = torch.zeros(2 + self.history_len, dtype=torch.float32)
        fresh[0] = saved[0]
        kept = min(self.history_len, saved.numel() - 1)
        fresh[2:2 + kept] = saved[1:1 + kept]
        if self.state is not None:
            self.state.copy_(fresh)
            self.ticket.zero_()
        else:
            self.state, self.ticket = fresh, torch.zeros(1, dtype=torch.int32)

    def quantize(self, t: torch.Tensor, fp8_dtype: torch.dtype, margin: int, *, rows: bool, transposed: bool):
        """Tensorwise FP8 of ``t`` ([R, C] or [B, R, C]) with this role's scale, recording t's amax.
        Returns ``(rows_fp8, transposed_fp8, dequant_scale)`` as
        ``quantize.quantize_tensorwise_layouts``; ``dequant_scale`` is the scale this cast used."""
        state = self.state
        if state is None or state.device != t.device:  # first use (or a move): no import, no closure per call
            from .quantize import _amax

            self.prepare(t.device, fp8_dtype, margin, lambda: _amax(t))
        kernels = _history_kernels(t)
        if kernels is not None:
            return kernels.fp8_tensorwise_cast_delayed(t, self.state, self.ticket, self.history_len, self.most_recent,
                                                       fp8_dtype, fp8_max(fp8_dtype), margin, rows, transposed)
        return self._quantize_torch(t, fp8_dtype, margin, rows, transposed)

    def _quantize_torch(self, t, fp8_dtype, margin, rows, transposed):
        from .quantize import _amax, _cast

        scale = self.state[0].clone()
        dequant = scale.reciprocal()
        if t.numel() == 0 or not (rows or transposed):
            return (torch.empty(t.shape, dtype=fp8_dtype, device=t.device) if rows else None,
                    torch.empty(t.shape[:-2] + t.shape[:-3:-1], dtype=fp8_dtype, device=t.device) if transposed
                    else None, torch.ones_like(dequant))
        q = _cast(t, scale, fp8_dtype)
        self.record(_amax(t), fp8_dtype, margin)
        return (q.contiguous() if rows else None, q.transpose(-1, -2).contiguous() if transposed else None, dequant)

    def record(self, amax: torch.Tensor, fp8_dtype: torch.dtype, margin: int) -> None:
        """What a cast kernel's last program does (``amax_history``): roll ``amax`` into the history
        and store the next scale for ``fp8_dtype`` and ``margin``, in torch ops (the CPU path). The
        state must exist (a cast seeded it)."""
        from .quantize import _quant_scale

        state = self.state
        state[2:] = torch.cat((amax.float().reshape(1), state[2:-1]))
        amax_h = state[2] if self.most_recent else state[2:].max()  # torch's max keeps NaN
        usable = torch.isfinite(amax_h) & (amax_h > 0)
        state[0] = torch.where(usable, _quant_scale(amax_h, fp8_dtype, margin), state[0])


def _history_kernels(t: torch.Tensor):
    """``turbo_moe.kernels.triton.amax_history`` for 2-D/3-D GPU tensors, or None (CPU, or no triton)."""
    return triton_kernels("amax_history") if t.is_cuda and t.dim() in (2, 3) else None


class DelayedScalingState:
    """The amax histories of one FP8 GEMM's quantized activations: ``input`` (x, forward) and
    ``grad_output`` (dy, backward; in an expert MLP, fc1's is the SwiGLU backward's ``dh``)."""

    __slots__ = ("input", "grad_output")

    def __init__(self, config: Float8Config) -> None:
        if not config.delayed:
            raise ValueError(f"DelayedScalingState is for Float8Config(strategy='delayed'), got {config.strategy.value!r}")
        most_recent = config.amax_compute_algo == "most_recent"
        self.input = AmaxHistory(config.amax_history_len, most_recent)
        self.grad_output = AmaxHistory(config.amax_history_len, most_recent)

    def reset(self) -> None:
        self.input.reset()
        self.grad_output.reset()

    def state_dict(self) -> torch.Tensor:
        """What a checkpoint keeps (``_extra_state`` of the layer owning this state): a float32 CPU
        tensor ``[marker, version, history_len, most_recent, n_input, n_grad_output]`` followed by
        the ``input`` and ``grad_output`` roles' :meth:`AmaxHistory.saved` values (``n = 0`` for a
        role not used yet)."""
        roles = [self.input.saved(), self.grad_output.saved()]
        sizes = [0.0 if r is None else float(r.numel()) for r in roles]
        header = torch.tensor([_MARKER, _VERSION, float(self.input.history_len), float(self.input.most_recent),
                               *sizes], dtype=torch.float32)
        return torch.cat([header] + [r for r in roles if r is not None])

    def load_state_dict(self, state: torch.Tensor) -> None:
        """Restore :meth:`state_dict`'s histories (this recipe's settings stay: a history saved with
        another length or reduction is taken as recorded, ``AmaxHistory.load``)."""
        if not is_saved_delayed_state(state):
            raise ValueError("not a saved turbo_moe delayed-scaling state (DelayedScalingState.state_dict()'s "
                             f"float32 tensor): {type(state).__name__}")
        values = state.detach().to("cpu", torch.float32)
        n_input, n_grad = int(values[4].item()), int(values[5].item())
        if values.numel() != _HEADER + n_input + n_grad:
            raise ValueError(f"a saved delayed-scaling state of {values.numel()} values, its header promising "
                             f"{_HEADER} + {n_input} + {n_grad}")
        body = values[_HEADER:]
        self.input.load(body[:n_input] if n_input else None)
        self.grad_output.load(body[n_input:] if n_grad else None)


def restore_delayed_state(delayed: Optional[DelayedScalingState], state, owner: str) -> bool:
    """Apply a layer's saved ``_extra_state`` to its delayed-scaling state ``delayed`` (None when the
    layer scales with the current amax). Returns False, touching nothing, when ``state`` is neither
    None nor :meth:`DelayedScalingState.state_dict`'s (the caller decides what else it accepts).
    None (a checkpoint without histories) makes the next casts seed afresh; saved histories loaded
    into a current-scaling layer are dropped with a warning."""
    if state is None:
        if delayed is not None:
            delayed.reset()
        return True
    if not is_saved_delayed_state(state):
        return False
    if delayed is None:
        import warnings

        warnings.warn(f"{owner}: the checkpoint's delayed-scaling amax histories were dropped: this layer scales "
                      "with the current amax (Float8Config(strategy='delayed') would use them)", UserWarning,
                      stacklevel=3)
        return True
    delayed.load_state_dict(state)
    return True


def is_saved_delayed_state(state) -> bool:
    """Whether ``state`` (a layer's ``_extra_state``) is :meth:`DelayedScalingState.state_dict`'s."""
    return (isinstance(state, torch.Tensor) and state.dtype == torch.float32 and state.dim() == 1
            and state.numel() >= _HEADER and state[0].item() == _MARKER and state[1].item() == _VERSION)


def delayed_state_for(config: Optional[Float8Config]) -> Optional[DelayedScalingState]:
    """A fresh state when ``config`` asks for delayed scaling, else None."""
    if config is None or not config.delayed:
        return None
    return DelayedScalingState(config)
