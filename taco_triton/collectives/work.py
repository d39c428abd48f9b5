"""The Work types of the collectives, p2p and the integrations: what their async calls return.

- `Pending`: work whose `wait()` finishes it once, on this rank: an async compressed collective
  (ordering the waiting stream after it), a p2p or process-group receive (decoding the wire buffer
  into the caller's tensor), a p2p send a handshake decides, megatron's pipeline receives. A
  failure is kept: that `wait()` and every later one raise it. `PendingWork` is the same as a
  ``torch.distributed.Work``, for a process group to return (a plain class is what the
  collectives return: making a Work object costs about three times as much host time).
- `WaitAll`: several Works as one (a coalesced process-group call, megatron's coalescing manager).
- `Counted`: a Work whose `wait()` also counts the bytes handed to the process group while it
  finishes (megatron's per-site counters).
- `completed` / `all_of`: a finished Work from a result; one Work for a list of them.

`PendingWork`, `WaitAll` and `completed`'s are ``torch.distributed.Work`` objects, so a process
group may return them and torch's own callers can wait on them; `Counted` forwards to the Work
it wraps.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist

from . import _streams
from ._pg import WireStats

_C10D = torch._C._distributed_c10d


class Pending:
    """Handle of an async operation; like torch.distributed's Work.

    For a compressed collective: its work is issued in the group's order when the collective is
    called (on CUDA onto the device's communication stream, on CPU as a job of the group's worker
    thread), so waiting on handles in any order, or never before the next collective, changes
    nothing. `wait()` finishes what is left on this rank: on CUDA it makes the current stream wait
    for the call's end event (no host sync); on CPU it blocks until the call's job is done; on the
    native path it waits for the process group's work and copies back into a non-contiguous
    tensor. `is_completed()` says, without waiting, whether the work is done; `get_future()` is a
    future of the output tensors, as torch's.

    Errors belong to their call: `wait()` raises this call's tag mismatch (see
    `taco_triton.check_errors`), never another call's, and no other call raises this one's. A
    handle that failed stays failed: every later `wait()` raises the same error. As torch's Works:
    `is_completed()` is True once the work is done, successfully or not (its error known);
    `is_success()` only when it is done and did not fail.

    Args:
        finish: what `wait()` runs, once; it may return the call's error record (`_errors.Watched`)
            when it is made only then (a receive's decode).
        entry: the call's error record, when the call made one at issue (the Triton path).
        done: what completes with the work, asked without waiting (`query()`): a CUDA event or
            a worker's job; None: complete once `wait()` has returned.
        future: makes `get_future()`'s future; None: a future completed by `wait()`.
        again: what every later `wait()` runs (CUDA: order the waiting stream after the work, as
            torch's `wait()` does on every call; see `on_every_wait`); None: nothing.
    """

    def __init__(self, finish: Callable[[], object], entry=None, done=None, future=None, again=None):
        self._finish = finish
        self._entry = entry
        self._done = False
        self._error: BaseException | None = None
        self._completion = done
        self._future = future
        self._again = again

    def wait(self, timeout=None) -> bool:
        """Finish the operation; True once its result is in place.

        Args:
            timeout: accepted for Work compatibility; the process group's own timeout bounds
                communication.

        Returns:
            True.

        Raises:
            ValueError: this call's tags did not match (its outputs are NaN), a p2p handshake
                found the other end disagrees, or a receive's tag did not match.
            RuntimeError: what finishing raised (a process-group error), at this and every later
                wait().
        """
        if self._error is not None:
            raise self._error
        if not self._done:
            try:
                entry = self._finish()
            except BaseException as e:
                self._error = e
                raise
            if entry is not None:
                self._entry = entry
            self._done = True
        elif self._again is not None:
            self._again()
        if self._entry is not None and self._entry.own_error() is not None:
            self._error, self._done = self._entry.error, False
            self._entry.report()
        return True

    def is_completed(self) -> bool:
        """Whether the work is done, asked without waiting.

        Returns:
            True once the call's work is complete (its end event on CUDA; on CPU its job, and the
            Work that job issued) or `wait()` has returned or raised: its outputs are in place, or
            its error is known.
        """
        if self._error is not None or self._done:
            return True
        done = self._completion
        if done is None or isinstance(done, str):  # str: captured in a graph, complete at wait()
            return False
        return done.query()

    def is_success(self) -> bool:
        """Whether the work is done and did not fail, asked without waiting (torch's older Work API).

        Returns:
            True once `is_completed()` is and neither the work (a worker job's error, the call's
            tag mismatch) nor `wait()` failed.
        """
        if self._error is not None or not self.is_completed():
            return False
        if getattr(self._completion, "error", None) is not None:  # a CPU job that raised
            return False
        return self._entry is None or self._entry.own_error() is None

    def get_future(self) -> torch.futures.Future:
        """A future of the operation, as torch's Work gives.

        Returns:
            A ``torch.futures.Future`` that completes with the operation's output tensors when
            it is done (on CUDA carrying the end of its work as torch's futures do: waiting on
            it orders the current stream after it); one without a result of its own (a native
            call) completes with None once `wait()` has run, which this call does.
        """
        if self._future is not None:
            return self._future()
        self.wait()
        fut = torch.futures.Future()
        fut.set_result(None)
        return fut

    def exception(self) -> BaseException | None:
        """The error this handle failed with.

        Returns:
            The exception, or None.
        """
        return self._error


class PendingWork(Pending, dist.Work):
    """A `Pending` that is a ``torch.distributed.Work`` (what a process group's methods return)."""

    def __init__(self, finish: Callable[[], object], entry=None, done=None, future=None, again=None):
        dist.Work.__init__(self)
        Pending.__init__(self, finish, entry, done, future, again)


def on_every_wait(finish: Callable[[], object], device: torch.device):
    """(finish, again) for a `Pending` whose `finish` works on the waiting stream (a decode, a copy
    into the caller's tensor): on CUDA the end of that work is recorded, and every later `wait()`
    orders its own current stream after it, as torch's `wait()` orders the current stream on every
    call. CPU: `finish` as it is, nothing again."""
    if not _streams.on_streams(device):
        return finish, None
    end: list = []

    def first():
        out = finish()
        end.append(_streams.completion(device))
        return out

    def again():
        _streams.wait_for(end[0], device)

    return first, again


def decode_on_wait(works: list, wires: list, decode: Callable[[], object], device: torch.device, cls=Pending):
    """A receive's Work (`cls`: `Pending`, or `PendingWork` for a process group): its first `wait()`
    waits for the receives' `works` (once: a gloo p2p Work waited twice blocks), then runs `decode()`
    (what it returns is the call's error record, or None) on the waiting stream, after the issuing
    stream's work up to now (as torch's `irecv` orders it) and with each received wire buffer
    (`wires`, allocated just now by the receives) recorded there; every later `wait()` orders its
    stream after the decode. A failure is raised again by every later `wait()`."""
    allocated_on = _streams.allocation_stream(device)
    issued = _streams.completion(device)

    def finish():
        for w in works:
            w.wait()
        _streams.wait_for(issued, device)
        for wire in wires:
            _streams.used_here(wire, allocated_on)
        return decode()

    finish, again = on_every_wait(finish, device)
    return cls(finish, again=again)


def as_work(pending, result, device: torch.device, then: Callable[[], None] | None = None):
    """A collective's handle as a ``torch.distributed.Work`` for a process group to return: its
    `wait()` waits for `pending` (a `Pending`, a Work, or None for work already complete), then
    runs `then` (copies into the caller's outputs); `get_future()` completes with `result` (the
    handle's own future when it has one and nothing is left for `then`)."""
    if pending is None and then is None:
        return completed(result, device)
    if isinstance(pending, dist.Work) and then is None:
        return pending

    def finish():
        if pending is not None:
            pending.wait()
        if then is not None:
            then()

    if then is None:  # a later wait() is the handle's own (it orders the waiting stream again)
        again = None if pending is None else pending.wait
    else:  # the copies ran on the first waiting stream: later ones wait for their end
        finish, again = on_every_wait(finish, device)
    # complete with the work, or (`then`: copies made at wait()) once wait() has run them
    done = getattr(pending, "_completion", None) if then is None else None
    own = getattr(pending, "_future", None) if then is None else None
    if own is not None:  # the handle's future (its failure included), completed with `result`
        work = PendingWork(finish, done=done, future=lambda: own().then(lambda fut: (fut.value(), result)[1]),
                           again=again)
    else:  # complete it at wait(), with the result (on CUDA: the waiting stream's events)
        work = PendingWork(finish, done=done, again=again)
        work._future = lambda: (work.wait(), completed(result, device).get_future())[1]
    return work


class Deferred:
    """An operation with a peer posted later, in issue order, by that peer's thread (`_handshake.submit`),
    on the stream that was current where it was issued.
    `post()` posts it and returns (works, failed): the Works to wait for and a Handshake whose
    error the operation ends with, or None. `wait()` waits until it is posted, then for its works,
    then raises the handshake's error, or whatever posting raised, at this and every later call."""

    def __init__(self, post: Callable[[], tuple], device: torch.device):
        self._post = post
        self._stream = _streams.current(device) if device.type == "cuda" else None  # the issuer's (CUDA only)
        self._posted = threading.Event()
        self._works: list = []
        self._failed = None
        self._error: BaseException | None = None

    def run(self) -> None:
        try:
            with _streams.use(self._stream) if self._stream is not None else contextlib.nullcontext():
                self._works, self._failed = self._post()
        except BaseException as e:  # noqa: BLE001 - handed to wait()
            self._error = e
        self._posted.set()

    def fail(self, error: BaseException) -> None:
        """End without posting (an earlier operation with the peer could not be posted)."""
        self._error = error
        self._posted.set()

    def wait(self, timeout=None) -> bool:
        self._posted.wait()
        works, self._works = self._works, []  # once: a gloo p2p Work waited twice blocks
        for w in works:
            w.wait()
        if self._failed is not None:
            self._error, failed, self._failed = self._failed.error, self._failed, None
            failed.raised()
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._posted.is_set() and self._error is None and self._failed is None and all(
            w.is_completed() for w in self._works)


class WaitAll(dist.Work):
    """One Work for several: `wait()` waits for each in order. `works` may grow until then (the
    Works issued inside a coalescing block); `result` is what `get_future()` completes with."""

    def __init__(self, works: list | None = None, result=None):
        super().__init__()
        self.works = [] if works is None else works
        self._result = result

    def wait(self, timeout=None) -> bool:
        for w in self.works:
            w.wait()
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def get_future(self):
        try:
            futures = [w.get_future() for w in self.works]
        except RuntimeError:  # some Works have no future (gloo's reduce_scatter, send, ...): wait now
            self.wait()
            fut = torch.futures.Future()
            fut.set_result(self._result)
            return fut
        return torch.futures.collect_all(futures).then(lambda _: self._result)


class Counted:
    """`work`, whose `wait()` also adds to `stats.wire_bytes` the bytes this rank hands to the
    process group while finishing it (`WireStats`), and those recorded into `issued` (the
    `WireStats` open when the work was issued) since `counted` of them were counted: an async
    call on CPU hands its bytes to the process group from its group's worker thread, into the
    `WireStats` open at its issue, until it is done. Everything else is `work`'s own."""

    def __init__(self, work, stats, issued=None, counted: float = 0.0):
        self._work, self._stats = work, stats
        self._issued, self._counted = issued, counted

    def wait(self, timeout=None):
        with WireStats() as ws:
            out = self._work.wait()
        self._stats.wire_bytes += ws.wire_bytes
        if self._issued is not None:  # once: later waits find nothing new
            total = self._issued.wire_bytes
            self._stats.wire_bytes += total - self._counted
            self._counted = total
        return out

    def __getattr__(self, name: str):
        return getattr(self._work, name)


def completed(result, device: torch.device):
    """A completed Work whose future holds `result` (on CUDA: with the current stream's events).

    Args:
        result: what the future completes with (None: nothing to order on CUDA).
        device: the device of the call's tensors.

    Returns:
        A ``torch.distributed.Work`` that is already complete.
    """
    if device.type == "cuda" and result is not None:
        fut = torch.futures.Future(devices=[_streams.indexed(device)])
    else:  # CPU work is done; a coalescing block's end has no tensors to order
        fut = torch.futures.Future()
    fut.set_result(result)
    return _C10D._create_work_from_future(fut)


def all_of(works: list, result, device: torch.device):
    """One Work that completes when every Work in `works` (None: already done) has.

    Args:
        works: the parts' Works.
        result: what the combined future completes with.
        device: the device of the call's tensors.

    Returns:
        A `WaitAll`, or a completed Work when no part is pending.
    """
    works = [w for w in works if w is not None]
    if not works:
        return completed(result, device)
    return WaitAll(works, result)
