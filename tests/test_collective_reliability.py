"""Collectives that neither crash, hang nor blame the wrong call: zero-size collectives, p2p
receives posted first on both ends, errors raised by the call they belong to, fresh stochastic
seeds in CUDA graph replays (the device side of it here; the replays themselves in
tests/test_cuda_graphs.py). Each test is named for the behaviour that
failed before the fix; the multi-rank ones run on 2 gloo ranks with a short process-group
timeout, so a regression into a hang fails instead of stalling the suite."""
import pytest
import torch

from taco_triton.collectives import _streams, p2p
from taco_triton.kernels import slots

from . import collective_reliability_cases as cases
from .collective_cases import two_quantization_bound
from .dist_utils import run_ranks


# ------------------------------------------------------------------ zero-size collectives
@pytest.fixture(scope="module")
def session():
    return run_ranks(cases.collectives, 2, pg_timeout_s=20, timeout_s=300)


def _scenario(session, name):
    reports = [report[name] for report in session]
    assert all("error" not in r for r in reports), [r.get("error") for r in reports]
    return reports


@pytest.fixture(scope="module")
def zero(session):
    return _scenario(session, "zero")


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("kind", cases.KINDS)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_zero_size_collective_is_a_no_op_as_in_torch(zero, backend, kind, mode):
    """Before: all_gather on the Triton path raised `max() arg is an empty sequence`."""
    name = f"{kind}-{backend}-{mode}"
    for report in zero:
        assert report[name] == "ok", report[name]
        assert report[name + "-returned"] == ("None" if mode == "sync" else "True")
        assert report[name + "-numel"] == 0
        # the next call of the kind with elements still pairs up: sums 1 + 2, gathers 1 and 2, within
        # the two roundings of the code format (each rank's and the requantized sum's)
        got, want = report[f"{kind}-{backend}-after"], ([1.0, 2.0] if kind == "all_gather" else [3.0])
        rel = 2 * cases.PLAIN.spec.relative_rounding
        assert len(got) == len(want) and all(abs(g - w) <= rel * w for g, w in zip(got, want)), got


@pytest.mark.parametrize("kind", cases.KINDS)
def test_zero_size_collective_through_a_compressing_group(zero, kind):
    assert all(report[f"group-{kind}"] == "ok" for report in zero), [r[f"group-{kind}"] for r in zero]


# ------------------------------------------------------- errors belong to their call
@pytest.fixture(scope="module")
def attribution(session):
    return _scenario(session, "attribution")


def test_async_mismatch_is_raised_by_its_own_wait_not_by_a_later_good_call(attribution):
    """Before: the good call raised the async call's error; the async wait() returned True."""
    for report in attribution:
        assert report["good_call"] == "ok", report["good_call"]
        assert report["good_values"] == [2.0]  # 1 + 1: exact in INT8 (each value its group's absmax)
        (first, n1), (second, n2) = report["bad_wait"]
        assert first.startswith("ValueError") and "carries tag" in first, first
        assert second == first and n1 is not None  # a failed handle stays failed
        assert report["bad_nan"]
        assert report["after_waits"] == "ok"  # raised by its handle: nothing left to report


def test_two_mismatching_async_calls_of_one_plan_each_raise_their_own(attribution):
    """Before: the first wait() raised naming the second call; the second wait() and
    check_errors() were clean."""
    for report in attribution:
        (w1, n1), (w2, n2) = report["waits"]
        assert w1.startswith("ValueError") and w2.startswith("ValueError"), (w1, w2)
        assert n1 is not None and n2 == n1 + 1, (n1, n2)  # consecutive calls, each named by its own wait
        # check_errors() before the waits raises the oldest unreported one, then the next, then nothing
        assert [n for _, n in report["check_first"]] == [n1, n2, None], report["check_first"]
        assert report["check_first"][2][0] == "ok"
        assert report["check_last"] == "ok"


def test_calls_in_flight_keep_their_own_records_until_their_work_is_complete(attribution):
    """The CUDA rules on CPU, with stand-in completion events: two mismatching async calls of one
    plan in flight write records of their own; no later call reads, clears or raises them before
    their work is complete (before: one record per plan, the second call's error overwrote the
    first's, and the host could clear a record a call in flight was writing); check_errors()
    then raises each, oldest first. A synchronous call's error is raised by the next synchronous
    call that ends after its work completed, naming it."""
    for report in attribution:
        assert report["flight_good"] == "ok" and report["flight_later_good"] == "ok"
        (c1, n1), (c2, n2), (c3, n3) = report["flight_check"]
        assert c1.startswith("ValueError") and c2.startswith("ValueError") and c3 == "ok", report["flight_check"]
        assert n2 == n1 + 1
        sync, n_sync = report["flight_sync"]
        assert sync == "ok"  # its work is not complete when it ends: nothing to read yet
        later, n_later = report["flight_sync_later"]
        assert later.startswith("ValueError") and "carries tag" in later and n_later == n2 + 3, later
        assert report["flight_sync_check"] == "ok"


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_p2p_tag_error_stays_raised_on_every_wait(attribution, backend):
    """Before: a second wait() of the failed receive returned True."""
    tag = attribution[1][f"p2p_tag_{backend}"]
    assert all(o.startswith("ValueError") and "carries tag" in o for o in tag), tag
    assert attribution[1][f"p2p_tag_nan_{backend}"]


# -------------------------------------------- stochastic seeds from the device counter
@pytest.fixture(scope="module")
def graph_seeds(session):
    return _scenario(session, "graph_seeds")


