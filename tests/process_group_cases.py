"""Per-rank bodies of the compressing process group tests (module-level: spawned ranks import them).

Each body runs many checks in one spawn; every check asserts on the rank that runs it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

import taco_triton as taco
from taco_triton.collectives import _pg
from taco_triton.integrations.process_group import CompressingProcessGroup, GroupStats, compressed_group
from taco_triton.integrations.sites import track_sites
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
    x = rank_input(rank, (world * 32768,), torch.bfloat16, 1)  # large enough that gloo's per-message headers are noise
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
    report = {"wire": wire_bytes(rank, world)}
    policy = CompressionPolicy(min_bytes=MIN_BYTES)
    g = compressed_group(None, policy)
    inner = g.inner

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
    # coalesced reduce_scatter / all_gather (FSDP-style buckets), a compressed and a forwarded one each
    big, ints = rank_input(rank, (world * 4000,), torch.bfloat16, 12), torch.arange(world * 6) * (rank + 1)
    rs_big, rs_ints = torch.empty(4000, dtype=torch.bfloat16), torch.empty(6, dtype=torch.int64)
    ag_big, ag_ints = torch.empty(world * world * 4000, dtype=torch.bfloat16), torch.empty(world * world * 6,
                                                                                        dtype=torch.int64)
    with _coalescing_manager(group=g, device=torch.device("cpu"), async_ops=True) as cm:
        REDUCE_SCATTER(rs_big, big, group=g)
        REDUCE_SCATTER(rs_ints, ints, group=g)
    cm.wait()
    with _coalescing_manager(group=g, device=torch.device("cpu"), async_ops=True) as cm:
        ALL_GATHER(ag_big, big, group=g)
        ALL_GATHER(ag_ints, ints, group=g)
    cm.wait()
    want_rs, want_ag = torch.empty_like(rs_big), torch.empty_like(ag_big)
    taco.reduce_scatter(want_rs, big, inner, CFG, min_bytes=MIN_BYTES)
    taco.all_gather(want_ag, big, inner, CFG, min_bytes=MIN_BYTES)
    assert _same_bits(rs_big, want_rs) and _same_bits(ag_big, want_ag)
    all_ints = _gather_all(ints, world)
    assert torch.equal(rs_ints, sum(all_ints)[rank * 6 : (rank + 1) * 6]) and torch.equal(ag_ints, torch.cat(all_ints))

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

    # point-to-point: float messages from min_bytes up compressed once (the receiver decodes
    # exactly what the sender's compression holds), the rest forwarded bit for bit
    from taco_triton.collectives import p2p

    peer, src = (rank + 1) % world, (rank - 1) % world
    msg = rank_input(rank, (3000,), torch.bfloat16, 11)
    ints = torch.arange(2000, dtype=torch.int32) * (rank + 1)
    recv, recv_ints = torch.empty_like(msg), torch.empty_like(ints)
    with taco.WireStats() as ws:
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, msg, peer, g), dist.P2POp(dist.irecv, recv, src, g),
                                       dist.P2POp(dist.isend, ints, peer, g), dist.P2POp(dist.irecv, recv_ints, src, g)])
        for r in reqs:
            r.wait()
    sent = rank_input(src, (3000,), torch.bfloat16, 11)
    want = torch.empty_like(sent)
    p2p.decode_into(p2p.encode(sent, CFG), want, CFG)
    assert _same_bits(recv, want) and not _same_bits(recv, sent)
    assert torch.equal(recv_ints, torch.arange(2000, dtype=torch.int32) * (src + 1))
    report["p2p_sends"] = sorted((c.compressed, c.wire_bytes) for c in ws.calls if c.kind == "send")
    strided = torch.empty(3000, 2, dtype=torch.bfloat16)[:, 0]  # a non-contiguous receive buffer
    if rank == 0:
        dist.send(msg, 1, group=g)
        exempt = compressed_group(None, CompressionPolicy(min_bytes=MIN_BYTES, exempt=["p2p"]))
        dist.send(msg, 1, group=exempt)
    elif rank == 1:
        dist.recv(strided, 0, group=g)
        want = torch.empty_like(msg)
        p2p.decode_into(p2p.encode(rank_input(0, (3000,), torch.bfloat16, 11), CFG), want, CFG)
        assert _same_bits(strided, want)
        exempt = compressed_group(None, CompressionPolicy(min_bytes=MIN_BYTES, exempt=["p2p"]))
        got = torch.empty_like(msg)
        dist.recv(got, 0, group=exempt)
        assert _same_bits(got, rank_input(0, (3000,), torch.bfloat16, 11))
    else:
        exempt = compressed_group(None, CompressionPolicy(min_bytes=MIN_BYTES, exempt=["p2p"]))

    # forwarded unchanged: broadcast, all_to_all, barrier, gather, scatter, objects
    b = torch.full((3,), float(rank))
    dist.broadcast(b, src=1, group=g)
    assert torch.equal(b, torch.full((3,), 1.0))
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
    except TypeError as e:
        errors["twice"] = str(e)
    try:
        compressed_group(None, policy="fp8")
    except TypeError as e:
        errors["policy"] = str(e)
    try:  # an op the inner group lacks: forwarded unchanged, the inner group's own error surfaces
        dist.all_reduce(torch.ones(4), op=dist._make_nccl_premul_sum(2.0), group=g)
    except RuntimeError as e:
        errors["inner_lacks"] = str(e)
    for name, call in (("reduce_scatter", lambda: REDUCE_SCATTER(torch.empty(3, dtype=torch.bfloat16),
                                                                  torch.empty(7, dtype=torch.bfloat16), group=g)),
                       ("all_gather", lambda: ALL_GATHER(torch.empty(7), torch.empty(3), group=g))):
        try:  # refused before anything is sent (gloo's own check would abort the process)
            call()
        except ValueError as e:
            errors[name] = str(e)
    report["errors"] = errors

    # the registered backend name: dist.new_group(backend="taco") makes a compressing group over a
    # new inner group of the default backend, with the default policy
    from taco_triton.integrations.process_group import BACKEND

    named = dist.new_group(list(range(world)), backend=BACKEND)
    z = torch.arange(5) + rank
    dist.all_reduce(z, group=named)
    assert isinstance(named, CompressingProcessGroup) and dist.get_backend(named) == BACKEND
    assert torch.equal(z, sum(torch.arange(5) + r for r in range(world)))
    assert named.inner is not None and dist.get_process_group_ranks(named.inner) == list(range(world))

    # a max_error plan: calibrated from what the group's sites carried, then in force on every rank
    cal = CompressionPolicy(min_bytes=MIN_BYTES, calibrate_steps=1, max_error=0.05)
    cg = compressed_group(None, cal)
    x = rank_input(rank, (6, 1500), torch.bfloat16, 30)
    dist.all_reduce(x.clone(), group=cg)
    cal.step(cg)
    plan = cal.plan_dict()
    y, want = x.clone(), x.clone()
    dist.all_reduce(y, group=cg)
    taco.all_reduce(want, inner, plan["all_reduce|forward"], min_bytes=MIN_BYTES)
    assert _same_bits(y, want)
    report["plan"] = {k: (c.codec, c.group_size) for k, c in plan.items()}
    report["stats"] = {f"{k[0]}|{k[1]}": (v.calls, v.compressed) for k, v in g.stats.items()}
    return report


# ------------------------------------------------------------------------------- bounds per collective
def _reduce_scatter_bound(inputs: list[torch.Tensor], rank: int, cfg, dtype) -> float:
    """L2 bound on rank `rank`'s reduce_scatter output: each rank's quantization of its slice, the
    dense sum's rounding into `dtype`, FP32 sums (as the collective tests derive it)."""
    from taco_triton import bounds

    world = len(inputs)
    rows = inputs[0].shape[0] // world
    full = sum(t.double() for t in inputs)
    bound = 0.0
    for t in inputs:
        piece = t[rank * rows : (rank + 1) * rows].contiguous()
        bound += bounds.l2_error_bound(piece, taco.compress(piece, cfg, backend="torch"), torch.float32)
    want = full[rank * rows : (rank + 1) * rows]
    return bound + float(want.abs().norm()) * torch.finfo(dtype).eps + float(full.abs().norm()) * world * 2.0**-22


