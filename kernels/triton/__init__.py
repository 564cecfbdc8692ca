"""Triton kernels of turbo_moe (NVIDIA Hopper and any Triton target; CPU via ``TRITON_INTERPRET=1``).

Import the submodules explicitly; this package file imports nothing so that importing
``turbo_moe.kernels`` never needs triton.
"""
