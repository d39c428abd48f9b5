"""The steady state of the compressed collectives: a repeated call reuses what its first call
decided (validation, agreement, plan, wire buffers), and what must be decided again still is:
the check mode from the environment, bad arguments, another thread's buffers.

Runs on torch's fake process group (rank 0 of 2, no data moves) with the kernels stubbed
(`taco_triton.host_audit`), so only the host path is exercised; the gloo tests check the bytes.
"""
import threading

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import taco_triton as taco
from taco_triton.collectives import _pg
from taco_triton.state import STATE
from taco_triton.host_audit import audit

KW = {"min_bytes": 0, "backend": "triton"}
N = 2 * 4096  # two super-blocks per rank at P = 2


@pytest.fixture
def fake_group():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with audit(stub_kernels=True):
            yield _pg.group_object(None)
    finally:
        dist.destroy_process_group()


def test_repeats_reuse_the_plan_and_their_threads_buffers(fake_group):
    x = torch.ones(N, dtype=torch.bfloat16)
    taco.all_reduce(x, check=False, **KW)
    plans, steady = dict(STATE.plans.items()), dict(STATE.steady.items())
    for _ in range(3):
        taco.all_reduce(x, check=False, **KW)
    assert dict(STATE.plans.items()) == plans and dict(STATE.steady.items()) == steady  # nothing new was built
    (plan,) = [p for key, p in STATE.plans.items() if key[0] is fake_group]
    assert len(plan._buffers) == 1
    send = plan.buffers()[0].send
    other = threading.Thread(target=lambda: taco.all_reduce(x, check=False, **KW))
    other.start()
    other.join()
    assert len(plan._buffers) == 2  # another thread gets its own set
    assert plan.buffers()[0].send is send  # this thread keeps its own


def test_the_environments_check_mode_is_read_on_every_call(fake_group, monkeypatch):
    exchanged = []
    monkeypatch.setattr(_pg, "agree", lambda what, *a, **k: exchanged.append(what))
    monkeypatch.delenv("TACO_TRITON_CHECK_COLLECTIVES", raising=False)
    x = torch.ones(N, dtype=torch.bfloat16)
    for _ in range(3):
        taco.all_reduce(x, **KW)
    assert exchanged == ["all_reduce"]  # "first": once per signature
    monkeypatch.setenv("TACO_TRITON_CHECK_COLLECTIVES", "always")
    taco.all_reduce(x, **KW)
    taco.all_reduce(x, **KW)
    assert len(exchanged) == 3  # "always": every call, steady or not
    y = torch.ones(2 * N, dtype=torch.bfloat16)
    monkeypatch.setenv("TACO_TRITON_CHECK_COLLECTIVES", "0")
    taco.all_reduce(y, **KW)
    taco.all_reduce(y, **KW)
    assert len(exchanged) == 3  # "never"
    monkeypatch.delenv("TACO_TRITON_CHECK_COLLECTIVES")
    taco.all_reduce(y, **KW)
    taco.all_reduce(y, **KW)
    assert len(exchanged) == 4  # back to "first": this signature was never agreed on, now once


def test_bad_arguments_raise_after_the_steady_state(fake_group):
    out, inp = torch.empty(N, dtype=torch.bfloat16), torch.ones(2 * N, dtype=torch.bfloat16)
    for _ in range(2):
        taco.reduce_scatter(out, inp, check=False, **KW)
    with pytest.raises(ValueError, match="world_size"):
        taco.reduce_scatter(torch.empty(N - 1, dtype=torch.bfloat16), inp, check=False, **KW)
    with pytest.raises(ValueError, match="op must be"):
        taco.reduce_scatter(out, inp, op="max", check=False, **KW)
    with pytest.raises(ValueError, match="pipeline"):
        taco.reduce_scatter(out, inp, pipeline=0, check=False, **KW)
    with pytest.raises(TypeError, match="expects tensors"):
        taco.reduce_scatter(out, [1, 2], check=False, **KW)
    with pytest.raises(ValueError, match="pipeline"):
        taco.all_reduce(inp, pipeline=[1], check=False, **KW)  # unhashable: no steady key, still validated