def _all_gather_bound(shard: torch.Tensor, cfg) -> float:
    from taco_triton import bounds

    return bounds.l2_error_bound(shard.contiguous(), taco.compress(shard.contiguous(), cfg, backend="torch"), shard.dtype)


def check_log(log: list, world: int, cfg) -> dict:
    """Every collective a test layer issued, against its format bound: {kind: (count, max err/bound)}."""
    used: dict = {}
    for kind, inp, out in log:
        inputs = _gather_all(inp, world)
        rank = dist.get_rank()
        if kind == "all_reduce":
            exact = sum(t.double() for t in inputs)
            bound = two_quantization_bound(inputs, cfg, inp.dtype, "sum")
        elif kind == "reduce_scatter":
            rows = inp.shape[0] // world
            exact = sum(t.double() for t in inputs)[rank * rows : (rank + 1) * rows]
            bound = _reduce_scatter_bound(inputs, rank, cfg, inp.dtype)
        else:  # all_gather: every slice is its owner's single compression
            exact = torch.cat([t.double() for t in inputs])
            bound = sum(_all_gather_bound(t, cfg) ** 2 for t in inputs) ** 0.5
        err = float((out.detach().double() - exact).norm())
        assert err <= bound, (kind, tuple(inp.shape), err, bound)
        n, worst = used.get(kind, (0, 0.0))
        used[kind] = (n + 1, max(worst, err / bound))
    return used


