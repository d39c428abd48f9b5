"""Per-rank bodies of the collective tests (module-level so spawned processes can import them)."""
from __future__ import annotations

import torch
import torch.distributed as dist

import taco_triton as taco
from taco_triton import bounds, reference
from taco_triton.config import SUPERBLOCK_ELEMS
from taco_triton.layout import WireLayout

SHAPES = [(37, 129), (5000,), (3, 4097)]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
CONFIGS = [taco.CompressionConfig(), taco.CompressionConfig(codec="int8"),
           taco.CompressionConfig(codec="fp8_e5m2", hadamard=False, group_size=64)]
#: The packed sub-byte codecs: INT6 at its recommended G=32 with Hadamard, INT4 without it (G=64)
SUBBYTE = [taco.CompressionConfig(codec="int6", group_size=32),
           taco.CompressionConfig(codec="int4", group_size=64, hadamard=False)]
CONFIG_SETS = {"8bit": CONFIGS, "subbyte": SUBBYTE}


def rank_input(rank: int, shape, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    x = torch.randn(shape, generator=g)
    x.view(-1)[:: 97] *= 50.0  # outliers
    return x.to(dtype)


def _gather_all(t: torch.Tensor, world: int) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(out, t.contiguous())
    return out


def _chunks(n: int, p: int):
    c = -(-(-(-n // p)) // SUPERBLOCK_ELEMS) * SUPERBLOCK_ELEMS
    return [(min(j * c, n), min((j + 1) * c, n)) for j in range(p)]


def two_quantization_bound(inputs: list[torch.Tensor], cfg, out_dtype, op: str) -> float:
    """L2 bound on all_reduce's error: each rank's quantization + the requantized sum + FP32 sums.

    Recomputes what the ranks sent with the reference (nearest rounding is deterministic), chunk by
    chunk as the collective cuts them. Per chunk: the sum of the ranks' format bounds (the errors
    add linearly), the requantization's format bound for the dequantized sum, and the FP32 sum of
    P terms in the transformed domain (each term rounded once: (P + 2) u of sum_p ||x'_p||, since
    the transform preserves L2 norms up to the factor it undoes), all times 1/P for "avg".
    """
    p = len(inputs)
    scale = 1.0 / p if op == "avg" else 1.0
    flats = [x.reshape(-1) for x in inputs]
    total = 0.0
    for a, b in _chunks(flats[0].numel(), p):
        if b <= a:
            continue
        n = b - a
        lay = WireLayout.of(n, cfg)
        bufs = torch.zeros(p, -(-lay.nbytes // 16) * 16, dtype=torch.uint8)
        deq = torch.zeros(n, dtype=torch.float64)
        first, norms = 0.0, 0.0
        for r, f in enumerate(flats):
            data = reference.compress_reference(f[a:b], cfg)
            bufs[r, : lay.nbytes] = data
            first += bounds.l2_error_bound(f[a:b], taco.Compressed(data, torch.Size([n]), f.dtype, cfg), torch.float32)
            d = reference.decompress_reference(data, n, cfg).double()
            deq += d
            norms += float(d.norm())
        red = reference.reduce_reference(bufs, n, cfg, scale)
        requant = bounds.l2_error_bound((deq * scale).float(), taco.Compressed(red, torch.Size([n]), out_dtype, cfg), out_dtype)
        fp32_sums = (p + 3) * 2.0**-24 * norms
        total += scale * (first + fp32_sums) + requant
    return total


def battery(rank: int, world: int, every: int = 1, configs: str = "8bit") -> dict:
    """all_reduce over shapes x dtypes x codecs of CONFIG_SETS[configs] x (sync sum, async avg);
    every `every`-th case."""
    report = {"cases": 0, "max_bound_use": 0.0}
    seed = 0
    for shape in SHAPES:
        for dtype in DTYPES:
            for cfg in CONFIG_SETS[configs]:
                for op, async_op in (("sum", False), ("avg", True)):
                    seed += 1
                    if (seed - 1) % every:
                        continue
                    x = rank_input(rank, shape, dtype, seed)
                    inputs = _gather_all(x, world)
                    exact = sum(t.double() for t in inputs) * (1.0 / world if op == "avg" else 1.0)
                    t = x.clone()
                    work = taco.all_reduce(t, config=cfg, op=op, async_op=async_op, min_bytes=0, pipeline=1)
                    if async_op:
                        assert work is not None and work.wait()
                    results = _gather_all(t, world)
                    assert all(torch.equal(r.view(torch.uint8), results[0].view(torch.uint8)) for r in results), "ranks differ"
                    err = float((t.double() - exact).norm())
                    bound = two_quantization_bound(inputs, cfg, dtype, op)
                    assert err <= bound, (shape, dtype, cfg, op, err, bound)
                    report["max_bound_use"] = max(report["max_bound_use"], err / bound)
                    report["cases"] += 1
    return report


def reduce_scatter_and_all_gather(rank: int, world: int) -> dict:
    used = 0.0
    for i, (rows, cols) in enumerate([(3, 384), (1, 1000), (5, 129)]):
        for j, dtype in enumerate(DTYPES):
            cfg = (CONFIGS + SUBBYTE)[(i + 3 * j) % (len(CONFIGS) + len(SUBBYTE))]
            inp = rank_input(rank, (world * rows, cols), dtype, 100 + i)
            out = torch.empty(rows, cols, dtype=dtype)
            taco.reduce_scatter(out, inp, config=cfg, min_bytes=0, pipeline=2)
            full = sum(t.double() for t in _gather_all(inp, world))
            want = full[rank * rows : (rank + 1) * rows]
            # one quantization per rank, then a dense sum: sum of the ranks' own L2 bounds + FP32 sum
            bound = 0.0
            for r, t in enumerate(_gather_all(inp, world)):
                piece = t[rank * rows : (rank + 1) * rows].contiguous()
                c = taco.compress(piece, cfg, backend="torch")
                bound += bounds.l2_error_bound(piece, c, torch.float32)
            bound += float(want.abs().norm()) * torch.finfo(dtype).eps + float(full.abs().norm()) * world * 2.0**-22
            err = float((out.double() - want).norm())
            assert err <= bound, ("reduce_scatter", rows, cols, dtype, err, bound)
            used = max(used, err / bound)
            # all_gather: every slice decompresses the owner's single compression; identical on all ranks
            shard = rank_input(rank, (rows, cols), dtype, 200 + i)
            out = torch.empty(world * rows, cols, dtype=dtype)
            w = taco.all_gather(out, shard, config=cfg, async_op=True, min_bytes=0, pipeline=3)
            w.wait()
            shards = _gather_all(shard, world)
            for r in range(world):
                want = taco.decompress(taco.compress(shards[r], cfg, backend="torch"), backend="torch")
                assert torch.equal(out[r * rows : (r + 1) * rows], want), ("all_gather", r)
    return {"max_bound_use": used}


def pipeline_depth_is_bitwise_irrelevant(rank: int, world: int) -> bool:
    x = rank_input(rank, (3, 50000), torch.bfloat16, 7)
    outs = []
    for depth in (1, 2, 5, 16):
        t = x.clone()
        taco.all_reduce(t, min_bytes=0, pipeline=depth)
        outs.append(t)
    return all(torch.equal(o.view(torch.int16), outs[0].view(torch.int16)) for o in outs)


def native_paths(rank: int, world: int) -> bool:
    x = rank_input(rank, (17, 33), torch.float32, 3)
    want = x.clone()
    dist.all_reduce(want)
    # disabled config; a message under min_bytes; and the CPU default (the torch reference codec
    # is slower than every link measured, so min_bytes=None stays native on CPU tensors)
    for kwargs in ({"config": taco.CompressionConfig(enabled=False), "min_bytes": 0}, {"min_bytes": 1 << 30}, {}):
        t = x.clone()
        taco.all_reduce(t, **kwargs)
        assert torch.equal(t, want)
    t = x.clone()
    taco.all_reduce(t, op="avg", min_bytes=1 << 30)
    assert torch.allclose(t, want / world, rtol=0, atol=0)
    i = torch.arange(6, dtype=torch.int64) + rank  # non-float dtypes always go native
    taco.all_reduce(i, min_bytes=0)
    assert torch.equal(i, sum(torch.arange(6) + r for r in range(world)))
    return True


def nan_propagates(rank: int, world: int) -> bool:
    cfg = taco.CompressionConfig()
    x = rank_input(rank, (8192,), torch.float32, 9)
    if rank == world - 1:
        x[300] = float("nan")
    taco.all_reduce(x, config=cfg, min_bytes=0)
    groups = x.view(-1, cfg.group_size)
    bad = groups.isnan().all(dim=1)
    return bool(bad[300 // 128]) and int(bad.sum()) == 1 and not bool(groups[~bad].isnan().any())


def wire_bytes_ratio(rank: int, world: int, codec: str = "fp8_e4m3", group_size: int = 128) -> dict:
    x = rank_input(rank, (64, 4096), torch.bfloat16, 11)
    with taco.WireStats() as native:
        taco.all_reduce(x.clone(), config=taco.CompressionConfig(enabled=False))
    with taco.WireStats() as comp:
        taco.all_reduce(x.clone(), min_bytes=0, config=taco.CompressionConfig(codec=codec, group_size=group_size))
    return {"native": native.wire_bytes, "compressed": comp.wire_bytes, "kinds": comp.by_kind()}


def triton_backend(rank: int, world: int) -> bool:
    x = rank_input(rank, (3, 4100), torch.bfloat16, 13)
    same = []
    for codec, g in (("fp8_e4m3", 128), ("int6", 32), ("int4", 64)):
        cfg = taco.CompressionConfig(codec=codec, group_size=g, hadamard=False)
        a, b = x.clone(), x.clone()
        taco.all_reduce(a, min_bytes=0, backend="triton", config=cfg)
        taco.all_reduce(b, min_bytes=0, backend="torch", config=cfg)
        same.append(torch.equal(a.view(torch.int16), b.view(torch.int16)))
    return all(same)


def triton_backend_odd_shards(rank: int, world: int) -> bool:
    """reduce_scatter and all_gather of a shard size that is no multiple of 16 and spans a whole
    tile and a partial one: rank r's piece starts at r * m, off 16-byte alignment, where the slotted
    kernels take their whole tiles without masks (`slots.WHOLE_PATH`)."""
    m = 8192 + 21  # one whole tile (kernels._tables.TILE_ELEMS) and a partial one
    x = rank_input(rank, (world * m,), torch.bfloat16, 17)
    same = []
    for codec, g in (("fp8_e4m3", 128), ("int4", 32)):
        cfg = taco.CompressionConfig(codec=codec, group_size=g)
        outs = {}
        for backend in ("triton", "torch"):
            shard, gathered = torch.empty(m, dtype=x.dtype), torch.empty(world * m, dtype=x.dtype)
            taco.reduce_scatter(shard, x, min_bytes=0, backend=backend, config=cfg)
            taco.all_gather(gathered, shard, min_bytes=0, backend=backend, config=cfg)
            outs[backend] = (shard, gathered)
        same += [torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(outs["triton"], outs["torch"])]
    return all(same)


def mismatched_shapes(rank: int, world: int) -> str:
    x = torch.randn(100 + rank)
    try:
        taco.all_reduce(x, min_bytes=0, check=True)
    except ValueError as e:
        return str(e)
    return "no error"


def peer_dies(rank: int, world: int) -> str:
    if rank == 1:
        import os

        os._exit(0)  # a peer that dies without a word
    try:
        taco.all_reduce(torch.randn(5000), min_bytes=0)
    except RuntimeError as e:
        return f"RuntimeError: {e}"[:200]
    return "no error"


# ------------------------------------------------------------------ regressions of issue findings
def _outcome(fn) -> str:
    """'ok', or the exception's type and message (so each rank reports instead of dying)."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - reported to the test
        return f"{type(e).__name__}: {e}"
    return "ok"


def findings(rank: int, world: int) -> dict:
    """One 2-rank session over the findings' scenarios; each entry is what this rank saw."""
    out = {}
    # async handles waited in opposite orders on the two ranks (torch's Work allows it)
    a = torch.full((5000,), float(rank + 1))
    b = torch.full((5000,), 100.0 * (rank + 1))
    h1 = taco.all_reduce(a, min_bytes=0, async_op=True)
    h2 = taco.all_reduce(b, min_bytes=0, async_op=True)
    for h in ((h1, h2) if rank == 0 else (h2, h1)):
        h.wait()
    out["wait_order"] = (a.tolist(), b.tolist())
    # one rank waits before its next collective, the other after it
    c = torch.full((5000,), float(rank + 1))
    h = taco.all_reduce(c, min_bytes=0, async_op=True)
    if rank == 0:
        h.wait()
    d = torch.full((5000,), float(rank + 1))
    taco.all_reduce(d, min_bytes=0)
    h.wait()
    out["wait_late"] = (c.tolist(), d.tolist())
    # native path on views: strided columns of an int tensor and of a float tensor (CPU default)
    for name, dtype in (("int", torch.int64), ("float", torch.float32)):
        big = (torch.arange(40) + 1000 * rank).reshape(4, 10).to(dtype)
        view = big[:, ::2]
        taco.all_reduce(view)
        out[f"view_{name}"] = big.tolist()
    out["expanded"] = _outcome(lambda: taco.all_reduce(torch.zeros(3, 1).expand(3, 4)))
    # autograd: the collective is invisible to it, as dist.all_reduce is
    for path, mb in (("compressed", 0), ("native", None)):
        x = torch.randn(300, requires_grad=True)
        y = x * 2
        taco.all_reduce(y, min_bytes=mb)
        y.sum().backward()
        out[f"grad_{path}"] = x.grad.tolist()
        leaf = torch.randn(300, requires_grad=True)
        out[f"leaf_{path}"] = _outcome(lambda: taco.all_reduce(leaf, min_bytes=mb))
    # overflow: a sum 5% past the rounding margin (fp16 40000 per rank for E4M3) is inf natively
    # and must stay inf; a sum at the max saturates
    from taco_triton.collectives.compressed import overflow_threshold

    for cfg in CONFIGS:
        per_rank = max(40000.0, 1.05 * overflow_threshold(cfg, torch.float16) / world)
        big = torch.full((4096,), per_rank, dtype=torch.float16)
        taco.all_reduce(big, config=cfg, min_bytes=0)
        at_max = torch.full((4096,), torch.finfo(torch.float16).max / world, dtype=torch.float16)
        taco.all_reduce(at_max, config=cfg, min_bytes=0)
        rs_out = torch.empty(4096, dtype=torch.float16)
        taco.reduce_scatter(rs_out, torch.full((4096 * world,), per_rank, dtype=torch.float16), config=cfg, min_bytes=0)
        out[f"overflow_{cfg.codec}"] = (bool(big.isposinf().all()), bool(torch.isfinite(at_max).all()),
                                        float(at_max.float().min()), bool(rs_out.isposinf().all()))
    # op="avg" on an integer tensor: rejected before it is touched
    i = torch.arange(6) + rank
    out["int_avg"] = (_outcome(lambda: taco.all_reduce(i, op="avg")), i.tolist())
    # a rank outside the group: a no-op, as natively
    sub = dist.new_group([0])
    s = torch.ones(5000)
    out["outside_group"] = (_outcome(lambda: taco.all_reduce(s, group=sub, min_bytes=0)), float(s.sum()))
    # ranks that disagree: every rank raises ValueError naming both sides, nobody hangs or diverges
    disagree = {
        "op": dict(op="sum" if rank == 0 else "avg", min_bytes=0),
        "min_bytes": dict(min_bytes=0 if rank == 0 else 1 << 30),
        "pipeline": dict(min_bytes=0, pipeline=1 if rank == 0 else 2),
        "codec": dict(min_bytes=0, config=CONFIGS[rank % 2]),
        "group_size": dict(min_bytes=0, config=taco.CompressionConfig(group_size=128 if rank == 0 else 64)),
    }
    for name, kwargs in disagree.items():
        t = torch.randn(3 * SUPERBLOCK_ELEMS * 2)
        before = t.clone()
        out[f"disagree_{name}"] = (_outcome(lambda: taco.all_reduce(t, **kwargs)), torch.equal(t, before))
    t = torch.randn(100 + rank)
    out["disagree_shape"] = _outcome(lambda: taco.all_reduce(t, min_bytes=0))
    # with the fingerprint exchange off, the per-slot tags still catch a config mismatch
    t = torch.randn(5000)
    out["tags_catch_codec"] = _outcome(lambda: taco.all_reduce(t, min_bytes=0, config=CONFIGS[rank % 2], check=False))
    dist.barrier()
    return out


# ------------------------------------------------------------------ randomized soak
SOAK_SIZES = [0, 1, 7, 129, 4095, 4097]


def _soak_op(rng, world):
    """One random collective, drawn from the generator every rank shares (same calls everywhere)."""
    kind = rng.choice(["all_reduce", "all_reduce", "reduce_scatter", "all_gather"])
    dtype = rng.choice([torch.bfloat16, torch.float16, torch.float32, torch.int32])
    return dict(kind=kind, n=rng.choice(SOAK_SIZES), dtype=dtype, cfg=rng.choice(CONFIGS),
                op=rng.choice(["sum", "avg"]) if dtype.is_floating_point and kind != "all_gather" else "sum",
                compress=rng.random() < 0.6, view=rng.random() < 0.3, pipeline=rng.choice([1, 2, "auto"]))


def _soak_data(gen, n, dtype, view):
    """n values; as a strided view (every other column of a wider tensor) when `view`."""
    x = torch.randn(n, 2, generator=gen) * 4 if view else torch.randn(n, generator=gen) * 4
    x = x.round() if not dtype.is_floating_point else x
    x = x.to(dtype)
    return x[:, 0] if view else x


def _soak_issue(spec, rank, world, gen):
    """(issue, result tensor, native result, bound) for one collective: `issue()` issues it async
    and returns its work; the native collective runs here, on copies, so both see the same inputs
    (before any call of the batch is issued: a call made directly on the group while async
    compressed work is in flight on it is not ordered with that work)."""
    n, dtype = spec["n"], spec["dtype"]
    kw = dict(config=spec["cfg"], min_bytes=0 if spec["compress"] else 1 << 40, pipeline=spec["pipeline"], async_op=True)
    compressed = spec["compress"] and dtype.is_floating_point
    if spec["kind"] == "all_reduce":
        x = _soak_data(gen, n, dtype, spec["view"])
        inputs = _gather_all(x, world)
        want = x.clone()
        dist.all_reduce(want)
        if spec["op"] == "avg":
            want.div_(world)
        bound = two_quantization_bound(inputs, spec["cfg"], dtype, spec["op"]) if compressed and n else 0.0
        return (lambda: taco.all_reduce(x, op=spec["op"], **kw)), x, want, bound
    shard = _soak_data(gen, n, dtype, False)
    if spec["kind"] == "all_gather":
        out = torch.empty(world * n, 2, dtype=dtype)[:, 0] if spec["view"] else torch.empty(world * n, dtype=dtype)
        want = torch.empty(world * n, dtype=dtype)
        dist.all_gather_into_tensor(want, shard)
        if compressed:  # exact: every slice is the owner's single compression
            want = torch.cat([taco.decompress(taco.compress(s, spec["cfg"], backend="torch"), backend="torch")
                              for s in _gather_all(shard, world)])
        kw.pop("op", None)
        return (lambda: taco.all_gather(out, shard, **kw)), out, want, 0.0
    inp = _soak_data(gen, world * n, dtype, False)
    out = torch.empty(n, 2, dtype=dtype)[:, 0] if spec["view"] else torch.empty(n, dtype=dtype)
    want = torch.empty(n, dtype=dtype)
    dist.reduce_scatter_tensor(want, inp.clone())
    if spec["op"] == "avg":
        want.div_(world)
    bound = 0.0
    if compressed and n:  # each rank's quantization of its slice, then a dense FP32 sum and one rounding
        scale = 1.0 / world if spec["op"] == "avg" else 1.0
        for t in _gather_all(inp, world):
            piece = t[rank * n : (rank + 1) * n].contiguous()
            bound += scale * bounds.l2_error_bound(piece, taco.compress(piece, spec["cfg"], backend="torch"), torch.float32)
        bound += float(want.double().norm()) * (torch.finfo(dtype).eps + world * 2.0**-22)
    return (lambda: taco.reduce_scatter(out, inp, op=spec["op"], **kw)), out, want, bound


def soak(rank: int, world: int, n_ops: int, seed: int) -> dict:
    """`n_ops` random collectives in batches of 1-3 async calls waited in a per-rank order; each
    result equals the native collective's (exactly on the native path, within the format's bound
    on the compressed one) and is bitwise identical across ranks."""
    import random

    shared = random.Random(seed)  # the calls: the same on every rank
    mine = random.Random(seed * 1000 + rank)  # the wait order: this rank's own
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    done, compressed = 0, 0
    while done < n_ops:
        batch = [_soak_op(shared, world) for _ in range(shared.randint(1, 3))]
        issued = [_soak_issue(spec, rank, world, gen) for spec in batch]
        issued = [(issue(), got, want, bound) for issue, got, want, bound in issued]
        order = list(range(len(batch)))
        mine.shuffle(order)
        for i in order:
            issued[i][0].wait() if issued[i][0] is not None else None
        for spec, (_, got, want, bound) in zip(batch, issued):
            exact = bound == 0.0 and not (spec["compress"] and spec["dtype"].is_floating_point and spec["kind"] != "all_gather" and spec["n"])
            if exact:
                assert torch.equal(got.contiguous().view(-1), want.view(-1)), (spec, got, want)
            else:
                err = float((got.double().reshape(-1) - want.double().reshape(-1)).norm())
                assert err <= bound, (spec, err, bound)
                compressed += 1
            if spec["kind"] != "reduce_scatter":  # every rank holds the same result
                every = _gather_all(torch.empty(got.numel(), dtype=got.dtype).copy_(got.reshape(-1)), world)
                assert all(torch.equal(e.view(torch.uint8), every[0].view(torch.uint8)) for e in every), spec
        done += len(batch)
    return {"ops": done, "compressed_within_bound": compressed}
