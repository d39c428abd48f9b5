"""The compile-time performance model (bench/aot.py) as a gate: before any GPU runs a change.

Every default launch (and every launch a shipped tuned file can choose) of the default config
and of INT8 must compile for A100 (sm_80), L40S (sm_89), H100/H200 (sm_90) and MI300 (gfx942)
with no register spills, and on sm_90 the model's bounds must stay at the goals: compress and
decompress limited by memory alone (100% of copy bandwidth) at <= 0.4 warp-instructions per
element, the fused reduce (both outputs) >= 85%. A change that makes a kernel slower by this
model fails here. The compiler runs in a subprocess: this process runs Triton's interpreter.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMPRESS_DECOMPRESS_MAX_INSTR = 0.4
REDUCE_MIN_PCT = 85.0


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    out = tmp_path_factory.mktemp("aot") / "ci.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "aot.py"), "--set", "ci", "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def _id(r):
    return f"{r['kernel']}-{r['target']}-{r['codec']}-w{r['num_warps']}s{r['num_stages']}"


def test_every_ci_launch_compiles_without_spills(rows):
    assert {r["target"] for r in rows} == {"sm_80", "sm_89", "sm_90", "gfx942"}
    assert {r["kernel"] for r in rows} == {"compress", "decompress", "reduce", "reduce_dense"}
    failed = [f"{_id(r)}: {r['error']}" for r in rows if not r["ok"]]
    assert not failed, failed
    spilled = [f"{_id(r)}: {r['spill_bytes']} B" for r in rows if r["spill_bytes"]]
    assert not spilled, spilled


def test_hopper_bounds_meet_the_goals(rows):
    for r in rows:
        if r["target"] != "sm_90" or r["num_warps"] != 4:
            continue
        if r["kernel"] in ("compress", "decompress"):
            assert r["pct_copy_bw_bound"] == 100.0, _id(r)
            assert r["instr_per_elem"] <= COMPRESS_DECOMPRESS_MAX_INSTR, (_id(r), r["instr_per_elem"])
        else:
            assert r["pct_copy_bw_bound"] >= REDUCE_MIN_PCT, (_id(r), r["pct_copy_bw_bound"])
        assert r["mma_per_elem"] > 0 or r["kernel"] == "reduce", f"{_id(r)} lost its tensor-core transform"
