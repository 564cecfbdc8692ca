"""The Triton kernels of turbo_moe's quantization path compile for gfx950 (MI355X) on a CPU machine.

On an AMD GPU FlyDSL runs the GEMMs, but the casts that feed them (amax passes, tensorwise /
rowwise / delayed casts, the SwiGLU fused into fc2's quantization, fc1's FP8 ``dh``, the group
offsets) are these Triton kernels on every GPU. No AMD GPU is lent, so this compiles each one for
``GPUTarget("hip", "gfx950", 64)`` with the very arguments and constexprs the GPU host path
launches it with (recorded from ``scripts/host_glue_cpu.py``'s ``gpu_path_on_cpu``, which runs the
GPU code path on CPU tensors with launches made no-ops) and checks the ISA: no scratch (spills),
FP8 stores through the hardware conversion, the delayed casts' amax records as global atomics.
The GEMMs on ROCm are the pointer kernels (TMA is NVIDIA's): they run where FlyDSL does not take a
call (the hybrid format's e5m2 gradients, float32-scale blockwise), with the tile configurations of
``triton_backend.HIP_CANDIDATES``; each is compiled for gfx950 here, recorded from the same host
path with TMA declined, and must use FP8 MFMAs without scratch.
"""

import contextlib
import os
import re
import sys

import pytest
import torch

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    pytest.skip("compiles kernels (the interpreter runs them instead)", allow_module_level=True)
try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:  # pragma: no cover - a Triton without the AMD backend's compile entry
    pytest.skip("this Triton cannot compile for an explicit target", allow_module_level=True)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

import turbo_moe  # noqa: E402
from host_glue_cpu import gpu_path_on_cpu  # noqa: E402
from turbo_moe.bench.recipes import bench_float8_config  # noqa: E402
from turbo_moe.kernels.triton import launch  # noqa: E402

GFX950 = GPUTarget("hip", "gfx950", 64)
_TRITON_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32", torch.uint8: "u8",
                 torch.int64: "i64", torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"}
_LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "debug")
# NVIDIA-only launch options: recorded here (a CPU torch is not a ROCm one) but never passed on ROCm
# (e.g. the blockwise token cast's register cap, blockwise_cast._TOKEN_MAXNREG).
_NVIDIA_OPTIONS = ("maxnreg",)


@contextlib.contextmanager
def _first_launches(key_of, patches=()):
    """Inside ``gpu_path_on_cpu``: yields ``{key_of(fn, args, kwargs): (fn, args, kwargs)}`` of the
    first launch of every key that is not None, with ``patches`` (``(object, name, value)``)
    applied; the launcher and every patched name (set again inside the block or not) are restored
    on exit."""
    recorded = {}
    with gpu_path_on_cpu():
        stand_in = launch.LeanLauncher._first_launch
        saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]

        def record(self, key, grid, args, kwargs):
            k = key_of(self.fn, args, kwargs)
            if k is not None:
                recorded.setdefault(k, (self.fn, tuple(args), dict(kwargs)))
            return stand_in(self, key, grid, args, kwargs)

        launch.LeanLauncher._first_launch = record
        for obj, name, value in patches:
            setattr(obj, name, value)
        try:
            yield recorded
        finally:
            launch.LeanLauncher._first_launch = stand_in
            for obj, name, value in saved:
                setattr(obj, name, value)


def _linear_fwd_bwd(config, g, t, hidden, ffn):
    """One GroupedLinearFP8 fwd+bwd (no weight cache) on empty CPU tensors; returns ``(x, dy, lens)``."""
    lens = torch.full((g,), t, dtype=torch.int64)
    layer = turbo_moe.GroupedLinearFP8(g, hidden, ffn, config=config, device="meta", dtype=torch.bfloat16,
                                       backend="triton", cache_fp8_weight=False)
    layer.weight = torch.nn.Parameter(torch.empty(g, ffn, hidden, dtype=torch.bfloat16))
    x = torch.empty(g * t, hidden, dtype=torch.bfloat16).requires_grad_()
    dy = torch.empty(g * t, ffn, dtype=torch.bfloat16)
    torch.autograd.grad(layer(x, lens), (x, layer.weight), dy)
    return x, dy, lens


