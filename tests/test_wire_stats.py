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


def test_a_fractional_ring_share_is_counted_in_whole_bytes():
    """Before: `by_kind()` gave floats (264464.0). A native all_reduce of 100 bytes at P = 3 sends
    2 (P-1)/P of them, 133.33 by the ring model: counted as the nearest whole byte."""
    from taco_triton.estimate import ring_bytes

    call = taco.collectives.WireCall("all_reduce", 100, ring_bytes("all_reduce", 100, 3), False)
    assert call.wire_bytes == 133 and type(call.wire_bytes) is int


def _readme_collective(rank: int, world: int) -> dict:
    """The README's collective example: each rank all-reduces 512 x 1024 bf16 (1 MiB), FP8."""
    torch.manual_seed(rank)
    t = torch.randn(512, 1024, dtype=torch.bfloat16)
    with taco.WireStats() as ws:
        taco.all_reduce(t, min_bytes=0)
    return {"by_kind": ws.by_kind(), "by_collective": ws.by_collective(), "wire_bytes": ws.wire_bytes}


def test_the_readme_prints_what_by_kind_returns():
    """The dict the README's collective example says it prints is what `by_kind()` returns there:
    whole bytes, each from the wire format (the all_to_all sends the peer's slot of the compressed
    message, the all_gather this rank's reduced slot to the peer; an 8-byte fingerprint each way)."""
    import ast
    import re
    from pathlib import Path

    from taco_triton.estimate import compressed_wire_bytes

    r = run_ranks(_readme_collective, 2)[0]
    slot = compressed_wire_bytes(512 * 1024, taco.CompressionConfig(), 2) // 2
    assert r["by_kind"] == {"all_to_all": slot, "all_gather": slot, "fingerprint": 8}
    assert all(type(v) is int for v in [*r["by_kind"].values(), *r["by_collective"].values(), r["wire_bytes"]])
    for page in ("README.md", "docs/getting-started.md"):
        text = (Path(__file__).resolve().parents[1] / page).read_text()
        printed = re.search(r"print\(ws\.by_kind\(\)\)\s+# (\{[^}]*\})", text)
        assert printed and ast.literal_eval(printed.group(1)) == r["by_kind"], page
