"""Compressed p2p on 2 gloo ranks: both ends checked, per-message seeds, unusable receive
buffers refused at call time, a randomized soak. Regressions of the p2p findings (items 4, 5, 9)."""
import os

import pytest

from . import p2p_cases as cases
from .dist_utils import run_ranks

BACKENDS = ["torch", "triton"]


@pytest.fixture(scope="module", params=BACKENDS)
def seen(request):
    return run_ranks(cases.findings, 2, request.param, pg_timeout_s=20, timeout_s=400)


@pytest.mark.parametrize("field", ["codec", "group_size", "hadamard", "size", "min_bytes"])
def test_ends_that_disagree_raise_value_error_on_both_ranks(seen, field):
    for rank, report in enumerate(seen):
        assert report[field].startswith("ValueError") and "expects a different message" in report[field], (rank, report[field])


def test_a_later_mismatch_is_caught_by_the_tag_and_leaves_nan(seen):
    assert seen[1]["tag"].startswith("ValueError") and "carries tag" in seen[1]["tag"], seen[1]["tag"]
    assert seen[1]["tag_nan"]


def test_non_contiguous_receive_is_refused_before_the_message_is_consumed(seen):
    assert seen[1]["strided"].startswith("ValueError") and "contiguous" in seen[1]["strided"]
    assert seen[1]["after_strided"] <= 2.0**-7  # the message arrived intact in the next receive (INT8: 1/254 of amax)


def test_stochastic_rounding_gets_a_fresh_seed_per_message(seen):
    assert seen[0]["wires_differ"]
    one, mean = seen[1]["err_one"], seen[1]["err_mean16"]
    # 16 independent unbiased roundings: the error of the mean falls like 1/sqrt(16) (with slack)
    assert mean < one / 2, (one, mean)


@pytest.mark.parametrize("backend", BACKENDS)
def test_soak_random_messages_deliver_the_codec_round_trip(backend):
    n_ops = int(os.environ.get("P2P_SOAK_OPS", "6"))
    reports = run_ranks(cases.soak, 2, n_ops, int(os.environ.get("SOAK_SEED", "1")), backend,
                        pg_timeout_s=30, timeout_s=600)
    assert sum(r["checked"] for r in reports) > 0


def test_the_handshake_and_the_payload_are_counted_where_issued():
    rep = run_ranks(cases.handshake_counted, 2, timeout_s=300, pg_timeout_s=60)
    assert rep[0]["fingerprint"] == rep[1]["fingerprint"] == 16, rep  # once per signature, per end
    assert rep[0]["sends"] == [rep[0]["wire"]] * 2 and rep[1]["sends"] == [], rep


def test_a_stochastic_message_has_the_same_bytes_on_both_codec_paths():
    """The reference path salts a message's seed as the kernels do (rank, message number, slot 0):
    the same message number gives the same wire bytes on the Triton and torch paths (before the
    message ran under the plans, the torch path left the slot out and its bytes differed)."""
    import itertools

    import torch

    import taco_triton as taco
    from taco_triton.collectives import p2p
    from taco_triton.state import STATE

    cfg = taco.CompressionConfig(codec="int4", group_size=32, hadamard=False, rounding="stochastic")
    x = torch.randn(5000, generator=torch.Generator().manual_seed(0)).bfloat16()
    wires, saved = {}, STATE.messages_sent
    try:
        for backend in ("triton", "torch"):
            STATE.messages_sent = itertools.count(7)
            wires[backend] = p2p.encode(x, cfg, backend)
    finally:
        STATE.messages_sent = saved
    assert torch.equal(wires["triton"], wires["torch"])
