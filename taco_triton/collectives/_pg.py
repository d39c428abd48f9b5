"""Process-group plumbing: torch-version shims, wire-byte accounting, rank-agreement checks,
a clean interpreter exit after gloo collectives.

Every byte the collectives hand to torch.distributed goes through the functions here, so
`WireStats` sees exactly what was passed to the process group.
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import threading
import time
import zlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..estimate import ring_bytes
from ..state import STATE

# torch 2.13 renamed the *_tensor collectives (the old names warn); torch 2.11 has only the old.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_stats = threading.local()


@dataclass
class WireCall:
    """One call handed to the process group: its kind (the operation on the wire), the buffer
    bytes, the bytes each rank sends, whether they are compressed, and the collective the user
    called that issued it (a compressed all_reduce sends an all_to_all and an all_gather, both
    with collective "all_reduce"; a native call's kind and collective are the same)."""

    kind: str
    """The operation on the wire ("all_to_all", "all_gather", "send", ...)."""
    buffer_bytes: int
    """Bytes of the buffer handed to the process group."""
    wire_bytes: int
    """Bytes this rank sends in it (the standard ring cost, `taco_triton.estimate.ring_bytes`), in
    whole bytes: where the ring's share 2(P-1)/P or (P-1)/P of a buffer is fractional (P does
    not divide it), the nearest whole byte; a real ring's ranks send whole chunks averaging it."""
    compressed: bool
    """Whether the buffer holds compressed bytes."""
    collective: str = ""
    """The collective the user called that issued it (default: `kind`)."""

    def __post_init__(self):
        self.collective = self.collective or self.kind
        self.wire_bytes = round(self.wire_bytes)


@dataclass(eq=False)  # compared by identity: leaving one must never remove an equal (e.g. empty) other
class WireStats:
    """Context manager recording what this rank hands to the process group. Nested ones each
    record every call made while they are open.

    `wire_bytes` counts what each rank sends by the collective's standard cost (as nccl-tests
    counts bus bytes): ring all_reduce 2(P-1)/P of the buffer, reduce_scatter and all_to_all
    (P-1)/P of the input buffer, all_gather (P-1) times the shard. `by_collective()` sums them
    per collective the user called (`all_reduce`, ...); `by_kind()` per operation on the wire
    (a compressed all_reduce is an `all_to_all` and an `all_gather`). Every count is in whole
    bytes (`WireCall.wire_bytes`).

        >>> with WireStats() as ws:
        ...     pass
        >>> ws.wire_bytes
        0
    """

    calls: list = field(default_factory=list)
    """The `WireCall` of every call recorded, in order."""
    fingerprint_bytes: int = 0
    """Bytes this rank sent in the per-call fingerprint exchanges that check the ranks agree
    (counted in `wire_bytes`, kept out of `calls`: they are not the collective's payload)."""

    def __enter__(self) -> "WireStats":
        if not hasattr(_stats, "stack"):
            _stats.stack = []
        _stats.stack.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _stats.stack.remove(self)

    @property
    def wire_bytes(self) -> int:
        """Bytes this rank sent in every recorded call, fingerprints included."""
        return sum(c.wire_bytes for c in self.calls) + self.fingerprint_bytes

    def _summed(self, key) -> dict:
        out: dict = {}
        for c in self.calls:
            out[key(c)] = out.get(key(c), 0) + c.wire_bytes
        if self.fingerprint_bytes:
            out["fingerprint"] = self.fingerprint_bytes
        return out

    def by_collective(self) -> dict:
        """Wire bytes per collective the user called.

        Returns:
            {collective ("all_reduce", "send", ...): bytes (int)}, plus "fingerprint" for the
            agreement checks.
        """
        return self._summed(lambda c: c.collective)

    def by_kind(self) -> dict:
        """Wire bytes per operation handed to the process group.

        Returns:
            {kind ("all_to_all", ...): bytes (int)}, plus "fingerprint" for the agreement checks.
        """
        return self._summed(lambda c: c.kind)


def _record(kind: str, buffer_bytes: int, wire_bytes: float, compressed: bool) -> None:
    collective = getattr(_stats, "collective", None) or kind
    for ws in getattr(_stats, "stack", ()):
        ws.calls.append(WireCall(kind, buffer_bytes, wire_bytes, compressed, collective))


def stats_context() -> tuple:
    """The `WireStats` open on this thread and the collective being recorded: what a call that runs
    on another thread (`_worker`) records into (`stats_restored`)."""
    stack = getattr(_stats, "stack", None)
    return (tuple(stack) if stack else (), getattr(_stats, "collective", None))


@contextlib.contextmanager
def stats_restored(context: tuple):
    """Record into `context` (`stats_context`, taken where the call was issued) on this thread."""
    saved = (getattr(_stats, "stack", None), getattr(_stats, "collective", None))
    _stats.stack, _stats.collective = list(context[0]), context[1]
    try:
        yield
    finally:
        _stats.stack, _stats.collective = saved[0] if saved[0] is not None else [], saved[1]


def records_as(collective: str):
    """Decorator: every call the decorated collective hands to the process group is recorded as
    issued by `collective` (its wire operations may be others)."""

    def wrap(fn):
        @functools.wraps(fn)
        def recorded(*args, **kwargs):
            if not getattr(_stats, "stack", None):  # no WireStats open: nothing records the name
                return fn(*args, **kwargs)
            outer = getattr(_stats, "collective", None)
            _stats.collective = outer or collective  # a collective built on another keeps the outer name
            try:
                return fn(*args, **kwargs)
            finally:
                _stats.collective = outer

        return recorded

    return wrap


#: How long the interpreter waits at exit, with the GIL released, once a CPU collective ran.
EXIT_GRACE_S = 0.05


def _let_gloo_workers_finish() -> None:
    time.sleep(EXIT_GRACE_S)


def guard_exit(t: torch.Tensor) -> None:
    """Before a collective on CPU tensors (gloo): make sure the process exits cleanly.

    A gloo worker thread drops its references to an op's tensors just after the op completes,
    and dropping a tensor that Python has seen takes the GIL. If the interpreter is already
    finalizing by then, Python ends that thread inside a C++ destructor and the process aborts
    ("terminate called without an active exception", SIGABRT) although all work is done. That
    happens when the process group outlives `destroy_process_group` (DTensor keeps references
    to it) and the main thread runs from its last collective to the end of the script without
    releasing the GIL. An exit handler that sleeps `EXIT_GRACE_S`, GIL released, lets the worker
    finish first. Registered once, on the first CPU collective; nothing for CUDA tensors (NCCL).
    """
    if not STATE.exit_grace and t.device.type == "cpu":
        atexit.register(_let_gloo_workers_finish)
        STATE.exit_grace = True


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_reduce(t, op, group, async_op, compressed=False):
    p = dist.get_world_size(group)
    _record("all_reduce", _nbytes(t), ring_bytes("all_reduce", _nbytes(t), p), compressed)
    guard_exit(t)
    return dist.all_reduce(t, op=op, group=group, async_op=async_op)


def reduce_scatter(out, inp, op, group, async_op):
    p = dist.get_world_size(group)
    _record("reduce_scatter", _nbytes(inp), ring_bytes("reduce_scatter", _nbytes(inp), p), False)
    guard_exit(inp)
    return _REDUCE_SCATTER(out, inp, op=op, group=group, async_op=async_op)


def all_gather(out, inp, group, async_op, compressed=False):
    if getattr(_stats, "stack", None):
        p = dist.get_world_size(group)
        _record("all_gather", _nbytes(inp), ring_bytes("all_gather", _nbytes(inp), p), compressed)
    guard_exit(inp)
    return _ALL_GATHER(out, inp, group=group, async_op=async_op)


def all_to_all(out, inp, out_splits, in_splits, group, async_op):
    if getattr(_stats, "stack", None):
        rank = dist.get_rank(group)
        sent = sum(s for j, s in enumerate(in_splits) if j != rank)  # what leaves this rank
        _record("all_to_all", _nbytes(inp), sent, True)
    guard_exit(inp)
    return dist.all_to_all_single(out, inp, out_splits, in_splits, group=group, async_op=async_op)


def default_group():
    """The current default process group, or None (cheaper than `group_object(None)`: for the
    steady state's check that the default group was not re-created)."""
    return dist.distributed_c10d._world.default_pg


def group_object(group):
    """The process group a call runs on: `group`, or the current default group for None."""
    return group if group is not None else dist.distributed_c10d._get_default_group()


CARRIER = "taco_carrier"
"""The attribute of a process group that only wraps another (the compressing process group): the
group that carries its bytes."""


def carrier(group):
    """The process group that carries the bytes of a call on `group` (None: the default group): a
    compressing process group's inner group, else the group itself. The collectives issue on it and
    order by it, so a call through a compressing group and one on its inner group share one order
    and are counted once."""
    pg = group_object(group)
    return getattr(pg, CARRIER, pg)


def fingerprint(signature: tuple) -> int:
    """A 32-bit digest of a call's signature (what every rank must agree on)."""
    return zlib.crc32(repr(signature).encode())


def record_send(buffer: torch.Tensor, compressed: bool) -> None:
    """Count a point-to-point message this rank sends in the active `WireStats` (its bytes, once,
    when it is issued: where it is posted later, from another thread, it still counts here)."""
    n = buffer.numel() * buffer.element_size()
    _record("send", n, float(n), compressed)
    guard_exit(buffer)


def isend(buffer: torch.Tensor, peer: int, group, tag: int = 0):
    """`dist.isend`: every point-to-point send of the library goes through here (its bytes are
    counted where it is issued: `record_send`, or `send_fingerprint`)."""
    return dist.isend(buffer, peer, group=group, tag=tag)


def irecv(buffer: torch.Tensor, peer: int, group, tag: int = 0):
    """`dist.irecv` (what a rank receives is counted by its sender)."""
    guard_exit(buffer)
    return dist.irecv(buffer, peer, group=group, tag=tag)


def send_fingerprint(fingerprint: torch.Tensor, peer: int, group, tag: int, context: tuple):
    """A p2p handshake's message (a fingerprint and a size): sent, and counted in the
    `WireStats` of `context` (`stats_context`, where the message it checks was issued) as
    `fingerprint_bytes`, as the collectives' agreement exchange is."""
    for ws in context[0]:
        ws.fingerprint_bytes += _nbytes(fingerprint)
    return isend(fingerprint, peer, group, tag)


def agree(what: str, signature: tuple, device, group) -> None:
    """Raise ValueError on every rank if any rank's `signature` differs.

    One fixed-size all_gather of the signature's fingerprint (8 bytes per rank), so it cannot
    itself mismatch; only on a mismatch the readable signatures are gathered for the message.
    """
    p = dist.get_world_size(group)
    mine = torch.tensor([fingerprint(signature)], dtype=torch.int64, device=device)
    guard_exit(mine)
    every = torch.empty(p, dtype=torch.int64, device=device)
    for ws in getattr(_stats, "stack", ()):
        ws.fingerprint_bytes += ring_bytes("all_gather", _nbytes(mine), p)
    _ALL_GATHER(every, mine, group=group)
    if bool((every == mine).all()):
        return
    sigs = [None] * p
    dist.all_gather_object(sigs, signature, group=group)
    detail = "; ".join(f"rank {r}: {s}" for r, s in enumerate(sigs))
    raise ValueError(f"taco_triton.{what}: ranks disagree on {_FIELDS}: {detail}")


_FIELDS = "(kind, numels, dtype, op, compressed, config, pipeline slices, backend)"