def _record_quantization_launches():
    """``{(kernel name, FP8 output dtypes): (jit function, args, kwargs)}``: the first launch of
    every non-GEMM kernel (per FP8 format it writes) a layer and a SwiGLU MLP fwd+bwd make, over
    the recipes with fused casts (hybrid format, so both e4m3 and e5m2 stores appear)."""
    def key_of(fn, args, kwargs):
        if "gemm" in fn.__name__:
            return None
        # one entry per kernel (per source for the rowwise layouts: x, the SwiGLU, its gradient) and
        # FP8 output format (hybrid: e4m3 activations, e5m2 gradients)
        name = fn.__name__ if "SOURCE" not in kwargs else f"{fn.__name__}:source{kwargs['SOURCE']}"
        return name, tuple(sorted({str(a.dtype) for a in args if isinstance(a, torch.Tensor)
                                   and a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)}))

    g, t, hidden, ffn = 4, 64, 256, 128
    with _first_launches(key_of) as recorded:
        for recipe in ("tensorwise", "rowwise", "tensorwise-delayed"):
            config = bench_float8_config("hybrid", recipe)
            x, _, lens = _linear_fwd_bwd(config, g, t, hidden, ffn)
            mlp = turbo_moe.GroupedSwiGLUMLPFP8(g, hidden, ffn, config=config, device="meta", dtype=torch.bfloat16,
                                                backend="triton")
            mlp.fc1.weight = torch.nn.Parameter(torch.empty(g, 2 * ffn, hidden, dtype=torch.bfloat16))
            mlp.fc2.weight = torch.nn.Parameter(torch.empty(g, hidden, ffn, dtype=torch.bfloat16))
            probs = torch.rand(g * t, requires_grad=True)
            y = mlp(x, lens, probs=probs)
            torch.autograd.grad(y, (x, probs), torch.empty_like(y))
    return recorded


_RECORDED = None


def _recorded():
    global _RECORDED
    if _RECORDED is None:
        _RECORDED = _record_quantization_launches()
    return _RECORDED


# What the hot path launches with the recipes above (the test fails if one goes unrecorded, so a
# renamed or new cast kernel is added here knowingly).
KERNELS = ["resolve_group_offs_kernel", "amax_partials_kernel", "fp8_cast_kernel", "zero_f32_kernel",
           *(f"rowwise_layouts_{step}_kernel:source{source}" for step in ("stats", "cast", "straddle")
             for source in range(3)),
           "fp8_cast_delayed_kernel", "swiglu_amax_partials_kernel",
           "swiglu_fp8_cast_kernel", "swiglu_backward_amax_kernel", "swiglu_backward_fp8_cast_kernel",
           "swiglu_fp8_cast_delayed_kernel", "swiglu_backward_fp8_delayed_kernel", "swiglu_dprobs_sum_kernel"]


def _signature(fn, args, kwargs):
    """ASTSource's (signature, constexprs, attrs) for a recorded launch, and its launch options."""
    runtime = [p for p in fn.params if not p.is_constexpr]
    assert len(runtime) == len(args), (fn.__name__, len(runtime), len(args))
    signature, attrs = {}, {}
    for i, (param, arg) in enumerate(zip(runtime, args)):
        if isinstance(arg, torch.Tensor):
            signature[param.name] = "*" + _TRITON_TYPES[arg.dtype]
            divisible = arg.data_ptr() % 16 == 0
        elif isinstance(arg, bool):
            signature[param.name] = "i1"
            divisible = False
        elif isinstance(arg, int):
            signature[param.name] = "i32" if -(2**31) <= arg < 2**31 else "i64"
            divisible = arg % 16 == 0
        elif isinstance(arg, float):
            signature[param.name] = "fp32"
            divisible = False
        else:
            raise AssertionError(f"{fn.__name__}: argument {param.name} of type {type(arg).__name__}")
        if divisible:
            attrs[(i,)] = [["tt.divisibility", 16]]
    constexprs = {k: v for k, v in kwargs.items() if k not in _LAUNCH_OPTIONS + _NVIDIA_OPTIONS}
    for name in constexprs:
        signature[name] = "constexpr"
    options = {k: v for k, v in kwargs.items() if k in _LAUNCH_OPTIONS}
    return signature, constexprs, attrs, options


def _gfx950_isa(fn, args, kwargs, label):
    """``(ISA, signature, constexprs)`` of a recorded launch compiled for gfx950; fails ``label``
    if the kernel needs scratch (register spills)."""
    signature, constexprs, attrs, options = _signature(fn, args, kwargs)
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                              target=GFX950, options=options)
    isa = compiled.asm["amdgcn"]
    scratch = [int(v) for v in re.findall(r"\.private_segment_fixed_size:\s+(\d+)", isa)]
    assert scratch and max(scratch) == 0, f"{label}: {scratch} bytes of scratch (register spills) on gfx950"
    return isa, signature, constexprs