# ------------------------------------------------------------------------------- TE-shaped layers
# The three helpers issue exactly what TransformerEngine's transformer_engine/pytorch/distributed.py
# issues on the TP group it is given (torch.distributed's own names, async_op and .wait()).
def te_allreduce(inp, tp_group, async_op=False):
    handle = dist.all_reduce(inp, group=tp_group, async_op=async_op)
    return inp, handle


def te_gather_along_first_dim(inp, process_group, async_op=False):
    world = dist.get_world_size(process_group)
    out = torch.empty([inp.shape[0] * world, *inp.shape[1:]], dtype=inp.dtype, device=inp.device)
    handle = dist.all_gather_into_tensor(out, inp.contiguous(), group=process_group, async_op=async_op)
    return out, handle


def te_reduce_scatter_along_first_dim(inp, tp_group, async_op=False):
    world = dist.get_world_size(tp_group)
    out = torch.empty([inp.shape[0] // world, *inp.shape[1:]], dtype=inp.dtype, device=inp.device)
    handle = dist.reduce_scatter_tensor(out, inp.contiguous(), group=tp_group, async_op=async_op)
    return out, handle


class _TEColumn(torch.autograd.Function):
    """TE's column-parallel linear: SP input all-gather (async, waited before the GEMM); backward
    dgrad reduce-scatter (SP) or all-reduce, async, overlapped with the wgrad GEMM."""

    @staticmethod
    def forward(ctx, x, w, group, sp, log):
        total = x
        if sp:
            total, handle = te_gather_along_first_dim(x, group, async_op=True)
            handle.wait()
            log.append(("all_gather", x.detach().clone(), total))
        ctx.save_for_backward(x, w)
        ctx.group, ctx.sp, ctx.log = group, sp, log
        return total @ w.t()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        dgrad = g @ w
        sent = dgrad.detach().clone()
        if ctx.sp:
            total, handle = te_gather_along_first_dim(x, ctx.group, async_op=True)  # for wgrad, as TE does
            handle.wait()
            ctx.log.append(("all_gather", x.detach().clone(), total))
            out, handle = te_reduce_scatter_along_first_dim(dgrad, ctx.group, async_op=True)
            wgrad = g.t() @ total
            handle.wait()
            ctx.log.append(("reduce_scatter", sent, out))
            return out, wgrad, None, None, None
        _, handle = te_allreduce(dgrad, ctx.group, async_op=True)
        wgrad = g.t() @ x
        handle.wait()
        ctx.log.append(("all_reduce", sent, dgrad))
        return dgrad, wgrad, None, None, None


class _TERow(torch.autograd.Function):
    """TE's row-parallel linear: output reduce-scatter (SP) or all-reduce; backward SP all-gather."""

    @staticmethod
    def forward(ctx, x, w, group, sp, log):
        y = x @ w.t()
        sent = y.detach().clone()
        ctx.save_for_backward(x, w)
        ctx.group, ctx.sp, ctx.log = group, sp, log
        if sp:
            out, _ = te_reduce_scatter_along_first_dim(y, group)
            log.append(("reduce_scatter", sent, out))
            return out
        te_allreduce(y, group)
        log.append(("all_reduce", sent, y))
        return y

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        if ctx.sp:
            total, handle = te_gather_along_first_dim(g, ctx.group, async_op=True)
            handle.wait()
            ctx.log.append(("all_gather", g.detach().clone(), total))
            g = total
        return g @ w, g.t() @ x, None, None, None


class TELinear(torch.nn.Module):
    def __init__(self, fn, w: torch.Tensor, group, sp: bool, log: list):
        super().__init__()
        self.weight = torch.nn.Parameter(w)
        self.fn, self.group, self.sp, self.log = fn, group, sp, log

    def forward(self, x):
        return self.fn.apply(x, self.weight, self.group, self.sp, self.log)


class TEMlp(torch.nn.Module):
    """fc1 (column) -> GELU -> fc2 (row), each rank holding its shard of the weights."""

    def __init__(self, rank, world, group, sp, log, hidden=128, ffn=256, dtype=torch.bfloat16):
        super().__init__()
        gen = torch.Generator().manual_seed(5)
        w1 = torch.randn(ffn, hidden, generator=gen) / hidden**0.5
        w2 = torch.randn(hidden, ffn, generator=gen) / ffn**0.5
        s = ffn // world
        self.fc1 = TELinear(_TEColumn, w1[rank * s : (rank + 1) * s].to(dtype), group, sp, log)
        self.fc2 = TELinear(_TERow, w2[:, rank * s : (rank + 1) * s].contiguous().to(dtype), group, sp, log)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def _te_step(rank, world, group, sp, tokens=64, hidden=128):
    import warnings

    log: list = []
    model = TEMlp(rank, world, group, sp, log)
    gen = torch.Generator().manual_seed(11 if sp else 10)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    if sp:
        x = x.chunk(world)[rank].contiguous()
    x.requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch 2.13 deprecates TE's *_tensor names
        with track_sites(model):
            y = model(x)
            y.float().square().sum().backward()
    return log, model


def _native_cost(kind: str, inp: torch.Tensor, world: int) -> float:
    """Bytes this rank sends for `kind` on `inp` uncompressed (WireStats' standard cost)."""
    n = inp.numel() * inp.element_size()
    return {"all_reduce": 2 * (world - 1) / world * n, "reduce_scatter": (world - 1) / world * n,
            "all_gather": (world - 1) * n}[kind]


def te_shaped(rank: int, world: int) -> dict:
    """TE's calls through a compressing TP group, with and without sequence parallelism: every
    collective compressed and within its format bound, site names from the module hooks, and
    an exempt module's traffic forwarded."""
    report = {}
    for sp in (False, True):
        g = compressed_group(None, CompressionPolicy(min_bytes=MIN_BYTES))
        with taco.WireStats() as ws:
            log, _ = _te_step(rank, world, g, sp)
        report[f"sp={sp}"] = {"used": check_log(log, world, CFG), "wire_bytes": ws.wire_bytes,
                              "native_bytes": sum(_native_cost(kind, inp, world) for kind, inp, _ in log),
                              "stats": {f"{k[0]}|{k[1]}": (v.calls, v.compressed) for k, v in g.stats.items()},
                              "compressed_calls": sum(c.compressed for c in ws.calls),
                              "forwarded_calls": sum(not c.compressed for c in ws.calls)}
    g = compressed_group(None, CompressionPolicy(min_bytes=MIN_BYTES, exempt=["fc1.*"]))
    log, _ = _te_step(rank, world, g, False)
    report["exempt_fc1"] = {f"{k[0]}|{k[1]}": (v.calls, v.compressed) for k, v in g.stats.items()}
    return report


# ------------------------------------------------------------------------------- DTensor and DDP
class RecordingPolicy(CompressionPolicy):
    """Keeps (site, direction, copy) of every tensor the group is about to compress."""

    def observe(self, site, direction, tensor):
        self.__dict__.setdefault("records", []).append((site, direction, tensor.detach().clone()))
        super().observe(site, direction, tensor)


def dtensor_and_ddp(rank: int, world: int) -> dict:
    """DeviceMesh.from_group over a compressing group: Partial -> Replicate / Shard and Shard ->
    Replicate are our collectives bit for bit (so within their bounds), a row-parallel matmul's
    reduction within its bound, MAX reductions exact; DDP over a compressing group: every
    gradient bucket compressed, the gradients within the summed bucket bounds of the exact mean."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    report = {}
    g = compressed_group(None, CompressionPolicy(min_bytes=MIN_BYTES))
    inner = g.inner
    mesh = DeviceMesh.from_group(g, "cpu")
    x = rank_input(rank, (world * 8, 512), torch.bfloat16, 20)
    want = x.clone()
    taco.all_reduce(want, inner, CFG, min_bytes=MIN_BYTES)
    assert _same_bits(DTensor.from_local(x, mesh, [Partial()]).redistribute(mesh, [Replicate()]).to_local(), want)
    rs = torch.empty(8, 512, dtype=torch.bfloat16)
    taco.reduce_scatter(rs, x, inner, CFG, min_bytes=MIN_BYTES)
    assert _same_bits(DTensor.from_local(x, mesh, [Partial()]).redistribute(mesh, [Shard(0)]).to_local(), rs)
    ag = torch.empty(world * world * 8, 512, dtype=torch.bfloat16)
    taco.all_gather(ag, x, inner, CFG, min_bytes=MIN_BYTES)
    assert _same_bits(DTensor.from_local(x, mesh, [Shard(0)]).redistribute(mesh, [Replicate()]).to_local(), ag)
    mx = DTensor.from_local(torch.arange(6.0) * (rank + 1), mesh, [Partial("max")]).redistribute(mesh, [Replicate()])
    assert torch.equal(mx.to_local(), torch.arange(6.0) * world)
    # row-parallel matmul: each rank's partial product, reduced by the redistribution
    gen = torch.Generator().manual_seed(21)
    a = torch.randn(32, 64 * world, generator=gen).to(torch.bfloat16)
    w = torch.randn(64 * world, 128, generator=gen).to(torch.bfloat16)
    part = a[:, rank * 64 : (rank + 1) * 64] @ w[rank * 64 : (rank + 1) * 64]
    y = DTensor.from_local(part, mesh, [Partial()]).full_tensor()
    parts = _gather_all(part, world)
    err = float((y.double() - sum(t.double() for t in parts)).norm())
    bound = two_quantization_bound(parts, CFG, torch.bfloat16, "sum")
    assert 0 < err <= bound, (err, bound)
    report["dtensor_matmul_bound_use"] = err / bound

    # DDP: gradient buckets through a compressing data-parallel group
    policy = RecordingPolicy(min_bytes=MIN_BYTES)
    report["ddp"] = ddp_step(rank, world, policy, compressed_group(None, policy))
    return report


def ddp_step(rank: int, world: int, policy: RecordingPolicy, dp, exact_group=None) -> dict:
    """One DDP step through `dp` (None: the default group), a compressing group with `policy`:
    every gradient bucket compressed, the gradients within the summed bucket bounds of the exact
    mean of the ranks' local gradients (gathered over `exact_group`, uncompressed), replicas
    bitwise equal."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 32))
    local = [p.detach().clone() for p in model.parameters()]
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=dp, bucket_cap_mb=0.02)
    batch = torch.randn(16, 64, generator=torch.Generator().manual_seed(100 + rank))
    with taco.WireStats() as ws:
        ddp(batch).square().mean().backward()
    got = [p.grad.detach().clone() for p in model.parameters()]
    # the exact mean of the ranks' local gradients, computed without any communication
    ref = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 32))
    with torch.no_grad():
        for p, v in zip(ref.parameters(), local):
            p.copy_(v)
    ref(batch).square().mean().backward()
    exact = [sum(t.double() for t in _gather_all(p.grad, world, exact_group)) / world for p in ref.parameters()]
    buckets = policy.records
    assert len(buckets) >= 1 and all(d == "backward" for _, d, _ in buckets), [r[:2] for r in buckets]
    bound = sum(two_quantization_bound(_gather_all(t, world, exact_group), CFG, torch.float32, "sum")
                for _, _, t in buckets)
    err = sum(float((a.double() - b).norm()) ** 2 for a, b in zip(got, exact)) ** 0.5
    assert 0 < err <= bound, (err, bound)
    assert all(torch.equal(a, b) for a, b in zip(got, _gather_all_list(got, world)))  # replicas agree bitwise
    return {"buckets": len(buckets), "bound_use": err / bound, "sites": sorted({r[0] for r in buckets}),
            "numels": [r[2].numel() for r in buckets],
            "compressed_wire": sum(c.wire_bytes for c in ws.calls if c.compressed),
            "grad_bytes": sum(p.numel() * 4 for p in model.parameters())}


