"""Regressions of an adversarial user's findings on 2 gloo ranks (one session, one test each).

Each test is named for the behaviour that failed before the fix. A 10 s process-group timeout
turns a regression into a hang into an error instead of a stuck suite.
"""
import math

import pytest
import torch

import taco_triton as taco
from taco_triton import reference
from taco_triton.collectives import Pending
from taco_triton.collectives.compressed import overflow_threshold

from . import collective_cases as cases
from .dist_utils import run_ranks


@pytest.fixture(scope="module")
def seen():
    return run_ranks(cases.findings, 2, pg_timeout_s=10, timeout_s=240)


def _close(values, want, rel):
    return all(abs(v - want) <= rel * abs(want) for v in values)


def test_async_wait_order_does_not_mix_results(seen):
    # constant groups: one Hadamard coefficient each, so only code rounding (3 mantissa bits) applies
    rel = 2 * taco.CompressionConfig().spec.relative_rounding
    for r in seen:
        a, b = r["wait_order"]
        assert _close(a, 3.0, rel) and _close(b, 300.0, rel), (a[:3], b[:3])
    assert seen[0]["wait_order"] == seen[1]["wait_order"]


def test_waiting_after_the_next_collective_does_not_hang_or_mix(seen):
    rel = 2 * taco.CompressionConfig().spec.relative_rounding
    for r in seen:
        c, d = r["wait_late"]
        assert _close(c, 3.0, rel) and _close(d, 3.0, rel)


@pytest.mark.parametrize("dtype", ["int", "float"])
def test_native_all_reduce_of_a_view_reduces_the_view_and_leaves_the_rest(seen, dtype):
    base = [torch.arange(40).reshape(4, 10) + 1000 * r for r in range(2)]
    want = base[0].clone()
    want[:, ::2] = base[0][:, ::2] + base[1][:, ::2]
    for r, s in enumerate(seen):
        got = torch.tensor(s[f"view_{dtype}"]).long()
        mine = want.clone()
        mine[:, 1::2] = base[r][:, 1::2]  # untouched columns keep this rank's values
        assert torch.equal(got, mine), got


def test_expanded_output_is_a_value_error_not_heap_corruption(seen):
    assert all(s["expanded"].startswith("ValueError") and "overlapping" in s["expanded"] for s in seen)


@pytest.mark.parametrize("path", ["compressed", "native"])
def test_gradient_through_all_reduce_is_not_zeroed(seen, path):
    for s in seen:
        assert s[f"grad_{path}"] == [2.0] * 300
        assert s[f"leaf_{path}"] == "ok"


@pytest.mark.parametrize("codec", [c.codec for c in cases.CONFIGS])
def test_fp16_sum_that_overflows_is_inf_and_one_at_the_max_saturates(seen, codec):
    for s in seen:
        overflowed_inf, at_max_finite, at_max_min, rs_inf = s[f"overflow_{codec}"]
        assert overflowed_inf and rs_inf
        assert at_max_finite
        # within the two roundings of the format below the max
        cfg = taco.CompressionConfig(codec=codec)
        assert at_max_min >= 65504 * (1 - 2 * cfg.spec.relative_rounding) - 32


def test_int_avg_is_rejected_before_the_tensor_is_touched(seen):
    for r, s in enumerate(seen):
        msg, values = s["int_avg"]
        assert msg.startswith("ValueError") and "torch.int64" in msg
        assert values == [v + r for v in range(6)]


def test_rank_outside_the_group_is_a_no_op(seen):
    assert seen[1]["outside_group"] == ("ok", 5000.0)
    assert seen[0]["outside_group"] == ("ok", 5000.0)  # a group of one: nothing to add


@pytest.mark.parametrize("field", ["op", "min_bytes", "pipeline", "codec", "group_size"])
def test_ranks_that_disagree_all_raise_naming_both_and_keep_their_tensor(seen, field):
    msgs = [s[f"disagree_{field}"][0] for s in seen]
    assert all(m.startswith("ValueError") and "rank 0:" in m and "rank 1:" in m for m in msgs), msgs
    assert all(s[f"disagree_{field}"][1] for s in seen)


def test_ranks_with_different_shapes_raise_instead_of_aborting(seen):
    assert all(s["disagree_shape"].startswith("ValueError") and "(100,)" in s["disagree_shape"]
               and "(101,)" in s["disagree_shape"] for s in seen)


def test_per_slot_tags_catch_a_config_mismatch_without_the_fingerprint_exchange(seen):
    assert all(s["tags_catch_codec"].startswith("ValueError") and "carries tag" in s["tags_catch_codec"]
               for s in seen)


def test_failed_handle_stays_failed():
    def boom():
        raise RuntimeError("peer gone")

    h = Pending(boom)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="peer gone"):
            h.wait()
    # as torch's Works: complete (the error is known), not successful
    assert h.is_completed() and not h.is_success() and isinstance(h.exception(), RuntimeError)


@pytest.mark.parametrize("codec", ["fp8_e4m3", "fp8_e5m2", "int8"])
def test_reference_saturate_cast_inf_only_beyond_the_rounding_margin(codec):
    cfg = taco.CompressionConfig(codec=codec)
    edge = overflow_threshold(cfg, torch.float16)
    big = torch.finfo(torch.float16).max
    y = torch.tensor([big * 1.0001, edge * 0.999, edge * 1.001, -edge * 1.001, math.nan], dtype=torch.float64)
    got = reference.saturate_cast(y, torch.float16, edge)
    assert got[:2].tolist() == [big, big]
    assert got[2] == math.inf and got[3] == -math.inf and got[4].isnan()
    assert reference.saturate_cast(y, torch.float16)[2] == big  # default: today's saturation
