"""Per-rank bodies of tests/test_collective_reliability.py (module-level: spawned ranks import them)."""
from __future__ import annotations

import torch
import torch.distributed as dist

import taco_triton as taco
from taco_triton.collectives import _pg

from .collective_cases import _outcome

KINDS = ("all_reduce", "reduce_scatter", "all_gather")
#: Constant groups without the transform: each value is its group's absmax, so only code rounding applies.
PLAIN = taco.CompressionConfig(codec="int8", hadamard=False)


def _issue(kind: str, n: int, world: int, **kw):
    """One `kind` call of n elements per rank (bf16 ones times the rank + 1); returns (handle or
    None, the output tensor)."""
    rank = dist.get_rank()
    if kind == "all_reduce":
        out = torch.full((n,), rank + 1.0, dtype=torch.bfloat16)
        return taco.all_reduce(out, **kw), out
    if kind == "reduce_scatter":
        out = torch.empty(n, dtype=torch.bfloat16)
        return taco.reduce_scatter(out, torch.full((world * n,), rank + 1.0, dtype=torch.bfloat16), **kw), out
    out = torch.empty(world * n, dtype=torch.bfloat16)
    return taco.all_gather(out, torch.full((n,), rank + 1.0, dtype=torch.bfloat16), **kw), out


def zero_size(rank: int, world: int) -> dict:
    """Finding 2: every kind with zero elements, both codec paths, sync and async, then a call of
    the same kind with elements (so a zero-size call that moved different messages on the ranks
    would show there)."""
    out = {}
    for backend in ("triton", "torch"):
        for kind in KINDS:
            for async_op in (False, True):
                name = f"{kind}-{backend}-{'async' if async_op else 'sync'}"
                kw = {"min_bytes": 0, "backend": backend, "async_op": async_op, "config": PLAIN}

                def call(kind=kind, kw=kw, name=name):
                    h, t = _issue(kind, 0, world, **kw)
                    out[name + "-returned"] = "None" if h is None else ("True" if h.wait() is True else "other")
                    out[name + "-numel"] = t.numel()

                out[name] = _outcome(call)
            h, t = _issue(kind, 300, world, min_bytes=0, backend=backend, config=PLAIN)
            out[f"{kind}-{backend}-after"] = sorted(set(t.float().tolist()))
    # through a compressing process group whose policy compresses every size
    from taco_triton.integrations.process_group import compressed_group
    from taco_triton.parallel import CompressionPolicy

    cg = compressed_group(None, CompressionPolicy(min_bytes=0))
    empty = torch.empty(0, dtype=torch.bfloat16)
    out["group-all_gather"] = _outcome(lambda: _pg._ALL_GATHER(torch.empty(0, dtype=torch.bfloat16),
                                                                        empty, group=cg))
    out["group-reduce_scatter"] = _outcome(lambda: _pg._REDUCE_SCATTER(empty, torch.empty(0, dtype=torch.bfloat16),
                                                                           group=cg))
    out["group-all_reduce"] = _outcome(lambda: dist.all_reduce(empty, group=cg))
    dist.barrier()
    return out


#: Configs the two ranks disagree on (fingerprint exchange off): the device tag check finds it.
MISMATCH = (taco.CompressionConfig(codec="fp8_e4m3", hadamard=False), taco.CompressionConfig(codec="int8", hadamard=False))


def _failure(fn) -> tuple[str, int | None]:
    """(outcome, the call number an error message names)."""
    import re

    got = _outcome(fn)
    m = re.search(r"\(call (\d+)\)", got)
    return got, int(m.group(1)) if m else None


