"""Process-group setup shared by the torchrun scripts (``ep_train.py``, ``ep_overlap_bench.py``)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def init_torchrun(cpu: bool) -> torch.device:
    """Join torchrun's process group and return this rank's device: NCCL on the GPU named by
    ``LOCAL_RANK`` (made current), or gloo on the CPU (``--cpu``: the CI runs)."""
    if cpu:
        dist.init_process_group("gloo")
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=device)
    return device
