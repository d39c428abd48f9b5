"""Process-group plumbing: torch-version shims, wire-byte accounting, rank-consistency checks.

Every byte the collectives hand to torch.distributed goes through the functions here, so
`WireStats` sees exactly what was passed to the process group.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# torch 2.13 renamed the *_tensor collectives (the old names warn); torch 2.11 has only the old.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_stats = threading.local()


@dataclass
class WireCall:
    """One call handed to the process group: its kind, the buffer bytes, bytes each rank sends."""

    kind: str
    buffer_bytes: int
    wire_bytes: float
    compressed: bool


@dataclass
class WireStats:
    """Context manager recording what this rank hands to the process group.

    `wire_bytes` counts what each rank sends by the collective's standard cost (as nccl-tests
    counts bus bytes): ring all_reduce 2(P-1)/P of the buffer, reduce_scatter and all_to_all
    (P-1)/P of the input buffer, all_gather (P-1) times the shard.

        >>> with WireStats() as ws:
        ...     pass
        >>> ws.wire_bytes
        0.0
    """

    calls: list = field(default_factory=list)

    def __enter__(self) -> "WireStats":
        if not hasattr(_stats, "stack"):
            _stats.stack = []
        _stats.stack.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _stats.stack.remove(self)

    @property
    def wire_bytes(self) -> float:
        return float(sum(c.wire_bytes for c in self.calls))

    def by_kind(self) -> dict:
        out: dict = {}
        for c in self.calls:
            out[c.kind] = out.get(c.kind, 0.0) + c.wire_bytes
        return out


def _record(kind: str, buffer_bytes: int, wire_bytes: float, compressed: bool) -> None:
    for ws in getattr(_stats, "stack", ()):
        ws.calls.append(WireCall(kind, buffer_bytes, wire_bytes, compressed))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_reduce(t, op, group, async_op, compressed=False):
    p = dist.get_world_size(group)
    _record("all_reduce", _nbytes(t), 2 * (p - 1) / p * _nbytes(t), compressed)
    return dist.all_reduce(t, op=op, group=group, async_op=async_op)


def reduce_scatter(out, inp, op, group, async_op):
    p = dist.get_world_size(group)
    _record("reduce_scatter", _nbytes(inp), (p - 1) / p * _nbytes(inp), False)
    return _REDUCE_SCATTER(out, inp, op=op, group=group, async_op=async_op)


def all_gather(out, inp, group, async_op, compressed=False):
    p = dist.get_world_size(group)
    _record("all_gather", _nbytes(inp), (p - 1) * _nbytes(inp), compressed)
    return _ALL_GATHER(out, inp, group=group, async_op=async_op)


def all_to_all(out, inp, out_splits, in_splits, group, async_op):
    rank = dist.get_rank(group)
    sent = sum(s for j, s in enumerate(in_splits) if j != rank)  # what leaves this rank
    _record("all_to_all", _nbytes(inp), float(sent), True)
    return dist.all_to_all_single(out, inp, out_splits, in_splits, group=group, async_op=async_op)


def check_same_across_ranks(what: str, signature: tuple, group) -> None:
    """Raise ValueError naming the ranks whose `signature` differs (one small all_gather_object)."""
    p = dist.get_world_size(group)
    sigs = [None] * p
    dist.all_gather_object(sigs, signature, group=group)
    if any(s != sigs[0] for s in sigs):
        detail = "; ".join(f"rank {r}: {s}" for r, s in enumerate(sigs))
        raise ValueError(f"taco_triton.{what}: ranks disagree on (shape, dtype, config, op): {detail}")
