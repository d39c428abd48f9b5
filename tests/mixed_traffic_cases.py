"""Per-rank bodies of the mixed-traffic tests: compressed, forwarded and p2p calls on one group, sync
and async, one rank late (module-level so spawned processes can import them).

Each body returns what it saw; the assertions live in tests/test_mixed_traffic.py. The programs
are ones plain gloo completes with exact results: whatever path a call takes, the library must
give gloo's result where it forwards, the format's bound where it compresses, and never hang.
"""
from __future__ import annotations

import gc
import threading
import time
import weakref

import torch
import torch.distributed as dist

import taco_triton as taco
from taco_triton.collectives import p2p
from taco_triton.integrations.process_group import GroupOptions

from .collective_cases import rank_input, two_quantization_bound
from .process_group_cases import RecordingPolicy, _gather_all, _gather_all_list, _reinit_as_taco

#: how late rank 1 enters where lateness matters (seconds)
DELAY = 1.5
#: elements of the compressed messages (two super-blocks of the default config)
N = 2 * 16384
CFG = taco.CompressionConfig()


def _late(rank: int) -> None:
    dist.barrier()
    if rank == 1:
        time.sleep(DELAY)


def _raises(fn) -> str | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - reported to the test
        return f"{type(e).__name__}: {e}"
    return None


def _all_reduce_bound(world: int, seed: int) -> tuple[list[torch.Tensor], torch.Tensor, float]:
    xs = [rank_input(r, (N,), torch.bfloat16, seed) for r in range(world)]
    exact = torch.stack([x.double() for x in xs]).sum(0)
    return xs, exact, two_quantization_bound(xs, CFG, torch.bfloat16, "sum")


def taco_default_mixed(rank: int, world: int) -> dict:
    """On dist.init_process_group("taco") (min_bytes 0: every bf16 message compressed), with rank 1
    late: taco.* async beside forwarded dist.* (findings 1, 5), counting (7), p2p metadata beside a
    compressed activation (2), is_completed of a queued forwarded call (3), a forwarded send while a
    compressed all_reduce is in flight (5), a failed async call's state before wait (7), inference
    mode (8)."""
    _reinit_as_taco(rank, world, taco.CompressionPolicy(min_bytes=0))
    inner = dist.group.WORLD.inner
    out: dict = {}
    xs, exact, bound = _all_reduce_bound(world, 1)

    # 1, 5: taco.all_reduce on the "taco" default group, then a forwarded int64 all_reduce
    x, y = xs[rank].clone(), torch.arange(8, dtype=torch.int64) * (rank + 1)
    _late(rank)
    w1 = taco.all_reduce(x, async_op=True, min_bytes=0)
    w2 = dist.all_reduce(y, async_op=True)
    w1.wait()
    w2.wait()
    out["mixed_err"], out["mixed_bound"] = float((x.double() - exact).norm()), bound
    out["mixed_int_ok"] = torch.equal(y, torch.arange(8, dtype=torch.int64) * sum(range(1, world + 1)))

    # 7: the bytes of one all_reduce counted once, as on the inner group directly
    with taco.WireStats() as on_default:
        taco.all_reduce(xs[rank].clone(), min_bytes=0)
    with taco.WireStats() as on_inner:
        taco.all_reduce(xs[rank].clone(), group=inner, min_bytes=0)
    out["wire_default"], out["wire_inner"] = on_default.wire_bytes, on_inner.wire_bytes

    # 2: int64 metadata, then a bf16 activation, to one peer with one tag, rank 0's async all_reduce in
    # flight; rank 1 receives before it joins the all_reduce (plain gloo completes this program)
    act = rank_input(7, (N,), torch.bfloat16, 2)
    meta = torch.tensor([N, 3, 5], dtype=torch.int64)
    x = xs[rank].clone()
    _late(rank)
    if rank == 0:
        w = taco.all_reduce(x, async_op=True, min_bytes=0)
        sends = [dist.isend(meta, 1, tag=3), dist.isend(act, 1, tag=3)]
        out["p2p_raised"] = [_raises(s.wait) for s in sends]
    else:
        got_meta, got_act = torch.zeros_like(meta), torch.zeros_like(act)
        recvs = [dist.irecv(got_meta, 0, tag=3), dist.irecv(got_act, 0, tag=3)]
        out["p2p_raised"] = [_raises(r.wait) for r in recvs]
        want = torch.empty_like(act)
        p2p.decode_into(p2p.encode(act, CFG), want, CFG)  # the sender's bytes, decoded here
        out["p2p_meta_ok"] = torch.equal(got_meta, meta)
        out["p2p_act_ok"] = torch.equal(got_act.view(torch.int16), want.view(torch.int16))
        w = taco.all_reduce(x, async_op=True, min_bytes=0)
    w.wait()

    # 3: a forwarded async call queued behind a compressed one is not complete before its data is:
    # both ranks make the compressed call at once, rank 1 the forwarded one late
    y = torch.ones(4, dtype=torch.int64)
    big = rank_input(rank, (8 * N,), torch.bfloat16, 3)
    dist.barrier()
    w1 = taco.all_reduce(big, async_op=True, min_bytes=0)
    if rank == 1:
        time.sleep(DELAY)
    w2 = dist.all_reduce(y, async_op=True)
    if rank == 0:
        time.sleep(DELAY / 3)
        seen = w2.is_completed(), y.clone()
        out["early_completed"], out["early_value_ok"] = seen[0], torch.equal(seen[1], torch.full((4,), world))
    w1.wait()
    w2.wait()
    value = w2.get_future().wait()  # torch's Work: its future holds the outputs
    out["queued_future"] = [t.tolist() for t in value] if isinstance(value, list) else repr(value)

    # 5: a forwarded send while a compressed all_reduce is in flight, the receiver joining the
    # all_reduce after it received (plain gloo completes this)
    t = torch.arange(6, dtype=torch.int64) + 100 * rank
    x = xs[rank].clone()
    _late(rank)
    if rank == 0:
        w = dist.all_reduce(x, async_op=True)
        dist.send(t, 1)
    else:
        dist.recv(t, 0)
        out["send_ok"] = torch.equal(t, torch.arange(6, dtype=torch.int64))
        w = dist.all_reduce(x, async_op=True)
    w.wait()

    # 7: a failed async call: not successful before wait(), its own error at wait()
    _late(rank)
    bad = taco.all_reduce(xs[rank].clone(), op="avg" if rank else "sum", async_op=True, min_bytes=0,
                          check="always")
    t0 = time.monotonic()
    while not bad.is_completed() and time.monotonic() - t0 < 10:
        time.sleep(0.02)
    out["failed_completed"], out["failed_success"] = bad.is_completed(), bad.is_success()
    out["failed_wait"] = _raises(bad.wait)

    # 8: the caller's inference mode holds on the thread that writes its tensors
    with torch.inference_mode():
        t = xs[rank].clone()
        out["inference_sync"] = _raises(lambda: dist.all_reduce(t))
        t2 = xs[rank].clone()
        out["inference_async"] = _raises(lambda: taco.all_reduce(t2, async_op=True, min_bytes=0).wait())
        t3 = torch.empty(N * world, dtype=torch.bfloat16)
        out["inference_gather"] = _raises(lambda: dist.all_gather_into_tensor(t3, xs[rank].clone()))
    return out