def attribution(rank: int, world: int) -> dict:
    """Finding 4: each call's tag mismatch is raised by that call (its handle), never by another."""
    out = {}
    kw = {"min_bytes": 0, "backend": "triton", "check": False}
    # an async call whose tags mismatch, then a good synchronous call on another plan
    bad = torch.ones(300, dtype=torch.bfloat16)
    h = taco.all_reduce(bad, config=MISMATCH[rank], async_op=True, **kw)
    good = torch.ones(600, dtype=torch.bfloat16)
    out["good_call"] = _outcome(lambda: taco.all_reduce(good, config=PLAIN, **kw))
    out["good_values"] = sorted(set(good.float().tolist()))
    out["bad_wait"] = [_failure(h.wait) for _ in range(2)]
    out["bad_nan"] = bool(bad.float().isnan().all())
    out["after_waits"] = _outcome(taco.check_errors)
    # two mismatching async calls of one plan, waited after check_errors()
    xs = [torch.ones(300, dtype=torch.bfloat16) for _ in range(2)]
    hs = [taco.all_reduce(x, config=MISMATCH[rank], async_op=True, **kw) for x in xs]
    out["check_first"] = [_failure(taco.check_errors) for _ in range(3)]
    out["waits"] = [_failure(hd.wait) for hd in hs]
    out["check_last"] = _outcome(taco.check_errors)
    out.update(in_flight(rank))
    # p2p: after agreement, a message whose tag differs fails its wait() every time
    from taco_triton.collectives import p2p

    other = taco.CompressionConfig(codec="fp8_e4m3", hadamard=False)
    msg = torch.ones(128, dtype=torch.bfloat16)
    for backend in ("triton", "torch"):
        if rank == 0:
            p2p.isend(msg, 1, config=PLAIN, min_bytes=0, backend=backend).wait()
            p2p.isend(msg, 1, config=other, min_bytes=0, backend=backend, check=False).wait()
        else:
            got = torch.empty(128, dtype=torch.bfloat16)
            p2p.irecv(got, 0, config=PLAIN, min_bytes=0, backend=backend).wait()
            r = p2p.irecv(got, 0, config=PLAIN, min_bytes=0, backend=backend, check=False)
            out[f"p2p_tag_{backend}"] = [_outcome(r.wait) for _ in range(2)]
            out[f"p2p_tag_nan_{backend}"] = bool(got.float().isnan().all())
    dist.barrier()
    return out




STOCHASTIC = taco.CompressionConfig(codec="int4", group_size=32, hadamard=False, rounding="stochastic")


def graph_seeds(rank: int, world: int) -> dict:
    """Finding 5, the device side on CPU: all_reduce calls numbered alike (as the replays of one
    captured call are) with the seeds CUDA graph captures use (`_graph_seeds` forced on), and
    without. Returns the outputs' bits."""
    import itertools

    from taco_triton.collectives import _streams
    from taco_triton.state import STATE

    x = torch.randn(4096, generator=torch.Generator().manual_seed(rank)).bfloat16()
    out = {}

    def run(cfg, backend="triton"):
        STATE.calls = itertools.count(1000)  # the same call number every time
        y = x.clone()
        taco.all_reduce(y, config=cfg, min_bytes=0, backend=backend)
        return y.view(torch.int16).tolist()

    out["eager"] = [run(STOCHASTIC) for _ in range(2)]
    out["reference"] = run(STOCHASTIC, backend="torch")
    nearest = STOCHASTIC.replace(rounding="nearest")
    out["nearest_eager"] = run(nearest)
    forced = _streams.graph_seeds
    _streams.graph_seeds = lambda device: True
    try:
        out["graph"] = [run(STOCHASTIC) for _ in range(2)]
        out["nearest_graph"] = run(nearest)
    finally:
        _streams.graph_seeds = forced
    out["exact"] = sum(torch.randn(4096, generator=torch.Generator().manual_seed(r)).bfloat16().double()
                       for r in range(world)).tolist()
    dist.barrier()
    return out


class _Event:
    """A stand-in for the CUDA event that tells when a call's work is complete (`done`)."""

    def __init__(self):
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


def in_flight(rank: int) -> dict:
    """The CUDA rules of the error records, on CPU: the CUDA schedule driven with recording fake
    streams (`host_audit.fake_streams`) whose events report a call's work complete only when
    told (the kernels have written the records already). An async call's work is complete at its
    end event (recorded on the communication stream), a synchronous call's at its completion
    event on the caller's stream."""
    from taco_triton.collectives import _streams
    from taco_triton.host_audit import fake_streams

    out = {}
    kw = {"min_bytes": 0, "backend": "triton", "check": False}
    events = []

    def event():
        events.append(_Event())
        return events[-1]

    with fake_streams() as log:
        _streams.event = event  # restored by fake_streams
        # two mismatching async calls of one plan in flight, then a good call that completes
        xs = [torch.ones(300, dtype=torch.bfloat16) for _ in range(2)]
        for x in xs:
            taco.all_reduce(x, config=MISMATCH[rank], async_op=True, **kw)
        first, second = [e for e in events if getattr(e, "stream", None) is log.comm]  # the end events
        for e in events:
            if e not in (first, second):
                e.done = True  # the forks and the synchronous calls' events
        good = torch.ones(600, dtype=torch.bfloat16)
        out["flight_good"] = _outcome(lambda: taco.all_reduce(good, config=PLAIN, **kw))
        first.done = True  # the first call completes: a later call may read its record, not raise it
        out["flight_later_good"] = _outcome(lambda: taco.all_reduce(good, config=PLAIN, **kw))
        out["flight_check"] = [_failure(taco.check_errors) for _ in range(3)]  # waits for the second
        # a synchronous call: its error is raised by the first synchronous call that ends after
        # its work completed (here: the next one), naming it
        events.clear()
        out["flight_sync"] = _failure(lambda: taco.all_reduce(xs[0], config=MISMATCH[rank], **kw))
        events[0].done = True
        out["flight_sync_later"] = _failure(lambda: taco.all_reduce(good, config=PLAIN, **kw))
        out["flight_sync_check"] = _outcome(taco.check_errors)
    return out


