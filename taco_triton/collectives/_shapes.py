"""Each compressed collective as a shape: what its stages compute over its slices, the wire slots
they fill and check, and the native collective it falls back to.

A shape is data for the plan and the driver, which are the same for every collective:

- `stages`: the codec step of each stage (`COMPRESS` this rank's pieces into slots, `REDUCE` the P
  received copies of this rank's piece, `DECOMPRESS` every received slot) and the process-group
  call that moves what it wrote (`ALL_TO_ALL`, `ALL_GATHER`, or None for the last);
- `chunks`: how a message is cut among the ranks; `send_slots` / `gathered_slots`: per slice, the
  slots this rank compresses and those it decompresses (pieces, layouts, offsets, strides, tags,
  source ranks), from which the plan builds the device tables and the reference path its loops;
- `dense_reduce`: whether the reduce writes the dense sum (reduce_scatter) or a requantized slot
  that the next stage gathers (all_reduce);
- `check`, `flats`, `native`: argument checks before any byte moves, the flat views the stages
  read and write (`in_place`: all_reduce's output is its input), and the native fallback
  (disabled config, small message, one rank).

all_reduce is TACO's two-shot: compress P chunks, all_to_all, fused dequantize-sum-requantize,
all_gather, decompress every chunk (its own too, so every rank ends bitwise identical);
reduce_scatter is its first half with a dense reduce; all_gather compresses the local shard once.
A new collective is one more shape here and a public function in `compressed`.

Tags: every slot carries `slots.tag(fingerprint, space, slice, slot)`, where the space is the
process-group call that moves it: slot j of the all_to_all carries (0, k, j) and goes to rank j;
the slot rank r sends in an all_gather carries (1, k, r).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..kernels import slots
from . import _pg, _streams
from .work import Pending, on_every_wait

from ..wire import ALL_GATHER, ALL_TO_ALL, COMPRESS, DECOMPRESS, REDUCE, SEND, STAGES, chunks  # noqa: F401 - the shapes' vocabulary


def overflow_threshold(config, dtype: torch.dtype) -> float:
    """Decompressed reduced values above this magnitude become +-inf, below it they saturate.

    A reduced value went through two roundings of the code format (each rank's quantization and
    the requantized sum), each within `spec.relative_rounding` of the value; one that lands past
    the output dtype's largest finite value by less than that margin is rounding and saturates,
    beyond it the sum itself overflowed and is +-inf, as in the native collective.

    Args:
        config: the `CompressionConfig` the values were reduced with.
        dtype: the output dtype (bf16, fp16 or fp32).

    Returns:
        The magnitude in `dtype`'s units, above `torch.finfo(dtype).max`.
    """
    return torch.finfo(dtype).max * (1.0 + 2.0 * config.spec.relative_rounding)


class Stage(NamedTuple):
    """One stage of a collective: its codec step, then the process-group call (or None) that
    moves what the step wrote."""

    op: str
    comm: str | None


class Slots(NamedTuple):
    """The slots of one slice that one codec step writes or reads (`slots.descriptors`' fields)."""

    pieces: list    # [(first element, end)] in the dense tensor the step reads or writes
    layouts: list   # their WireLayouts
    offsets: list   # each slot's byte offset in the wire buffer
    ends: list      # each slot's stride (its tag follows the wire bytes, zeros pad to here)
    tags: list      # the tag each slot carries (uint32 as int)
    sources: list   # the rank each slot comes from (for errors)


def flat_inplace(t: torch.Tensor):
    """A contiguous flat tensor to work in, and what to copy back into `t` afterwards (or None)."""
    if t.is_contiguous():
        return t.view(-1), None
    return t.contiguous().view(-1), t


def _native_op(op: str, group):
    if op == "avg" and dist.get_backend(group) == "nccl":
        return dist.ReduceOp.AVG, False
    return dist.ReduceOp.SUM, op == "avg"  # gloo has no AVG: sum, then divide


def _run_native(issue: Callable[[torch.Tensor, bool], object], out: torch.Tensor, divide: int | None, async_op: bool):
    """Run a native collective into `out` (through a contiguous copy: gloo misreads views), then
    divide for avg. The process group gets the work at call time; the rest runs at wait()."""
    flat, copy_back = flat_inplace(out)
    allocated_on = _streams.allocation_stream(flat.device) if copy_back is not None else None
    work = issue(flat.view(out.shape), async_op)

    def finish():
        if async_op:
            work.wait()
            _streams.used_here(flat, allocated_on)  # a copy of ours, read on the waiting stream
        if divide is not None:
            flat.div_(divide)
        if copy_back is not None:
            copy_back.copy_(flat.view(out.shape))

    if async_op:
        finish, again = on_every_wait(finish, out.device)
        return Pending(finish, again=again)
    finish()
    return None


def _check_pair(kind: str, big_name: str, big, small, p: int) -> None:
    """`big` must hold P times `small`'s elements, in its dtype (before any byte moves)."""
    for t in (big, small):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"taco_triton.{kind} expects tensors, got {type(t).__name__}")
    if big.numel() != p * small.numel() or big.dtype != small.dtype:
        raise ValueError(
            f"{kind}: {big_name} must have world_size ({p}) times the other's elements and its dtype; "
            f"got {big_name} {tuple(big.shape)} {big.dtype}, other {tuple(small.shape)} {small.dtype}"
        )