def _bf16(bits) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.int16).view(torch.bfloat16).double()


def test_graph_seeded_calls_round_afresh_with_the_same_call_number(graph_seeds):
    """The device side of fresh seeds in CUDA graph replays, on CPU: two all_reduce calls with the
    same call number (all a replay repeats) round differently when their seeds come from the device
    counter, each within the format's bound; outside graphs the same number gives the same bits,
    those of the reference path (the host seeds are unchanged), and nearest rounding is bitwise
    the same either way. The replays themselves: tests/test_cuda_graphs.py (GPU)."""
    inputs = [torch.randn(4096, generator=torch.Generator().manual_seed(r)).bfloat16() for r in range(2)]
    bound = two_quantization_bound(inputs, cases.STOCHASTIC, torch.bfloat16, "sum")
    for report in graph_seeds:
        first, second = report["eager"]
        assert first == second and first == report["reference"]
        g1, g2 = report["graph"]
        assert g1 != g2
        exact = torch.tensor(report["exact"])
        for bits in (g1, g2):
            assert float((_bf16(bits) - exact).norm()) <= bound
        assert report["nearest_graph"] == report["nearest_eager"]


@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
def test_p2p_encode_salts_the_seed_with_the_device_counter(monkeypatch, rounding):
    """A message encoded with the graph seeds twice under the same message number: different
    bytes for stochastic rounding, exactly those of the plan's eager launch with the message's
    host seed salted with the counter's value (`slots.salt`, the same mixing); nearest rounding:
    the bytes of the eager encode."""
    import itertools

    from taco_triton.state import STATE

    cfg = cases.STOCHASTIC.replace(rounding=rounding)
    x = torch.randn(1024, generator=torch.Generator().manual_seed(5)).bfloat16()
    saved = STATE.messages_sent

    def encode():  # message number 77 every time
        STATE.messages_sent = itertools.count(77)
        return p2p.encode(x, cfg, "triton").clone()

    try:
        eager = encode()
        monkeypatch.setattr(_streams, "graph_seeds", lambda device: True)
        wires = [encode() for _ in range(2)]
        counter = int(slots.seed_counter(x.device)[0])
        monkeypatch.undo()
    finally:
        STATE.messages_sent = saved
    if rounding == "nearest":
        assert torch.equal(wires[0], eager) and torch.equal(wires[1], eager)
        return
    plan = p2p._message(x, cfg, "triton")

    def eager_with(seed):  # the plan's eager compress launch with this host seed
        wire = torch.empty(plan.slices[0].slot, dtype=torch.uint8)
        plan.launches[0][0](x, wire, seed)
        return wire

    host = slots.salt(cfg.seed, 0, 77)  # (rank, message number): one process, rank 0
    assert torch.equal(eager, eager_with(host))
    assert not torch.equal(wires[0], wires[1])
    assert torch.equal(wires[1], eager_with(slots.salt(host, counter)))
    assert torch.equal(wires[0], eager_with(slots.salt(host, counter - 1)))


# ---------------------------------------------------- p2p receives that never block
@pytest.fixture(scope="module")
def receives_first():
    # a 10 s process-group timeout: before the fix both ranks blocked in irecv until it. The
    # handshake and the order of receives do not depend on the codec path: the Triton one here
    return run_ranks(cases.p2p_receives_first, 2, "triton", pg_timeout_s=10, timeout_s=300)


def _within(values, want, cfg=cases.PLAIN):
    """Each value within the format's rounding of its group's absmax (INT8 without the transform)."""
    want = torch.as_tensor(want, dtype=torch.float64)
    got = torch.as_tensor(values, dtype=torch.float64)
    return bool(((got - want).abs() <= cfg.spec.relative_rounding * want.abs().max() * 2).all())


def _sent(n, who, salt=0):
    return torch.arange(n, dtype=torch.float32).add(1000 * who + salt).bfloat16().double()


def test_receives_posted_first_on_both_ends_do_not_block(receives_first):
    """Before: both ranks blocked inside irecv, in the handshake's receive, until the timeout."""
    for rank, report in enumerate(receives_first):
        peer = 1 - rank
        assert report["crossed"] == "ok", report["crossed"]
        assert _within(report["crossed_values"], _sent(256, peer))


def test_receives_queued_behind_a_handshake_meet_their_sends_in_order(receives_first):
    for rank, report in enumerate(receives_first):
        peer = 1 - rank
        assert report["queued"] == "ok", report["queued"]
        a, b, c = report["queued_values"]
        assert _within(a, _sent(512, peer)) and _within(c, _sent(256, peer, 7))
        assert b == [float(i + peer) for i in range(96)]  # native: exact


def test_two_sends_of_a_new_signature_before_any_wait_pair_up(receives_first):
    """Before: the second send shook hands again, the receiver did not, and the sender's wait()
    hung for an answer that never came."""
    for report in receives_first:
        assert report["twice"] == "ok", report["twice"]
    for i, values in enumerate(receives_first[1]["twice_values"]):
        assert _within(values, _sent(640, 0, i))


def test_refused_first_message_fails_both_waits_on_both_ranks_and_leaves_the_channel_clean(receives_first):
    for rank, report in enumerate(receives_first):
        assert all(o.startswith("ValueError") and "expects a different message" in o for o in report["refused"]), \
            report["refused"]
        assert report["refused_untouched"]
        assert report["after_refused"] == "ok", report["after_refused"]
        assert _within(report["after_refused_values"], _sent(128, 1 - rank))
