"""What a new user meets first: each command's --help is its own and ends cleanly, logs show only
what was measured, WireStats names the collective the user called."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import taco_triton as taco
from taco_triton.examples import train_dtensor, train_gpt
from taco_triton.examples.modes import progress

from .dist_utils import run_ranks
from .helpers import load_script

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("main, prog, says", [
    (train_gpt.main, "python -m taco_triton.examples.train_gpt", "Train a small GPT"),
    (train_dtensor.main, "python -m taco_triton.examples.train_dtensor", "DTensor"),
    (lambda argv: load_script(ROOT / "bench/netns.py").main(argv), "python bench/netns.py", "throttled namespace"),
], ids=["train_gpt", "train_dtensor", "bench-netns"])
def test_help_describes_its_own_command_and_exits_zero(main, prog, says, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0
    assert out.startswith(f"usage: {prog} ") and says in out, out[:400]


def test_a_step_without_evaluation_logs_no_validation_loss():
    row = {"step": 7, "train_loss": 2.25, "val_loss": float("nan")}
    assert "val" not in progress("[fp8]", row) and "nan" not in progress("[fp8]", row)
    assert "val 2.5000" in progress("[fp8]", {**row, "val_loss": 2.5})


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