def fsdp2(rank: int, world: int) -> dict:
    """FSDP2 (fully_shard) over a compressing group: its gradient reduce-scatters compressed, the
    gathered gradients within the summed format bounds of the exact mean of the ranks' local
    gradients. The parameter all-gathers are exempt (site "all_gather": outside tracked modules
    the site is the bare collective name), so the forward sees exact weights and every gradient
    error comes from the reduce-scatters; they are compressed when not exempt (checked too)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 32))

    batch = torch.randn(16, 64, generator=torch.Generator().manual_seed(200 + rank))
    ref = build()
    ref(batch).square().mean().backward()
    exact = [sum(t.double() for t in _gather_all(p.grad, world)) / world for p in ref.parameters()]
    report = {}
    for exempt in (["all_gather"], []):
        policy = RecordingPolicy(min_bytes=1024, exempt=exempt)
        g = compressed_group(None, policy)
        mesh = DeviceMesh.from_group(g, "cpu")
        model = build()
        for m in model:
            if isinstance(m, torch.nn.Linear):
                fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model(batch).square().mean().backward()
        stats = {f"{k[0]}|{k[1]}": (v.calls, v.compressed) for k, v in g.stats.items()}
        if exempt:
            got = [p.grad.full_tensor() for p in model.parameters()]  # exempt all_gather: exact
            err = sum(float((a.double() - b).norm()) ** 2 for a, b in zip(got, exact)) ** 0.5
            bound = 0.0
            scatters = [t for site, _, t in policy.records if site == "reduce_scatter"]
            assert len(scatters) == 2, [r[:2] for r in policy.records]  # one per fully_shard'ed Linear
            for t in scatters:  # each reduce-scatter: this rank's shard bound, then all ranks'
                mine = torch.tensor([_reduce_scatter_bound(_gather_all(t, world), rank, CFG, t.dtype)], dtype=torch.float64)
                bound += float(torch.cat(_gather_all(mine, world)).norm())
            assert 0 < err <= bound, (err, bound)
            report["bound_use"] = err / bound
        report[f"stats_exempt={exempt}"] = stats
    return report


def _gather_all_list(ts: list[torch.Tensor], world: int) -> list[torch.Tensor]:
    """Rank 0's copy of each tensor (to compare every rank against)."""
    out = []
    for t in ts:
        t0 = t.clone()
        dist.broadcast(t0, src=0)
        out.append(t0)
    return out


