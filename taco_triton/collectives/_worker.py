"""CPU (gloo) async calls: one worker thread per process group runs them first-in, first-out.

The group is the one that carries the bytes (`_pg.carrier`: a compressing process group's inner
group), whichever path a call takes: `taco.*` on either group, the compressing group's compressed
and forwarded collectives, native fallbacks, agreements. So one queue orders every collective that
reaches that group through taco_triton, on every rank.

Point-to-point messages are not queued: they are issued on the calling thread at once, in the
caller's order (compressed and forwarded alike). gloo (and NCCL) match a message by its peer and
tag in the order each side posts it, never against collectives, so their own order is the only one
to keep; queueing a send behind a compressed collective would make it wait for that collective to
complete, which plain gloo does not (a peer that receives before it joins the collective would hang).

gloo runs a collective on the host, so an async compressed call that ran its pipeline on the
calling thread (compress, all_to_all, wait, reduce, all_gather, wait, decompress) would return
only once every rank had joined. Instead an async call on CPU tensors is one job of its group's
worker (`submit`) and returns at once; its Work's `wait()` blocks until the job is done and
raises what it raised.

gloo pairs a group's collectives across ranks by the order they are issued. So while a group's
worker has jobs, every call that touches the group through taco_triton (synchronous compressed
calls, native fallbacks, the rank-agreement exchange, the compressing process group's forwarded
calls) becomes a job of the same queue too (`run`: enqueue, then wait), and the ranks issue the
same sequence whatever order their Works are waited in. When the queue is empty and no job runs,
a synchronous call runs inline on the calling thread under the worker's lock: it costs nothing
new. Calls made directly on the group, bypassing taco_triton, while async work is in flight are
not ordered with it (wait first, or go through taco_triton or the compressing group).

Under Triton's interpreter (CPU kernels, `TRITON_INTERPRET=1`) launches are made one at a time
once a worker exists (`_serial_interpreter`): the interpreter patches `triton.language` for the
length of a launch and keeps the program index in one global builder, so launches from two
threads at once would corrupt each other.

A job records the bytes it hands to the process group into the `WireStats` that were open when
it was issued (`_pg.stats_context`).
"""
from __future__ import annotations

import os
import threading
import weakref
from collections import deque
from collections.abc import Callable

import torch

from ..state import STATE
from . import _pg
from .work import PendingWork


_then_lock = threading.Lock()


class Job:
    """One queued call: `query()` (done, without waiting), `synchronize()` (wait until done), and
    the result or error of `fn`. It quacks like a CUDA event, so an error record watched until
    `query()` is True is read only once the job's kernels are done (`_errors`)."""

    __slots__ = ("_done", "_finished", "_fn", "_grad", "_inference", "_stats", "_then", "error", "result")

    def __init__(self, fn: Callable[[], object]):
        self._fn = fn
        self._stats = _pg.stats_context()
        # the caller's thread-local autograd modes: a job writes the caller's tensors (an output made
        # under inference mode may only be written under it)
        self._grad, self._inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
        self._done = threading.Event()
        self.result = None
        self.error: BaseException | None = None
        self._then: list = []
        self._finished = False  # then() runs at once from here on

    def run(self) -> None:
        try:
            with _pg.stats_restored(self._stats), torch.inference_mode(self._inference), \
                    torch.set_grad_enabled(self._grad):
                self.result = self._fn()
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits
            self.error = e
        self._fn = None  # drop the call's tensors
        with _then_lock:
            self._finished = True
            then, self._then = self._then, []
        for fn in then:  # before the job counts as done: a future is complete when wait() returns
            fn(self)
        self._done.set()

    def then(self, fn: Callable[["Job"], None]) -> None:
        """Run `fn(job)` once the job is done (now, if it is)."""
        with _then_lock:
            if not self._finished:
                self._then.append(fn)
                return
        fn(self)

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()

    def outcome(self):
        """Wait for the job; its result, or raise its error."""
        self._done.wait()
        if self.error is not None:
            raise self.error
        return self.result


_CLOSE = object()  # the job that ends a worker's thread


