"""Per-rank bodies of the stream-rule tests: the async CUDA schedule driven on CPU tensors with the
recording fake streams (`taco_triton.host_audit.fake_streams`, which also model the caching
allocator's rule for memory used on another stream), and every process-group method called with
and without options (module-level so spawned processes can import them)."""
from __future__ import annotations

import gc
import weakref

import torch
import torch.distributed as dist

import taco_triton as taco
from taco_triton.collectives import _streams, p2p
from taco_triton.state import STATE
from taco_triton.host_audit import FakeStream, fake_streams
from taco_triton.integrations.process_group import compressed_group

from .collective_cases import rank_input

N = 16384
KW = {"min_bytes": 0, "backend": "triton"}


def capture_holds_temporaries(rank: int, world: int) -> dict:
    """Inside a (fake) graph capture, two async all_gathers into non-contiguous outputs (each works
    in a contiguous copy of its own), an allocating op, then the waits: no memory used on the
    communication stream is reusable by the capturing stream before it joined (finding 1). The
    same outside a capture (record_stream), as a control. A first call outside, as the capture
    documentation asks (warm each signature up first)."""
    shard = rank_input(rank, (N,), torch.bfloat16, 1)
    taco.all_gather(torch.empty(world * N, 2, dtype=torch.bfloat16)[:, 0], shard, **KW)
    out = {}
    before = len(STATE.unchecked), len(STATE.captured)
    for capturing in (False, True):
        with fake_streams(capturing=capturing) as log:
            works = [taco.all_gather(torch.empty(world * N, 2, dtype=torch.bfloat16)[:, 0], shard, async_op=True, **KW)
                     for _ in range(2)]
            scratch = torch.ones(world * N, dtype=torch.bfloat16) * 2  # the capturing stream allocates
            for w in works:
                w.wait()
            del works, w, scratch
            gc.collect()
        out[capturing] = log.conflicts
    # the captured calls' error records: kept apart (no later call scans them), read by check_errors
    out["unchecked_growth"] = len(STATE.unchecked) - before[0]
    out["captured_growth"] = len(STATE.captured) - before[1]
    with fake_streams() as log:
        taco.check_errors()
    out["synchronized"] = [str(e[1]) for e in log.log if e[0] == "synchronize"]
    return out


def plans_keep_no_call_tensors(rank: int, world: int) -> dict:
    """A plan's prepared launches keep no tensor of the calls that made them (finding 6): the
    memory of a first call's input goes when the caller drops it."""
    x = rank_input(rank, (world * N,), torch.bfloat16, 5)
    taco.all_reduce(x, **KW)
    storage = weakref.ref(x.untyped_storage())
    del x
    gc.collect()
    return {"kept": storage() is not None}


def every_wait_orders_its_stream(rank: int, world: int) -> dict:
    """wait() first with another stream current, then on the caller's stream: both streams wait
    for the call's end event (finding 4), for a collective and for the process group's Work."""
    x = rank_input(rank, (world * N,), torch.bfloat16, 2)
    g = compressed_group(None, taco.CompressionPolicy(min_bytes=0))
    out = {}
    with fake_streams() as log:
        other = FakeStream("other")
        for name, issue in (("taco", lambda: taco.all_reduce(x.clone(), async_op=True, **KW)),
                            ("process_group", lambda: dist.all_reduce(x.clone(), group=g, async_op=True))):
            w = issue()
            with _streams.use(other):
                w.wait()
            start = len(log.log)
            w.wait()
            out[name] = any(e[0] == "wait" and e[1] is log.caller and e[2].stream is log.comm for e in log.log[start:])
    return out


