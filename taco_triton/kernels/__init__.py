"""Triton kernels: one file per fused op, each with a thin launch wrapper.

Importing this package needs `triton` but touches no GPU. Set TRITON_INTERPRET=1 before the first
import to run the same kernels on CPU tensors (Triton's interpreter); that is how the tests run
them on machines without a GPU.
"""