def test_every_quantization_kernel_of_the_hot_path_is_recorded():
    recorded = _recorded()
    assert sorted({name for name, _ in recorded}) == sorted(KERNELS)
    # the tensorwise, rowwise and delayed casts write e5m2 (gradients) as well as e4m3
    for name in ("fp8_cast_kernel", "rowwise_layouts_cast_kernel:source0", "fp8_cast_delayed_kernel"):
        assert {formats for n, formats in recorded if n == name} == {
            ("torch.float8_e4m3fn",), ("torch.float8_e5m2",)}, name


@pytest.mark.parametrize("name", KERNELS)
def test_quantization_kernel_compiles_for_gfx950(name):
    variants = [(formats, launch_) for (n, formats), launch_ in _recorded().items() if n == name]
    assert variants
    for formats, recorded in variants:
        label = (name, formats)
        isa, signature, _ = _gfx950_isa(*recorded, label)
        fp8_out = {t for p, t in signature.items() if t in ("*fp8e4nv", "*fp8e5")}
        if "*fp8e4nv" in fp8_out:  # OCP e4m3 through gfx950's conversion instruction, not an emulation
            assert re.search(r"v_cvt_\w*pk_fp8_f32", isa), f"{label}: no hardware e4m3 conversion"
        if "*fp8e5" in fp8_out:
            assert re.search(r"v_cvt_\w*pk_bf8_f32", isa), f"{label}: no hardware e5m2 conversion"
        if "ticket_ptr" in signature:  # delayed scaling: the amax record and the ticket are global atomics
            assert "global_atomic_add" in isa and re.search(r"global_atomic_(smax|umax|max)", isa), label


def _record_pointer_gemm_launches():
    """``{(kernel, operand dtypes, rowwise, accumulate): (jit function, args, kwargs)}``: the pointer
    GEMMs of fwd+bwd as ROCm runs them (TMA declined), tensorwise and rowwise, e4m3 and hybrid, and
    the wgrad into an fp32 ``main_grad``."""
    from turbo_moe.autograd import grouped_wgrad_fp8
    from turbo_moe.backends import triton_backend

    def key_of(fn, args, kwargs):
        if "gemm" not in fn.__name__:
            return None
        dtypes = tuple(str(a.dtype) for a in args if isinstance(a, torch.Tensor))
        return fn.__name__, dtypes, (kwargs.get("A_ROWWISE"), kwargs.get("ACCUMULATE"))

    g, t, hidden, ffn = 4, 64, 256, 128
    declined = (triton_backend, "_tma_reason", lambda problem: "TMA is an NVIDIA Hopper+ feature")
    with _first_launches(key_of, [declined]) as recorded:
        for fmt in ("e4m3", "hybrid"):
            for recipe in ("tensorwise", "rowwise"):
                config = bench_float8_config(fmt, recipe)
                x, dy, _ = _linear_fwd_bwd(config, g, t, hidden, ffn)
                offs = torch.arange(0, g * t + 1, t, dtype=torch.int64)
                grouped_wgrad_fp8(dy, x.detach(), offs, config=config, backend="triton",
                                  main_grad=torch.empty(g, ffn, hidden, dtype=torch.float32))
    return recorded


def _hip_candidates(kind_name: str, accumulate: bool):
    from turbo_moe.backends.base import GemmKind
    from turbo_moe.backends.triton_backend import HIP_ACCUMULATE_CANDIDATES, HIP_CANDIDATES

    return HIP_ACCUMULATE_CANDIDATES if accumulate else HIP_CANDIDATES[GemmKind[kind_name]]


def _hip_gemm_cases():
    """(kind, into an fp32 main_grad, candidate index): what ``candidates_for`` offers on ROCm."""
    return [(kind, acc, i) for kind, acc in (("M_GROUPED", False), ("K_GROUPED", False), ("K_GROUPED", True))
            for i in range(len(_hip_candidates(kind, acc)))]


_GEMMS = None


def _gemms():
    global _GEMMS
    if _GEMMS is None:
        _GEMMS = _record_pointer_gemm_launches()
    return _GEMMS


