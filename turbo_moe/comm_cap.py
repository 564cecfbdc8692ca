"""How many SMs/CUs the expert GEMMs may take when a communication kernel runs beside them.

``num_cu`` caps the persistent grid of turbo_moe's kernels so that an NCCL all-to-all launched on
another stream finds free SMs and runs *beside* the GEMM instead of queueing behind it. The rule
(docs/expert_parallel.md gives the justification and how to check it on a machine):

    num_cu = SMs - CTAs the communication kernel launches, rounded down to an even count
             (SMs come in pairs, a TPC), and never below half of the SMs.

NCCL launches one CTA per channel; how many it may launch comes from, in this order:
``comm_ctas=`` (the caller's own count), ``NCCL_MAX_CTAS``, ``NCCL_MAX_P2P_NCHANNELS`` (all-to-all
is point-to-point in NCCL), ``NCCL_MAX_NCHANNELS``, and otherwise :data:`DEFAULT_COMM_CTAS` -- a
default to be replaced by the measured best cap (``scripts/ep_overlap_bench.py`` prints it).

What the user sets always wins: an explicit ``num_cu`` or the environment variable
``TURBO_MOE_NUM_CU`` (an int, or ``all`` for no cap). With no communication to leave room for
(one rank in the expert-parallel group) the rule returns None: all SMs.

Pure host code, no device query unless ``num_sms`` is None.
"""

from __future__ import annotations

import os
from typing import Mapping, Optional

__all__ = ["num_cu_for_comm", "comm_ctas_from_env", "DEFAULT_COMM_CTAS", "NUM_CU_ENV"]

NUM_CU_ENV = "TURBO_MOE_NUM_CU"

# NCCL's compile-time channel limit (MAXCHANNELS) is 32 in the NCCL 2.1x-2.2x releases that torch
# ships; one CTA per channel. An intra-node all-to-all over NVLink rarely needs them all, so this is
# the conservative end: the overlap benchmark's measured best cap replaces it per machine.
DEFAULT_COMM_CTAS = 32

# Variables read, in order of precedence: the first one set decides.
_NCCL_CTA_VARS = ("NCCL_MAX_CTAS", "NCCL_MAX_P2P_NCHANNELS", "NCCL_MAX_NCHANNELS")


def _positive_int(value, name: str) -> int:
    try:
        parsed = int(str(value).strip())
    except ValueError:
        raise ValueError(f"{name} must be a positive integer, got {value!r}") from None
    if parsed < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return parsed


def comm_ctas_from_env(env: Optional[Mapping[str, str]] = None) -> tuple[int, str]:
    """(CTAs the NCCL kernel may launch, where that number came from)."""
    env = os.environ if env is None else env
    for name in _NCCL_CTA_VARS:
        if env.get(name, "").strip():
            return _positive_int(env[name], name), name
    return DEFAULT_COMM_CTAS, "default"


def _device_sms() -> int:
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("num_cu_for_comm: no GPU visible and num_sms not given")
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def num_cu_for_comm(
    num_cu: Optional[int] = None,
    *,
    num_sms: Optional[int] = None,
    comm_ctas: Optional[int] = None,
    ep_size: int = 2,
    env: Optional[Mapping[str, str]] = None,
) -> Optional[int]:
    """The ``num_cu`` to give the expert GEMMs that co-run with expert-parallel communication.

    Args:
        num_cu: the user's own choice; returned unchanged when given (checked).
        num_sms: SMs/CUs of the device (None: read from the current CUDA device).
        comm_ctas: CTAs the communication kernel launches (None: from NCCL's environment, else
            :data:`DEFAULT_COMM_CTAS`).
        ep_size: ranks in the expert-parallel group; 1 means no all-to-all: no cap (None).
        env: environment to read (default ``os.environ``); for tests.

    Returns None for "all SMs", else a cap in ``[num_sms // 2, num_sms]``.
    """
    env = os.environ if env is None else env
    if num_cu is not None:
        if isinstance(num_cu, bool) or not isinstance(num_cu, int) or num_cu < 1:
            raise ValueError(f"num_cu must be None or a positive int, got {num_cu!r}")
        return num_cu
    user = env.get(NUM_CU_ENV, "").strip()
    if user:
        return None if user.lower() == "all" else _positive_int(user, NUM_CU_ENV)
    if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1:
        raise ValueError(f"ep_size must be a positive int, got {ep_size!r}")
    if ep_size == 1:
        return None
    sms = _device_sms() if num_sms is None else num_sms
    if isinstance(sms, bool) or not isinstance(sms, int) or sms < 2:
        raise ValueError(f"num_sms must be an int >= 2, got {sms!r}")
    ctas = comm_ctas_from_env(env)[0] if comm_ctas is None else _positive_int(comm_ctas, "comm_ctas")
    cap = (sms - ctas) // 2 * 2
    # Below half the SMs the GEMM slows more than the all-to-all gains (the scaling target
    # only holds down to half); an NCCL allowed that many CTAs is better capped itself (NCCL_MAX_CTAS).
    return max(cap, sms // 2)
