"""The one-launch device offsets kernel (``kernels/triton/group_offsets.py``).

On the CPU it runs in Triton's interpreter (a subprocess: Triton fixes a kernel's mode at import),
where device asserts are compiled out, so invalid routing there shows the clamp alone: offsets
always inside [0, M] and non-decreasing, whatever the routing says. On a GPU (marked ``gpu``) the
asserts are live; ``tests/test_autograd_gpu.py`` checks that bad routing fails loudly.
"""

import textwrap

import pytest

from interpreter_child import assert_prints_ok, run_on_gpu

CHECK = textwrap.dedent(
    """
    import torch
    from turbo_moe.kernels.triton.group_offsets import resolve_group_offs
    device = DEVICE
    gen = torch.Generator().manual_seed(0)
    for G in (1, 2, 7, 64, 300):
        for dt in (torch.int32, torch.int64):
            lens = torch.randint(0, 50, (G,), generator=gen, dtype=dt)
            if G > 2:
                lens[G // 2] = 0  # an empty group
            M = int(lens.sum())
            ref = torch.cat([torch.zeros(1, dtype=torch.int64), lens.long().cumsum(0)])
            got = resolve_group_offs(lens.to(device), M, True).cpu()
            assert got.dtype == torch.int64 and torch.equal(got, ref), (G, dt, got, ref)
            got = resolve_group_offs(ref.to(dt).to(device), M, False).cpu()
            assert torch.equal(got, ref), (G, dt)
    if CLAMP:
        for src, m, from_lens, want in (
            ([3, -1, 2], 4, True, [0, 3, 3, 4]),        # negative size: clamped to 0, then to M
            ([5, 5], 7, True, [0, 5, 7]),               # sums past M
            ([0, 4, 2, 9], 6, False, [0, 4, 4, 6]),     # decreasing and past M
            ([-3, 2, 8], 5, False, [0, 2, 5]),          # negative start
        ):
            got = resolve_group_offs(torch.tensor(src).to(device), m, from_lens).cpu().tolist()
            assert got == want, (src, m, got, want)
    print("ok")
    """
)


def test_offsets_kernel_in_interpreter():
    assert_prints_ok(CHECK.replace("DEVICE", "'cpu'").replace("CLAMP", "True"))


@pytest.mark.gpu
def test_offsets_kernel_on_gpu():
    run_on_gpu(CHECK.replace("DEVICE", "'cuda'").replace("CLAMP", "False"), "offsets_check")