def _to_every_rank(plan, k: int, sl) -> Slots:
    """Slot j of the all_to_all: piece j of every chunk, for rank j."""
    p = plan.p
    return Slots(sl.piece, sl.lays, sl.offsets, sl.strides, [plan.tag(0, k, j) for j in range(p)],
                 list(range(p)))


class Shape:
    """A collective's shape (see the module docstring); tensors are (output, input) except for
    all_reduce's (tensor,)."""

    kind = ""
    stages: tuple = ()
    dense_reduce = False
    in_place = False  # the output is the input (all_reduce's one tensor)
    slice_salt = True  # the compress's stochastic seed is salted with (rank, call, slice), not only (rank, call)

    def mismatch(self, plan, k: int, src: int, got: int, want: int, seq: int, reference: bool = False) -> ValueError:
        """The error of a slot whose tag is not the expected one (`reference`: found on the host,
        before any output was written; else the kernels made the outputs it fed NaN)."""
        if reference:
            return ValueError(
                f"taco_triton.{plan.kind}: slice {k} from rank {src} carries tag {slots.tag_hex(got)}, this rank "
                f"expected {slots.tag_hex(want)} for {plan.signature}: the ranks issued different collectives "
                "(config, size, dtype, op, pipeline or order differ)")
        return ValueError(
            f"taco_triton.{plan.kind} (call {seq}): slice {k} from rank {src} carries tag {slots.tag_hex(got)}, "
            f"this rank expected {slots.tag_hex(want)} for {plan.signature}: the ranks issued different "
            "collectives (config, size, dtype, op, pipeline or order differ); the outputs it fed are NaN")

    def check(self, tensors, group) -> None:
        """Raise before any byte moves if the tensors cannot make this collective."""

    def flats(self, tensors):
        """(src, dst, copy_back): the flat input the stages read, the flat output they write, and
        the tensor dst is copied back into afterwards (None when dst is a view of it)."""
        output, input = tensors
        dst, copy_back = flat_inplace(output)
        return input.contiguous().view(-1), dst, copy_back

    def inf_above(self, config, dtype) -> float:
        """Decoded values beyond this become +-inf (see `overflow_threshold`)."""
        return overflow_threshold(config, dtype)


def _stages(kind: str) -> tuple:
    return tuple(Stage(op, comm) for op, comm in STAGES[kind])


class AllReduce(Shape):
    kind = "all_reduce"
    in_place = True
    stages = _stages(kind)

    def flats(self, tensors):
        flat, copy_back = flat_inplace(tensors[0])
        return flat, flat, copy_back

    def chunks(self, src, dst, p: int):
        """Super-block-aligned chunks of the tensor, one per rank (`wire.chunks`)."""
        return chunks(self.kind, src.numel(), p)

    def native(self, tensors, group, op: str, p: int, async_op: bool):
        red, divide = _native_op(op, group)
        return _run_native(lambda t, a: _pg.all_reduce(t, red, group, a), tensors[0], p if divide else None, async_op)

    send_slots = staticmethod(_to_every_rank)

    def gathered_slots(self, plan, k: int, sl) -> Slots:
        """Slot j of the all_gather: rank j's reduced piece of every chunk."""
        p = plan.p
        return Slots(sl.piece, sl.lays, [j * sl.slot for j in range(p)], [sl.slot] * p,
                     [plan.tag(1, k, j) for j in range(p)], list(range(p)))


