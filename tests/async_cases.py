"""Per-rank bodies of the async-overlap tests (module-level so spawned processes can import them)."""
from __future__ import annotations

import re
import time

import torch
import torch.distributed as dist

import taco_triton as taco
from taco_triton.config import SUPERBLOCK_ELEMS
from taco_triton.integrations.process_group import compressed_group

from .collective_cases import rank_input

#: Elements per rank of every message: two super-blocks, so pipeline 2 makes two slices.
PER_RANK = 2 * SUPERBLOCK_ELEMS


def _inputs(world: int, seed: int, n: int) -> list[torch.Tensor]:
    """Every rank's input of a call (each rank can make all of them: no communication needed)."""
    return [rank_input(r, (n,), torch.bfloat16, seed) for r in range(world)]


def _warm_worker() -> None:
    """One matched async call first: the group's worker thread exists (made once per process;
    under Triton's interpreter its creation imports the interpreter), so that the timed calls
    measure themselves. The timed calls are still the first of their signatures."""
    taco.all_reduce(torch.ones(64, dtype=torch.bfloat16), min_bytes=0, async_op=True).wait()


def late_peer(rank: int, world: int, delay: float) -> dict:
    """Rank 1 enters `delay` seconds late. Every other rank issues async all_reduce,
    reduce_scatter and all_gather through `taco.*` and through `dist.*` on a compressing group,
    timing each issue, then waits for all of them. Reports the issue and wait times, and whether
    each result equals (bitwise) the same collective issued synchronously afterwards."""
    n = PER_RANK * world
    ar, rs, ag = _inputs(world, 1, n), _inputs(world, 2, n), _inputs(world, 3, PER_RANK)
    group = compressed_group(None, taco.CompressionPolicy(min_bytes=0))
    kw = {"min_bytes": 0, "async_op": True}

    def outs():
        return {"all_reduce": ar[rank].clone(), "reduce_scatter": torch.empty(PER_RANK, dtype=torch.bfloat16),
                "all_gather": torch.empty(n, dtype=torch.bfloat16)}

    mine, theirs = outs(), outs()
    calls = [
        ("taco.all_reduce", lambda: taco.all_reduce(mine["all_reduce"], **kw)),
        ("taco.reduce_scatter", lambda: taco.reduce_scatter(mine["reduce_scatter"], rs[rank], **kw)),
        ("taco.all_gather", lambda: taco.all_gather(mine["all_gather"], ag[rank], **kw)),
        ("dist.all_reduce", lambda: dist.all_reduce(theirs["all_reduce"], group=group, async_op=True)),
        ("dist.reduce_scatter", lambda: dist.reduce_scatter_tensor(theirs["reduce_scatter"], rs[rank], group=group,
                                                                   async_op=True)),
        ("dist.all_gather", lambda: dist.all_gather_into_tensor(theirs["all_gather"], ag[rank], group=group,
                                                                async_op=True)),
    ]
    _warm_worker()
    dist.barrier()
    if rank == 1:
        time.sleep(delay)
    issued, works = {}, []
    t0 = time.monotonic()
    for name, call in calls:
        t = time.monotonic()
        works.append(call())
        issued[name] = time.monotonic() - t
    t = time.monotonic()
    for w in works:
        w.wait()
    waited = time.monotonic() - t
    total = time.monotonic() - t0
    # the same collectives, synchronous, on the same inputs: the async results must be their bits
    sync = outs()
    taco.all_reduce(sync["all_reduce"], min_bytes=0)
    taco.reduce_scatter(sync["reduce_scatter"], rs[rank], min_bytes=0)
    taco.all_gather(sync["all_gather"], ag[rank], min_bytes=0)
    same = {f"{api}.{k}": torch.equal(got[k].view(torch.int16), sync[k].view(torch.int16))
            for api, got in (("taco", mine), ("dist", theirs)) for k in sync}
    # and within the format's bound of the exact sum (all_reduce), as the collectives' own tests check
    from .collective_cases import two_quantization_bound

    exact = torch.stack([x.double() for x in ar]).sum(0)
    err = float((sync["all_reduce"].double() - exact).norm())
    bound = two_quantization_bound(ar, taco.CompressionConfig(), torch.bfloat16, "sum")
    return {"issued": issued, "waited": waited, "total": total, "same": same, "err": err, "bound": bound}


def opposite_orders(rank: int, world: int, delay: float) -> dict:
    """Rank 1 enters `delay` seconds late. Three async all_reduces on the Triton path: `a` agreed
    by both ranks, `b` and `c` of one plan whose op differs between the ranks (check=False, so
    only the tags catch it). Rank 0 waits c, b, a; rank 1 waits a, b, c. Reports issue times,
    what each wait raised, a's result against a synchronous repeat, and what a later
    synchronous call and `check_errors` raised."""
    n = PER_RANK * world
    xa, xb, xc = (_inputs(world, s, n)[rank] for s in (4, 5, 6))
    kw = {"min_bytes": 0, "async_op": True, "backend": "triton", "check": False}
    wrong = "avg" if rank == 1 else "sum"
    a, b, c = xa.clone(), xb.clone(), xc.clone()
    taco.all_reduce(xa.clone(), **kw).wait()  # a's plan (on rank 0 also b's and c's): built at issue
    dist.barrier()
    if rank == 1:
        time.sleep(delay)
    t = time.monotonic()
    works = {"a": taco.all_reduce(a, **kw), "b": taco.all_reduce(b, op=wrong, **kw),
             "c": taco.all_reduce(c, op=wrong, **kw)}
    issue = time.monotonic() - t
    raised = {}
    for name in ("cba" if rank == 0 else "abc"):
        try:
            works[name].wait()
            raised[name] = None
        except ValueError as e:
            raised[name] = str(e)
    calls = {k: int(re.search(r"\(call (\d+)\)", v).group(1)) for k, v in raised.items() if v}
    again = {k: _raises(works[k].wait) for k in "bc"}  # a failed handle stays failed
    sync = xa.clone()
    later = _raises(lambda: taco.all_reduce(sync, min_bytes=0, backend="triton", check=False))
    return {"issue": issue, "raised": {k: v is not None for k, v in raised.items()}, "calls": calls,
            "again": again, "a_same": torch.equal(a.view(torch.int16), sync.view(torch.int16)),
            "later": later, "check_errors": _raises(taco.check_errors)}