def model_users(rank: int, world: int) -> dict:
    """One spawn for the model-level users of a group: the TE-shaped layers, DTensor and DDP."""
    return {"te": te_shaped(rank, world), **dtensor_and_ddp(rank, world), "fsdp2": fsdp2(rank, world)}


# ------------------------------------------------------------------------------- forwarded Works
# Policies under which a tensor the policy could compress (float, SUM, from min_bytes up) is forwarded.
FORWARDING_POLICIES = {
    "exempt": dict(exempt=["all_reduce", "reduce_scatter", "all_gather", "p2p"]),
    "default=None": dict(default=None),
    "forward=False": dict(forward=False),
}


def _forwarded_calls(rank: int, world: int) -> dict:
    """Every kind of call a compressing group forwards, each as fn(group, async_op) -> (Work or None,
    the tensors it writes). Float tensors from MIN_BYTES up: what the policy could compress."""
    shard = rank_input(rank, (8, 700), torch.bfloat16, 40)  # 11200 bytes
    full = rank_input(rank, (world * 8, 700), torch.bfloat16, 41)
    peer, src = (rank + 1) % world, (rank - 1) % world

    def out(t):  # outputs start as a sentinel, so a copy made before the data arrived shows
        return torch.full_like(t, -7.0)

    def all_gather(g, a):
        parts = [out(shard) for _ in range(world)]
        return dist.all_gather(parts, shard, group=g, async_op=a), parts

    def all_gather_tensor(g, a):
        o = out(full)
        return ALL_GATHER(o, shard, group=g, async_op=a), [o]

    def all_gather_coalesced(g, a):
        parts = [[out(shard) for _ in range(world)] for _ in range(2)]
        w = dist.all_gather_coalesced(parts, [shard, shard.flip(0)], group=g, async_op=a)
        return w, parts[0] + parts[1]

    def all_reduce(g, a):
        o = full.clone()
        return dist.all_reduce(o, group=g, async_op=a), [o]

    def all_reduce_coalesced(g, a):
        outs = [full.clone(), full.flip(0)]
        return dist.all_reduce_coalesced(outs, group=g, async_op=a), outs

    def reduce_scatter(g, a):
        o = out(shard)
        return dist.reduce_scatter(o, list(full.chunk(world)), group=g, async_op=a), [o]

    def reduce_scatter_tensor(g, a):
        o = out(shard)
        return REDUCE_SCATTER(o, full, group=g, async_op=a), [o]

    def coalesced_block(g, a):
        from torch.distributed.distributed_c10d import _coalescing_manager

        ar, ag, rs = full.clone(), out(full), out(shard)
        if not isinstance(g, CompressingProcessGroup):  # the reference: gloo has no coalescing blocks
            dist.all_reduce(ar, group=g), ALL_GATHER(ag, shard, group=g), REDUCE_SCATTER(rs, full, group=g)
            return None, [ar, ag, rs]
        with _coalescing_manager(group=g, device=torch.device("cpu"), async_ops=a) as cm:
            dist.all_reduce(ar, group=g)
        with _coalescing_manager(group=g, device=torch.device("cpu"), async_ops=a) as cm2:
            ALL_GATHER(ag, shard, group=g)
        with _coalescing_manager(group=g, device=torch.device("cpu"), async_ops=a) as cm3:
            REDUCE_SCATTER(rs, full, group=g)
        return (_Waits([cm, cm2, cm3]) if a else None), [ar, ag, rs]

    def broadcast(g, a):
        o = full.clone()
        return dist.broadcast(o, src=0, group=g, async_op=a), [o]

    def reduce(g, a):
        o = full.clone()
        return dist.reduce(o, dst=0, group=g, async_op=a), [o] if rank == 0 else []

    def gather(g, a):
        parts = [out(shard) for _ in range(world)] if rank == 0 else None
        return dist.gather(shard, parts, dst=0, group=g, async_op=a), parts or []

    def scatter(g, a):
        o = out(shard)
        return dist.scatter(o, list(full.chunk(world)) if rank == 0 else None, src=0, group=g, async_op=a), [o]

    def all_to_all_single(g, a):
        o = out(full)
        return dist.all_to_all_single(o, full, group=g, async_op=a), [o]

    def send_recv(g, a):
        o = out(shard)
        ops = [dist.P2POp(dist.isend, shard, peer, g), dist.P2POp(dist.irecv, o, src, g)]
        works = dist.batch_isend_irecv(ops)
        if not a:
            for w in works:
                w.wait()
        return (_Waits(works) if a else None), [o]

    return {f.__name__: f for f in (all_gather, all_gather_tensor, all_gather_coalesced, all_reduce, all_reduce_coalesced,
                                    reduce_scatter, reduce_scatter_tensor, coalesced_block, broadcast, reduce, gather,
                                    scatter, all_to_all_single, send_recv)}


