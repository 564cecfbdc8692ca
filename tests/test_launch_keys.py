"""The launch keys the call sites hand ``LeanLauncher.launch_keyed`` (kernels/triton/launch.py), on the CPU.

A keyed launch trusts its caller: one key must never stand for two Triton specializations, or a
hit would launch a kernel compiled for other argument facts (an alignment it does not have, a
32-bit offset where 64 bits are needed). The GPU tests check every hit against Triton's own
dispatch (TURBO_MOE_LAUNCH_CHECK=1); here the contract itself is checked on many calls: the
launchers are replaced by recorders, and any two launches of one kernel with the same key must
have the same argument facts (``arg_fact`` of every argument, every keyword's value).
"""

import itertools

import pytest
import torch

pytest.importorskip("triton")

from turbo_moe.backends import triton_backend  # noqa: E402
from turbo_moe.backends.base import GemmKind, GroupedGemmProblem  # noqa: E402
from turbo_moe.kernels.triton import fp8_cast  # noqa: E402
from turbo_moe.kernels.triton.launch import HostDesc, arg_fact, triton_args  # noqa: E402

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


class _Recorder:
    """A launcher that records ``(kernel, key, facts)`` instead of launching, the facts of the
    arguments as Triton receives them (host descriptors as ``TensorDescriptor``s), and every host
    descriptor's ``(cache_key, what it describes)`` in ``descriptors``."""

    def __init__(self, name, log, descriptors=None):
        self.name, self.log, self.descriptors = name, log, descriptors

    def launch_keyed(self, grid, key, *args, **kwargs):
        self.log.append((self.name, key, (tuple(map(arg_fact, triton_args(args))), tuple(kwargs.items()))))
        for arg in args:
            if type(arg) is HostDesc and self.descriptors is not None:
                self.descriptors.append((arg.cache_key, (arg.base.data_ptr(), arg.base.dtype, tuple(arg.shape),
                                                         tuple(arg.strides), tuple(arg.block_shape))))


def _assert_keys_determine_facts(log):
    seen = {}
    for name, key, facts in log:
        first = seen.setdefault((name, key), facts)
        assert first == facts, f"{name}: one key, two argument facts:\n{first}\n{facts}"
    return len(seen)


def _assert_descriptor_keys_determine_descriptors(descriptors):
    """A ``HostDesc.cache_key`` stands for one descriptor: the launcher reuses the expansion it made
    for the first (its address, dtype, shape, strides and block shape) for every later one."""
    seen = {}
    for key, described in descriptors:
        first = seen.setdefault(key, described)
        assert first == described, f"one descriptor key, two descriptors:\n{first}\n{described}"
    return len(seen)


