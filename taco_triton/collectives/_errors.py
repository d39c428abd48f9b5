"""Error records: each compressed call's tag mismatches, read once its work is complete and raised
by that call (or `check_errors`).

The receiving kernels check every slot's tag on the device; a mismatch makes the outputs it fed
NaN and fills the call's own small host-visible error record (`slots.ErrorRecord`, claimed from
its plan's or p2p message's pool, one per call in flight). The host reads a record only once its
call's work is complete (CPU: at once, or once its worker job is done; CUDA: its completion event,
the end event of an async call, has fired, without waiting for it), clears it and gives it back to its owner, so no record is cleared while a kernel may write
it; an error read stays with its call's entry (`Watched`) until it is raised:

- an async call's by its handle's `wait()` (and every later one), never by another call;
- a synchronous call's at its end, or (CUDA, not complete yet) by the first synchronous call that
  ends after it completed, or by `check_errors`;
- a call captured in a CUDA graph: by `check_errors`, for the replays run since.

The entries live in `STATE.unchecked` (not read yet, in issue order) and `STATE.unreported`
(read, not raised yet). An entry is claimed from them under one lock (`_claim`), so two readers
(a `wait()` and `check_errors`, a new call's issue and an old handle's `wait()`, two threads) take
each record once; waiting for a call's work happens outside it. CUDA is asked through `_streams`
only; no kernel is imported here.
"""
from __future__ import annotations

import threading

import torch

from . import _streams
from ..state import STATE
from .work import Pending

_claim = threading.Lock()


class Watched:
    """One call's error record in flight: `owner` (the plan or p2p message: it names the error and
    takes the record back), the `record` only this call's kernels write, `done` (None: the work
    was complete at issue, as on CPU; a CUDA event; `_streams.IN_GRAPH`), whether an async handle
    owns the error (`handle`), and the error once the record was read."""

    __slots__ = ("done", "error", "handle", "owner", "read", "record", "reported")

    def __init__(self, owner, record, done, handle: bool):
        self.owner, self.record, self.done, self.handle = owner, record, done, handle
        self.error = None
        self.read = self.reported = False

    def own_error(self) -> BaseException | None:
        """The error of this call, once its work is complete (read without waiting)."""
        if not self.read:
            read([self], block=False)
        return self.error

    def report(self):
        """Raise this call's error, which counts as reported from then on."""
        with _claim:
            if not self.reported:
                self.reported = True
                STATE.unreported.remove(self)
        raise self.error


def read(entries, block: bool) -> None:
    """Read the error records of those `entries` whose work is complete (all of them with
    `block`, waiting for it). A record is cleared and given back to its owner only here, after
    its call's work is complete, so no kernel can still write it; an error read stays with its
    entry until it is raised (`Watched.report`)."""
    capturing = None  # asked once, only for entries with an event: CPU work has none
    for e in entries:
        if e.done is _streams.IN_GRAPH:  # written by every replay: `read_captured`
            continue
        if e.done is not None:
            if capturing is None:
                capturing = _streams.capturing()
            if capturing:  # no event query or sync while a CUDA graph is captured
                continue
        if e.done is not None:
            if block:
                e.done.synchronize()
            elif not e.done.query():  # not done yet: read later
                continue
        with _claim:
            if e.read or e not in STATE.unchecked:  # another reader took it meanwhile
                continue
            STATE.unchecked.remove(e)
            _take(e)


def read_captured() -> None:
    """Read the records of calls captured in CUDA graphs (`STATE.captured`), written by every
    replay: after a synchronization of each device they are on, never given back (the graph's
    replays keep writing them). Each error found is one more to raise, of no handle."""
    if not STATE.captured or _streams.capturing():
        return
    for device in {getattr(e.owner, "device", None) for e in STATE.captured}:
        _streams.synchronize(device)
    with _claim:
        for e in STATE.captured:
            record = e.record.take()
            if record is not None:
                replay = Watched(e.owner, None, None, False)
                replay.error, replay.read = e.owner.error(record), True
                STATE.unreported.append(replay)


