"""The driver: the schedule of a compressed call's stages over its slices, one for both codec paths.

What each stage computes is the shape's (`_shapes`) and the plan's (`_plan.*.begin`: the codec
steps bound to the call's tensors); what moves between stages is the shape's process-group call
(`Stage.comm`). This module decides only when each (stage, slice) step runs, where, and when it
waits, in one function (`run`) that a different schedule replaces:

Today's schedule, decided: everything runs now, on the calling thread, and the codec on the
caller's current stream. The message is cut into `pipeline` slices; the steps run in `order`:
slice k+1 is compressed and its communication issued before slice k waits for its own and moves
to the next stage, so compression of one slice overlaps the communication of the previous (async
process-group work; on GPUs NCCL runs on its own stream). A stage waits (`Work.wait()`, which on
CUDA orders the current stream after the communication, with no host sync) for its slice's
communication before it runs. Collectives are issued in the same order on every rank, driven
from the calling thread, so concurrent collectives on a group can never interleave differently
across ranks; and a call's process-group work is all waited on when it returns, which is what
makes reusing its wire buffers safe (`TritonPlan.buffers`).

Why not a side stream for the codec: NCCL already moves slice k on its own stream while the
current stream compresses slice k+1 and reduces slice k-1 (c10d orders the two with events). By
the compile-time model (bench/aot.py) the codec runs at memory speed: a 16 MiB bf16 compress is
a few microseconds of H200 time against tens of microseconds for NVLink to move the slice, so a
side stream could hide at most those few microseconds of compute-stream time, while costing a
cross-stream event pair per slice, `record_stream` bookkeeping for every buffer, and outputs no
longer ready in the caller's stream order, which CUDA graph capture and torch's stream semantics
rely on. What this schedule does not give is an async call that returns before its
communication is done (the waits above run at issue).
"""
from __future__ import annotations

from collections import deque

import torch

from . import _pg
from ._shapes import ALL_GATHER, ALL_TO_ALL


def order(n_slices: int, n_stages: int) -> list[tuple[int, int]]:
    """The (stage, slice) steps of a call in the order they run: a software pipeline in which
    slice k enters stage 0 (which launches its communication) while slice k-1 moves through
    stage 1, and so on. The order is a pure function of the sizes, the same on every rank and
    independent of when anyone waits."""
    queues = [deque() for _ in range(n_stages)]
    steps: list = []

    def advance(i):  # run stage i on the oldest slice waiting for it
        k = queues[i].popleft()
        steps.append((i, k))
        if i + 1 < n_stages:
            queues[i + 1].append(k)

    for k in range(n_slices):
        queues[0].append(k)
        advance(0)
        for i in range(1, n_stages):
            if len(queues[i]) > 1:
                advance(i)
    for i in range(1, n_stages):
        while queues[i]:
            advance(i)
    return steps


def run(plan, src: torch.Tensor, dst: torch.Tensor, seq: int, group):
    """Issue one compressed call on `plan`: `src` the flat input (all_reduce: also `dst`), `dst`
    the flat output, `seq` its call number. Runs every (stage, slice) step in `order` on the
    calling thread (see the module docstring). Returns the error record the call's kernels write
    (Triton path) or None (the reference path checks its tags as it goes)."""
    record, step = plan.begin(src, dst, seq)
    bufs = plan.buffers()
    schedule = plan.schedule
    if schedule is None:
        schedule = plan.schedule = order(len(plan.slices), len(plan.ops))
    comms, slices = plan.comms, plan.slices
    work = [None] * len(slices)
    for stage, k in schedule:
        b = bufs[k]
        if stage:
            work[k].wait()
        sent = step(stage, k, b)
        comm = comms[stage]
        if comm is ALL_TO_ALL:
            work[k] = _pg.all_to_all(b.recv, sent, b.recv_splits, slices[k].strides, group, True)
        elif comm is ALL_GATHER:
            work[k] = _pg.all_gather(b.gathered, sent, group, True, compressed=True)
    return record
