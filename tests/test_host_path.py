"""The host path around the kernels: no host reads of tensor data in the steady state of any
compressed collective, at most 3 launches per pipeline slice for all_reduce (2 for
reduce_scatter and all_gather) at any world size, tag mismatches caught on the device.

The kernels run under Triton's interpreter with their launches stubbed and counted
(`taco_triton.host_audit`); the audited code is the Triton path that CUDA runs.
"""
import pytest
import torch

from taco_triton.host_audit import audit

from . import host_path_cases as cases
from .dist_utils import run_ranks

PER_SLICE = {"all_reduce": 3, "reduce_scatter": 2, "all_gather": 2}


def test_audit_counts_reads_device_ops_and_launches():
    with audit() as seen:
        y = torch.zeros(4) + 1      # two device ops
        bool(y.sum() > 0)           # a host read (and two more ops)
        torch.empty(8).view(2, 4)   # no kernel
    assert seen.host_reads == 1 and seen.reads["__bool__"] == 1
    assert seen.device_ops == 4, seen.ops


@pytest.fixture(scope="module")
def gloo():
    return run_ranks(cases.audit_gloo, 2, pg_timeout_s=30, timeout_s=600)


@pytest.mark.parametrize("kind", cases.KINDS)
def test_steady_state_has_no_host_reads_and_no_other_device_ops_on_gloo(gloo, kind):
    for report in gloo:
        for name, seen in report.items():
            if not name.startswith(kind):
                continue
            assert seen["reads"] == {} and seen["ops"] == {}, (name, seen)
            pipeline = int(name[-1])
            assert seen["kernels"] == PER_SLICE[kind] * pipeline, (name, seen)


def test_p2p_steady_state_has_no_host_reads_and_one_launch_per_side(gloo):
    for report in gloo:
        assert report["p2p"] == {"reads": {}, "ops": {}, "kernels": 1}, report["p2p"]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_tag_mismatch_is_found_on_the_device_and_raises_on_both_ranks(gloo, mode):
    for report in gloo:
        msg = report["mismatch"][mode]
        assert msg.startswith("ValueError") and "carries tag" in msg and "nan=True" in msg, msg


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_launches_per_slice_at_any_world_size(world):
    seen = cases.audit_fake(world)
    for name, s in seen.items():
        kind, pipe = name.rsplit("-pipe", 1)
        assert s["reads"] == {} and s["ops"] == {}, (name, s)
        assert s["kernels"] == PER_SLICE[kind] * int(pipe), (name, s)


def test_check_always_keeps_the_per_call_exchange_and_the_audit_sees_its_read(gloo):
    """Control: check="always" exchanges fingerprints on every call, one host read each."""
    for report in gloo:
        assert report["check_always"]["reads"] == {"__bool__": 1}, report["check_always"]


def test_host_overhead_bench_core_on_tiny_settings(monkeypatch):
    """bench/host_overhead.py's table: every row counted, no host reads, 3/2/2 launches per slice
    (without the test suite's poisoned allocations, whose fill is a device op of its own)."""
    monkeypatch.delenv("TACO_TRITON_POISON_ALLOC", raising=False)
    from pathlib import Path

    from .helpers import load_script

    bench = load_script(Path(__file__).resolve().parents[1] / "bench" / "host_overhead.py")
    df = bench.measure(worlds=(2,), pipelines=(1,), numel=4096, calls=1, repeats=1)
    assert list(df.columns) == bench.COLUMNS
    assert set(df["what"]) == {"compress", "decompress", "all_reduce", "reduce_scatter", "all_gather"}
    assert (df["host_reads_per_call"] == 0).all()
    launches = dict(zip(df["what"], df["launches_per_call"]))
    assert launches == {"compress": 1, "decompress": 1, "all_reduce": 3, "reduce_scatter": 2, "all_gather": 2}
    assert (df["host_us"] > 0).all() and (df["ratio_to_tiny_op"] > 0).all()


def test_a_new_default_group_gets_its_own_plans():
    """Plans hold P and the rank: after destroy_process_group and a new default group of another
    size, the same call (same signature) must build a new plan, not reuse the old one."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from taco_triton.collectives import _pg
    from taco_triton.state import STATE

    for world in (2, 4):
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        try:
            cases.steady_state(cases.issue("all_reduce", 2, 1, True, check=False))  # same numel at both sizes
            group = _pg.group_object(None)
            assert {plan.p for key, plan in STATE.plans.items() if key[0] is group} == {world}
        finally:
            dist.destroy_process_group()
