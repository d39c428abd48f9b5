"""One group, one order: compressed, forwarded and p2p calls on one group, sync and async, with a
late rank, give what plain gloo gives where forwarded (bit for bit), stay within the format's bound
where compressed, never hang, and leave nothing behind after destroy (2 gloo ranks on CPU)."""
from __future__ import annotations

import pytest

from . import mixed_traffic_cases as cases
from .dist_utils import run_ranks


@pytest.fixture(scope="module")
def mixed():
    return run_ranks(cases.taco_default_mixed, 2, timeout_s=240, pg_timeout_s=30)


def test_taco_calls_and_forwarded_calls_on_the_taco_default_group_keep_one_order(mixed):
    for r in mixed:
        assert r["mixed_int_ok"], r
        assert r["mixed_err"] <= r["mixed_bound"], r


def test_a_compressed_call_on_the_taco_default_group_is_counted_once(mixed):
    for r in mixed:
        assert r["wire_default"] == r["wire_inner"] > 0, r


def test_p2p_metadata_and_a_compressed_activation_arrive_in_the_order_sent(mixed):
    assert mixed[0]["p2p_raised"] == [None, None]
    r1 = mixed[1]
    assert r1["p2p_raised"] == [None, None] and r1["p2p_meta_ok"] and r1["p2p_act_ok"], r1


def test_a_queued_forwarded_call_is_complete_only_once_its_data_is_in_place(mixed):
    r0 = mixed[0]
    assert not r0["early_completed"] or r0["early_value_ok"], r0
    assert not r0["early_completed"], r0  # the peer is late: nothing can be done yet
    for r in mixed:
        assert r["queued_future"] == [[2, 2, 2, 2]], r["queued_future"]


def test_a_forwarded_send_while_a_compressed_all_reduce_is_in_flight_completes(mixed):
    assert mixed[1]["send_ok"]


def test_a_failed_async_call_is_completed_not_successful_and_raises_its_error_at_wait(mixed):
    for r in mixed:
        assert r["failed_completed"] and not r["failed_success"], r
        assert r["failed_wait"] and r["failed_wait"].startswith("ValueError"), r["failed_wait"]


def test_calls_run_under_the_callers_inference_mode(mixed):
    for r in mixed:
        assert (r["inference_sync"], r["inference_async"], r["inference_gather"]) == (None, None, None), r


def test_a_disagreement_is_raised_on_every_repeat_and_nothing_aborts():
    for r in run_ranks(cases.disagreement_repeated, 2, timeout_s=240, pg_timeout_s=30):
        assert all(e and e.startswith("ValueError") for e in r["raised"]), r
        assert r["after"] == 2.0, r


def test_ddp_with_compressed_and_forwarded_buckets_on_a_taco_default_group():
    for r in run_ranks(cases.ddp_mixed_buckets, 2, timeout_s=240, pg_timeout_s=30):
        assert r["compressed_numels"] == r["big_numels"] == [128 * 2048], r  # one bucket per parameter
        assert len(r["forwarded_bitwise"]) == 3 and all(r["forwarded_bitwise"]), r
        assert 0 < r["compressed_err"] <= r["compressed_bound"], r
        assert r["replicas_agree"], r


def test_destroyed_groups_leave_no_thread_and_no_reference():
    for r in run_ranks(cases.groups_die_with_their_state, 2, timeout_s=300, pg_timeout_s=30):
        assert r == {"threads": [], "alive": 0}, r