def _shifted(shape, dtype, shift_bytes):
    """A tensor of ``shape`` whose storage starts ``shift_bytes`` (a multiple of its item size) past
    a 16-byte boundary."""
    numel = 1
    for s in shape:
        numel *= s
    item = torch.empty((), dtype=dtype).element_size()
    assert shift_bytes % item == 0
    buf = torch.empty(numel + 64 // item, dtype=dtype)
    return buf[shift_bytes // item:shift_bytes // item + numel].view(shape)


def test_cast_keys_determine_every_argument_fact(monkeypatch):
    log = []
    monkeypatch.setattr(fp8_cast, "_amax_partials", _Recorder("amax", log))
    monkeypatch.setattr(fp8_cast, "_tensorwise_cast", _Recorder("tensorwise", log))
    monkeypatch.setitem(fp8_cast._lean, "fp8_rowwise_cast_kernel", _Recorder("rowwise", log))
    monkeypatch.setitem(fp8_cast._lean, "fp8_colwise_grouped_cast_kernel", _Recorder("colwise", log))
    # Token counts that share their facts (17, 33: neither 1 nor a multiple of 16) and ones that
    # do not (1, 16, 48), 2-D and 3-D, aligned and not, two source dtypes, both FP8 formats.
    for rows, cols, batch, shift, dtype, fp8, margin in itertools.product(
            (1, 16, 17, 33, 48), (16, 40), (None, 3), (0, 8), (torch.bfloat16, torch.float32), (E4M3, E5M2), (0, 1)):
        shape = (rows, cols) if batch is None else (batch, rows, cols)
        x = _shifted(shape, dtype, shift).normal_()
        fmax = torch.finfo(fp8).max
        for write_rows, write_t in ((True, False), (True, True), (False, True)):
            fp8_cast.fp8_tensorwise_cast(x, fp8, fmax, margin, write_rows=write_rows, write_transposed=write_t)
        fp8_cast.fp8_rowwise_cast(x, fp8, fmax, margin)
        fp8_cast.fp8_colwise_grouped_cast(x, None, fp8, fmax, margin)
        if batch is None:
            offs = _shifted((4,), torch.int64, shift)  # misaligned with x
            offs.copy_(torch.tensor([0, rows // 3, rows // 2, rows]))
            fp8_cast.fp8_colwise_grouped_cast(x, offs, fp8, fmax, margin)
        if shift == 0 and batch is None:  # a strided (column-sliced) source of the same shape
            wide = torch.empty(rows, cols + 8, dtype=dtype).normal_()[:, :cols]
            fp8_cast.fp8_rowwise_cast(wide, fp8, fmax, margin)
            fp8_cast.fp8_colwise_grouped_cast(wide, None, fp8, fmax, margin)
    kernels = {name for name, _, _ in log}
    assert kernels == {"amax", "tensorwise", "rowwise", "colwise"}
    # Keys are shared where the facts are (17 and 33 rows), so the check compares real collisions.
    assert _assert_keys_determine_facts(log) < len(log)


class _FakeKernels:
    def __init__(self, log, descriptors):
        from turbo_moe.kernels.triton import grouped_gemm

        self.module = grouped_gemm
        for name in ("m_grouped_gemm_kernel", "m_grouped_gemm_tma_kernel", "k_grouped_gemm_kernel",
                     "k_grouped_gemm_tma_kernel"):
            setattr(self, name, _Recorder(name, log, descriptors))


def _problem(kind, m, n, k, groups, *, rowwise, shifts, out_given, accumulate=False):
    """A problem on fresh operands; ``shifts``: bytes past 16-byte alignment of (a_scale, b_scale,
    offsets, out)."""
    a_shift, b_shift, offs_shift, out_shift = shifts

    def scales(a_shape, b_shape):
        return (_shifted(a_shape, torch.float32, a_shift).fill_(0.5),
                _shifted(b_shape, torch.float32, b_shift).fill_(0.5))

    offs = _shifted((groups + 1,), torch.int64, offs_shift)
    offs.copy_(torch.linspace(0, m, groups + 1).round().to(torch.int64))
    if kind is GemmKind.M_GROUPED:
        a, b = torch.empty(m, k).to(E4M3), torch.empty(groups, n, k).to(E4M3)
        a_scale, b_scale = scales((m,), (groups, n)) if rowwise else scales((), ())
        out_shape = (m, n)
    else:
        a, b = torch.empty(n, m).to(E5M2), torch.empty(k, m).to(E4M3)
        a_scale, b_scale = scales((groups, n), (groups, k)) if rowwise else scales((), ())
        out_shape = (groups, n, k)
    out_dtype = torch.float32 if accumulate else torch.bfloat16
    out = _shifted(out_shape, out_dtype, out_shift) if out_given else None
    return GroupedGemmProblem(kind, a, b, a_scale, b_scale, offs, out_dtype, out=out, accumulate=accumulate,
                              role="test")


def test_gemm_plan_keys_determine_every_argument_fact(monkeypatch):
    log, descriptors = [], []
    monkeypatch.setattr(triton_backend, "_KERNELS", _FakeKernels(log, descriptors))
    backend = triton_backend.TritonBackend()
    plans = {}  # as TritonBackend.run caches them: one plan per (problem signature, config)
    candidates = {kind: list(triton_backend.GPU_CANDIDATES[kind]) + [triton_backend.INTERPRETER_CONFIG]
                  for kind in GemmKind}
    for kind, m, groups, rowwise, out_given, (n, k) in itertools.product(
            GemmKind, (17, 33, 64), (1, 3), (False, True), (False, True), ((32, 48), (40, 16))):
        for accumulate in ((False, True) if kind is GemmKind.K_GROUPED else (False,)):
            given = out_given or accumulate
            first = _problem(kind, m, n, k, groups, rowwise=rowwise, shifts=(0, 0, 0, 0), out_given=given,
                             accumulate=accumulate)
            # Twins: the same operands (so the same signature when the output is fresh) with fresh
            # scales, offsets and output at every combination of alignments, which the signature
            # does not describe: the launch key must, each on its own.
            for shifts in itertools.product((0, 8), repeat=4):  # 8 bytes: misaligned for every dtype here
                twin = _problem(kind, m, n, k, groups, rowwise=rowwise, shifts=shifts, out_given=given,
                                accumulate=accumulate)
                twin = GroupedGemmProblem(kind, first.a, first.b, twin.a_scale, twin.b_scale, twin.group_offs,
                                          first.out_dtype, out=twin.out, accumulate=accumulate, role="test")
                assert given or twin.signature() == first.signature()
                out = triton_backend._output(twin)
                for config in candidates[kind]:
                    key = (twin.signature(), config)
                    if key not in plans:
                        plans[key] = backend._make_plan(twin, out, config)
                    plans[key].launch(twin, out)
    kernels = {name for name, _, _ in log}
    assert kernels == {"m_grouped_gemm_kernel", "m_grouped_gemm_tma_kernel", "k_grouped_gemm_kernel",
                       "k_grouped_gemm_tma_kernel"}
    assert _assert_keys_determine_facts(log) < len(log)
    # Twins share a and b, so their descriptors' keys collide: the check compares real reuse.
    assert 0 < _assert_descriptor_keys_determine_descriptors(descriptors) < len(descriptors)


def test_a_key_that_misses_a_fact_is_caught():
    """The checker itself: two launches under one key whose alignments differ fail it."""
    aligned, shifted = _shifted((8,), torch.float32, 0), _shifted((8,), torch.float32, 8)
    log = []
    recorder = _Recorder("k", log)
    recorder.launch_keyed((1,), "same-key", aligned, 8, BLOCK=16)
    recorder.launch_keyed((1,), "same-key", shifted, 8, BLOCK=16)
    with pytest.raises(AssertionError, match="one key, two argument facts"):
        _assert_keys_determine_facts(log)


def test_a_descriptor_key_that_misses_a_field_is_caught():
    """The descriptor checker itself: one cache key over two block shapes (as a plan whose key
    dropped the slot would give a tile and its token tail) fails it."""
    t = torch.empty(64, 64).to(E4M3)
    descriptors = []
    recorder = _Recorder("k", [], descriptors)
    recorder.launch_keyed((1,), "k", HostDesc(t, [64, 64], [64, 1], [32, 32], ("plan", t.data_ptr())))
    recorder.launch_keyed((1,), "k", HostDesc(t, [64, 64], [64, 1], [32, 16], ("plan", t.data_ptr())))
    with pytest.raises(AssertionError, match="one descriptor key, two descriptors"):
        _assert_descriptor_keys_determine_descriptors(descriptors)