def scratch_recorded_where_read(rank: int, world: int) -> dict:
    """A Work waited on another stream than the one it was issued on reads memory of the call's on
    that stream: the process group's list all_gather (its flat buffer, copied out at wait()) and an
    async native call into a non-contiguous tensor (its contiguous copy) record their scratch
    there (finding 5); a compressed receive decoded at wait() is ordered after the issuing
    stream's earlier work."""
    g = compressed_group(None, taco.CompressionPolicy(min_bytes=0))
    inp = rank_input(rank, (N,), torch.bfloat16, 3)
    out = {}
    with fake_streams() as log:
        other = FakeStream("other")
        outs = [torch.empty(N, dtype=torch.bfloat16) for _ in range(world)]
        w = dist.all_gather(outs, inp, group=g, async_op=True)
        out["list_all_gather_done_early"] = w.is_completed()  # its copies into `outs` run at wait()
        with _streams.use(other):
            w.wait()
        out["list_all_gather_done"] = w.is_completed()
        out["list_all_gather"] = any(e[0] == "record_stream" and e[1] is other and e[2].numel() == world * N
                                     for e in log.log)
        t = torch.ones(N, 2)[:, 0]
        w = taco.all_reduce(t, async_op=True, min_bytes=1 << 40)  # native: below min_bytes
        with _streams.use(other):
            w.wait()
        out["native_copy"] = any(e[0] == "record_stream" and e[1] is other and e[2].numel() == N for e in log.log)
        out["native_value"] = bool((t == world).all())
        msg = rank_input(0, (N,), torch.bfloat16, 4)
        if rank == 0:
            p2p.isend(msg, 1, config=taco.CompressionConfig(), min_bytes=0).wait()
        elif rank == 1:
            got = torch.empty_like(msg)
            w = p2p.irecv(got, 0, config=taco.CompressionConfig(), min_bytes=0)
            start = len(log.log)
            with _streams.use(other):
                w.wait()
            out["recv_ordered"] = any(e[0] == "wait" and e[1] is other and e[2].stream is log.caller
                                      for e in log.log[start:])
    return out


def every_process_group_method(rank: int, world: int) -> dict:
    """Every method torch.distributed calls on a process group, on a compressing group, with its
    options omitted and given (finding 6: `dist.AllgatherOptions` does not exist in torch 2.13)."""
    from torch._C import _distributed_c10d as c10d

    g = compressed_group(None, taco.CompressionPolicy(min_bytes=0))
    n = 64

    def t(v=1.0, dtype=torch.float32):
        return torch.full((n,), v + rank, dtype=dtype)

    calls = {
        "allreduce": (lambda: ([t()],), c10d.AllreduceOptions),
        "allreduce_coalesced": (lambda: ([t(), t()],), c10d.AllreduceCoalescedOptions),
        "reduce_scatter_single": (lambda: (torch.empty(n), torch.ones(world * n)), c10d.ReduceScatterOptions),
        "reduce_scatter": (lambda: ([torch.empty(n)], [[torch.ones(n) for _ in range(world)]]),
                           c10d.ReduceScatterOptions),
        "reduce_scatter_single_coalesced": (lambda: ([torch.empty(n)], [torch.ones(world * n)]),
                                            c10d.ReduceScatterOptions),
        "all_gather_single": (lambda: (torch.empty(world * n), t()), c10d.AllgatherOptions),
        "allgather": (lambda: ([[torch.empty(n) for _ in range(world)]], [t()]), c10d.AllgatherOptions),
        "all_gather_single_coalesced": (lambda: ([torch.empty(world * n)], [t()]), c10d.AllgatherOptions),
        "allgather_coalesced": (lambda: ([[torch.empty(n)] for _ in range(world)], [t()]), c10d.AllgatherOptions),
        "broadcast": (lambda: ([t()],), c10d.BroadcastOptions),
        "all_to_all_single": (lambda: (torch.empty(world * n), torch.ones(world * n), [], []), c10d.AllToAllOptions),
        "alltoall": (lambda: ([torch.empty(n) for _ in range(world)], [t() for _ in range(world)]),
                     c10d.AllToAllOptions),
        "barrier": (lambda: (), c10d.BarrierOptions),
        "gather": (lambda: ([[torch.empty(n) for _ in range(world)]] if rank == 0 else [], [t()]), c10d.GatherOptions),
        "scatter": (lambda: ([torch.empty(n)], [[t() for _ in range(world)]] if rank == 0 else []),
                    c10d.ScatterOptions),
        "reduce": (lambda: ([t()],), c10d.ReduceOptions),
    }
    failed = {}
    for name, (args, options) in calls.items():
        for given in (False, True):
            try:
                work = getattr(g, name)(*args(), *([options()] if given else []))
                if work is not None:
                    work.wait()
            except Exception as e:  # noqa: BLE001 - reported to the test
                failed[f"{name}{'(opts)' if given else ''}"] = f"{type(e).__name__}: {e}"
    return {"failed": failed}


def session(rank: int, world: int) -> dict:
    """Every case above in one pair of processes (each spawn costs seconds)."""
    return {"capture": capture_holds_temporaries(rank, world), "waits": every_wait_orders_its_stream(rank, world),
            "scratch": scratch_recorded_where_read(rank, world), "methods": every_process_group_method(rank, world),
            "plans": plans_keep_no_call_tensors(rank, world)}
