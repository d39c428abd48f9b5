"""Measure what the host does around the kernels: host reads of tensor data, device operations,
kernel launches, and host time with the launches stubbed out.

On a GPU every read of device data by the host (`item`, `tolist`, `cpu`, `numpy`, `bool(t)`,
`int(t)`, `float(t)`) waits for the device, and every operation that writes device memory
(`zeros`, `fill_`, `copy_`, arithmetic) is a kernel launch. `audit()` counts both on any device,
so the counts taken on CPU tensors hold for the same code path on CUDA. Under Triton's
interpreter (TRITON_INTERPRET=1) it also counts the fused kernels' launches and, with
`stub_kernels=True`, replaces them by no-ops, so a timing measures only Python and torch
overhead, as a GPU user's host sees it.

    >>> import torch
    >>> from taco_triton.host_audit import audit
    >>> with audit() as seen:
    ...     y = torch.ones(4) + 1
    ...     _ = y.tolist()
    >>> seen.host_reads, seen.device_ops
    (1, 2)
"""
from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: Tensor methods that copy device data to the host (each a host-device synchronization on CUDA).
HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")

#: aten ops that only make tensors or views (no kernel on any device): not counted as device ops.
_NO_KERNEL = ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "view", "_unsafe_view",
              "slice", "select", "as_strided", "alias", "detach", "_reshape_alias", "reshape", "unsqueeze",
              "squeeze", "expand", "t", "transpose", "permute", "split", "unbind", "chunk", "narrow",
              "view_as", "lift_fresh", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size",
              "_local_scalar_dense")  # the last: the device side of a host read, counted as one


@dataclass
class Seen:
    """What ran inside an `audit()` block."""

    reads: Counter = field(default_factory=Counter)       # host reads by method name
    ops: Counter = field(default_factory=Counter)         # device ops (aten) by name
    kernels: Counter = field(default_factory=Counter)     # Triton launches by kernel name

    @property
    def host_reads(self) -> int:
        return sum(self.reads.values())

    @property
    def device_ops(self) -> int:
        return sum(self.ops.values())

    @property
    def launches(self) -> int:
        """Triton kernel launches plus other device ops: every kernel the device would run."""
        return sum(self.kernels.values()) + self.device_ops


class _DeviceOps(TorchDispatchMode):
    def __init__(self, seen: Seen):
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if func.namespace == "aten" and name not in _NO_KERNEL:
            self.seen.ops[name] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def audit(stub_kernels: bool = False, ops: bool = True):
    """Count host reads, device ops (with `ops`) and Triton launches inside the block.

    stub_kernels: Triton launches return at once without running (interpreter only; on a GPU
        the compiled launch is not stubbed and launches are not counted). Outputs of stubbed
        kernels are garbage: for timing and counting only.
    """
    seen = Seen()
    saved = {}

    def reader(name, orig):
        def wrapped(self, *a, **k):
            seen.reads[name] += 1
            return orig(self, *a, **k)
        return wrapped

    for name in HOST_READS:
        saved[name] = getattr(torch.Tensor, name)
        setattr(torch.Tensor, name, reader(name, saved[name]))
    interp = _interpreted_function()
    run = interp.run if interp is not None else None
    if interp is not None:
        def counted(self, *args, **kwargs):
            seen.kernels[getattr(self.fn, "__name__", "kernel")] += 1
            return None if stub_kernels else run(self, *args, **kwargs)
        interp.run = counted
    mode = _DeviceOps(seen) if ops else contextlib.nullcontext()
    try:
        with mode:
            yield seen
    finally:
        for name, orig in saved.items():
            setattr(torch.Tensor, name, orig)
        if interp is not None:
            interp.run = run


def _interpreted_function():
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # no triton: nothing to count
        return None
    return InterpretedFunction