def _take(e: Watched) -> None:
    """Read a complete call's record, clear it and give it back (its error, if any, kept)."""
    record = e.record.take()
    e.owner.errors.release(e.record)
    e.record, e.read = None, True
    if record is not None:
        e.error = e.owner.error(record)
        STATE.unreported.append(e)


def watched(owner, record, done, handle: bool) -> Watched:
    """A call's error record watched from issue: read at once when its work is complete (CPU:
    the interpreter ran it already), else kept in `STATE.unchecked` until it is."""
    entry = Watched(owner, record, done, handle)
    with _claim:
        if done is None:
            _take(entry)
        elif done is _streams.IN_GRAPH:  # read by check_errors only, never by a call's own end
            STATE.captured.append(entry)
        else:
            STATE.unchecked.append(entry)
    return entry


def watch(owner, record, device: torch.device, handle: bool) -> Watched:
    """Register one call's error record (claimed from `owner.errors`), to be read once the call's
    work is complete: at once on CPU (the interpreter ran it already)."""
    return watched(owner, record, _streams.completion(device), handle)


def end_of_call(entry: Watched | None) -> None:
    """The error check at the end of a call without a handle: its own error if its work is
    complete (always on CPU), else the oldest error of an earlier call without a handle whose
    work completed since (on CUDA, without waiting for anything)."""
    if STATE.unchecked:
        read(list(STATE.unchecked), block=False)  # also gives completed calls' records back
    if entry is not None and entry.error is not None:
        entry.report()
    for e in STATE.unreported:
        if not e.handle:
            e.report()


def check_errors() -> None:
    """Raise ValueError if a compressed call found a tag mismatch (ranks that issued different
    collectives, or p2p ends that disagree) that has not been raised yet.

    Each call's tags are checked on the device into an error record of its own (one per call in
    flight), read by the host without a synchronization once that call's work is complete:

    - an async call's error is raised by its handle's `wait()` (by every later `wait()` too),
      never by another call; on CUDA, `wait()` can only see it once the call's work has completed
      (it does not wait for the device), so a `wait()` issued earlier returns True and a later
      one, or this function, raises it;
    - a synchronous call's error is raised at its end on CPU; on CUDA by the first synchronous
      call that ends after the work completed, or by this function;
    - calls captured in a CUDA graph: by this function, for the replays run since its last call.

    This function waits for all compressed work issued so far (on CUDA: a host synchronization
    with it), then raises the oldest error not raised yet (call it again for the next); an async
    call's handle still raises its own error afterwards.

    Returns:
        None, when no error is left to raise.

    Raises:
        ValueError: the oldest error not raised yet. The message names the call (its number),
            the slice, the rank the message came from and both tags.

    Example:
        >>> import taco_triton as taco
        >>> taco.check_errors()  # nothing issued, nothing to report
    """
    read(list(STATE.unchecked), block=True)
    read_captured()
    if STATE.unreported:
        STATE.unreported[0].report()


def finish_call(owner, device: torch.device, async_op: bool, record, done, finish=None, future=None, again=None):
    """What follows the issue of a compressed call: its error record watched (`record`: the one
    its kernels write, None on the reference path) until `done`, what completes with the call's
    work (one meaning, three forms: a `_streams.completion` of the stream that ran it, which is
    None when the work was complete at issue, an event, or `IN_GRAPH`; or the `_worker.Job` that
    runs it on CPU), then the handle (async: its `wait()` runs `finish`, every later one `again`,
    its `get_future()` is `future()`) or the error check (sync: None)."""
    entry = None if record is None else watched(owner, record, done, async_op)
    if not async_op:
        end_of_call(entry)
        return None
    if STATE.unchecked:
        read(list(STATE.unchecked), block=False)  # gives completed calls' records back; raises nothing

    if finish is None:
        def finish():
            if done is not None:  # CPU: nothing to wait for
                _streams.wait_for(done, device)
        again = finish if again is None else again

    return Pending(finish, entry, done=done, future=future, again=again)
