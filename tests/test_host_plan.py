"""Host launch plans on the CPU: the C++ parameter patching, the address-to-source mapping and the
refusal rules (turbo_moe/host_plan.py). Replays themselves need a GPU: tests/test_host_plan_gpu.py."""

import shutil
import struct
import types

import pytest
import torch

from turbo_moe import host_plan


def test_sources_map_addresses_to_inputs_and_allocations_or_refuse():
    base = torch.empty(64, dtype=torch.float32)
    view = base[8:24]
    alloc = torch.empty(100, dtype=torch.uint8)
    sources = host_plan._Sources([view], [alloc])
    assert sources.find(view.data_ptr(), "x") == (0, 0)
    assert sources.find(view.data_ptr() + 12, "x") == (0, 12)
    assert sources.find(alloc.data_ptr() + 99, "x") == (1, 99)
    with pytest.raises(host_plan.RecordingRefused, match="nowhere known"):
        sources.find(base.data_ptr(), "x")  # before the input's first element: not the input's memory
    with pytest.raises(host_plan.RecordingRefused, match="nowhere known"):
        sources.find(view.data_ptr() + 16 * 4, "x")  # one past its last element


@pytest.mark.parametrize("granularity", ["tensorwise", "rowwise", "blockwise", "mxfp8"])
def test_cached_weight_inputs_each_own_their_memory(granularity):
    """A cached weight's plan inputs never overlap (an address inside two inputs is refused, which
    the GPU test found for blockwise: W^T's block scales are a transposed view of W's), and every
    pointer a GEMM takes from the cache lies inside one of them."""
    from turbo_moe import Float8Config
    from turbo_moe.autograd import cached_weight_inputs, cached_weight_key, quantize_weight

    w = torch.randn(3, 256, 384, dtype=torch.bfloat16)
    w_fp8 = quantize_weight(w, Float8Config(granularity=granularity))
    inputs = [t for t in cached_weight_inputs(w_fp8) if t is not None]
    sources = host_plan._Sources(inputs, [])
    for t in inputs:  # no address is inside two inputs
        start, size = host_plan.storage_extent(t)
        for address in (start, start + size - 1):
            sources.find(address, granularity)
    for t in (w_fp8.data, w_fp8.scale, w_fp8.data_t, w_fp8.scale_t):
        sources.find(t.data_ptr(), granularity)
    shared = cached_weight_key(w_fp8)[1]
    assert shared == (granularity in ("tensorwise", "blockwise")), (granularity, shared)


def test_cached_weight_scales_in_one_buffer_stay_two_inputs():
    """Both scales as disjoint views of one allocation (as a kernel writing both may make them)
    are two inputs, each its own memory: dropping one would hand the plan a None."""
    from turbo_moe.autograd import Float8Weight, cached_weight_inputs, cached_weight_key

    buffer = torch.ones(2 * 3 * 64)
    scale, scale_t = buffer[:192].view(3, 64), buffer[192:].view(3, 64)
    w_fp8 = Float8Weight(torch.empty(3, 64, 64), scale, torch.empty(3, 64, 64), scale_t)
    assert cached_weight_key(w_fp8)[1] is False and cached_weight_inputs(w_fp8)[3] is scale_t
    overlapping = Float8Weight(w_fp8.data, scale, w_fp8.data_t, scale.transpose(0, 1))
    assert cached_weight_key(overlapping)[1] is True and cached_weight_inputs(overlapping)[3] is None


