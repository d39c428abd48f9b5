"""Async compressed collectives that overlap: an async call returns before its communication
completes and leaves the caller's stream free until `wait()`.

On 2 gloo ranks with one rank late by `DELAY` seconds: the punctual rank's async calls (through
`taco.*` and through `dist.*` on a compressing group) return at once and `wait()` takes the rest
(before: each call returned only after the late rank arrived); calls waited in opposite orders on
the two ranks pair up, and each failing call raises at its own `wait()`. The CUDA schedule is
driven on CPU with recording fake streams (the one module the collectives touch streams
through): the caller's stream records one event and waits on nothing until `wait()`, which adds
one wait. The GPU side (a real overlap with a GEMM, graph capture) is in tests/test_cuda_graphs.py.
"""
import pytest

from . import async_cases as cases
from .dist_utils import run_ranks

#: How late rank 1 enters. An async call must return in well under it.
DELAY = 1.5
#: An issue that takes longer than this did not return before the communication completed.
QUICK = DELAY / 3


@pytest.fixture(scope="module")
def reports():
    return run_ranks(cases.session, 2, DELAY, pg_timeout_s=30, timeout_s=300)


@pytest.fixture(scope="module")
def late(reports):
    return [r["late"] for r in reports]


def test_async_calls_return_before_a_late_peer_arrives(late):
    """Before: each of rank 0's async calls returned only once rank 1 had joined (~DELAY s)."""
    r = late[0]
    assert max(r["issued"].values()) < QUICK, r["issued"]
    assert r["total"] >= DELAY * 0.8, r  # the wait took the rest: the peer really was late
    assert r["waited"] >= DELAY * 0.8 - sum(r["issued"].values()), r


def test_async_results_are_the_synchronous_bits_within_the_bound(late):
    for r in late:
        assert all(r["same"].values()), r["same"]
        assert r["err"] <= r["bound"], (r["err"], r["bound"])


def test_calls_waited_in_opposite_orders_pair_up_and_raise_their_own_errors(reports):
    """Rank 0 waits c, b, a; rank 1 a, b, c (rank 1 late, so nothing is done at issue). b and c
    (one plan, tags that differ between the ranks) each raise at their own wait, again at every
    later wait; a is right; nothing is left for a later call or `check_errors`. Before: the calls
    returned only once the late rank had joined."""
    orders = [r["orders"] for r in reports]
    assert orders[0]["issue"] < QUICK, orders[0]["issue"]
    for r in orders:
        assert r["raised"] == {"a": False, "b": True, "c": True}, r
        assert r["calls"]["c"] == r["calls"]["b"] + 1, r["calls"]  # each its own call's error
        assert all(r["again"].values()), r["again"]
        assert r["a_same"], r
        assert r["later"] is None and r["check_errors"] is None, r


@pytest.fixture(scope="module")
def schedule(reports):
    return [r["schedule"] for r in reports]


@pytest.mark.parametrize("kind, tensors", [pytest.param("all_reduce", 1, id="all_reduce-pipeline2"),
                                           pytest.param("all_gather", 3, id="all_gather-strided-output")])
def test_cuda_schedule_leaves_the_callers_stream_free_until_wait(schedule, kind, tensors):
    """With recording fake streams: after the async call returns the caller's stream has recorded
    one event and waits on nothing; `wait()` adds exactly one wait (the end event recorded on the
    communication stream after the call's last step); the communication stream waited for the
    fork before its first step; every launch, process-group call and stage wait ran with the
    communication stream current; no launch read a buffer before the wait of the communication
    that filled it; the caller's tensors were `record_stream`ed there; results are the
    synchronous path's bits. Before: no communication stream; the call ran on the caller's."""
    for r in schedule:
        s = r[kind]
        assert s["after_issue"] == (1, 0), s
        assert s["after_wait"] == (1, 1), s
        assert s["forked_first"] and s["end_after_work"] and s["joined_end"], s
        assert s["streams"] == {"launch": ["comm"], "comm": ["comm"], "waited": ["comm"]}, s
        assert s["read_early"] == [], s
        assert s["record_streams"] == tensors, s
        assert s["same"], s