def collectives(rank: int, world: int) -> dict:
    """The three collective scenarios in one session; one that raises reports its error alone."""
    out = {}
    for name, scenario in (("zero", zero_size), ("attribution", attribution), ("graph_seeds", graph_seeds)):
        try:
            out[name] = scenario(rank, world)
        except Exception as e:  # noqa: BLE001 - reported to the test
            out[name] = {"error": f"{type(e).__name__}: {e}"}
    return out


def p2p_receives_first(rank: int, world: int, backend: str) -> dict:
    """Finding 3: both ranks post their receives of new signatures before their sends (as pipeline
    schedules do), then wait in various orders; and finding 4's p2p part."""
    from taco_triton.collectives import p2p

    peer = 1 - rank
    out = {}
    kw = {"min_bytes": 0, "backend": backend}

    def payload(n, who, salt=0):
        return torch.arange(n, dtype=torch.float32).add(1000 * who + salt).bfloat16()

    # 1: one new signature each way, the sends waited first (the receives' handshakes must have
    # completed without anyone waiting for them)
    got = torch.empty(256, dtype=torch.bfloat16)
    r = p2p.irecv(got, peer, config=PLAIN, **kw)
    s = p2p.isend(payload(256, rank), peer, config=PLAIN, **kw)
    out["crossed"] = _outcome(lambda: (s.wait(), r.wait()))
    out["crossed_values"] = got.float().tolist()
    # 2: two new signatures from the same peer (one compressed, one native) queued behind each
    # other, waited in reverse order, and a steady message of the first signature after them
    a, b, c = torch.empty(512, dtype=torch.bfloat16), torch.empty(96, dtype=torch.float32), torch.empty(256, dtype=torch.bfloat16)
    works = [p2p.irecv(a, peer, config=PLAIN, **kw), p2p.irecv(b, peer, config=None, **kw),
             p2p.irecv(c, peer, config=PLAIN, **kw)]
    sends = [p2p.isend(payload(512, rank), peer, config=PLAIN, **kw),
             p2p.isend(torch.arange(96, dtype=torch.float32) + rank, peer, config=None, **kw),
             p2p.isend(payload(256, rank, 7), peer, config=PLAIN, **kw)]
    out["queued"] = _outcome(lambda: [w.wait() for w in reversed(works + sends)])
    out["queued_values"] = [a.float().tolist(), b.tolist(), c.float().tolist()]
    # 2b: rank 0 sends two messages of one new signature before waiting for either (the second
    # follows the first's handshake on both ends), rank 1 waits its receives in reverse
    twice = [torch.empty(640, dtype=torch.bfloat16) for _ in range(2)]
    if rank == 0:
        ws = [p2p.isend(payload(640, rank, i), peer, config=PLAIN, **kw) for i in range(2)]
    else:
        ws = [p2p.irecv(t, peer, config=PLAIN, **kw) for t in twice]
    out["twice"] = _outcome(lambda: [w.wait() for w in reversed(ws)])
    out["twice_values"] = [t.float().tolist() for t in twice]
    # 3: both ends disagree on a new signature's config, receives first: both waits raise on both
    # ranks, at every wait; then a matching exchange still pairs up
    other = taco.CompressionConfig(codec="fp8_e4m3", hadamard=False)
    mine = PLAIN if rank == 0 else other
    bad = torch.full((384,), -5.0, dtype=torch.bfloat16)
    r = p2p.irecv(bad, peer, config=mine, **kw)
    s = p2p.isend(payload(384, rank), peer, config=mine, **kw)
    out["refused"] = [_outcome(w.wait) for w in (s, r, s, r)]
    out["refused_untouched"] = bool((bad == -5.0).all())
    got = torch.empty(128, dtype=torch.bfloat16)
    r = p2p.irecv(got, peer, config=PLAIN, **kw)
    s = p2p.isend(payload(128, rank), peer, config=PLAIN, **kw)
    out["after_refused"] = _outcome(lambda: (s.wait(), r.wait()))
    out["after_refused_values"] = got.float().tolist()
    dist.barrier()
    return out
