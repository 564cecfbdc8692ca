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

from turbo_moe.kernels.triton.launch import LeanLauncher, arg_fact  # noqa: E402


@triton.jit
def _toy_kernel(x_ptr, n, stride, BLOCK: tl.constexpr, FLAG: tl.constexpr = False):
    pass


def test_facts_separate_what_triton_specializes_on():
    base = torch.empty(64, dtype=torch.float32)
    assert arg_fact(base) != arg_fact(base[1:])  # 16-byte aligned or not
    assert arg_fact(base) != arg_fact(base.to(torch.bfloat16))  # dtype
    ints = [1, 2, 16, 17, 32, 2**31 - 1, 2**31, -5]
    facts = {v: arg_fact(v) for v in ints}
    assert facts[1] != facts[2] != facts[16]  # ==1, %16
    assert facts[2**31 - 1] != facts[2**31]  # i32 vs i64
    assert facts[16] == facts[32] and facts[2] == facts[17]  # same specialization, same key
    assert arg_fact(None) != arg_fact(True) != arg_fact(False)


def test_descriptor_facts_cover_block_shape_and_strides():
    from triton.tools.tensor_descriptor import TensorDescriptor

    t = torch.empty(64, 64, dtype=torch.float32)
    a = TensorDescriptor(t, [64, 64], [64, 1], [16, 16])
    b = TensorDescriptor(t, [64, 64], [64, 1], [32, 16])
    c = TensorDescriptor(t, [60, 64], [64, 1], [16, 16])
    assert len({arg_fact(a), arg_fact(b), arg_fact(c)}) == 3


def test_constexpr_tail_follows_the_signature_with_defaults():
    launcher = LeanLauncher(_toy_kernel)
    args = (torch.empty(4), 4, 1)
    assert launcher._constexpr_values(args, {"BLOCK": 128, "num_warps": 4}) == (128, False)
    assert launcher._constexpr_values(args, {"BLOCK": 64, "FLAG": True}) == (64, True)
    with pytest.raises(TypeError, match="runtime argument 'stride' must be positional"):
        launcher._constexpr_values(args[:2], {"stride": 1, "BLOCK": 64})
    with pytest.raises(TypeError, match="constexpr 'BLOCK' has no value"):
        launcher._constexpr_values(args, {})


class _Param:
    def __init__(self, name, is_constexpr, default=None, has_default=False):
        self.name, self.is_constexpr, self.default, self.has_default = name, is_constexpr, default, has_default


class _LauncherOfTriton36:
    """Triton 3.6's ``CudaLauncher.__call__`` (the argument order it hands its C ``launch``), on a
    recorder: what the direct launch must reproduce."""

    def __init__(self, calls, scratch_size=0):
        self.launch = lambda *a: calls.append(("c", a))
        self.global_scratch_size, self.global_scratch_align = scratch_size, 128
        self.profile_scratch_size, self.profile_scratch_align = 0, 1
        self.launch_cooperative_grid, self.launch_pdl, self.num_ctas = False, True, 1

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        scratch = ("scratch", gridX * gridY * gridZ * self.num_ctas * self.global_scratch_size) \
            if self.global_scratch_size else None
        self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl,
                    scratch, None, *args)


_LauncherOfTriton36.__name__ = "CudaLauncher"


class _FakeCompiled:
    def __init__(self, runner):
        self.run, self.function, self.packed_metadata = runner, "fn-handle", "packed"


class _FakeJit:
    """A ``@triton.jit`` stand-in: ``fn[grid](...)`` counts Triton-path launches and returns one
    compiled kernel per specialization (here: per alignment of the tensor argument)."""

    __name__ = "fake_kernel"

    def __init__(self, runner_factory):
        self.params = [_Param("x_ptr", False), _Param("n", False), _Param("BLOCK", True),
                       _Param("FLAG", True, False, True)]
        self.triton_path = []
        self.compiled = {}
        self._runner_factory = runner_factory

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            self.triton_path.append((grid, args, kwargs))
            return self.compiled.setdefault(arg_fact(args[0]), _FakeCompiled(self._runner_factory()))
        return call


@pytest.fixture
def fake_cuda(monkeypatch):
    from turbo_moe.kernels.triton import launch

    monkeypatch.setattr(launch, "_cuda_get_device", lambda: 0)
    monkeypatch.setattr(launch, "_cuda_raw_stream", lambda device: 77)
    monkeypatch.delenv("TURBO_MOE_LAUNCH_CHECK", raising=False)
    return launch