def test_region_keeps_the_python_run_when_recording_is_refused(monkeypatch):
    """A region doing a torch op (no plan possible): the result is the one Python run's, run once
    per call, and after MAX_ATTEMPTS refusals the signature stays on its Python path."""
    pytest.importorskip("triton")
    monkeypatch.setattr(host_plan, "_extension", lambda: object())  # refused before it is used
    region = host_plan.Region("test")
    runs = []

    def fn(t):
        runs.append(1)
        return (t + 1,)

    t = torch.arange(4.0)
    for i in range(host_plan.RECORD_AFTER + host_plan.MAX_ATTEMPTS + 2):
        (out,) = region(("k",), (t,), lambda: fn(t), pure=True)
        assert torch.equal(out, t + 1)
    assert len(runs) == host_plan.RECORD_AFTER + host_plan.MAX_ATTEMPTS + 2
    assert region.replays == 0
    # Never recorded: a compute op (add) is refused before anything else is looked at.
    assert region.refusals and all("aten op add" in r for r in region.refusals), region.refusals
    assert len(region.refusals) == host_plan.MAX_ATTEMPTS


def test_region_stops_recording_a_static_key_whose_token_counts_keep_changing(monkeypatch):
    """Token counts that change call to call (expert parallelism, dropless routing) repeat now and
    then; each repeat would be recorded (a host sync, a plan kept for good). Past
    MAX_PLANS_PER_STATIC_KEY plans of one static key, new signatures of it keep the Python path and
    say so once; its recorded plans still replay, and other static keys still record."""
    recorded = []

    class _Plan:
        def __init__(self, tag):
            self.plan_id, self.tag = 10**6 + len(recorded), tag

        def replay(self, inputs):
            return ("replayed", self.tag)

    def record(ext, inputs, fn, pure):
        recorded.append(inputs[0].shape[0])
        return fn(), _Plan(inputs[0].shape[0]), ""

    monkeypatch.setattr(host_plan, "_extension", lambda: object())
    monkeypatch.setattr(host_plan, "_record", record)
    monkeypatch.setattr(host_plan, "MAX_PLANS_PER_STATIC_KEY", 4)
    region = host_plan.Region("test")

    def call(rows, static=("k",)):
        t = torch.empty(rows, 2)
        return region(static, (t,), lambda: ("python", rows), pure=True)

    for rows in range(1, 8):  # seven token counts, each called twice: the first four are recorded
        assert call(rows) == ("python", rows)
        assert call(rows) == ("python", rows)
    assert recorded == [1, 2, 3, 4]
    assert call(3) == ("replayed", 3) and call(7) == ("python", 7)
    assert region.refused((("k",), host_plan.fact(torch.empty(7, 2))))
    assert not region.refused((("k",), host_plan.fact(torch.empty(3, 2))))
    assert sum("keep the Python path" in r for r in region.refusals) == 1, region.refusals
    call(9, static=("other",))
    call(9, static=("other",))
    assert recorded[-1] == 9
    region.clear()  # forgets the counts too
    call(7)
    call(7)
    assert recorded[-1] == 7