class _Waits:
    def __init__(self, works):
        self.works = works

    def wait(self):
        for w in self.works:
            w.wait()
        return True


def forwarded_works(rank: int, world: int, late_s: float = 0.1) -> dict:
    """Each forwarded call, sync and async, with the other ranks entering it `late_s` late (so this
    rank's inner Work cannot be complete when the call returns): once waited, its outputs are bit
    for bit what the same call on the inner group gives, under each forwarding policy."""
    import time

    wrong = []
    for name, kw in FORWARDING_POLICIES.items():
        g = compressed_group(None, CompressionPolicy(min_bytes=MIN_BYTES, **kw))
        for call, fn in _forwarded_calls(rank, world).items():
            _, want = fn(g.inner, False)
            for async_op in (False, True):
                if rank != 0:
                    time.sleep(late_s)
                try:
                    work, got = fn(g, async_op)
                    if async_op:
                        work.wait()
                except RuntimeError as e:
                    wrong.append(f"{name}: {call} async_op={async_op} raised {str(e)[:160]}")
                    continue
                if len(got) != len(want) or not all(_same_bits(a, b) for a, b in zip(got, want)):
                    wrong.append(f"{name}: {call} async_op={async_op}")
        compressed = {k: v.compressed for k, v in g.stats.items() if v.compressed}
        assert not compressed, (name, compressed)  # every call was forwarded
    return {"wrong": wrong}


