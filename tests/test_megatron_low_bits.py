"""4-bit data-parallel traffic (4 gloo ranks, DP = 4 emulated as 2 nodes of 2 ranks): the
distributed optimizer's parameter all-gather as INT4 weight differences, and the two-level
(INT8 inside a node, INT4 between nodes) gradient reduction in megatron's DDP and torch DDP;
6-bit pipeline traffic (2 ranks, PP = 2)."""
from __future__ import annotations

import pytest

from .dist_utils import run_ranks
from .test_megatron import needs_megatron

STEPS = 4


@pytest.fixture(scope="module")
def deltas():
    from . import megatron_low_bit_cases as mc

    return run_ranks(mc.weight_deltas, 4, STEPS, timeout_s=300, pg_timeout_s=200)


@needs_megatron
def test_weight_deltas_keep_every_rank_bit_identical(deltas):
    assert all(r["identical"] for r in deltas)


@needs_megatron
def test_weight_delta_error_is_one_difference_not_a_sum(deltas):
    """Each step the applied weights differ from the master's bf16 rounding by at most the last
    difference's INT4 error (bounds.l2_error_bound) plus one bf16 rounding: the error of earlier
    steps is carried into the next difference instead of adding up."""
    for r in deltas:
        assert r["errors"][0] == 0.0  # the first gather is exact
        for err, limit in zip(r["errors"][1:], r["limits"][1:]):
            assert 0 < err <= limit, (r["errors"], r["limits"])


@needs_megatron
def test_weight_deltas_move_int4_bytes(deltas):
    # INT4, G=32, dual scales: 16 code bytes + 1 scale byte per 32 elements + 4 bytes per 4096,
    # against 2 bytes per bf16 weight: 0.266 (plus the slots' tags and alignment)
    for r in deltas:
        assert r["wire_ratio"] <= 0.27, r["wire_ratio"]


@pytest.fixture(scope="module")
def two_level():
    from . import megatron_low_bit_cases as mc

    return run_ranks(mc.two_level, 4, 2, 3, timeout_s=300, pg_timeout_s=200)


@needs_megatron
@pytest.mark.parametrize("path", ["rs", "ar"])
def test_two_level_with_exact_codecs_is_the_reduction(two_level, path):
    """Exact stages: the same sums in another order (FP32, a handful of additions: 2^-20)."""
    for r in two_level:
        assert r["dp"] == 4
        assert r[f"{path}_exact_rel"] <= 2.0**-20, r[f"{path}_exact_rel"]


@needs_megatron
def test_two_level_int4_between_nodes_within_the_format_bound(two_level):
    for r in two_level:
        assert 0 < r["rs_inter_rel"] <= r["rs_inter_limit"], (r["rs_inter_rel"], r["rs_inter_limit"])


@needs_megatron
def test_two_level_all_reduce_leaves_replicas_identical(two_level):
    for r in two_level:
        assert r["ar_default_identical"] and r["ar_inter_identical"]
        # the defaults quantize twice more than INT4 alone (INT8 inside, both ways); sanity bound,
        # not a format bound: INT4 after Hadamard drops ~2^-3 of a group's range
        assert 0 < r["ar_default_rel"] < 0.5 and 0 < r["rs_default_rel"] < 0.5


@needs_megatron
def test_two_level_error_feedback_sends_what_the_residual_leaves_out(two_level):
    """3 reduce-scatters of one gradient with error feedback between nodes (exact inside) sum to
    3 x the exact reduction minus the residuals of this chunk's senders, up to FP32 rounding."""
    for r in two_level:
        assert r["ef_buffers"] == 1
        assert r["ef_residual_share"] > 2.0**-8
        assert r["ef_identity_rel"] <= 2.0**-18, r["ef_identity_rel"]


def test_ddp_comm_hook():
    from . import megatron_low_bit_cases as mc

    for r in run_ranks(mc.ddp_hook, 4, 2, timeout_s=200):
        assert r["exact_rel"] <= 2.0**-20, r
        assert r["identical"]
        assert 0 < r["default_rel"] < 0.5, r


@needs_megatron
def test_pipeline_int6_bytes_and_loss():
    from . import megatron_low_bit_cases as mc

    for r in run_ranks(mc.pipeline_int6, 2, timeout_s=200):
        calls, compressed, wire = r["int6_pp"]
        assert calls == compressed > 0 and r["native_pp"][1] == 0
        # INT6, G=32, dual scales: 24 code bytes + 1 scale byte per 32 elements + 4 bytes per 4096,
        # against 2 bytes per bf16 element: 0.392 (plus the slots' tags and alignment)
        assert wire <= 0.40 * r["native_pp"][2], (wire, r["native_pp"])
        if r["last_stage"]:
            # sanity bound, not a format bound: INT6 after Hadamard is ~2^-5 of a group's range per
            # element of the stage boundary's activations; the loss moves far less
            assert 0 < abs(r["int6_loss"] - r["native_loss"]) <= 2.0**-5 * r["native_loss"], r


def test_weight_deltas_without_megatron_sync_and_async():
    from . import megatron_low_bit_cases as mc

    for r in run_ranks(mc.weight_deltas_plain, 2, 6, timeout_s=200):
        assert r["identical"]
        for err, limit in zip(r["errors"], r["limits"]):
            assert 0 < err <= limit, (r["errors"], r["limits"])


@needs_megatron
def test_clip_grad_takes_the_norm_over_every_stage_and_shard():
    from . import megatron_low_bit_cases as mc

    runs = run_ranks(mc.clipped_step, 4, timeout_s=300, pg_timeout_s=200)
    for r in runs:
        plain, sharded = r[False], r[True]
        assert plain["grad_norm"] == runs[0][False]["grad_norm"]  # every rank scales by the same norm
        # the same gradients (two replicas' FP32 sum, in either order the same bits), their squares
        # summed in FP64 in another order: equal far inside FP32's rounding
        assert sharded["grad_norm"] == pytest.approx(plain["grad_norm"], rel=2.0**-24)
        assert plain["grad_norm"] > 1e-3 * 10  # the clip acted
        for run in (plain, sharded):  # scaled by 1e-3 / (norm + 1e-6); FP32 rounding per element
            g = run["grad_norm"]
            assert run["clipped_norm"] == pytest.approx(g * 1e-3 / (g + 1e-6), rel=2.0**-20), run