def test_region_is_bypassed_when_plans_are_off():
    region = host_plan.Region("test")
    previous = host_plan.set_enabled(False)
    try:
        t = torch.ones(3)
        for _ in range(5):
            (out,) = region(("k",), (t,), lambda: (t * 2,), pure=True)
        assert region.refusals == [] and region.replays == 0
    finally:
        host_plan.set_enabled(previous)


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="no C++ compiler")
def test_extension_writes_each_address_into_the_parameter_bytes():
    ext = host_plan._extension()
    if ext is None:
        pytest.skip(host_plan.status())
    template = bytearray(64)
    template[16:20] = struct.pack("<i", 1234)  # a scalar parameter stays as recorded
    template[40:48] = b"\xaa" * 8
    error, plan = ext.add_plan(
        4, [(0, [3, 1, 1], 128, 0, bytes(template), [0, 8, 16, 24, 32],
             [(0, 0, 0), (8, 1, 32), (24, 3, 16), (32, 2, 0)])])
    assert error == "" and plan >= 0
    error, (packed,) = ext.packed(plan, [0x1000, 0x2000, 0x9000, 0xA000])
    assert error == ""
    words = struct.unpack("<8Q", packed)
    assert words[0] == 0x1000 and words[1] == 0x2000 + 32 and words[3] == 0xA000 + 16 and words[4] == 0x9000
    assert struct.unpack("<i", packed[16:20])[0] == 1234 and packed[40:48] == b"\xaa" * 8
    # Errors come back as text (no C++ exception leaves the extension), naming what is wrong.
    error, _ = ext.add_plan(1, [(0, [1, 1, 1], 32, 0, bytes(16), [0], [(0, 3, 0)])])
    assert "bad address slot" in error
    error, _ = ext.add_plan(1, [(0, [1, 1, 1], 32, 0, bytes(16), [0], [(12, 0, 0)])])
    assert "patch out of range" in error
    error, _ = ext.packed(10**6, [])
    assert "no plan" in error
    assert "takes 4 addresses" in ext.launch(plan, [1, 2], 0)


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="no C++ compiler")
def test_extension_replay_makes_the_registered_allocations_then_launches():
    """replay() makes a plan's allocations as set_allocs registered them (shape, strides, dtype,
    zero fill, each dropped one undefined) before its launches; on a machine without a GPU the
    launch then reports the missing driver as text, with the allocations still returned."""
    if torch.cuda.is_available():
        pytest.skip("a CPU-only check: the plan's kernel handle is a stand-in")
    ext = host_plan._extension()
    if ext is None:
        pytest.skip(host_plan.status())
    error, plan = ext.add_plan(4, [(0, [1, 1, 1], 32, 0, bytes(32), [0, 8, 16, 24],
                                    [(0, 0, 0), (8, 1, 0), (16, 2, 0), (24, 3, 0)])])
    assert error == ""
    error, allocs = ext.replay(plan, [torch.empty(8)], 0)
    assert "has no allocations set" in error and allocs == []
    specs = [([4, 3], [3, 1], torch.empty(0), False, [], []),
             ([2, 5], [1, 2], torch.empty(0, dtype=torch.float8_e4m3fn), False, [0], [0]),  # drops the first, and x
             ([6], [1], torch.empty(0, dtype=torch.int32), True, [], [])]
    assert ext.set_allocs(plan, specs) == ""
    error, allocs = ext.replay(plan, [torch.empty(8)], 0)
    assert "libcuda" in error or "cuLaunchKernel" in error, error
    assert allocs[0] is None
    assert allocs[1].shape == (2, 5) and allocs[1].stride() == (1, 2) and allocs[1].dtype == torch.float8_e4m3fn
    assert allocs[2].dtype == torch.int32 and torch.equal(allocs[2], torch.zeros(6, dtype=torch.int32))
    # Refusals come back as text, naming what is wrong.
    assert "released before it is made" in ext.set_allocs(plan, [([1], [1], torch.empty(0), False, [0], [])])
    assert "an input release out of range" in ext.set_allocs(plan, [([1], [1], torch.empty(0), False, [], [3])])
    assert "more allocations than address slots" in ext.set_allocs(plan, specs + specs)
    assert "no plan" in ext.set_allocs(10**6, [])


def test_release_schedule_frees_what_the_python_path_frees_between_launches():
    """A replay makes its allocations before launching: an allocation whose last launch precedes
    another's first is dropped before that one is made (the rowwise forward: x's rows copy, last
    read by the GEMM, before the token-major copy is made); outputs are never dropped."""
    # allocations: 0 x rows copy, 1 x scales, 2 y, 3 x token-major copy, 4 its scales
    uses = [[0, 1], [0, 1, 2], [3, 4]]  # rowwise cast, GEMM, columnwise cast
    schedule = host_plan.release_schedule(uses, 5, kept={2, 3, 4})
    assert schedule == [(), (), (), (0, 1), ()]
    # Used together to the end: nothing is dropped.
    assert host_plan.release_schedule([[0, 1, 2]], 3, kept=set()) == [(), (), ()]
    # An allocation no launch uses (its first use never comes) waits for nothing.
    assert host_plan.release_schedule([[0]], 2, kept=set()) == [(), (0,)]
    # A zero-filled allocation is filled when made, before any launch: no block is handed on.
    assert host_plan.release_schedule(uses, 5, kept={2, 3, 4}, zero_filled=True) == [()] * 5


