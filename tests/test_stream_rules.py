"""The async CUDA schedule keeps ProcessGroupNCCL's rules, checked on CPU with the recording fake
streams (`host_audit.fake_streams`, which model the caching allocator's reuse rule): memory used on
the communication stream is held or recorded until the caller joins, in a graph capture too; every
`wait()` orders its current stream; scratch read at `wait()` is recorded on the waiting stream and a
receive's decode follows the issuing stream's work; error records are claimed once by concurrent
readers; every process-group method takes its options omitted or given."""
from __future__ import annotations

import threading
import time

import pytest

from taco_triton.collectives import _errors
from taco_triton.state import STATE

from . import stream_rules_cases as cases
from .dist_utils import run_ranks


@pytest.fixture(scope="module")
def seen():
    return run_ranks(cases.session, 2, timeout_s=300, pg_timeout_s=60)


@pytest.mark.parametrize("capturing", [False, True], ids=["outside-capture", "in-graph-capture"])
def test_memory_used_on_the_communication_stream_outlives_the_join(seen, capturing):
    for r in seen:
        assert r["capture"][capturing] == [], r["capture"]


def test_captured_calls_error_records_are_kept_apart_and_read_by_check_errors(seen):
    for r in seen:
        assert r["capture"]["unchecked_growth"] == 0 and r["capture"]["captured_growth"] == 2, r["capture"]
        assert r["capture"]["synchronized"] == ["cpu"], r["capture"]  # the device the records are on


def test_a_plan_keeps_no_tensor_of_the_call_that_made_it(seen):
    for r in seen:
        assert not r["plans"]["kept"], r["plans"]


@pytest.mark.parametrize("api", ["taco", "process_group"])
def test_every_wait_orders_the_current_stream_after_the_call(seen, api):
    for r in seen:
        assert r["waits"][api], r["waits"]


def test_scratch_read_at_wait_is_recorded_on_the_waiting_stream(seen):
    for r in seen:
        s = r["scratch"]
        assert s["list_all_gather"] and s["native_copy"] and s["native_value"], s
        assert not s["list_all_gather_done_early"] and s["list_all_gather_done"], s  # complete once copied out
    assert seen[1]["scratch"]["recv_ordered"], seen[1]["scratch"]


def test_every_process_group_method_takes_its_options_omitted_or_given(seen):
    for r in seen:
        assert r["methods"]["failed"] == {}, r["methods"]


class _SlowEvent:
    """A completion that turns done after a while; waiting for it takes a while too."""

    def __init__(self, at: float):
        self.at = at

    def query(self) -> bool:
        return time.monotonic() >= self.at

    def synchronize(self) -> None:
        time.sleep(max(0.0, self.at - time.monotonic()) + 0.005)


class _Owner:
    class errors:  # noqa: N801 - the pool's interface
        @staticmethod
        def release(record):
            pass

    @staticmethod
    def error(record):
        return ValueError("mismatch")


class _Record:
    def take(self):
        return None


def test_concurrent_readers_claim_each_error_record_once():
    """check_errors() (waiting for each call) racing non-blocking reads (a wait(), a new call's
    issue): each record is taken once, nobody raises (a list.remove of a taken entry raised
    ValueError, the type of a tag mismatch)."""
    start = time.monotonic()
    entries = [_errors.watched(_Owner(), _Record(), _SlowEvent(start + 0.002 * i), True) for i in range(40)]
    raised = []

    def blocking():
        try:
            _errors.read(list(STATE.unchecked), block=True)
        except Exception as e:  # noqa: BLE001 - collected for the assertion
            raised.append(e)

    def polling():
        try:
            while any(not e.read for e in entries):
                _errors.read(list(STATE.unchecked), block=False)
        except Exception as e:  # noqa: BLE001
            raised.append(e)

    threads = [threading.Thread(target=blocking), threading.Thread(target=polling)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert raised == [] and all(e.read for e in entries)
        assert not any(e in STATE.unchecked for e in entries)
    finally:
        for e in entries:
            if e in STATE.unchecked:
                STATE.unchecked.remove(e)


@pytest.mark.parametrize("on_cuda", [True, False], ids=["cuda-issued-at-once", "cpu-queued-in-order"])
def test_forwarded_calls_take_the_route_of_their_device(monkeypatch, on_cuda):
    """A forwarded call on CUDA tensors is issued at once, on the caller's thread (its stream, and
    NCCL's order among the CUDA calls, which are all issued there), even while CPU jobs are queued
    on the inner group (finding 2: it went through the CPU worker queue); on CPU it queues behind
    them, in order."""
    from types import SimpleNamespace

    from taco_triton.collectives import _worker
    from taco_triton.integrations import process_group as pgm

    class Inner:
        def __init__(self):
            self.threads = []

        def broadcast(self, tensors, opts):
            self.threads.append(threading.current_thread())
            return None

    inner, release = Inner(), threading.Event()
    monkeypatch.setattr(pgm, "_on_cuda", lambda args: on_cuda)
    busy = _worker.of(inner).submit(lambda: release.wait(30))  # a CPU job in flight on the inner group
    group = SimpleNamespace(inner=inner, _track=lambda work: work)
    try:
        work = pgm.CompressingProcessGroup._forward(group, "broadcast", 8, 8, "broadcast", [object()], None)
        assert inner.threads == ([threading.current_thread()] if on_cuda else [])
    finally:
        release.set()
    busy.synchronize()
    if not on_cuda:
        work.wait()
        assert len(inner.threads) == 1 and inner.threads[0] is not threading.current_thread()
    STATE.forget(inner)