# ------------------------------------------------------------------------------- "taco" as the default group
def _reinit_as_taco(rank: int, world: int, policy) -> None:
    """Replace this process's gloo default group by dist.init_process_group("taco") (a file
    rendezvous whose path rank 0 picks)."""
    import tempfile

    path = [tempfile.mktemp(prefix="taco-init-") if rank == 0 else None]
    dist.broadcast_object_list(path, src=0)
    dist.destroy_process_group()
    dist.init_process_group("taco", init_method=f"file://{path[0]}", rank=rank, world_size=world,
                            pg_options=taco.GroupOptions(policy=policy))


def taco_default(rank: int, world: int) -> dict:
    """dist.init_process_group("taco"): the default group compresses what its policy selects over a
    gloo inner group; DDP on it trains; new groups under it compress over new gloo groups; the
    inner groups the library made are destroyed with their groups, a caller's are not."""
    from taco_triton.integrations.process_group import BACKEND, GroupOptions

    c10d = dist.distributed_c10d
    report = {}
    policy = RecordingPolicy(min_bytes=MIN_BYTES)
    _reinit_as_taco(rank, world, policy)
    world_pg = dist.group.WORLD
    inner = world_pg.inner
    assert isinstance(world_pg, CompressingProcessGroup) and dist.get_backend() == BACKEND
    assert world_pg.policy is policy and world_pg.inner_backend == "gloo"  # the device's own: gloo on a CPU torch
    assert dist.get_backend(inner) == "gloo" and dist.get_process_group_ranks(inner) == list(range(world))

    # DDP on the default group (no process_group argument): one step's gradients within their
    # bound, then a few steps of training
    report["ddp"] = ddp_step(rank, world, policy, None, exact_group=inner)
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(7 + rank)
    x = torch.randn(64, 32, generator=gen)
    y = x[:, :1] * 2.0 - x[:, 1:2]
    before = world_pg.stats.get(("all_reduce", "backward", "all_reduce"), GroupStats()).compressed
    losses = []
    for _ in range(8):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    report["losses"] = losses
    report["train_compressed"] = world_pg.stats[("all_reduce", "backward", "all_reduce")].compressed - before
    params = [p.detach().clone() for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(params, _gather_all_list(params, world)))  # replicas agree

    # new groups under it: compressing groups over new gloo groups, never a recursion
    for kwargs in ({}, {"backend": BACKEND}):
        sub = dist.new_group(list(range(world)), **kwargs)
        assert isinstance(sub, CompressingProcessGroup) and sub.policy is policy, kwargs
        assert dist.get_backend(sub.inner) == "gloo" and sub.inner not in (inner, world_pg), kwargs
        z = torch.arange(5) + rank
        dist.all_reduce(z, group=sub)
        assert torch.equal(z, sum(torch.arange(5) + r for r in range(world)))
        sub_inner = sub.inner
        dist.destroy_process_group(sub)  # and the inner group it made
        assert sub not in c10d._world.pg_map and sub_inner not in c10d._world.pg_map, kwargs
    plain = dist.new_group(list(range(world)), backend="gloo")
    assert not isinstance(plain, CompressingProcessGroup)
    own = dist.new_group(list(range(world)), backend=BACKEND, pg_options=GroupOptions(inner=plain))
    assert own.inner is plain and own.inner_backend is None
    dist.destroy_process_group(own)  # the caller's inner group stays
    assert plain in c10d._world.pg_map
    dist.barrier(group=plain)
    over = compressed_group(None, CompressionPolicy(min_bytes=MIN_BYTES))  # None: the default group's inner
    assert over.inner is inner

    # monitored_barrier: torch refuses a group not named gloo; the inner group and the group's own method work
    errors = {}
    try:
        dist.monitored_barrier(group=world_pg)
    except ValueError as e:
        errors["monitored_barrier"] = str(e)
    dist.monitored_barrier(group=world_pg.inner)
    world_pg.monitored_barrier(c10d.default_pg_timeout)
    for name, options in (("taco_inner", lambda: GroupOptions(inner="cpu:taco")),
                          ("options_type", lambda: dist.new_group(list(range(world)), backend=BACKEND, pg_options=3))):
        try:
            options()
        except (TypeError, ValueError) as e:
            errors[name] = f"{type(e).__name__}: {e}"
    report["errors"] = errors

    dist.destroy_process_group()  # everything, the default group and its inner group included
    report["destroyed"] = not dist.is_initialized() and not c10d._world.pg_map
    return report