def test_pointer_gemms_are_recorded_for_every_variant():
    kinds = {(name, dtypes[0], flags) for name, dtypes, flags in _gemms()}
    for fp8 in ("torch.float8_e4m3fn", "torch.float8_e5m2"):  # e5m2: hybrid dgrad / wgrad operand a
        for rowwise in (False, True):
            assert ("m_grouped_gemm_kernel", fp8, (rowwise, None)) in kinds, (fp8, rowwise, kinds)
            assert ("k_grouped_gemm_kernel", fp8, (rowwise, False)) in kinds, (fp8, rowwise, kinds)
            assert ("k_grouped_gemm_kernel", fp8, (rowwise, True)) in kinds, (fp8, rowwise, kinds)


@pytest.mark.parametrize("kind, accumulate, index", _hip_gemm_cases())
def test_hip_gemm_candidates_compile_for_gfx950_without_scratch(kind, accumulate, index):
    """Every ROCm tile candidate, for every recorded variant of its kernel (operand formats, rowwise
    scales; the fp32 main_grad accumulation for its own candidates), compiles for gfx950 to FP8
    MFMAs with no scratch."""
    config = _hip_candidates(kind, accumulate)[index]
    assert not config.tma  # ROCm has no TMA: the candidate describes the kernel that runs
    name = "m_grouped_gemm_kernel" if kind == "M_GROUPED" else "k_grouped_gemm_kernel"
    variants = [v for key, v in _gemms().items() if key[0] == name and bool(key[2][1]) == accumulate]
    assert len(variants) == 4  # e4m3 / e5m2 operand a, tensorwise / rowwise scales
    for fn, args, kwargs in variants:
        tiles = dict(kwargs, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                     GROUP_M=config.group_m, num_warps=config.num_warps, num_stages=config.num_stages)
        if "BAND_CYCLIC" in tiles:
            tiles["BAND_CYCLIC"] = config.band_cyclic
        label = (name, str(config), {k: kwargs.get(k) for k in ("A_ROWWISE", "ACCUMULATE")},
                 [str(a.dtype) for a in args if isinstance(a, torch.Tensor) and a.element_size() == 1])
        isa, _, _ = _gfx950_isa(fn, args, tiles, label)
        assert re.search(r"v_mfma\w*f8", isa), f"{label}: no FP8 MFMA"


def test_rocm_tunes_among_the_hip_candidates(monkeypatch):
    from types import SimpleNamespace

    from turbo_moe.backends.base import GemmKind
    from turbo_moe.backends.triton_backend import (ACCUMULATE_CANDIDATES, GPU_CANDIDATES, HIP_ACCUMULATE_CANDIDATES,
                                                   HIP_CANDIDATES, candidates_for)

    def problem(kind, accumulate=False):
        return SimpleNamespace(device=torch.device("cuda", 0), kind=kind, accumulate=accumulate, out=None,
                               swiglu_probs=None)

    monkeypatch.setattr(torch.version, "hip", "6.4.0")
    assert candidates_for(problem(GemmKind.M_GROUPED)) is HIP_CANDIDATES[GemmKind.M_GROUPED]
    assert candidates_for(problem(GemmKind.K_GROUPED)) is HIP_CANDIDATES[GemmKind.K_GROUPED]
    assert candidates_for(problem(GemmKind.K_GROUPED, True)) is HIP_ACCUMULATE_CANDIDATES
    monkeypatch.setattr(torch.version, "hip", None)
    # The Gluon configurations (the wgrads, the fwd/dgrad ping-pong) only where an sm_90 GPU takes
    # them (here: a device that is not one).
    from turbo_moe.backends import triton_backend

    monkeypatch.setattr(triton_backend, "_gluon_device_reason", lambda device: "not sm_90")
    assert candidates_for(problem(GemmKind.M_GROUPED)) == tuple(c for c in GPU_CANDIDATES[GemmKind.M_GROUPED]
                                                                if not c.gluon)
    assert candidates_for(problem(GemmKind.K_GROUPED, True)) == tuple(c for c in ACCUMULATE_CANDIDATES if not c.gluon)


