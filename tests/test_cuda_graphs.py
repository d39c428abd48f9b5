"""Compressed collectives and p2p captured in CUDA graphs and replayed: the same bytes as eager,
no host synchronization in the steady state (`torch.cuda.set_sync_debug_mode("error")`).

One GPU cannot run two NCCL ranks, so these run the compressed path on a group of one rank
(TACO_TRITON_COMPRESS_SINGLE_RANK=1, a switch for tests only): the codec, the tags, the batched
launches and the collectives themselves, as on more ranks. p2p sends to itself.
"""
import contextlib
import os

import pytest
import torch

import taco_triton as taco

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="CUDA graphs need a CUDA device (run by bench/gpu_check.sh)")


@pytest.fixture(scope="module")
def one_rank_nccl(tmp_path_factory):
    import torch.distributed as dist

    os.environ["TACO_TRITON_COMPRESS_SINGLE_RANK"] = "1"
    store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
    yield
    dist.destroy_process_group()
    del os.environ["TACO_TRITON_COMPRESS_SINGLE_RANK"]


@contextlib.contextmanager
def no_sync():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def _issue(kind, n, pipeline, config=None, async_op=False):
    """(run, out): `run()` issues the collective (async: and waits for it, which inside a capture
    joins the communication stream back into the capturing one)."""
    g = torch.Generator(device="cuda").manual_seed(7)
    kw = {"min_bytes": 0, "pipeline": pipeline, "config": config, "async_op": async_op}

    def waited(work):
        if work is not None:
            work.wait()

    if kind == "all_reduce":
        src = torch.randn(n, device="cuda", generator=g).bfloat16()
        x = torch.empty_like(src)

        def run():
            x.copy_(src)
            waited(taco.all_reduce(x, **kw))
        return run, x
    if kind == "reduce_scatter":
        inp = torch.randn(n, device="cuda", generator=g).bfloat16()
        out = torch.empty(n, device="cuda", dtype=torch.bfloat16)
        return (lambda: waited(taco.reduce_scatter(out, inp, **kw))), out
    shard = torch.randn(n, device="cuda", generator=g).bfloat16()
    out = torch.empty(n, device="cuda", dtype=torch.bfloat16)
    return (lambda: waited(taco.all_gather(out, shard, **kw))), out


def _captured(run):
    """`run` (called once already: plan, tables, compilation) captured in a CUDA graph, on a side
    stream as torch requires, after one more warm-up call there."""
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()  # warm on the capture stream
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            run()
    torch.cuda.synchronize()
    return graph


STOCHASTIC = taco.CompressionConfig(codec="int4", group_size=32, hadamard=False, rounding="stochastic")


@pytest.mark.parametrize("kind", ["all_reduce", "reduce_scatter", "all_gather"])
@pytest.mark.parametrize("pipeline", [1, 2])
@pytest.mark.parametrize("async_op", [pytest.param(False, id="sync"), pytest.param(True, id="async")])
def test_collective_replays_the_eager_bytes_without_host_sync(one_rank_nccl, kind, pipeline, async_op):
    """Async: the communication stream forks from the capturing stream and `wait()` joins it
    back; eager and replayed, the same bytes as the synchronous call."""
    n = 3 * 8192 + 5
    run, out = _issue(kind, n, pipeline, async_op=async_op)
    run()  # first call: plan, tables, compilation
    torch.cuda.synchronize()
    with no_sync():
        run()  # steady state, eager
    torch.cuda.synchronize()
    eager = out.clone()
    if async_op:
        sync, want = _issue(kind, n, pipeline)
        sync()
        torch.cuda.synchronize()
        assert torch.equal(eager.view(torch.int16), want.view(torch.int16))
    graph = _captured(run)
    out.zero_()
    with no_sync():
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.int16), eager.view(torch.int16))
    taco.check_errors()


def test_p2p_to_itself_replays_the_eager_bytes(one_rank_nccl):
    from taco_triton.collectives import p2p

    cfg = taco.CompressionConfig()
    x = torch.randn(3 * 8192 + 5, device="cuda").bfloat16()
    got = torch.empty_like(x)

    def run():
        wire = p2p.encode(x, cfg)
        p2p.decode_into(wire, got, cfg)  # the receiving half of a message (the wire as received)

    run()
    torch.cuda.synchronize()
    with no_sync():
        run()
    torch.cuda.synchronize()
    eager = got.clone()
    graph = _captured(run)
    got.zero_()
    with no_sync():
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got.view(torch.int16), eager.view(torch.int16))
    assert torch.equal(eager, taco.decompress(taco.compress(x, cfg)))
    taco.check_errors()