def _raises(fn) -> str | None:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def cuda_schedule(rank: int, world: int) -> dict:
    """The async CUDA schedule driven on CPU tensors with recording fake streams and events
    (`host_audit.fake_streams`): an all_reduce (pipeline 2, two slices) and an all_gather into a
    non-contiguous output, each issued async, then waited. Reports what the caller's stream
    recorded and waited for, where every launch and process-group call ran, which tensors were
    `record_stream`ed, and whether the results equal the synchronous path's bits."""
    from taco_triton.collectives import _pg
    from taco_triton.host_audit import fake_streams

    n = PER_RANK * world
    x = _inputs(world, 7, n)[rank]
    shard = _inputs(world, 8, PER_RANK)[rank]
    kw = {"min_bytes": 0, "backend": "triton", "pipeline": 2}
    want_ar = x.clone()
    taco.all_reduce(want_ar, **kw)
    want_ag = torch.empty(n, dtype=torch.bfloat16)
    taco.all_gather(want_ag, shard, **kw)

    got_ar = x.clone()
    got_ag = torch.empty(n, 2, dtype=torch.bfloat16)[:, 0]  # non-contiguous: a copy back at the end
    comm_calls = []
    originals = {name: getattr(_pg, name) for name in ("all_to_all", "all_gather")}

    def logged(name):
        def call(out, *args, **kwargs):
            work = originals[name](out, *args, **kwargs)
            entry = ["comm", log.current, name, out, work, None]
            log.log.append(entry)
            comm_calls.append(entry)

            class Waited:  # the stage's wait(), logged with the stream current then
                def wait(self, timeout=None):
                    log.log.append(["waited", log.current, entry])
                    return work.wait()
            return Waited()
        return call

    report = {}
    with fake_streams() as log:
        for name in originals:
            setattr(_pg, name, logged(name))
        try:
            for what, issue in (("all_reduce", lambda: taco.all_reduce(got_ar, async_op=True, **kw)),
                                ("all_gather", lambda: taco.all_gather(got_ag, shard, async_op=True, **kw))):
                start = len(log.log)
                caller_recorded, caller_waited = len(log.caller.recorded), len(log.caller.waited)
                work = issue()
                after_issue = (len(log.caller.recorded) - caller_recorded, len(log.caller.waited) - caller_waited)
                entries = log.log[start:]
                work.wait()
                after_wait = (len(log.caller.recorded) - caller_recorded, len(log.caller.waited) - caller_waited)
                report[what] = _check_schedule(log, entries, after_issue, after_wait)
        finally:
            for name, f in originals.items():
                setattr(_pg, name, f)
    report["all_reduce"]["same"] = torch.equal(got_ar.view(torch.int16), want_ar.view(torch.int16))
    report["all_gather"]["same"] = torch.equal(got_ag.contiguous().view(torch.int16), want_ag.view(torch.int16))
    return report


def _check_schedule(log, entries, after_issue, after_wait) -> dict:
    """What one async call's log entries show (see `cuda_schedule`)."""
    fork = [e for e in entries if e[0] == "record" and e[1] is log.caller]
    first_work = next(i for i, e in enumerate(entries) if e[0] in ("launch", "comm"))
    forked_first = bool(fork) and any(e[2] is fork[0][2] for e in entries[:first_work] if e[0] == "wait"
                                      and e[1] is log.comm)
    streams = {e[0]: set() for e in entries if e[0] in ("launch", "comm", "waited")}
    for e in entries:
        if e[0] in streams:
            streams[e[0]].add(e[1].name)
    # every launch that reads a buffer a process-group call wrote comes after that call's wait()
    # on the same stream (the communication stream)
    read_early = []
    for i, e in enumerate(entries):
        if e[0] != "launch":
            continue
        ptrs = {t.data_ptr() for t in e[3]}
        for j, c in enumerate(entries[:i]):
            if c[0] == "comm" and c[3].data_ptr() in ptrs and not any(
                    w[0] == "waited" and w[2] is c and w[1] is c[1] for w in entries[j:i]):
                read_early.append((e[2], c[2]))
    end = [e for e in entries if e[0] == "record" and e[1] is log.comm]
    last_work = max(i for i, e in enumerate(entries) if e[0] in ("launch", "comm", "waited"))
    recorded_on = {e[2].data_ptr() for e in entries if e[0] == "record_stream" and e[1] is log.comm}
    return {"after_issue": after_issue, "after_wait": after_wait, "forked_first": forked_first,
            "streams": {k: sorted(v) for k, v in streams.items()}, "read_early": read_early,
            "end_after_work": bool(end) and entries.index(end[-1]) > last_work,
            "joined_end": bool(end) and log.caller.waited[-1] is end[-1][2],
            "record_streams": len(recorded_on)}


def session(rank: int, world: int, delay: float) -> dict:
    """The three scenarios above in one pair of processes (each spawn costs seconds)."""
    return {"late": late_peer(rank, world, delay), "orders": opposite_orders(rank, world, delay),
            "schedule": cuda_schedule(rank, world)}
