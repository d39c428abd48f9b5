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
import weakref
from collections import Counter, defaultdict
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


class FakeStream:
    """A recording stand-in for a CUDA stream (`fake_streams`): the events recorded on it and
    waited for by it, in order."""

    def __init__(self, name: str):
        self.name = name
        self.recorded: list = []
        self.waited: list = []

    def __repr__(self) -> str:
        return f"FakeStream({self.name})"


class TensorSeen:
    """What the log keeps of a tensor a launch or `record_stream` used: its address and size, not
    the tensor (a reference would keep its memory alive and hide an early free)."""

    __slots__ = ("_ptr", "_numel", "shape", "dtype")

    def __init__(self, t: torch.Tensor):
        self._ptr, self._numel, self.shape, self.dtype = t.data_ptr(), t.numel(), tuple(t.shape), t.dtype

    def data_ptr(self) -> int:
        return self._ptr

    def numel(self) -> int:
        return self._numel


class FakeEvent:
    """A recording stand-in for a CUDA event: the stream it was recorded on and when (`at`, an
    index into `StreamLog.log`). Complete at once (the work it stands for ran on the host)."""

    def __init__(self):
        self.stream = None
        self.at = -1

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


@dataclass
class StreamLog:
    """What ran under `fake_streams`: `caller` and `comm` streams, and `log`, in order, of
    ("record", stream, event), ("wait", stream, event), ("launch", stream, kernel name, tensors),
    ("record_stream", stream, tensor), ("use", stream) and ("synchronize", device) entries (tensors
    as `TensorSeen`: address and size).

    It also models the CUDA caching allocator's rule for memory used on another stream: a block
    is allocated on the stream current then; freed, it is reusable by that stream at once, unless
    another stream's use of it was recorded (`record_stream`) or the allocating stream has waited
    for an event recorded on the using stream after the use. A block freed otherwise while
    another stream used it is a reuse conflict (`conflicts`: (kernel, using stream, allocating
    stream)): on a GPU the allocating stream's next allocation could take memory that work still
    queued on the other stream reads or writes. Uses are the fused kernels' launches; tensors made
    before the block count as the caller stream's."""

    caller: FakeStream = field(default_factory=lambda: FakeStream("caller"))
    comm: FakeStream = field(default_factory=lambda: FakeStream("comm"))
    log: list = field(default_factory=list)
    stack: list = field(default_factory=list)
    conflicts: list = field(default_factory=list)
    _allocated: dict = field(default_factory=dict)   # storage id -> the stream it was allocated on
    _uses: dict = field(default_factory=lambda: defaultdict(list))  # storage id -> [(stream, log index, kernel)]
    _recorded: dict = field(default_factory=lambda: defaultdict(set))  # storage id -> streams recorded

    @property
    def current(self) -> FakeStream:
        return self.stack[-1] if self.stack else self.caller

    def _block(self, t: torch.Tensor, stream=None):
        """The key of `t`'s memory; first seen: allocated on `stream` (default: the current one)."""
        storage = t.untyped_storage()
        key = id(storage)
        if key not in self._allocated:
            self._allocated[key] = self.current if stream is None else stream
            weakref.finalize(storage, self._freed, key)
        return key

    def _used(self, t: torch.Tensor, stream, kernel: str) -> None:
        key = self._block(t, self.caller)
        if stream is not self._allocated[key]:
            self._uses[key].append((stream, len(self.log), kernel))

    def _freed(self, key) -> None:
        home = self._allocated.pop(key, None)
        recorded = self._recorded.pop(key, set())
        for stream, at, kernel in self._uses.pop(key, []):
            if stream in recorded:
                continue
            joined = any(e[0] == "wait" and e[1] is home and e[2].stream is stream and e[2].at >= at
                         for e in self.log[at:])
            if not joined:
                self.conflicts.append((kernel, stream.name, getattr(home, "name", home)))


class _Allocations(TorchDispatchMode):
    """Every tensor an op makes under `fake_streams`: allocated on the stream current then."""

    def __init__(self, log: StreamLog):
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (list, tuple)) else (out,):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self.log._block(t)
        return out


@contextlib.contextmanager
def fake_streams(capturing: bool = False, check_memory: bool = True):
    """Drive the collectives' CUDA stream schedule on CPU tensors: inside the block the one module
    through which the collectives touch streams and events (`taco_triton.collectives._streams`)
    answers with recording fakes (`StreamLog`, which also checks the allocator's rule for memory
    used on another stream), and every Triton launch (interpreter) is logged with the stream
    current when it was made. `capturing`: as inside a CUDA graph capture. `check_memory`: model
    the allocator's rule (every op's outputs are seen through a dispatch mode, which costs host
    time: off when timing). For tests of the schedule and for timing its host bookkeeping (a real
    event record or stream wait costs a few microseconds more each)."""
    from .collectives import _streams

    log = StreamLog()

    def record(ev, stream):
        ev.stream, ev.at = stream, len(log.log)
        stream.recorded.append(ev)
        log.log.append(("record", stream, ev))

    def wait_event(stream, ev):
        stream.waited.append(ev)
        log.log.append(("wait", stream, ev))

    def record_stream(tensor, stream):
        if check_memory:
            log._recorded[log._block(tensor, log.caller)].add(stream)
        log.log.append(("record_stream", stream, TensorSeen(tensor)))

    @contextlib.contextmanager
    def use(stream):
        log.stack.append(stream)
        log.log.append(("use", stream))
        try:
            yield
        finally:
            log.stack.pop()

    fakes = {
        "on_streams": lambda device: True,
        "current": lambda device: log.current,
        "comm": lambda device: log.comm,
        "event": FakeEvent,
        "record": record,
        "wait_event": wait_event,
        "use": use,
        "record_stream": record_stream,
        "capturing": lambda: capturing,
        "synchronize": lambda device=None: log.log.append(("synchronize", device)),
    }
    saved = {name: getattr(_streams, name) for name in fakes}
    interp = _interpreted_function()
    run = interp.run if interp is not None else None
    if interp is not None:
        def logged(self, *args, **kwargs):
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            name = getattr(self.fn, "__name__", "kernel")
            if check_memory:
                for t in tensors:
                    log._used(t, log.current, name)
            log.log.append(("launch", log.current, name, [TensorSeen(t) for t in tensors]))
            return interp_run(self, *args, **kwargs)
        interp_run = run
        interp.run = logged
    for name, fake in fakes.items():
        setattr(_streams, name, fake)
    try:
        with _Allocations(log) if check_memory else contextlib.nullcontext():
            yield log
    finally:
        for name, orig in saved.items():
            setattr(_streams, name, orig)
        if interp is not None:
            interp.run = run