def test_keyed_launch_binds_the_kernel_the_full_path_memoized(fake_cuda):
    calls = []
    fn = _FakeJit(lambda: (lambda *a: calls.append(("run", a))))
    launcher = LeanLauncher(fn)
    x = torch.empty(64)
    launcher.launch_keyed((3,), "k", x, 5, BLOCK=16)  # miss: Triton's own path
    assert len(fn.triton_path) == 1 and not calls
    kernel = launcher.launch_keyed((3,), "k", x, 5, BLOCK=16)  # hit: the compiled kernel's launcher
    assert len(fn.triton_path) == 1
    assert calls == [("run", (3, 1, 1, 77, "fn-handle", "packed", None, None, None, x, 5, 16, False))]
    assert kernel is fn.compiled[arg_fact(x)]
    # The key is the caller's: another key for the misaligned tensor finds its own kernel.
    launcher.launch_keyed((3,), "k-misaligned", x[1:], 5, BLOCK=16)
    launcher.launch_keyed((3,), "k-misaligned", x[1:], 5, BLOCK=16)
    assert calls[-1][1][9].data_ptr() == x[1:].data_ptr() and len(fn.compiled) == 2
    assert launcher.hits == 2 and launcher.misses == 2


def test_keyed_launch_takes_tritons_path_while_a_launch_hook_is_set(fake_cuda, monkeypatch):
    calls = []
    fn = _FakeJit(lambda: (lambda *a: calls.append(a)))
    launcher = LeanLauncher(fn)
    x = torch.empty(64)
    launcher.launch_keyed((1,), "k", x, 5, BLOCK=16)
    runtime = fake_cuda._runtime_knobs()
    monkeypatch.setattr(runtime, "launch_enter_hook", lambda *a: None)
    launcher.launch_keyed((1,), "k", x, 5, BLOCK=16)
    assert len(fn.triton_path) == 2 and not calls


@pytest.mark.parametrize("scratch_size", [0, 64])
def test_direct_launch_passes_what_tritons_launcher_passes(fake_cuda, monkeypatch, scratch_size):
    """With a launcher object of the known layout the hit calls its C entry directly, with the
    arguments (and scratch) its __call__ would have passed."""
    direct, via_call = [], []
    fn = _FakeJit(lambda: _LauncherOfTriton36(direct, scratch_size))
    launcher = LeanLauncher(fn)
    x = torch.empty(64)
    allocations = []
    real_empty = torch.empty
    # (no GPU here: the scratch is made on the CPU, its request recorded)
    monkeypatch.setattr(torch, "empty", lambda *a, **k: allocations.append((a, dict(k))) or real_empty(
        *a, **{**k, "device": "cpu"}))
    launcher.launch_keyed((2, 3), "k", x, 5, BLOCK=16)
    launcher.launch_keyed((2, 3), "k", x, 5, BLOCK=16)
    compiled = fn.compiled[arg_fact(x)]
    reference = _LauncherOfTriton36(via_call, scratch_size)
    reference(2, 3, 1, 77, "fn-handle", "packed", None, None, None, x, 5, 16, False)
    (_, got), (_, want) = direct[-1], via_call[-1]
    assert got[:7] == want[:7] and got[8:] == want[8:]
    if scratch_size:  # a torch allocation of the size Triton's allocator would have been asked for
        assert got[7].dtype == torch.int8 and got[7].numel() == want[7][1] == 6 * scratch_size
        assert allocations and allocations[-1][1]["device"] == 0
    else:
        assert got[7] is None and want[7] is None and not allocations
    assert isinstance(compiled.run, _LauncherOfTriton36)


def test_direct_launch_only_for_the_known_launcher_layout(monkeypatch):
    from turbo_moe.kernels.triton.launch import _DIRECT_LAYOUT, _direct_launch, _launcher_layout_known

    assert _launcher_layout_known(_LauncherOfTriton36)
    assert _direct_launch(_LauncherOfTriton36([])) is not None
    monkeypatch.setenv("TURBO_MOE_DIRECT_LAUNCH", "0")  # the switch back to CompiledKernel.run
    assert _direct_launch(_LauncherOfTriton36([])) is None
    monkeypatch.delenv("TURBO_MOE_DIRECT_LAUNCH")
    with_profile_scratch = _LauncherOfTriton36([])
    with_profile_scratch.profile_scratch_size = 64  # (instrumented kernels: Triton's own path)
    assert _direct_launch(with_profile_scratch) is None

    class CudaLauncher:  # another layout (Triton 3.9 passes hooks and signatures itself)
        def __call__(self, gridX, gridY, gridZ, stream, function, kernel_metadata, *args):
            pass

    assert not _launcher_layout_known(CudaLauncher)
    assert _direct_launch(lambda *a: None) is None  # not a launcher object at all
    try:
        from triton.backends.nvidia.driver import CudaLauncher as Installed
    except Exception:  # noqa: BLE001  (a Triton build without the NVIDIA backend)
        return
    import inspect

    assert _launcher_layout_known(Installed) == (tuple(inspect.signature(Installed.__call__).parameters)
                                                 == _DIRECT_LAYOUT)


# Triton 3.6's descriptor wrapper (triton/backends/nvidia/driver.py, wrap_handle_tensordesc), on a
# recorder: the launcher object's ``launch`` is this ``inner`` closure when the kernel takes host
# TMA descriptors. The direct launch unwraps it by these names, so the replica keeps them.
_BASE_ARGS_FORMAT_LEN = 13
_expansions = []


