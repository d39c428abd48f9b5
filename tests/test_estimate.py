"""taco_triton.estimate: its byte counts are what the collectives send, its times follow its model."""
from __future__ import annotations

import math

import pytest
import torch

import taco_triton as taco
from taco_triton.estimate import COLLECTIVES, HOST_US_PER_LAUNCH, LAUNCHES_PER_SLICE
from taco_triton.wire import STAGES as STAGES_OF
from tests.dist_utils import run_ranks

# 3 ranks: equal super-block-aligned all_reduce chunks and equal first-dim shards, where the model's
# per-rank bytes are exact (otherwise each rank's count differs by its chunk's padding)
SHAPE = (6, 4096)


def sent_bytes(rank: int, world: int) -> dict:
    """WireStats of each collective, native and compressed, on this rank."""
    g = torch.Generator().manual_seed(rank)
    full = torch.randn(SHAPE, generator=g).to(torch.bfloat16)
    shard = full[: SHAPE[0] // world].clone()
    out = {}
    for enabled in (False, True):
        cfg = taco.CompressionConfig(enabled=enabled)
        calls = {
            "all_reduce": lambda: taco.all_reduce(full.clone(), config=cfg, min_bytes=0),
            "reduce_scatter": lambda: taco.reduce_scatter(torch.empty_like(shard), full, config=cfg, min_bytes=0),
            "all_gather": lambda: taco.all_gather(torch.empty_like(full), shard, config=cfg, min_bytes=0),
        }
        for name, call in calls.items():
            with taco.WireStats() as ws:
                call()
            # the payload: the 8-byte rank-agreement fingerprint per peer is the check's, not the collective's
            out[(name, enabled)] = ws.wire_bytes - ws.fingerprint_bytes
    return out


def sent_bytes_sliced(rank: int, world: int, rows: int, pipeline: int) -> dict:
    """WireStats of each compressed collective of a (rows, 4096) message cut in `pipeline` slices."""
    full = torch.randn(rows, 4096, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
    even = full[: rows // world * world]  # reduce_scatter and all_gather need P equal shards
    shard = even[: rows // world].clone()
    cfg, out = taco.CompressionConfig(), {}
    calls = {
        "all_reduce": lambda: taco.all_reduce(full.clone(), config=cfg, min_bytes=0, pipeline=pipeline),
        "reduce_scatter": lambda: taco.reduce_scatter(torch.empty_like(shard), even, config=cfg, min_bytes=0,
                                                      pipeline=pipeline),
        "all_gather": lambda: taco.all_gather(torch.empty(world * shard.shape[0], 4096, dtype=torch.bfloat16), shard,
                                              config=cfg, min_bytes=0, pipeline=pipeline),
    }
    for name, call in calls.items():
        with taco.WireStats() as ws:
            call()
        out[name] = (ws.wire_bytes - ws.fingerprint_bytes, len(ws.calls))
    return out


@pytest.mark.parametrize("rows, pipeline", [(7, 2), (12, 3)], ids=["uneven-chunks-2-slices", "3-slices"])
def test_byte_and_launch_counts_follow_the_wire_contract_for_uneven_chunks_and_slices(rows, pipeline):
    """all_reduce's chunks of 7 x 4096 elements at P = 3 are 3, 3 and 1 super-blocks: its all_gather
    carries the widest slot from every rank; each slice adds its own tags. `estimate` counts what
    `WireStats` counts, as the mean over the ranks (it counted the slots of one slice, each chunk's
    own, and missed both: 38,592 bytes here where the ranks send 44,160 on average)."""
    world = 3
    sent = run_ranks(sent_bytes_sliced, world, rows, pipeline)
    for collective in COLLECTIVES:
        numel = rows * 4096 if collective == "all_reduce" else world * (rows // world) * 4096
        e = taco.estimate(numel, torch.bfloat16, link_gbps=1.0, ranks=world, collective=collective, pipeline=pipeline)
        # the all_to_all's bytes leaving a rank are the other ranks' slots: with uneven chunks each
        # rank's count differs, and their mean is the ring share `estimate` models for one rank
        got = sum(sent[r][collective][0] for r in range(world)) / world
        calls = sent[0][collective][1]
        assert e.compressed_bytes_per_rank == pytest.approx(got, abs=len(STAGES_OF[collective]) * pipeline), collective
        assert e.launches == len(STAGES_OF[collective]) * calls // (len(STAGES_OF[collective]) - 1), collective


def test_byte_counts_equal_what_the_collectives_send():
    world = 3
    sent = run_ranks(sent_bytes, world)[0]
    for collective in COLLECTIVES:
        e = taco.estimate(math.prod(SHAPE), torch.bfloat16, link_gbps=1.0, ranks=world, collective=collective)
        assert e.native_bytes_per_rank == pytest.approx(sent[(collective, False)], rel=1e-12), collective
        assert e.compressed_bytes_per_rank == pytest.approx(sent[(collective, True)], rel=1e-12), collective


def sent_p2p_bytes(rank: int, world: int) -> dict:
    """WireStats of a p2p message (rank 0 to rank 1) of SHAPE, native and compressed, on rank 0,
    the handshake's bytes left out."""
    from taco_triton.collectives import p2p

    msg = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    out = {}
    for enabled in (False, True):
        cfg = taco.CompressionConfig(enabled=enabled)
        with taco.WireStats() as ws:
            if rank == 0:
                p2p.isend(msg, 1, config=cfg, min_bytes=0).wait()
            else:
                p2p.irecv(torch.empty_like(msg), 0, config=cfg, min_bytes=0).wait()
        out[enabled] = ws.wire_bytes - ws.fingerprint_bytes
    return out


def test_a_p2p_message_is_the_bytes_its_sender_sends_in_one_step_with_two_codec_passes():
    sent = run_ranks(sent_p2p_bytes, 2)[0]
    n, link, codec = math.prod(SHAPE), 1.0, 50.0
    e = taco.estimate(n, torch.bfloat16, link_gbps=link, ranks=2, collective="p2p", codec_gbytes_s=codec,
                      latency_us=7.0)
    assert e.native_bytes_per_rank == sent[False] == 2 * n
    assert e.compressed_bytes_per_rank == sent[True]
    assert e.native_s == pytest.approx(2 * n / (link * 1e9 / 8) + 7e-6, rel=1e-12)
    assert e.codec_s == pytest.approx(2 * 2 * n / (codec * 1e9), rel=1e-12)  # compress, then decompress
    assert e.launches == 2
    for bad in (dict(pipeline=2), dict(ranks=4)):
        with pytest.raises(ValueError, match="p2p message has one slice between 2 ranks"):
            taco.estimate(n, **{"ranks": 2, **bad}, collective="p2p")


@pytest.mark.parametrize("ranks", [2, 8])
def test_without_codec_time_the_speedup_is_the_inverse_wire_ratio(ranks):
    e = taco.estimate(1 << 24, link_gbps=100.0, ranks=ranks, codec_gbytes_s=None, host_us_per_launch=0)
    assert not e.codec_counted and e.codec_s == 0.0 and e.host_s == 0.0
    assert e.speedup == pytest.approx(1 / e.wire_ratio, rel=1e-12)
    # dual scales at G=128: (G + 1 + 4 G / 4096) / (2 G) of bf16, plus chunk padding
    assert 0.5 < e.wire_ratio < 0.505


def test_times_follow_the_stated_model():
    n, p, link, codec = 1 << 22, 4, 200.0, 50.0
    e = taco.estimate(n, torch.float16, link_gbps=link, ranks=p, codec_gbytes_s=codec, latency_us=5.0)
    dense, link_bytes_s = 2 * n, link * 1e9 / 8
    latency = 2 * (p - 1) * 5e-6
    assert e.native_s == pytest.approx(2 * (p - 1) / p * dense / link_bytes_s + latency)
    assert e.codec_s == pytest.approx((3 + 1 / p) * dense / (codec * 1e9))
    assert e.launches == 3 and e.host_s == pytest.approx(3 * HOST_US_PER_LAUNCH * 1e-6)
    assert e.compressed_s == pytest.approx(e.link_s + e.codec_s + e.host_s)
    overlapped = taco.estimate(n, torch.float16, link_gbps=link, ranks=p, codec_gbytes_s=codec, overlap=True,
                               latency_us=5.0)
    assert overlapped.compressed_s == pytest.approx(max(e.link_s, e.codec_s, e.host_s))


@pytest.mark.parametrize("collective, per_slice", sorted(LAUNCHES_PER_SLICE.items()))
def test_host_time_counts_the_launches_of_every_pipeline_slice(collective, per_slice):
    kw = dict(link_gbps=400.0, ranks=8, collective=collective, codec_gbytes_s=200.0)
    for pipeline, host_us in ((1, 25.0), (4, 25.0), (4, 10.0)):
        e = taco.estimate(1 << 22, pipeline=pipeline, host_us_per_launch=host_us, **kw)
        assert e.launches == per_slice * pipeline
        assert e.host_s == pytest.approx(per_slice * pipeline * host_us * 1e-6, rel=1e-12)
        free = taco.estimate(1 << 22, pipeline=pipeline, host_us_per_launch=0, **kw)
        assert e.compressed_s == pytest.approx(free.compressed_s + e.host_s, rel=1e-12)
    assert taco.estimate(1 << 22, **kw).host_s == pytest.approx(per_slice * HOST_US_PER_LAUNCH * 1e-6)


def test_host_time_decides_whether_a_small_message_pays_off():
    """64 KiB of bf16 at P = 8 (one super-block per rank) at 400 Gbit/s: the link saves about 1 us,
    three launches cost 18 us."""
    small = taco.estimate(8 * 4096, link_gbps=400.0, ranks=8)
    assert small.speedup < 0.2 and small.break_even_codec_gbytes_s == float("inf")
    assert taco.estimate(8 * 4096, link_gbps=400.0, ranks=8, host_us_per_launch=0).speedup > 1.5


def test_a_message_under_a_super_block_per_rank_costs_more_than_native():
    """16 KiB at P = 8: two ranks' chunks hold the message, six are empty, and the all_gather
    carries every rank's slot padded to the widest: more bytes than the native ring."""
    assert taco.estimate(8192, link_gbps=400.0, ranks=8, host_us_per_launch=0).wire_ratio > 1


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlapped"])
def test_at_the_break_even_codec_throughput_the_speedup_is_one(overlap):
    kw = dict(link_gbps=400.0, ranks=8, overlap=overlap)
    even = taco.estimate(1 << 26, **kw).break_even_codec_gbytes_s
    assert taco.estimate(1 << 26, codec_gbytes_s=even, **kw).speedup == pytest.approx(1.0, rel=1e-9)
    assert taco.estimate(1 << 26, codec_gbytes_s=2 * even, **kw).speedup > 1
    assert taco.estimate(1 << 26, codec_gbytes_s=even / 2, **kw).speedup < 1


@pytest.mark.parametrize(
    "kwargs, names",
    [
        (dict(numel=0), "numel"),
        (dict(numel=1.5), "numel"),
        (dict(dtype=torch.int8), "dtype"),
        (dict(link_gbps=0), "link_gbps"),
        (dict(link_gbps=float("nan")), "link_gbps"),
        (dict(ranks=1), "ranks"),
        (dict(codec_gbytes_s=-1.0), "codec_gbytes_s"),
        (dict(collective="broadcast"), "collective"),
        (dict(latency_us=-1), "latency_us"),
        (dict(pipeline=0), "pipeline"),
        (dict(host_us_per_launch=-1.0), "host_us_per_launch"),
        (dict(host_us_per_launch=float("nan")), "host_us_per_launch"),
        (dict(config="fp8"), "config"),
    ],
    ids=lambda v: v if isinstance(v, str) else "-".join(f"{k}={v[k]}" for k in v),
)
def test_bad_input_raises_naming_the_value(kwargs, names):
    args = dict(numel=1 << 20, link_gbps=100.0, ranks=8) | kwargs
    with pytest.raises(ValueError, match=names):
        taco.estimate(**args)


def test_estimate_of_a_disabled_config_is_the_native_collective():
    """Before: CompressionConfig(enabled=False), which the collectives run natively, was
    estimated at a 1.98x speedup."""
    for collective in ("all_reduce", "reduce_scatter", "all_gather"):
        e = taco.estimate(1 << 24, config=taco.CompressionConfig(enabled=False), link_gbps=400.0, ranks=8,
                          codec_gbytes_s=100.0, latency_us=2.0, collective=collective)
        assert e.speedup == 1.0 and e.compressed_s == e.native_s and e.wire_ratio == 1.0, collective
        assert e.codec_s == 0.0 and e.compressed_bytes_per_rank == e.native_bytes_per_rank


@pytest.mark.parametrize("kwargs, name", [
    (dict(link_gbps=float("inf")), "link_gbps"),
    (dict(latency_us=float("nan")), "latency_us"),
    (dict(latency_us=float("inf")), "latency_us"),
    (dict(codec_gbytes_s=float("inf")), "codec_gbytes_s"),
    (dict(numel="4096"), "numel"),
    (dict(ranks=2.0), "ranks"),
], ids=["link_inf", "latency_nan", "latency_inf", "codec_inf", "numel_str", "ranks_float"])
def test_estimate_refuses_non_finite_rates_naming_them(kwargs, name):
    """Before: link_gbps=inf raised ZeroDivisionError, latency_us=nan made every time NaN and
    latency_us=inf gave a NaN speedup."""
    with pytest.raises(ValueError, match=name):
        taco.estimate(**(dict(numel=1 << 20, link_gbps=100.0, ranks=8) | kwargs))


def test_estimate_takes_numpy_integers():
    """Before: a numpy integer numel (e.g. from np.prod of a shape) was rejected."""
    np = pytest.importorskip("numpy")
    e = taco.estimate(np.prod(np.array([4096, 4096])), link_gbps=100.0, ranks=np.int64(8))
    assert e == taco.estimate(4096 * 4096, link_gbps=100.0, ranks=8)


def test_wire_bytes_are_what_a_real_call_hands_the_process_group():
    """1 Mi bf16 elements at P = 4 (FP8): each rank's chunk is a slot of its wire bytes, its 4-byte
    tag and padding to 16 bytes; the model counts the tag too (before: 1,057,792 bytes for the
    1,057,856 the collective sends). Counted on torch's fake process group (rank 0 of 4) with the
    kernels stubbed: the buffers are the real call's, no data moves."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from taco_triton.estimate import compressed_wire_bytes
    from taco_triton.host_audit import audit

    numel, p, cfg = 1 << 20, 4, taco.CompressionConfig()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=p)
    try:
        with audit(stub_kernels=True), taco.WireStats() as ws:
            taco.all_reduce(torch.ones(numel, dtype=torch.bfloat16), config=cfg, min_bytes=0, backend="triton",
                            check=False)
    finally:
        dist.destroy_process_group()
    to_all = [c for c in ws.calls if c.kind == "all_to_all"]
    assert len(to_all) == 1 and to_all[0].buffer_bytes == compressed_wire_bytes(numel, cfg, p)
    e = taco.estimate(numel, torch.bfloat16, cfg, ranks=p)
    assert e.compressed_bytes_per_rank == ws.wire_bytes
