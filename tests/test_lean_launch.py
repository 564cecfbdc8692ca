"""The lean launcher's memo key and argument layout (kernels/triton/launch.py), on the CPU.

What it can be checked for without a GPU: that the key separates every argument fact Triton
specializes on (so one memoized kernel never serves two Triton specializations), and that the
constexpr tail it appends matches the kernel signature, defaults included. The GPU tests run with
TURBO_MOE_LAUNCH_CHECK=1, which compares every lean hit with Triton's own dispatch.
"""

import os

import pytest
import torch

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    pytest.skip("needs compiled-mode kernel objects", allow_module_level=True)

import triton.language as tl  # noqa: E402

from turbo_moe.kernels.triton.launch import LeanLauncher, _arg_fact  # noqa: E402


@triton.jit
def _toy_kernel(x_ptr, n, stride, BLOCK: tl.constexpr, FLAG: tl.constexpr = False):
    pass


def test_facts_separate_what_triton_specializes_on():
    base = torch.empty(64, dtype=torch.float32)
    assert _arg_fact(base) != _arg_fact(base[1:])  # 16-byte aligned or not
    assert _arg_fact(base) != _arg_fact(base.to(torch.bfloat16))  # dtype
    ints = [1, 2, 16, 17, 32, 2**31 - 1, 2**31, -5]
    facts = {v: _arg_fact(v) for v in ints}
    assert facts[1] != facts[2] != facts[16]  # ==1, %16
    assert facts[2**31 - 1] != facts[2**31]  # i32 vs i64
    assert facts[16] == facts[32] and facts[2] == facts[17]  # same specialization, same key
    assert _arg_fact(None) != _arg_fact(True) != _arg_fact(False)


def test_descriptor_facts_cover_block_shape_and_strides():
    from triton.tools.tensor_descriptor import TensorDescriptor

    t = torch.empty(64, 64, dtype=torch.float32)
    a = TensorDescriptor(t, [64, 64], [64, 1], [16, 16])
    b = TensorDescriptor(t, [64, 64], [64, 1], [32, 16])
    c = TensorDescriptor(t, [60, 64], [64, 1], [16, 16])
    assert len({_arg_fact(a), _arg_fact(b), _arg_fact(c)}) == 3


def test_constexpr_tail_follows_the_signature_with_defaults():
    launcher = LeanLauncher(_toy_kernel)
    args = (torch.empty(4), 4, 1)
    assert launcher._constexpr_values(args, {"BLOCK": 128, "num_warps": 4}) == (128, False)
    assert launcher._constexpr_values(args, {"BLOCK": 64, "FLAG": True}) == (64, True)
    with pytest.raises(TypeError, match="runtime argument 'stride' must be positional"):
        launcher._constexpr_values(args[:2], {"stride": 1, "BLOCK": 64})
    with pytest.raises(TypeError, match="constexpr 'BLOCK' has no value"):
        launcher._constexpr_values(args, {})
