"""Per-rank bodies of the compressing process group tests (module-level: spawned ranks import them).

Each body runs many checks in one spawn; every check asserts on the rank that runs it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

import taco_triton as taco
from taco_triton.collectives import _pg
from taco_triton.integrations.process_group import compressed_group
from taco_triton.parallel import CompressionPolicy

from .collective_cases import rank_input, two_quantization_bound

CFG = taco.CompressionConfig()  # FP8 E4M3, G=128, Hadamard: the policy default
MIN_BYTES = 4096
# torch 2.13 renamed the *_tensor collectives (the old names warn); torch 2.11 has only the old ones
REDUCE_SCATTER = _pg._REDUCE_SCATTER
ALL_GATHER = _pg._ALL_GATHER


def _gather_all(t: torch.Tensor, world: int, group=None) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.is_floating_point() else t


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def wchar() -> int:
    """Bytes this process wrote through write-like system calls (gloo's TCP sends among them)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("wchar"):
                return int(line.split()[1])
    raise RuntimeError("no wchar in /proc/self/io")


# ------------------------------------------------------------------------------- wire bytes
def wire_bytes(rank: int, world: int) -> dict:
    """bf16 SUM all_reduce through the group against the same call on the inner group: bytes
    WireStats counts and bytes the process really wrote to its sockets."""
    g = compressed_group(None, CompressionPolicy(min_bytes=MIN_BYTES))
    native = compressed_group(None, CompressionPolicy(default=None))  # forwards everything, counted
    x = rank_input(rank, (world * 8192,), torch.bfloat16, 1)
    out = {}
    for name, grp in (("compressed", g), ("forwarded", native)):
        with taco.WireStats() as ws:
            dist.all_reduce(x.clone(), group=grp)
        out[name] = ws.wire_bytes
        out[name + "_kinds"] = sorted(ws.by_kind())
    for name, grp in (("socket_native", None), ("socket_compressed", g)):
        dist.barrier()
        before = wchar()
        dist.all_reduce(x.clone(), group=grp)
        out[name] = wchar() - before
    out["nbytes"] = x.numel() * x.element_size()
    return out


# ------------------------------------------------------------------------------- plain dist.* calls
def plain_calls(rank: int, world: int) -> dict:
    """Compressed results, forwarded exactness, list/coalesced forms, Work semantics, functional
    collectives, point-to-point, all_to_all, broadcast, barrier, gather/scatter, clear errors."""
    policy = CompressionPolicy(min_bytes=MIN_BYTES)
    g = compressed_group(None, policy)
    inner = g.inner
    report = {}

    # compressed all_reduce: bitwise what taco.all_reduce over the inner group gives, within the bound
    for dtype, op, red in ((torch.bfloat16, "sum", dist.ReduceOp.SUM), (torch.float32, "avg", dist.ReduceOp.AVG),
                           (torch.float16, "sum", dist.ReduceOp.SUM)):
        x = rank_input(rank, (6, 1500), dtype, 2)
        y, want = x.clone(), x.clone()
        dist.all_reduce(y, op=red, group=g)
        taco.all_reduce(want, inner, CFG, op=op, min_bytes=MIN_BYTES)
        assert _same_bits(y, want), (dtype, op)
        inputs = _gather_all(x, world)
        exact = sum(t.double() for t in inputs) * (1.0 / world if op == "avg" else 1.0)
        err, bound = float((y.double() - exact).norm()), two_quantization_bound(inputs, CFG, dtype, op)
        assert err <= bound, (dtype, op, err, bound)
        assert float((y.double() - exact).norm()) > 0  # it was compressed, not forwarded
    # forwarded exactly: integers, MAX/MIN/PRODUCT, small messages, bit for bit as the inner group
    cases = [(torch.arange(3000, dtype=torch.int64) * (rank + 1), dist.ReduceOp.SUM),
             (rank_input(rank, (4000,), torch.bfloat16, 3), dist.ReduceOp.MAX),
             (rank_input(rank, (4000,), torch.float32, 4), dist.ReduceOp.MIN),
             (rank_input(rank, (4000,), torch.float32, 5), dist.ReduceOp.PRODUCT),
             (rank_input(rank, (MIN_BYTES // 2 - 1,), torch.bfloat16, 6), dist.ReduceOp.SUM)]
    for x, red in cases:
        y, want = x.clone(), x.clone()
        dist.all_reduce(y, op=red, group=g)
        dist.all_reduce(want, op=red, group=inner)
        assert _same_bits(y, want), (x.dtype, red)
    report["forwarded_cases"] = len(cases)

    # reduce_scatter / all_gather, sync and async (TE's form), and their list forms
    x = rank_input(rank, (world * 8, 700), torch.bfloat16, 7)
    out, want = torch.empty(8, 700, dtype=torch.bfloat16), torch.empty(8, 700, dtype=torch.bfloat16)
    w = REDUCE_SCATTER(out, x, group=g, async_op=True)
    assert w.wait() and w.is_completed()
    taco.reduce_scatter(want, x, inner, CFG, min_bytes=MIN_BYTES)
    assert _same_bits(out, want)
    outs = [torch.empty(8, 700, dtype=torch.bfloat16)]
    dist.reduce_scatter(outs[0], list(x.chunk(world)), group=g)
    assert _same_bits(outs[0], want)
    shard = rank_input(rank, (8, 700), torch.bfloat16, 8)
    full, want = torch.empty(world * 8, 700, dtype=torch.bfloat16), torch.empty(world * 8, 700, dtype=torch.bfloat16)
    w = ALL_GATHER(full, shard, group=g, async_op=True)
    fut = w.get_future()
    assert w.wait() and fut.done() and _same_bits(fut.value()[0], full)
    taco.all_gather(want, shard, inner, CFG, min_bytes=MIN_BYTES)
    assert _same_bits(full, want)
    assert not _same_bits(full, torch.cat(_gather_all(shard, world)))  # compressed
    parts = [torch.empty_like(shard) for _ in range(world)]
    dist.all_gather(parts, shard, group=g)
    assert _same_bits(torch.cat(parts), want)
    small = torch.arange(12, dtype=torch.int32) + rank
    got = torch.empty(world * 12, dtype=torch.int32)
    ALL_GATHER(got, small, group=g)
    assert torch.equal(got, torch.cat(_gather_all(small, world)))

    # coalesced forms (what DDP/FSDP-style bucketing issues through _coalescing_manager)
    from torch.distributed.distributed_c10d import _coalescing_manager

    a, b = rank_input(rank, (5000,), torch.bfloat16, 9), torch.arange(10) + rank
    ya, yb = a.clone(), b.clone()
    with _coalescing_manager(group=g, device=torch.device("cpu"), async_ops=True) as cm:
        dist.all_reduce(ya, group=g)
        dist.all_reduce(yb, group=g)
    cm.wait()
    wa = a.clone()
    taco.all_reduce(wa, inner, CFG, min_bytes=MIN_BYTES)
    assert _same_bits(ya, wa) and torch.equal(yb, sum(_gather_all(b, world)))

    # functional collectives (what DTensor uses)
    import torch.distributed._functional_collectives as fc

    x = rank_input(rank, (world * 4, 1024), torch.bfloat16, 10)
    want = x.clone()
    taco.all_reduce(want, inner, CFG, min_bytes=MIN_BYTES)
    assert _same_bits(fc.all_reduce(x, "sum", g), want)
    rs = torch.empty(4, 1024, dtype=torch.bfloat16)
    taco.reduce_scatter(rs, x, inner, CFG, min_bytes=MIN_BYTES)
    assert _same_bits(fc.reduce_scatter_tensor(x, "sum", 0, g), rs)
    ag = torch.empty(world * world * 4, 1024, dtype=torch.bfloat16)
    taco.all_gather(ag, x, inner, CFG, min_bytes=MIN_BYTES)
    assert _same_bits(fc.all_gather_tensor(x, 0, g), ag)
    assert torch.equal(fc.all_reduce(torch.arange(5) + rank, "max", g), torch.arange(5) + world - 1)

    # forwarded unchanged: broadcast, p2p, batch_isend_irecv, all_to_all, barrier, gather, scatter
    b = torch.full((3,), float(rank))
    dist.broadcast(b, src=1, group=g)
    assert torch.equal(b, torch.full((3,), 1.0))
    peer = 1 - rank if world == 2 else (rank + 1) % world
    src = (rank - 1) % world
    msg = rank_input(rank, (3000,), torch.bfloat16, 11)
    recv = torch.empty_like(msg)
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, msg, peer, g), dist.P2POp(dist.irecv, recv, src, g)])
    for r in reqs:
        r.wait()
    assert _same_bits(recv, rank_input(src, (3000,), torch.bfloat16, 11))
    if rank == 0:
        dist.send(msg, 1, group=g)
    elif rank == 1:
        got = torch.empty_like(msg)
        dist.recv(got, 0, group=g)
        assert _same_bits(got, rank_input(0, (3000,), torch.bfloat16, 11))
    a2a_in = torch.arange(world * 2, dtype=torch.float32) + 100 * rank
    a2a_out = torch.empty_like(a2a_in)
    dist.all_to_all_single(a2a_out, a2a_in, group=g)
    assert torch.equal(a2a_out, torch.tensor([100.0 * r + 2 * rank + k for r in range(world) for k in range(2)]))
    lists_out = [torch.empty(2) for _ in range(world)]
    dist.all_to_all(lists_out, list(a2a_in.chunk(world)), group=g)
    assert torch.equal(torch.cat(lists_out), a2a_out)
    dist.barrier(group=g)
    gathered = [torch.empty(2) for _ in range(world)] if rank == 0 else None
    dist.gather(torch.full((2,), float(rank)), gathered, dst=0, group=g)
    if rank == 0:
        assert torch.equal(torch.stack(gathered)[:, 0], torch.arange(world, dtype=torch.float32))
    scattered = torch.empty(2)
    dist.scatter(scattered, [torch.full((2,), float(r)) for r in range(world)] if rank == 0 else None, src=0, group=g)
    assert torch.equal(scattered, torch.full((2,), float(rank)))
    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank}, group=g)
    assert objs == [{"rank": r} for r in range(world)]

    # clear errors
    errors = {}
    try:
        dist.all_reduce(torch.empty(4, device="meta"), group=g)
    except ValueError as e:
        errors["device"] = str(e)
    try:
        compressed_group(g)
    except ValueError as e:
        errors["twice"] = str(e)
    try:
        compressed_group(None, policy="fp8")
    except TypeError as e:
        errors["policy"] = str(e)
    try:  # a mis-sized reduce_scatter is forwarded and the inner group's own error surfaces
        REDUCE_SCATTER(torch.empty(3, dtype=torch.bfloat16), torch.empty(7, dtype=torch.bfloat16), group=g)
    except (RuntimeError, ValueError) as e:
        errors["size"] = str(e)
    report["errors"] = errors
    report["stats"] = {f"{k[0]}|{k[1]}": (v.calls, v.compressed) for k, v in g.stats.items()}
    return report