def make_tensordesc_arg(arg, metadata):
    _expansions.append(arg.base.data_ptr())
    return [("tensor-map", arg.base.data_ptr(), tuple(arg.block_shape), metadata["swizzle"]), *arg.shape, *arg.strides]


def _wrap_handle_tensordesc(launcher, signature, tensordesc_meta):
    tensordesc_indices = set(i for i, sig in enumerate(signature.values()) if sig.startswith("tensordesc"))

    def inner(*args):
        final_args = list(args[:_BASE_ARGS_FORMAT_LEN])
        tensordesc_idx = 0
        for i, arg in enumerate(args[_BASE_ARGS_FORMAT_LEN:]):
            if i in tensordesc_indices:
                final_args.extend(make_tensordesc_arg(arg, tensordesc_meta[tensordesc_idx]))
                tensordesc_idx += 1
            else:
                final_args.append(arg)
        return launcher(*final_args)

    return inner


_DESC_SIGNATURE = {"a_desc": "tensordesc<fp8e4nv[16, 32]>", "b_desc": "tensordesc<fp8e4nv[16, 32]>",
                   "n": "i32", "BLOCK": "constexpr", "FLAG": "constexpr"}


class _DescLauncherOfTriton36(_LauncherOfTriton36):
    def __init__(self, calls, metas=({"swizzle": 3}, {"swizzle": 2})):
        super().__init__(calls)
        self.launch = _wrap_handle_tensordesc(lambda *a: calls.append(("c", a)), _DESC_SIGNATURE, metas)


_DescLauncherOfTriton36.__name__ = "CudaLauncher"


class _DescJit(_FakeJit):
    def __init__(self, runner_factory):
        super().__init__(runner_factory)
        self.params = [_Param("a_desc", False), _Param("b_desc", False), _Param("n", False), _Param("BLOCK", True),
                       _Param("FLAG", True, False, True)]


def _host_descs(a, b, plan="plan"):
    from turbo_moe.kernels.triton.launch import HostDesc

    return (HostDesc(a, [64, 64], [64, 1], [16, 32], (plan, 0, a.data_ptr())),
            HostDesc(b, [32, 64], [64, 1], [16, 32], (plan, 1, b.data_ptr())))


def test_direct_launch_expands_each_descriptor_once_per_key(fake_cuda):
    """Unwrapped from Triton's descriptor wrapper, a hit passes the C entry exactly what the wrapper
    would, and expands a descriptor once per cache key (again for a new address)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    direct, via_wrapper = [], []
    fn = _DescJit(lambda: _DescLauncherOfTriton36(direct))
    launcher = LeanLauncher(fn)
    a, b, b2 = (torch.empty(64, 64).to(torch.float8_e4m3fn) for _ in range(3))
    launcher.launch_keyed((4,), "k", *_host_descs(a, b), 5, BLOCK=16)  # miss: Triton's path gets TensorDescriptors
    assert all(isinstance(d, TensorDescriptor) for d in fn.triton_path[-1][1][:2])
    memo = next(iter(launcher._memo.values()))
    assert memo.direct is not None and isinstance(memo.direct[4], tuple)  # unwrapped
    _expansions.clear()
    for _ in range(3):
        launcher.launch_keyed((4,), "k", *_host_descs(a, b), 5, BLOCK=16)
    assert _expansions == [a.data_ptr(), b.data_ptr()]  # once per key, not per launch
    reference = _DescLauncherOfTriton36(via_wrapper)
    reference(4, 1, 1, 77, "fn-handle", "packed", None, None, None,
              TensorDescriptor(a, [64, 64], [64, 1], [16, 32]), TensorDescriptor(b, [32, 64], [64, 1], [16, 32]),
              5, 16, False)
    assert direct[-1] == via_wrapper[-1]
    launcher.launch_keyed((4,), "k", *_host_descs(a, b2), 5, BLOCK=16)  # a new address: a new expansion
    assert _expansions[-1] == b2.data_ptr() and direct[-1][1][13 + 5][1] == b2.data_ptr()


def test_descriptor_wrapper_without_metadata_is_called_as_is(fake_cuda):
    """Without TMA metadata Triton's wrapper passes the tensor itself (nothing address-only to
    cache): the direct launch then calls the wrapper, with TensorDescriptor arguments."""
    from turbo_moe.kernels.triton.launch import _WRAPPED

    calls = []
    seen = []
    fn = _DescJit(lambda: _DescLauncherOfTriton36(calls, metas=(None, None)))
    launcher = LeanLauncher(fn)
    a, b = (torch.empty(64, 64).to(torch.float8_e4m3fn) for _ in range(2))
    launcher.launch_keyed((4,), "k", *_host_descs(a, b), 5, BLOCK=16)
    memo = next(iter(launcher._memo.values()))
    assert memo.direct[4] is _WRAPPED
    memo.direct = (lambda *args: seen.append(args),) + memo.direct[1:]
    launcher.launch_keyed((4,), "k", *_host_descs(a, b), 5, BLOCK=16)
    assert [type(x).__name__ for x in seen[-1][13:15]] == ["TensorDescriptor", "TensorDescriptor"]