class ReduceScatter(Shape):
    kind = "reduce_scatter"
    stages = _stages(kind)
    dense_reduce = True

    def check(self, tensors, group) -> None:
        output, input = tensors
        _check_pair("reduce_scatter", "input", input, output, dist.get_world_size(group))

    def chunks(self, src, dst, p: int):
        """Rank j's shard of the input per rank (`wire.chunks`)."""
        return chunks(self.kind, src.numel(), p)

    def native(self, tensors, group, op: str, p: int, async_op: bool):
        output, input = tensors
        red, divide = _native_op(op, group)
        return _run_native(lambda t, a: _pg.reduce_scatter(t, input.contiguous(), red, group, a),
                       output, p if divide else None, async_op)

    send_slots = staticmethod(_to_every_rank)

    def gathered_slots(self, plan, k: int, sl) -> None:
        return None  # the reduce writes the output


class AllGather(Shape):
    kind = "all_gather"
    stages = _stages(kind)

    def check(self, tensors, group) -> None:
        output, input = tensors
        _check_pair("all_gather", "output", output, input, dist.get_world_size(group))

    def chunks(self, src, dst, p: int):
        """The local shard, whole (`wire.chunks`)."""
        return chunks(self.kind, dst.numel(), p)

    def native(self, tensors, group, op: str, p: int, async_op: bool):
        output, input = tensors
        return _run_native(lambda t, a: _pg.all_gather(t, input.contiguous(), group, a), output, None, async_op)

    def inf_above(self, config, dtype) -> float:
        return math.inf  # each rank's values are decoded alone: no sum can overflow

    def send_slots(self, plan, k: int, sl) -> Slots:
        """This rank's piece of its shard in one slot, for every rank."""
        rank = plan.rank
        return Slots(sl.piece, sl.lays, [0], [sl.slot], [plan.tag(1, k, rank)], [rank])

    def gathered_slots(self, plan, k: int, sl) -> Slots:
        """Slot j: rank j's piece, which goes to its shard of the output."""
        p, m = plan.p, plan.chunk_numel
        (a, b), = sl.piece
        return Slots([(j * m + a, j * m + b) for j in range(p)], sl.lays * p, [j * sl.slot for j in range(p)],
                     [sl.slot] * p, [plan.tag(1, k, j) for j in range(p)], list(range(p)))


class Message(Shape):
    """A point-to-point message (`p2p`): one slice, one slot. The sender compresses its tensor into
    the slot (stage 0; `p2p` posts the send), the receiver checks its tag and decompresses it
    (stage 1). Its plan has P = 1 and this process's global rank, which salts stochastic rounding
    with the message number (no slice: a message is one). The tag is `slots.tag(fingerprint, 0)`."""

    kind = "p2p"
    stages = _stages(kind)
    slice_salt = False

    def chunks(self, src, dst, p: int):
        return chunks(self.kind, src.numel(), p)

    def inf_above(self, config, dtype) -> float:
        return math.inf  # one sender's values, decoded alone: no sum can overflow

    def send_slots(self, plan, k: int, sl) -> Slots:
        return Slots(sl.piece, sl.lays, [0], [sl.slot], [slots.tag(plan.fp, 0)], [0])

    gathered_slots = send_slots

    def mismatch(self, plan, k: int, src: int, got: int, want: int, seq: int, reference: bool = False) -> ValueError:
        return ValueError(
            f"taco_triton.p2p: the received message carries tag {slots.tag_hex(got)}, this rank expected "
            f"{slots.tag_hex(want)} for {plan.signature}: sender and receiver disagree on (size, dtype, config); "
            "the tensor received NaN")


ALL_REDUCE_SHAPE, REDUCE_SCATTER_SHAPE, ALL_GATHER_SHAPE = AllReduce(), ReduceScatter(), AllGather()
MESSAGE_SHAPE = Message()
