"""Triton kernels: one file per fused op, each with a thin launch wrapper.

Importing this package needs `triton` but touches no GPU. Set TRITON_INTERPRET=1 before Triton is
first imported to run the same kernels on CPU tensors (Triton's interpreter); that is how the tests
run them on machines without a GPU. `import taco_triton` imports neither Triton nor the kernels
(`slots.py`, the host side of the slotted buffers, imports no Triton): the first Triton launch does.
"""
