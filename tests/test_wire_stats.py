"""WireStats names the collective the user called and keeps the wire operations it was made of."""
from __future__ import annotations

import torch

import taco_triton as taco

from .dist_utils import run_ranks


def test_a_wire_call_recorded_outside_any_collective_is_its_own_collective():
    assert taco.collectives.WireCall("send", 8, 8.0, True).collective == "send"


def _wire_stats_per_collective(rank: int, world: int) -> dict:
    x = torch.randn(8, 4096, dtype=torch.bfloat16)
    out = {}
    with taco.WireStats() as ws:
        taco.all_reduce(x, min_bytes=0)
    out["compressed"] = [(c.collective, c.kind, c.compressed) for c in ws.calls], ws.by_collective(), ws.by_kind()
    with taco.WireStats() as ws:
        taco.all_reduce(x)  # CPU tensors: native by default
        shard = torch.empty(8 // world, 4096, dtype=torch.bfloat16)
        taco.reduce_scatter(shard, x, min_bytes=0)
        taco.all_gather(x, shard, min_bytes=0)
    out["mixed"] = [(c.collective, c.kind, c.compressed) for c in ws.calls]
    return out


def test_wire_stats_name_the_collective_called_and_keep_the_wire_operations():
    r = run_ranks(_wire_stats_per_collective, 2)[0]
    calls, per_collective, per_kind = r["compressed"]
    assert calls == [("all_reduce", "all_to_all", True), ("all_reduce", "all_gather", True)]
    assert set(per_collective) == {"all_reduce", "fingerprint"}
    assert set(per_kind) == {"all_to_all", "all_gather", "fingerprint"}
    assert per_collective["all_reduce"] == per_kind["all_to_all"] + per_kind["all_gather"]
    assert [c for c, _, _ in r["mixed"]][0] == "all_reduce" and r["mixed"][0][1:] == ("all_reduce", False)
    assert {c for c, _, _ in r["mixed"][1:]} == {"reduce_scatter", "all_gather"}
    assert {c for c, k, _ in r["mixed"][1:] if k == "all_to_all"} == {"reduce_scatter"}
