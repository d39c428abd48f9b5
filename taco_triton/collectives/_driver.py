"""The driver: the schedule of a compressed call's stages over its slices, one for both codec paths.

What each stage computes is the shape's (`_shapes`) and the plan's (`_plan.*.begin`: the codec
steps bound to the call's tensors); what moves between stages is the shape's process-group call
(`Stage.comm`). This module decides only when each (stage, slice) step runs, where, and when it
waits (`issue`):

The steps (`run`): the message is cut into `pipeline` slices; the steps run in `order`: slice k+1
is compressed and its communication issued before slice k waits for its own and moves to the next
stage, so compression of one slice overlaps the communication of the previous. A stage waits
(`Work.wait()`: on CUDA it orders the current stream after the communication, with no host sync)
for its slice's communication before it runs.

Where they run (`issue`), one schedule per path:

- synchronous, CUDA: on the calling thread and the caller's current stream, as the steps come;
  the caller's stream is behind the whole call when it returns (the cheapest on the host).
- async, CUDA: off the caller's stream. The caller's stream records one event that the device's
  communication stream (`_streams.comm`, one per device) waits on; every step runs with that
  stream current (the kernels, and the process-group calls, so NCCL orders itself after it and
  the steps' `wait()` make that stream, not the host, wait); one end event is recorded on it.
  The caller's stream has waited on nothing when the call returns; the Work's `wait()` makes the
  waiting stream wait for the end event (one wait; every later `wait()` again, from whatever
  stream is current then, as torch's does). The call's tensors (the caller's, and the contiguous
  copies the call made of them) are `record_stream`ed on the communication stream, so the
  allocator keeps their memory until it is done with them, and the Work holds them until its
  `wait()`. Under CUDA graph capture the same fork and join are captured (the Work's `wait()`
  inside the capture joins the communication stream back); no stream use is recorded there (the
  allocator defers reuse in a capture only for blocks with recorded uses, and a recorded use
  would outlive the capture), so holding them until the join is what keeps the capturing
  stream's next allocations off them.
- CPU (gloo): an async call is one job of its group's worker thread (`_worker`), which runs the
  group's calls first-in, first-out, and returns at once; a synchronous call runs inline when the
  worker is idle, else as a job waited for, so every rank issues the group's collectives in the
  same order whatever order its Works are waited in.

Calls are issued in the same order on every rank, from the calling thread (CUDA) or the group's
worker (CPU), so collectives on a group never interleave differently across ranks. Wire buffers
are reused by the calls of one (thread, stream) (`Plan.buffers`): on CUDA every step of a call runs
on one stream and waits for its own communication there, so the next call on that stream runs
after all of it; on CPU a call's steps are done when it ends and the worker runs one at a time.

Why the codec of one call is not spread over more streams: NCCL already moves slice k on its own
stream while the codec stream compresses slice k+1 and reduces slice k-1 (c10d orders the two
with events), and by the compile-time model (bench/aot.py) the codec runs at memory speed, a few
microseconds of H200 time for a 16 MiB bf16 compress against tens of microseconds for NVLink to
move the slice.
"""
from __future__ import annotations

from collections import deque

import torch

from . import _errors, _pg, _streams, _worker
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
    steps(plan, step, group)
    return record


def steps(plan, step, group) -> None:
    """Run every (stage, slice) step of a call bound by `plan.begin` (`step`), in `order`."""
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


def issue(plan, src: torch.Tensor, dst: torch.Tensor, seq: int, group, pg, async_op: bool, before=None,
          copy_back: torch.Tensor | None = None):
    """Issue one compressed call on its schedule (see the module docstring) and finish it: the
    handle (async) or None (sync, its error raised). `before` runs first in the group's order (the
    rank agreement of a first call); `copy_back` receives `dst` at the end (a non-contiguous
    output)."""
    device = plan.device
    if not async_op:
        def call():
            if before is not None:
                before()
            record = run(plan, src, dst, seq, group)
            if copy_back is not None:
                copy_back.copy_(dst.view_as(copy_back))
            return record

        # the caller's thread and stream (the common case); on CPU behind the group's queued async calls
        worker = None if _streams.on_streams(device) else _worker.running(pg)
        record = call() if worker is None else worker.run(call)
        return _errors.finish_call(plan, device, False, record, _streams.completion(device))

    def after():
        if copy_back is not None:
            copy_back.copy_(dst.view_as(copy_back))

    if _streams.on_streams(device):
        if before is not None:
            before()
        return _cuda_async(plan, src, dst, seq, group, after, copy_back)
    record, step = plan.begin(src, dst, seq)

    def job():
        if before is not None:
            before()
        steps(plan, step, group)
        after()

    done, result = _worker.of(pg).submit(job), _outputs(dst, copy_back)

    def finish():
        done.outcome()

    def future():
        fut = torch.futures.Future()
        done.then(lambda j: fut.set_exception(j.error) if j.error is not None else fut.set_result(result))
        return fut

    return _errors.finish_call(plan, device, True, record, done=done, finish=finish, future=future)


def _outputs(dst: torch.Tensor, copy_back) -> list:
    """What an async call's future completes with: the tensor the caller sees written."""
    return [dst if copy_back is None else copy_back]


def _cuda_async(plan, src, dst, seq, group, after, copy_back):
    """The async CUDA schedule: fork the communication stream from the caller's, run every step
    there, record the end event (see the module docstring)."""
    device = plan.device
    caller, comm = _streams.current(device), _streams.comm(device)
    fork = _streams.event()
    _streams.record(fork, caller)
    _streams.wait_event(comm, fork)
    capturing = _streams.capturing()
    held = [t for t in {id(t): t for t in (src, dst, copy_back) if t is not None}.values()]
    with _streams.use(comm):
        if not capturing:  # a captured graph's memory stays with the graph for its replays
            for t in held:
                _streams.record_stream(t, comm)
        record = run(plan, src, dst, seq, group)
        after()
        join = _streams.event()
        _streams.record(join, comm)
    result = _outputs(dst, copy_back)

    def again():  # the waiting stream joins the end event: one wait, no host sync
        _streams.wait_for(join, device)

    def finish():  # the call's tensors are free to go once the waiting stream has joined
        again()
        held.clear()

    def future():  # completed with the communication stream current: it carries the end of the call
        if device.type != "cuda":  # the schedule driven on CPU tensors (tests)
            fut = torch.futures.Future()
        else:
            fut = torch.futures.Future(devices=[_streams.indexed(device)])
        with _streams.use(comm):
            fut.set_result(result)
        return fut

    return _errors.finish_call(plan, device, True, record, done=_streams.IN_GRAPH if capturing else join,
                               finish=finish, future=future, again=again)