def _record_block_scaled_launches():
    """``{(kernel, recipe, format, dot_scaled): (jit function, args, kwargs)}``: the fine-grained
    GEMMs (and their casts) of fwd+bwd as ROCm runs them: ``triton_gemm._HIP_DEFAULTS`` tiles,
    pointer kernels; MXFP8 both through ``tl.dot_scaled`` (gfx950's choice) and the promotion loop."""
    from turbo_moe.fine_grained import triton_gemm

    case = {}
    # set per case below; restored on exit
    patches = [(triton_gemm, "default_config", None), (triton_gemm, "use_dot_scaled", None)]
    with _first_launches(lambda fn, args, kwargs: (fn.__name__,) + case["key"], patches) as recorded:
        try:
            for recipe, dot_scaled in (("blockwise", False), ("mxfp8", True), ("mxfp8", False)):
                for fmt in ("e4m3", "hybrid"):
                    case["key"] = (recipe, fmt, dot_scaled)
                    triton_gemm._PLANS.clear()  # plans cache the dot_scaled choice (fixed per device in use)
                    triton_gemm.use_dot_scaled = lambda device, flag=dot_scaled: flag
                    # default_config's ROCm branch, for the CPU tensors of this harness
                    triton_gemm.default_config = lambda p, flag=dot_scaled: triton_gemm._HIP_DEFAULTS[
                        (p.recipe.block, p.recipe.e8m0 and flag, p.kind)]
                    _linear_fwd_bwd(bench_float8_config(fmt, recipe), 4, 128, 256, 256)
        finally:
            triton_gemm._PLANS.clear()
    return recorded


_BLOCK_SCALED = None


def _block_scaled():
    global _BLOCK_SCALED
    if _BLOCK_SCALED is None:
        _BLOCK_SCALED = _record_block_scaled_launches()
    return _BLOCK_SCALED


@pytest.mark.parametrize("recipe, dot_scaled", [("blockwise", False), ("mxfp8", True), ("mxfp8", False)])
def test_block_scaled_kernels_compile_for_gfx950_without_scratch(recipe, dot_scaled):
    """The fine-grained GEMMs with ROCm's default tiles and their casts, e4m3 and hybrid: no scratch;
    the GEMMs on FP8 MFMAs, MXFP8 through ``tl.dot_scaled`` on the MX-scaled MFMA."""
    cases = {key: v for key, v in _block_scaled().items() if key[1:2] == (recipe,) and key[3] == dot_scaled}
    names = {key[0] for key in cases}
    assert {"m_grouped_block_scaled_kernel", "k_grouped_block_scaled_kernel"} <= names, names
    for (name, _, fmt, _), (fn, args, kwargs) in cases.items():
        isa, _, _ = _gfx950_isa(fn, args, kwargs, f"{name} ({recipe}, {fmt})")
        if "block_scaled" in name:
            mfma = r"v_mfma_scale_f32\w*f8" if dot_scaled else r"v_mfma_f32\w*(f8|fp8|bf8)"
            assert re.search(mfma, isa), f"{name} ({recipe}, {fmt}): no {mfma}"


def test_rocm_block_scaled_defaults(monkeypatch):
    from types import SimpleNamespace

    from turbo_moe.backends.base import GemmKind
    from turbo_moe.fine_grained import triton_gemm

    monkeypatch.setattr(torch.version, "hip", "6.4.0")
    monkeypatch.setattr(triton_gemm, "use_dot_scaled", lambda device: True)
    for block, e8m0 in ((128, False), (32, True)):
        for kind in (GemmKind.M_GROUPED, GemmKind.K_GROUPED):
            problem = SimpleNamespace(device=torch.device("cuda", 0), kind=kind,
                                      recipe=SimpleNamespace(block=block, e8m0=e8m0))
            config = triton_gemm.default_config(problem)
            assert config is triton_gemm._HIP_DEFAULTS[(block, e8m0, kind)] and not config.tma


