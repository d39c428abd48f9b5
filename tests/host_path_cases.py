"""Scenarios of the host-path audit (tests/test_host_path.py), run on gloo ranks or in-process
on torch's fake process group (collectives that move nothing, so any world size fits one
process). Kernels are stubbed and counted (`taco_triton.host_audit`): only the host path runs."""
from __future__ import annotations

import torch
import torch.distributed as dist

import taco_triton as taco
from taco_triton.host_audit import audit

#: Two super-blocks per rank: pipeline=2 cuts every kind into exactly two slices at any P.
PER_RANK = 2 * 4096


def issue(kind: str, p: int, pipeline, async_op: bool, check=None, backend="triton", dtype=torch.bfloat16):
    """A closure issuing one compressed collective of `kind` on fresh-enough tensors."""
    n = PER_RANK * p
    kw = {"min_bytes": 0, "backend": backend, "pipeline": pipeline, "async_op": async_op, "check": check}
    if kind == "all_reduce":
        x = torch.ones(n, dtype=dtype)
        return lambda: taco.all_reduce(x, **kw)
    if kind == "reduce_scatter":
        out, inp = torch.empty(PER_RANK, dtype=dtype), torch.ones(n, dtype=dtype)
        return lambda: taco.reduce_scatter(out, inp, **kw)
    shard = torch.ones(PER_RANK, dtype=dtype)
    out = torch.empty(n, dtype=dtype)
    return lambda: taco.all_gather(out, shard, **kw)


def steady_state(fn) -> dict:
    """Counts of one call after a first one (which prepares the plan and checks agreement)."""
    with audit(stub_kernels=True):
        h = fn()
        if h is not None:
            h.wait()
    with audit(stub_kernels=True) as seen:
        h = fn()
        if h is not None:
            h.wait()
    return {"reads": dict(seen.reads), "ops": dict(seen.ops), "kernels": sum(seen.kernels.values())}


KINDS = ("all_reduce", "reduce_scatter", "all_gather")


def audit_gloo(rank: int, world: int) -> dict:
    """Steady-state counts of every kind, sync and async, pipeline 1 and 2, default check."""
    out = {}
    for kind in KINDS:
        for async_op in (False, True):
            for pipeline in (1, 2):
                out[f"{kind}-{'async' if async_op else 'sync'}-pipe{pipeline}"] = steady_state(
                    issue(kind, world, pipeline, async_op))
    out["p2p"] = p2p_steady_state(rank)
    out["check_always"] = steady_state(issue("all_reduce", world, 1, False, check="always"))
    out["mismatch"] = tag_mismatch(rank)
    dist.barrier()
    return out


def tag_mismatch(rank: int) -> dict:
    """Ranks that disagree on the config with the fingerprint exchange off: the device tag check
    fills the error record and the call raises ValueError (sync at its end, async at wait())."""
    cfgs = [taco.CompressionConfig(codec="fp8_e4m3", hadamard=False), taco.CompressionConfig(codec="int8", hadamard=False)]
    seen = {}
    for async_op in (False, True):
        x = torch.ones(300, dtype=torch.bfloat16)
        try:
            h = taco.all_reduce(x, min_bytes=0, config=cfgs[rank], backend="triton", check=False, async_op=async_op)
            if h is not None:
                h.wait()
            seen["async" if async_op else "sync"] = "ok"
        except ValueError as e:
            seen["async" if async_op else "sync"] = f"ValueError: {e} | nan={bool(x.float().isnan().any())}"
    return seen


def audit_fake(world: int) -> dict:
    """Steady-state counts at any world size on the fake process group (rank 0 of `world`)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        return {f"{kind}-pipe{pipe}": steady_state(issue(kind, world, pipe, True, check=False))
                for kind in KINDS for pipe in (1, 2)}
    finally:
        dist.destroy_process_group()


def p2p_steady_state(rank: int) -> dict:
    """Rank 0 sends, rank 1 receives: counts of a message after the first (which shakes hands)."""
    from taco_triton.collectives import p2p

    cfg = taco.CompressionConfig()
    x = torch.ones(PER_RANK, dtype=torch.bfloat16)

    def one():
        if rank == 0:
            p2p.isend(x, 1, config=cfg, min_bytes=0, backend="triton").wait()
        else:
            p2p.irecv(x, 0, config=cfg, min_bytes=0, backend="triton").wait()

    return steady_state(one)
