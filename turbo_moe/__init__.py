"""turbo_moe: FP8 grouped GEMMs for MoE expert layers.

``GroupedLinearFP8`` (an ``nn.Module``) and ``grouped_gemm_fp8`` (differentiable function) compute
``y[rows of g] = x[rows of g] @ W[g]^T`` for every expert ``g`` in FP8, on the FlyDSL (AMD gfx950),
Triton (NVIDIA Hopper, any Triton target) or torch (reference, CPU) backend. Importing turbo_moe
needs torch alone; the backend libraries are optional and loaded on first use.
``grouped_gemm_fp8_swiglu`` is an expert MLP's fc2 with the routing-weighted SwiGLU fused into its
FP8 input quantization (``turbo_moe.swiglu``); ``GroupedSwiGLUMLPFP8`` is the whole expert MLP
(fc1, that fc2, fc1's gradient handed over in FP8) as a module.
"""

from .autograd import GroupedGemmFP8Function, grouped_gemm, grouped_gemm_fp8
from .backends import BackendUnavailable, available_backends, recent_dispatches
from .comm_cap import num_cu_for_comm
from .config import Float8Accumulation, Float8Config, Float8Format, ScalingGranularity, ScalingStrategy
from .delayed_scaling import DelayedScalingState
from .mlp import GroupedSwiGLUMLPFP8
from .module import GroupedLinearFP8
from .swiglu import grouped_gemm_fp8_swiglu

__version__ = "0.1.0"

__all__ = [
    "GroupedLinearFP8",
    "GroupedSwiGLUMLPFP8",
    "grouped_gemm_fp8",
    "grouped_gemm",
    "grouped_gemm_fp8_swiglu",
    "GroupedGemmFP8Function",
    "Float8Config",
    "Float8Format",
    "ScalingGranularity",
    "ScalingStrategy",
    "DelayedScalingState",
    "Float8Accumulation",
    "BackendUnavailable",
    "available_backends",
    "recent_dispatches",
    "num_cu_for_comm",
    "__version__",
]