def test_wgrad_aligned_token_cast_compiles_for_gfx950(monkeypatch):
    """The fine-grained wgrad's token cast into the aligned layout (``quantize_tokens_aligned``:
    each group's first column a prefix sum over the groups before it, read in the kernel; the
    offsets written once, then reused), blockwise and MXFP8, e4m3 and e5m2: no scratch, FP8 stores
    through the hardware conversions."""
    from turbo_moe.fine_grained import quantize as Q
    from turbo_moe.kernels.triton import blockwise_cast as BC

    def key_of(fn, args, kwargs):
        return fn.__name__, kwargs["E8M0"], str(args[2].dtype), kwargs["TOKEN_ALIGN"], kwargs["WRITE_OFFS"], kwargs["FLAT"]

    offs = torch.tensor([0, 5, 5, 300, 333])
    x = torch.empty(333, 256, dtype=torch.bfloat16)
    cols = Q.aligned_token_columns(333, 4, 16)
    with _first_launches(key_of) as recorded:
        # both grids: the frontend's type checks (a loop-carried variable changing type) run only
        # in a compile, never in the interpreter
        for flat in (0, 1, 4):
            monkeypatch.setattr(BC, "_TOKEN_FLAT", flat)
            for recipe in (Q.BLOCKWISE, Q.MXFP8):
                for fp8, emax in ((torch.float8_e4m3fn, 8), (torch.float8_e5m2, 15)):
                    fp8_max = torch.finfo(fp8).max
                    _, _, aligned = BC.block_cast_tokens_aligned(x, offs, recipe, fp8, fp8_max, emax, 0, 16, cols)
                    BC.block_cast_tokens_aligned(x, offs, recipe, fp8, fp8_max, emax, 0, 16, cols, aligned)
    assert len(recorded) == 24 and {key[3] for key in recorded} == {16}, sorted(recorded)
    for key, (fn, args, kwargs) in recorded.items():
        isa, _, _ = _gfx950_isa(fn, args, kwargs, str(key))
        conversion = r"v_cvt_\w*pk_fp8_f32" if key[2] == "torch.float8_e4m3fn" else r"v_cvt_\w*pk_bf8_f32"
        assert re.search(conversion, isa), f"{key}: no {conversion}"


def test_wgrad_token_cast_probe_variants_compile_for_gfx950(monkeypatch):
    """The token cast's variants (scripts/probe_token_cast.py: two column tiles a program, the
    transposed tile from registers; the default has both): they compile for gfx950 too, no scratch,
    the FP8 conversion."""
    from turbo_moe.fine_grained import quantize as Q
    from turbo_moe.kernels.triton import blockwise_cast as BC

    def key_of(fn, args, kwargs):
        return fn.__name__, kwargs["COL_TILES"], kwargs["TRANS_REGS"]

    offs = torch.tensor([0, 5, 5, 300, 333])
    x = torch.empty(333, 256, dtype=torch.bfloat16)
    cols = Q.aligned_token_columns(333, 4, 16)
    monkeypatch.setattr(BC, "_TOKEN_FLAT", 1)
    with _first_launches(key_of) as recorded:
        for col_tiles, trans in ((2, False), (1, True)):
            monkeypatch.setattr(BC, "_TOKEN_COL_TILES", {128: col_tiles})
            monkeypatch.setattr(BC, "_TOKEN_TRANS_REGS", trans)
            BC.block_cast_tokens_aligned(x, offs, Q.BLOCKWISE, torch.float8_e4m3fn, 448.0, 8, 0, 16, cols)
    assert sorted(recorded) == [("block_cast_tokens_kernel", 1, True), ("block_cast_tokens_kernel", 2, False)]
    for key, (fn, args, kwargs) in recorded.items():
        isa, _, _ = _gfx950_isa(fn, args, kwargs, str(key))
        assert re.search(r"v_cvt_\w*pk_fp8_f32", isa), key


def test_fine_grained_swiglu_rows_cast_compiles_for_gfx950():
    """fc2's fused SwiGLU + rows cast under the fine-grained recipes (``swiglu_block_cast_rows``)
    and its backward with dh's rows copy (``swiglu_backward_block_rows``), blockwise and MXFP8:
    no scratch, the FP8 copies through the hardware FP8 conversion."""
    from turbo_moe.fine_grained import quantize as Q
    from turbo_moe.kernels.triton import swiglu_fp8 as SW

    def key_of(fn, args, kwargs):
        return fn.__name__, kwargs["E8M0"]

    h = torch.empty(333, 2 * 256, dtype=torch.bfloat16)
    probs = torch.empty(333, dtype=torch.float32)
    da = torch.empty(333, 256, dtype=torch.bfloat16)
    with _first_launches(key_of) as recorded:
        for recipe in (Q.BLOCKWISE, Q.MXFP8):
            SW.swiglu_block_cast_rows(h, probs, recipe, torch.float8_e4m3fn, 448.0, 8)
            SW.swiglu_backward_block_rows(h, probs, da, torch.float32, recipe, torch.float8_e4m3fn, 448.0, 8)
    assert sorted(recorded) == [(name, e8m0) for name in ("swiglu_backward_block_rows_kernel",
                                                           "swiglu_block_cast_rows_kernel") for e8m0 in (False, True)]
    for key, (fn, args, kwargs) in recorded.items():
        isa, _, _ = _gfx950_isa(fn, args, kwargs, str(key))
        assert re.search(r"v_cvt_\w*pk_fp8_f32", isa), f"{key}: no FP8 conversion"
