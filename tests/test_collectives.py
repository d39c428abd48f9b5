"""Compressed collectives on P gloo ranks (CPU processes): correctness, identity, bounds, edges."""
import pytest

from . import collective_cases as cases
from .dist_utils import run_ranks


@pytest.mark.parametrize("world,every,configs", [(2, 1, "8bit"), (3, 3, "8bit"), (4, 4, "8bit"), (3, 2, "subbyte")],
                         ids=["P2-all", "P3-third", "P4-quarter", "P3-half-int6-int4"])
def test_all_reduce_battery(world, every, configs, record_property):
    """Every shape x dtype x 8-bit codec x (sync sum, async avg) at P=2; an evenly spread share at
    P=3, 4; half of the INT6/INT4 cases at P=3."""
    reports = run_ranks(cases.battery, world, every, configs)
    n_all = len(cases.SHAPES) * len(cases.DTYPES) * len(cases.CONFIG_SETS[configs]) * 2
    assert reports[0]["cases"] == -(-n_all // every)
    record_property("max_bound_use", max(r["max_bound_use"] for r in reports))


@pytest.mark.parametrize("world", [2, 3])
def test_reduce_scatter_and_all_gather(world):
    run_ranks(cases.reduce_scatter_and_all_gather, world)


def test_pipeline_depth_changes_nothing_bitwise():
    assert all(run_ranks(cases.pipeline_depth_is_bitwise_irrelevant, 3))


def test_native_paths_are_exactly_torch():
    assert all(run_ranks(cases.native_paths, 3))


def test_nan_in_one_rank_poisons_only_its_group_everywhere():
    assert all(run_ranks(cases.nan_propagates, 2))


@pytest.mark.parametrize("world,codec,group_size,most", [(2, "fp8_e4m3", 128, 0.52), (4, "fp8_e4m3", 128, 0.52),
                                                        (4, "int6", 32, 0.40), (4, "int4", 32, 1 / 3.6)],
                         ids=["P2-fp8", "P4-fp8", "P4-int6-G32", "P4-int4-G32"])
def test_wire_bytes_of_bf16(world, codec, group_size, most):
    """The two-shot all_reduce against torch's bf16 all_reduce: FP8/INT8 about half, INT6 at G=32
    at most 0.40x (2.5x fewer bytes), INT4 at G=32 at most 1/3.6 (scales and tags included)."""
    r = run_ranks(cases.wire_bytes_ratio, world, codec, group_size)[0]
    assert r["compressed"] <= most * r["native"], r
    assert set(r["kinds"]) == {"all_to_all", "all_gather", "fingerprint"}
    assert r["kinds"]["fingerprint"] == (world - 1) * 8  # one 8-byte fingerprint per call, to each peer


def test_triton_kernels_in_the_collective_match_reference():
    assert all(run_ranks(cases.triton_backend, 2))


def test_triton_kernels_match_reference_on_odd_shards():
    assert all(run_ranks(cases.triton_backend_odd_shards, 2))


def test_rank_mismatch_is_a_clear_error():
    msgs = run_ranks(cases.mismatched_shapes, 2)
    assert all("ranks disagree" in m and "(100,)" in m and "(101,)" in m for m in msgs), msgs


def test_dead_peer_raises_instead_of_hanging():
    import time

    t0 = time.monotonic()
    results, errors = run_ranks(cases.peer_dies, 2, pg_timeout_s=5, timeout_s=90, allow_errors=True)
    assert "without reporting" in errors[1]
    assert results[0].startswith("RuntimeError"), results[0]
    assert time.monotonic() - t0 < 60


def test_soak_random_collectives_match_native_in_any_wait_order():
    """3 ranks, random kinds/sizes (empty, odd)/dtypes/configs/ops/views, async batches waited in a
    per-rank order. SOAK_OPS (default 100, `make soak`: 2000) sets the length."""
    import os

    n_ops = int(os.environ.get("SOAK_OPS", "100"))
    seed = int(os.environ.get("SOAK_SEED", "1"))
    reports = run_ranks(cases.soak, 3, n_ops, seed, pg_timeout_s=20, timeout_s=max(300, 3 * n_ops))
    assert all(r["ops"] >= n_ops for r in reports) and reports[0]["compressed_within_bound"] > 0


def test_wire_stats_nested_equal_ones_each_leave_only_themselves():
    """An empty inner WireStats equal in value to the outer one: leaving it keeps the outer recording."""
    import taco_triton as taco
    from taco_triton.collectives import _pg

    with taco.WireStats() as outer:
        with taco.WireStats() as inner:
            pass
        _pg._record("all_reduce", 8, 4.0, False)
    assert inner.wire_bytes == 0.0
    assert outer.wire_bytes == 4.0
    assert not getattr(_pg._stats, "stack", [])