def disagreement_repeated(rank: int, world: int) -> dict:
    """Finding 6: the Triton path, check=True, the ranks disagree on the size; the same async call
    twice. Both raise the disagreement at wait(); nothing aborts; a matching call then works."""
    n = 4096 if rank == 0 else 65536
    raised = []
    for _ in range(2):
        w = _raises(lambda: taco.all_reduce(torch.ones(n, dtype=torch.bfloat16), min_bytes=0, async_op=True,
                                            backend="triton", check=True).wait())
        raised.append(w)
    ok = torch.ones(4096, dtype=torch.bfloat16)
    taco.all_reduce(ok, min_bytes=0, backend="triton", check=True)
    return {"raised": raised, "after": float(ok.float().mean())}


def ddp_mixed_buckets(rank: int, world: int) -> dict:
    """Finding 4: DDP on a "taco" default group with buckets on both sides of min_bytes (each parameter
    a bucket of its own: the last layer's weight compressed, the others forwarded). The forwarded gradients bitwise DDP's on
    gloo, the compressed ones within their bound of the exact mean; three steps (main crashed in the
    second)."""
    policy = RecordingPolicy(min_bytes=16384)
    _reinit_as_taco(rank, world, policy)
    inner = dist.group.WORLD.inner

    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 128), torch.nn.GELU(), torch.nn.Linear(128, 2048))

    model, ref = build(), build()
    caps = [1e-6] * 4  # MiB per bucket: each parameter a bucket of its own
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb_list=caps)
    ddp_ref = torch.nn.parallel.DistributedDataParallel(ref, process_group=inner, bucket_cap_mb_list=caps)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(10 + rank)
    out = {}
    for step in range(3):
        batch = torch.randn(16, 8, generator=gen)
        opt.zero_grad()
        ddp(batch).square().mean().backward()
        if step == 0:
            ddp_ref(batch).square().mean().backward()
            pairs = [(a.grad, b.grad, a.numel() * 4 >= policy.min_bytes)
                     for a, b in zip(model.parameters(), ref.parameters())]
            out["forwarded_bitwise"] = [torch.equal(a, b) for a, b, big in pairs if not big]
            out["compressed_err"] = sum(float((a.double() - b.double()).norm()) ** 2 for a, b, big in pairs if big) ** 0.5
            buckets = [t for _, _, t in policy.records]
            out["compressed_numels"] = [t.numel() for t in buckets]
            out["big_numels"] = [p.numel() for p in model.parameters() if p.numel() * 4 >= policy.min_bytes]
            out["compressed_bound"] = sum(two_quantization_bound(_gather_all(t, world, inner), CFG, torch.float32, "sum")
                                          for t in buckets)
        opt.step()
    params = [p.detach().clone() for p in model.parameters()]
    out["replicas_agree"] = all(torch.equal(a, b) for a, b in zip(params, _gather_all_list(params, world)))
    return out


def groups_die_with_their_state(rank: int, world: int) -> dict:
    """Finding 7: 50 "taco" groups made, used async and destroyed: no worker thread and no reference
    to any of them (or their inner groups) is left."""
    refs = []
    before = {t.name for t in threading.enumerate()}
    for i in range(50):
        g = dist.new_group(list(range(world)), backend="taco",
                           pg_options=GroupOptions(inner="gloo", policy=taco.CompressionPolicy(min_bytes=0)))
        x = torch.full((N,), float(rank + i), dtype=torch.bfloat16)
        works = [taco.all_reduce(x, group=g, async_op=True, min_bytes=0),
                 dist.all_reduce(torch.ones(4, dtype=torch.int64), group=g, async_op=True)]
        for w in works:
            w.wait()
        refs += [weakref.ref(g), weakref.ref(g.inner)]
        dist.destroy_process_group(g)
        del g, works
    gc.collect()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        threads = [t.name for t in threading.enumerate() if t.name not in before and t.name.startswith("taco_triton")]
        if not threads:
            break
        time.sleep(0.05)
    return {"threads": threads, "alive": sum(r() is not None for r in refs)}