class Worker:
    """The FIFO of one process group (see the module docstring); its thread starts with the first
    job and stays (a daemon) until the group is destroyed or collected (`close`)."""

    def __init__(self, name: str):
        self._name = name
        self._mu = threading.Condition(threading.Lock())
        self._queue: deque = deque()
        self._pending = 0  # jobs queued or running
        self._exec = threading.Lock()  # held by the job or the inline call that runs
        self._thread: threading.Thread | None = None

    def submit(self, fn: Callable[[], object]) -> Job:
        """Queue `fn` behind the group's earlier jobs; its `Job`."""
        job = Job(fn)
        if threading.current_thread() is self._thread:  # a job's own call: it runs in order already
            job.run()
            return job
        with self._mu:
            self._queue.append(job)
            self._pending += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=f"taco_triton {self._name}", daemon=True)
                self._thread.start()
            self._mu.notify()
        return job

    def run(self, fn: Callable[[], object]):
        """Run `fn` in the group's issue order and return its result (or raise): inline when
        nothing is queued or running, else as a job waited for."""
        ran, out = self.inline(fn)
        return out if ran else self.submit(fn).outcome()

    def inline(self, fn: Callable[[], object]) -> tuple[bool, object]:
        """(True, fn()) when nothing is queued or running (or on the worker's own thread): `fn`
        ran on this thread, under the worker's lock; (False, None) otherwise, nothing ran."""
        if threading.current_thread() is not self._thread:
            with self._mu:
                if self._pending:
                    return False, None
                self._exec.acquire()  # nothing can start while we hold _mu and _pending is 0
            try:
                return True, fn()
            finally:
                self._exec.release()
        return True, fn()

    def busy(self) -> bool:
        """Whether jobs are queued or running."""
        return self._pending > 0

    def close(self) -> None:
        """End the thread once the jobs queued before this call have run (no new job may follow)."""
        with self._mu:
            if self._thread is not None:
                self._queue.append(_CLOSE)
                self._mu.notify()

    def _loop(self) -> None:
        while True:
            with self._mu:
                while not self._queue:
                    self._mu.wait()
                job = self._queue.popleft()
                if job is _CLOSE:
                    self._thread = None
                    return
            with self._exec:
                job.run()
            with self._mu:
                self._pending -= 1


def _serial_interpreter() -> None:
    """Make Triton's interpreter run one launch at a time (see the module docstring); once."""
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return
    from triton.runtime import interpreter

    grid = interpreter.GridExecutor
    if getattr(grid.__call__, "_taco_serial", False):
        return
    launch, lock = grid.__call__, threading.RLock()

    def serial(self, *args, **kwargs):
        with lock:
            return launch(self, *args, **kwargs)

    serial._taco_serial = True
    grid.__call__ = serial


def of(pg) -> Worker:
    """The worker of process group object `pg` (made on first use)."""
    w = STATE.workers.get(pg)
    if w is None:
        STATE.seen(pg)
        with STATE.lock:
            w = STATE.workers.get(pg)
            if w is None:
                _serial_interpreter()
                # held weakly: a worker holds no reference to its group (a job drops its call once
                # run), so a group collected without being destroyed also ends its worker's thread
                w = STATE.workers[pg] = Worker(f"group {id(pg):#x}")
                weakref.finalize(pg, w.close)
    return w


def running(pg) -> Worker | None:
    """`pg`'s worker if it has async jobs queued or running, else None (cheap: no worker is made,
    no lock taken; a call that finds None runs inline, which is in order: on this thread, only a
    job queued by another thread can have started since, and calls from several threads on one
    group have no order to keep)."""
    w = STATE.workers.get(pg)
    return w if w is not None and w._pending else None


class Issued:
    """What completes with a call a job issues: the job, then the Work it issued (quacks like a CUDA
    event for `Pending`: `query`, `synchronize`, and the job's `error`)."""

    __slots__ = ("job",)

    def __init__(self, job: Job):
        self.job = job

    @property
    def error(self):
        return self.job.error

    def query(self) -> bool:
        job = self.job
        if not job.query():
            return False
        return job.error is not None or job.result is None or job.result.is_completed()

    def synchronize(self) -> None:
        self.job.synchronize()


def _future_of(job: Job) -> torch.futures.Future:
    """A future completed as torch's would be by the Work the job issues: with its value (the
    output tensors), or the job's error."""
    fut = torch.futures.Future()

    def settle(inner):
        try:
            fut.set_result(inner.value())
        except Exception as e:  # noqa: BLE001 - the issued Work's failure is this future's
            fut.set_exception(e)

    def issued(j: Job):
        if j.error is not None:
            fut.set_exception(j.error)
        elif j.result is None:
            fut.set_result(None)
        else:
            try:
                inner = j.result.get_future()
            except RuntimeError:  # a Work without a future: done once waited for
                j.result.wait()
                fut.set_result(None)
            else:
                inner.add_done_callback(settle)

    job.then(issued)
    return fut


def in_order(pg, issue: Callable[[], object], async_op: bool):
    """Issue a call whose own Work (or None) `issue` returns, in `pg`'s order: at once when its
    worker is idle; else as a job, waited for (`async_op` False) or behind a Work that is complete
    once the job ran and the Work it issued is, whose future holds that Work's outputs and whose
    `wait()` raises what either raised."""
    w = running(pg)
    if w is None:
        return issue()
    if not async_op:
        return w.run(issue)
    ran, work = w.inline(issue)
    if ran:
        return work
    job = w.submit(issue)

    def finish():
        work = job.outcome()
        if work is not None:
            work.wait()

    future: list = []

    def get_future():  # one future, made on first use
        if not future:
            future.append(_future_of(job))
        return future[0]

    return PendingWork(finish, done=Issued(job), future=get_future)