def test_input_release_schedule_drops_a_handed_over_input_after_its_last_launch():
    """A backward's fused region (inputs 0 dy, 1 W^T, 2 x token-major; allocations 0 dy's rows
    copy, 1 its token-major copy, 2 dx, 3 dW): dy is last read by its cast (launch 0), so it is
    dropped before dx is made, which may then take its block; W^T and x's copy are read to the end.
    An input that is also an output is never dropped; nor anything before a zero-filled allocation."""
    alloc_uses = [[0, 1], [0, 2], [1, 3]]  # cast dy -> both layouts, dgrad, wgrad
    input_uses = [[0], [1], [2]]
    assert host_plan.input_release_schedule(alloc_uses, input_uses, 3, 4, kept=set()) == [(), (), (0,), (1,)]
    assert host_plan.input_release_schedule(alloc_uses, input_uses, 3, 4, kept={0}) == [(), (), (), (1,)]
    # An input no launch reads is dropped before the first allocation; with none made, nothing is.
    assert host_plan.input_release_schedule([[0]], [[]], 1, 1, kept=set()) == [(0,)]
    assert host_plan.input_release_schedule([[]], [[0]], 1, 0, kept=set()) == []
    assert host_plan.input_release_schedule(alloc_uses, input_uses, 3, 4, kept=set(), zero_filled=True) == [()] * 4


class _FakeExt:
    def __init__(self, info):
        self.info = info

    def param_info(self, function):
        return "", self.info


def _fake_launch(args, scratch=None):
    """A recorded launch of a kernel shaped like the casts (Triton 3.6's objects, as seen on the
    H100: ``src.signature`` with the specialized 1s and constexprs marked, the metadata, the lean
    launcher's memo with its direct-launch tuple)."""
    kernel = types.SimpleNamespace(
        name="cast_kernel", function=1234,
        src=types.SimpleNamespace(signature={"x_ptr": "*bf16", "out_ptr": "*fp8e4nv", "R": "i32",
                                             "stride_c": "constexpr", "scale": "fp32", "BLOCK": "constexpr"}),
        metadata=types.SimpleNamespace(num_warps=4, shared=8192, num_ctas=1, profile_scratch_size=0,
                                       tensordesc_meta=[]))
    memo = types.SimpleNamespace(kernel=kernel, direct=(None, False, False, 0, None), constexpr_values=(64,))
    return host_plan._Launch(memo, (7, 1, 1), args, scratch)


def test_launch_spec_lays_each_parameter_at_the_drivers_offset():
    x = torch.empty(100, 8, dtype=torch.bfloat16)
    out = torch.empty(800, dtype=torch.uint8)
    sources = host_plan._Sources([x], [out])
    # x, out, R, scale, then Triton's global and profile scratch pointers (stride_c == 1 and BLOCK
    # are constexprs: no parameter).
    info = [(0, 8), (8, 8), (16, 4), (20, 4), (24, 8), (32, 8)]
    spec = host_plan._launch_spec(_FakeExt(info), _fake_launch((x, out[16:], 100, 1, 0.5)), sources)
    function, grid, block, shared, params, offsets, patches = spec
    assert (function, grid, block, shared, offsets) == (1234, [7, 1, 1], 128, 8192, [0, 8, 16, 20, 24, 32])
    assert struct.unpack_from("<i", params, 16)[0] == 100 and struct.unpack_from("<f", params, 20)[0] == 0.5
    assert patches == [(0, 0, 0), (8, 1, 16)]  # x: input slot 0; out[16:]: allocation slot 1, 16 bytes in
    assert params[0:16] == bytes(16) and params[24:40] == bytes(16)  # addresses are written at replay


