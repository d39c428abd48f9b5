"""Pipeline- and data-parallel traffic through `integrations.megatron` (4 gloo ranks each):
TP2 x PP2 and TP2 x DP2 steps of the example's GPT stage, unpatched vs. routed natively vs.
compressed (INT8 for TP and PP, the gradient default INT8 + Hadamard + stochastic rounding for DP).
"""
from __future__ import annotations

import pytest

import taco_triton as taco

from .dist_utils import run_ranks
from .test_megatron import needs_megatron


@pytest.fixture(scope="module", params=[(2, 2, "tp2_pp2"), (2, 1, "tp2_dp2")], ids=lambda p: p[2])
def layout(request):
    from . import megatron_3d_cases as mc

    tp, pp, _ = request.param
    return pp, run_ranks(mc.three_d, 4, tp, pp, timeout_s=400, pg_timeout_s=200)


@needs_megatron
def test_routed_natively_is_bit_identical_and_disable_restores(layout):
    _, ranks = layout
    for r in ranks:
        assert r["off_loss"] == r["ref_loss"] or (r["ref_loss"] != r["ref_loss"] and not r["last_stage"])
        assert r["off_grads_equal"], r["rank"]
        assert r["restored"], r["rank"]
        assert all(c == 0 for _, c, _ in r["off_axes"].values())


@needs_megatron
def test_every_axis_counted_and_compressed(layout):
    pp, ranks = layout
    used = {"tp"} | ({"pp"} if pp > 1 else {"dp"})
    for r in ranks:
        for axis in ("tp", "pp", "dp"):
            calls, compressed, wire = r["on_axes"][axis]
            if axis in used:
                assert calls > 0 and compressed > 0 and wire > 0, (axis, r["on_axes"])
            else:
                assert compressed == 0 and wire == 0, (axis, r["on_axes"])
        # the bytes counted per axis are all the bytes this rank sent through the routed paths
        assert sum(w for _, _, w in r["on_axes"].values()) == pytest.approx(r["on_wire"])
    # PP / DP: INT8 with dual scales is 1 + 1/128 + 4/4096 bytes per element vs 2 (bf16) or 4 (FP32
    # gradients). Not TP here: its 4096-element messages are padded to one 4096-element chunk per
    # rank by the two-shot all-reduce (test_megatron checks TP's ratio)
    for axis in used - {"tp"}:
        on = sum(r["on_axes"][axis][2] for r in ranks)
        off = sum(r["off_axes"][axis][2] for r in ranks)
        assert on <= 0.55 * off, (axis, on, off)


@needs_megatron
def test_batched_and_individual_p2p_deliver_the_same_bits(layout):
    """megatron's batch_isend_irecv and its individual isend/irecv carry the same compressed messages."""
    for r in layout[1]:
        assert r["unbatched_same"] and r["unbatched_grads_same"], r["rank"]


@needs_megatron
def test_compressed_step_stays_close(layout):
    _, ranks = layout
    for r in ranks:
        if r["last_stage"]:
            # INT8 after Hadamard: <= 2^-7 relative per element and quantization; the loss moves far less
            assert abs(r["on_loss"] - r["ref_loss"]) <= 2.0**-5 * abs(r["ref_loss"]), r
        # the whole reduced gradient of the rank (one DDP buffer: its Hadamard groups span parameters,
        # so one parameter's small gradient can carry its neighbours' quantization step: one
        # parameter's gradient changed by 1.24x its norm at TP2xDP2). Sanity bound, not a format bound:
        # INT8 is 2^-7 of a group's range per quantization, and the activation errors of TP and PP
        # compression propagate through the backward pass.
        assert 0 < r["rel_grad_change"] < 2.0**-3, r["rel_grad_change"]


# ---------------------------------------------------------------------- distributed optimizer (TP2 x DP2)
@pytest.fixture(scope="module")
def dist_opt():
    from . import megatron_3d_cases as mc

    return run_ranks(mc.distributed_optimizer, 4, 3, timeout_s=400, pg_timeout_s=200)


@needs_megatron
def test_distributed_optimizer_reduce_scatter_native_exact_compressed_counted(dist_opt):
    for r in dist_opt:
        assert r["off_equal"]  # routed natively: the reduced shards are megatron's bits
        assert r["off_axes"]["dp"][:2] == (1, 0) and r["on_axes"]["dp"][:2] == (1, 1)  # one bucket
        # INT8 with dual scales: 1 + 1/128 + 4/4096 bytes per FP32 gradient element (4 bytes)
        assert r["on_axes"]["dp"][2] <= 0.26 * r["off_axes"]["dp"][2]
        # sanity bound as in test_compressed_step_stays_close (TP activations are compressed too)
        assert 0 < r["on_rel"] < 2.0**-3


@needs_megatron
def test_error_feedback_sends_exactly_what_the_residual_leaves_out(dist_opt):
    """Error feedback over 3 reductions of one batch: rank j sends g_j + r_j(t-1) - r_j(t), so the
    reduced shards sum to 3 * exact - sum_j r_j(3), up to FP32 rounding (2^-24 per value, a few
    additions per step: 2^-18 of the norm); the residual itself is ~2^-7 of it, so a residual
    that is not carried over or not subtracted fails by far."""
    for r in dist_opt:
        assert r["ef_buckets"] == 1 and r["ef_compressed"] == 3
        assert r["ef_residual_share"] > 2.0**-10
        assert r["ef_identity_rel"] <= 2.0**-18, r["ef_identity_rel"]


@needs_megatron
def test_param_all_gather_exact_unless_opted_in(dist_opt):
    for r in dist_opt:
        assert r["gather_native_equal"] and r["gather_native_axes"] == (1, 0)
        assert r["gather_on_axes"] == (1, 1)
        # INT8 after the orthonormal Hadamard: per group of G=128 the L2 error is at most
        # sqrt(G) * half a step (amax / 254, amax <= the group's L2 norm), then bf16 rounding (2^-9)
        assert 0 < r["gather_on_rel"] <= 128**0.5 / 254 + 2.0**-8, r["gather_on_rel"]


# ---------------------------------------------------------------------- compressed point-to-point
@pytest.mark.parametrize("codec", ["fp8_e4m3", "int8", "int6"])
def test_p2p_delivers_the_codec_round_trip(codec):
    from .megatron_3d_cases import p2p_round_trip

    same, err, bound = run_ranks(p2p_round_trip, 2, taco.CompressionConfig(codec=codec), timeout_s=120)[1]
    assert same  # compressed once by the sender, decoded once by the receiver
    assert 0 < err <= bound, (err, bound)