def _replays(graph, out, n=2):
    got = []
    for _ in range(n):
        with no_sync():
            graph.replay()
        torch.cuda.synchronize()
        got.append(out.clone())
    return got


def test_replays_of_a_stochastic_all_reduce_round_with_fresh_seeds(one_rank_nccl):
    """Each replay salts the captured seeds with a device counter it advances, so the rounding
    noise is independent across replays (before: every replay rounded as the capture did)."""
    from .collective_cases import two_quantization_bound

    n = 3 * 8192 + 5
    run, out = _issue("all_reduce", n, 1, STOCHASTIC)
    run()
    graph = _captured(run)
    first, second = _replays(graph, out)
    assert not torch.equal(first.view(torch.int16), second.view(torch.int16))
    x = torch.randn(n, device="cuda", generator=torch.Generator(device="cuda").manual_seed(7)).bfloat16()
    bound = two_quantization_bound([x.cpu()], STOCHASTIC, torch.bfloat16, "sum")
    for y in (first, second):
        assert float((y.double() - x.double()).norm()) <= bound
    taco.check_errors()


def test_replays_of_a_stochastic_p2p_message_round_with_fresh_seeds(one_rank_nccl):
    from taco_triton import bounds
    from taco_triton.collectives import p2p

    x = torch.randn(3 * 8192 + 5, device="cuda").bfloat16()
    got = torch.empty_like(x)

    def run():
        p2p.decode_into(p2p.encode(x, STOCHASTIC), got, STOCHASTIC)

    run()
    first, second = _replays(_captured(run), got)
    assert not torch.equal(first.view(torch.int16), second.view(torch.int16))
    bound = bounds.l2_error_bound(x, taco.compress(x, STOCHASTIC), torch.bfloat16)
    for y in (first, second):
        assert float((y.float() - x.float()).norm()) <= bound
    taco.check_errors()


def test_two_captured_async_calls_into_non_contiguous_outputs_replay_the_eager_bytes(one_rank_nccl):
    """Each call works in a contiguous copy of its output; the Work holds it until the join, so
    the capturing stream's allocations in between (no stream use is recorded in a capture) cannot
    take it while the communication branch still writes it."""
    n = 3 * 8192 + 5
    g = torch.Generator(device="cuda").manual_seed(11)
    shards = [torch.randn(n, device="cuda", generator=g).bfloat16() for _ in range(2)]
    outs = [torch.zeros(n, 2, device="cuda", dtype=torch.bfloat16)[:, 0] for _ in range(2)]

    def run():
        works = [taco.all_gather(o, s, min_bytes=0, async_op=True) for o, s in zip(outs, shards)]
        scratch = torch.ones(4 * n, device="cuda") * 3  # the capturing stream allocates meanwhile
        del scratch
        for w in works:
            w.wait()

    want = []
    for o, s in zip(outs, shards):
        taco.all_gather(o, s, min_bytes=0)
        want.append(o.clone())
    run()
    graph = _captured(run)
    for o in outs:
        o.zero_()
    graph.replay()
    torch.cuda.synchronize()
    for o, w in zip(outs, want):
        assert torch.equal(o.view(torch.int16), w.view(torch.int16))
    taco.check_errors()


def test_every_wait_orders_its_own_stream(one_rank_nccl):
    """wait() first on a side stream, then on the current one: the current stream reads the result
    in place (torch's Work.wait() orders the current stream on every call)."""
    n = 1 << 22
    x = torch.randn(n, device="cuda", generator=torch.Generator(device="cuda").manual_seed(12)).bfloat16()
    want = x.clone()
    taco.all_reduce(want, min_bytes=0)
    side = torch.cuda.Stream()
    for _ in range(3):
        y = x.clone()
        w = taco.all_reduce(y, min_bytes=0, async_op=True)
        with torch.cuda.stream(side):
            w.wait()
        w.wait()
        got = y * 1  # read on the current stream, right after the second wait
        torch.cuda.synchronize()
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