def test_launch_spec_refuses_what_it_cannot_replay():
    x = torch.empty(100, 8, dtype=torch.bfloat16)
    out = torch.empty(800, dtype=torch.uint8)
    sources = host_plan._Sources([x], [out])
    info = [(0, 8), (8, 8), (16, 4), (20, 4), (24, 8), (32, 8)]
    with pytest.raises(host_plan.RecordingRefused, match="the driver reports 5 parameters"):
        host_plan._launch_spec(_FakeExt(info[:5]), _fake_launch((x, out, 100, 1, 0.5)), sources)
    with pytest.raises(host_plan.RecordingRefused, match="a i32 parameter of 8 bytes"):
        host_plan._launch_spec(_FakeExt(info[:2] + [(16, 8)] + info[3:]), _fake_launch((x, out, 100, 1, 0.5)), sources)
    stranger = torch.empty(8, dtype=torch.uint8)  # neither an input nor an allocation of the call
    with pytest.raises(host_plan.RecordingRefused, match="points nowhere known"):
        host_plan._launch_spec(_FakeExt(info), _fake_launch((x, stranger, 100, 1, 0.5)), sources)
    launch = _fake_launch((x, out, 100, 1, 0.5))
    launch.memo.direct = (None, True, False, 0, None)  # a cooperative launch
    with pytest.raises(host_plan.RecordingRefused, match="not a plain direct launch"):
        host_plan._launch_spec(_FakeExt(info), launch, sources)


class _FakePlan:
    """What ``_verify`` reads of a plan: output specs and a replay (here a function of the inputs)."""

    def __init__(self, outputs, replay):
        self.outputs, self._replay = outputs, replay

    def replay(self, inputs):
        return self._replay(inputs)


def test_verify_frees_the_python_outputs_before_the_replay_and_hands_back_the_replays():
    """The recording check must not hold two sets of a region's outputs at once (a large weight's
    FP8 copies): the Python run's outputs are gone when the replay runs, and the replay's (the
    same bits, NaN payloads included) are what the caller gets."""
    import weakref

    x = torch.randn(4, 8)
    nan_bits = torch.tensor([float("nan")] * 3)
    python_out = (x * 2, nan_bits.clone(), None, x)  # an allocation, a NaN tensor, nothing, an input
    refs = [weakref.ref(python_out[0]), weakref.ref(python_out[1])]
    seen_alive = []

    def replay(inputs):
        seen_alive.extend(r() is not None for r in refs)
        return (inputs[0] * 2, nan_bits.clone(), None, inputs[0])

    plan = _FakePlan((("alloc", 0), ("alloc", 1), None, ("input", 0)), replay)
    holder = [python_out]
    del python_out
    outputs, why = host_plan._verify(plan, (x,), holder)
    assert why == "" and seen_alive == [False, False]
    assert torch.equal(outputs[0], x * 2) and outputs[2] is None and outputs[3] is x
    assert torch.isnan(outputs[1]).all()


def test_verify_refuses_a_differing_replay_and_restores_the_python_values():
    x = torch.randn(6, 5)
    base = torch.randn(6, 10)
    python_view = base[:, ::2]  # a strided output: restored with its strides
    expected = python_view.clone()
    plan = _FakePlan((("view", 0, (6, 5), (10, 2), 0),), lambda inputs: (torch.zeros(6, 10)[:, ::2],))
    outputs, why = host_plan._verify(plan, (x,), [(python_view,)])
    assert "differ from the Python run's" in why
    assert torch.equal(outputs[0], expected) and outputs[0].stride() == (10, 2)
    # Different strides are refused before the bytes are compared.
    plan = _FakePlan((("alloc", 0),), lambda inputs: (torch.zeros(5, 6).t(),))
    outputs, why = host_plan._verify(plan, (x,), [(x.clone(),)])
    assert "strides" in why and torch.equal(outputs[0], x) and outputs[0].stride() == x.stride()
