"""The compile-time performance model (bench/aot.py) as a gate: before any GPU runs a change.

Every default launch (and every launch a shipped tuned file can choose) of the default config,
of INT8 and of INT6 at G=32 must compile for A100 (sm_80), L40S (sm_89), H100/H200 (sm_90), B200 (sm_100) and
MI300 (gfx942) with no register spills, and on sm_90 the model's bounds must stay at the goals:
compress and decompress limited by memory alone (100% of copy bandwidth) at <= 0.4
warp-instructions per element, the fused reduce (both outputs) >= 85%; INT6, whose codes move as
32-bit words of 16 codes, compress >= 95%, decompress and the reduce to dense 100%, the fused
reduce >= 55%. The quick set on sm_90 and gfx942 must meet `FLOORS` (85% / 70%) or be named by
an `EXCEPTIONS` entry and be no slower than the committed table. A change that makes a kernel
slower by this model fails here. The compiler runs in a subprocess: this process runs Triton's
interpreter.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .helpers import load_script

ROOT = Path(__file__).resolve().parents[1]
COMPRESS_DECOMPRESS_MAX_INSTR = 0.4
REDUCE_MIN_PCT = 85.0
INT6_MIN_PCT = {"compress": 95.0, "decompress": 100.0, "reduce": 55.0, "reduce_dense": 100.0}


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
    assert {r["target"] for r in rows} == {"sm_80", "sm_89", "sm_90", "sm_100", "gfx942"}
    assert {r["kernel"] for r in rows} == {"compress", "decompress", "reduce", "reduce_dense", "compress_slots",
                                           "reduce_tagged", "reduce_tagged_dense", "decompress_slots"}
    failed = [f"{_id(r)}: {r['error']}" for r in rows if not r["ok"]]
    assert not failed, failed
    spilled = [f"{_id(r)}: {r['spill_bytes']} B" for r in rows if r["spill_bytes"]]
    assert not spilled, spilled


def test_hopper_bounds_meet_the_goals(rows):
    for r in rows:
        if r["target"] != "sm_90" or r.get("collective"):
            continue
        if r["codec"] == "int6":  # the launch the heuristic picks (no tuned file has INT6 yet)
            assert r["pct_copy_bw_bound"] >= INT6_MIN_PCT[r["kernel"]], (_id(r), r["pct_copy_bw_bound"])
        elif r["num_warps"] != 4:
            continue
        elif r["kernel"] in ("compress", "decompress"):
            assert r["pct_copy_bw_bound"] == 100.0, _id(r)
            assert r["instr_per_elem"] <= COMPRESS_DECOMPRESS_MAX_INSTR, (_id(r), r["instr_per_elem"])
        else:
            assert r["pct_copy_bw_bound"] >= REDUCE_MIN_PCT, (_id(r), r["pct_copy_bw_bound"])
        assert r["mma_per_elem"] > 0 or r["kernel"] == "reduce", f"{_id(r)} lost its tensor-core transform"


def test_the_collectives_launches_meet_their_floors(rows):
    """The launches the collectives run (`--set ci`: all_reduce, reduce_scatter and all_gather of
    16 MiB at P = 8, aligned and odd, FP8 and INT8, INT6 and INT4 at G = 32, on sm_90 and sm_80),
    counted over the whole launch, reach `HOT_FLOORS` (95% of copy bandwidth on sm_90, 80% on
    sm_80) without spilling, or an `EXCEPTIONS` entry names them and they are no slower than the
    committed tables bench/results/aot_hotpath.csv and aot_hotpath_subbyte.csv; and the model's
    second reading of each (`model_misreads`: the tile loop's bytes, its descriptor loads, the
    library's launches) agrees. Before each program ran only its own tiles, the slotted compress
    and decompress at P = 8 were at 57-80%."""
    aot = _aot_module()
    hot = [r for r in rows if r.get("collective")]
    assert {(r["collective"], r["kernel"]) for r in hot} == {
        ("all_reduce", "compress_slots"), ("all_reduce", "reduce_tagged"), ("all_reduce", "decompress_slots"),
        ("reduce_scatter", "compress_slots"), ("reduce_scatter", "reduce_tagged_dense"),
        ("all_gather", "compress_slots"), ("all_gather", "decompress_slots")}
    assert {r["odd"] for r in hot} == {True, False}
    assert {r["codec"] for r in hot} == {"fp8_e4m3", "int8", "int6", "int4"}
    assert {r["target"] for r in hot} == {"sm_90", "sm_80"}
    assert all(aot.LOOP_BYTES[0] <= r["loop_bytes_ratio"] <= aot.LOOP_BYTES[1] and r["launch_check"] == "" for r in hot)
    assert all(r["desc_in_tile_loop"] is (None if r["kernel"].startswith("reduce") else True) for r in hot)
    problems = aot.check_floors(hot, _hot_tables())
    assert not problems, "\n".join(problems)


def _hot_tables() -> list[dict]:
    """The rows of the committed tables of the collectives' launches: FP8 and INT8
    (bench/results/aot_hotpath.csv), INT6 and INT4 (aot_hotpath_subbyte.csv)."""
    import pandas as pd

    return [r for name in ("aot_hotpath.csv", "aot_hotpath_subbyte.csv")
            for r in json.loads(pd.read_csv(ROOT / "bench" / "results" / name).to_json(orient="records"))]


def test_the_committed_tables_of_the_collectives_meet_their_floors():
    """Every row of the committed tables of the collectives' launches (every target, P = 2..16, 16
    and 64 MiB, aligned and odd, FP8, INT8, INT6 and INT4) reaches `HOT_FLOORS` and does not spill,
    or an `EXCEPTIONS` entry names it, and the model's second reading agrees with it: a table
    recomputed without its exceptions fails here, not only on the launches CI compiles."""
    aot = _aot_module()
    rows = _hot_tables()
    assert {r["codec"] for r in rows} == {"fp8_e4m3", "int8", "int6", "int4"} and len(rows) == 2240
    problems = aot.check_floors(rows)
    assert not problems, "\n".join(problems)


def test_a_p2p_messages_launches_are_in_the_model():
    """A p2p message runs under the collectives' plans (`_shapes.Message`), so the model builds its
    two launches as it builds theirs: the committed table (bench/results/aot_hotpath_p2p.csv,
    `--set hotpath-p2p`, sm_90 and sm_80) holds both launches of every config, size and alignment,
    meets the floors or an `EXCEPTIONS` entry, and agrees with the model's second reading; the
    launches the model builds for a message are the ones the message's plan makes."""
    import pandas as pd

    aot = _aot_module()
    rows = json.loads(pd.read_csv(ROOT / "bench" / "results" / "aot_hotpath_p2p.csv").to_json(orient="records"))
    assert {(r["kernel"], r["target"]) for r in rows} == {(k, t) for k in ("compress_slots", "decompress_slots")
                                                         for t in ("sm_90", "sm_80")}
    assert len(rows) == 2 * 2 * len(aot.hot_variants("hotpath-p2p"))
    problems = aot.check_floors(rows)
    assert not problems, "\n".join(problems)
    hv = aot.hot_variants("hotpath-p2p")[1]  # FP8, 16 MiB, odd
    launches = aot.hot_launches(hv, aot.TARGETS["sm_90"])
    assert [x["kernel"] for x in launches] == ["compress_slots", "decompress_slots"]
    assert aot.check_launches(hv, launches) == []


def test_launch_model_counts_per_program_per_slot_and_per_tile_work():
    """The collectives' launches are modelled over the whole launch from the natural loops of the
    control-flow graph: a loop whose latch is laid out after other code is still one loop, an
    inner tile loop runs once per tile, the slot loop around it once per program and slot, code
    outside loops once per program, and a subroutine after EXIT not at all."""
    aot = _aot_module()
    sass = [  # entry; a slot loop 1..8 (and 10) with a tile loop 2..6 inside it
        (0x00, "MOV R0, RZ"),
        (0x10, "LDG R1, [R2]"),           # slot loop header
        (0x20, "FMUL R3, R3, R3"),        # tile loop header
        (0x30, "FMUL R4, R4, R4"),
        (0x40, "FMUL R5, R5, R5"),
        (0x50, "FMUL R6, R6, R6"),
        (0x60, "@P0 BRA 0x20"),           # tile loop latch
        (0x70, "@P1 BRA 0xa0"),           # to code laid out after EXIT, part of the slot loop
        (0x80, "@P2 BRA 0x10"),           # slot loop latch
        (0x90, "EXIT"),
        (0xa0, "BRA 0x80"),               # back into the slot loop
        (0xb0, "RET.REL.NODEC R20 0x0"),  # a subroutine no path from the entry reaches
    ]
    loops = aot._cfg_loops(sass, aot._sass_successors(sass))
    assert loops["loops"] == [(1, [1, 2, 3, 4, 5, 6, 7, 8, 10]), (2, [2, 3, 4, 5, 6])]
    assert 11 not in loops["reached"]
    a = {"instrs": sass, "cfg": loops}
    w = dict(aot.launch_weights(a, "compress_slots", programs=10, tiles=50, slots=3, ranks=4))
    assert [w[i] for i in range(12)] == [10, 30, 50, 50, 50, 50, 50, 30, 30, 10, 30, 0]
    w = dict(aot.launch_weights(a, "reduce_tagged", programs=10, tiles=50, slots=3, ranks=4))
    # the reduce's loop over ranks: ranks - 1 runs per tile (the first rank's term is before it)
    assert [w[i] for i in range(12)] == [10, 50, 150, 150, 150, 150, 150, 50, 50, 10, 50, 0]


def test_program_zero_work_of_the_reduce_counts_once():
    """The fused reduce's output tag, padding and error record are written by program 0 alone
    (`if pid == 0`): by their source lines (`_program0_code`) the model counts that code once per
    launch and the padding loop as many times as the slot's padding has 1 KiB chunks past the
    tag's 32 bytes (none at the plans' strides), where it counted both in every program, and the
    padding loop as often as the ranks' tag checks. The tile nest is never taken for such code."""
    aot = _aot_module()
    sass = [
        (0x00, "S2R R0, SR_CTAID.X"),
        (0x10, "LDG.E.U8 R1, desc[UR4][R2.64]"),  # the ranks' tag checks: a loop, every program
        (0x20, "@P0 BRA 0x10"),
        (0x30, "@P1 BRA 0x80"),                   # pid != 0: past the output's tag
        (0x40, "STG.E.U8 desc[UR4][R2.64], R5"),  # write_tag: the tag
        (0x50, "STG.E.64 desc[UR4][R2.64], RZ"),  # write_tag: the padding loop
        (0x60, "@P2 BRA 0x50"),
        (0x70, "MOV R6, RZ"),                     # write_tag, after its loop
        (0x80, "FADD R7, R7, R7"),                # tile loop header (the first rank's term)
        (0x90, "FMUL R8, R8, R8"),                # rank loop: the other ranks'
        (0xa0, "@P3 BRA 0x90"),
        (0xb0, "@P4 BRA 0x80"),                   # tile loop latch
        (0xc0, "EXIT"),
    ]
    a = {"instrs": sass, "cfg": aot._cfg_loops(sass, aot._sass_successors(sass)), "program0": [4, 5, 6, 7, 8]}
    before = dict(aot.launch_weights(a, "reduce_tagged", programs=10, tiles=50, slots=4, ranks=4))
    assert [before[i] for i in range(13)] == [10, 40, 40, 10, 10, 40, 40, 10, 50, 150, 150, 50, 10]
    w = dict(aot.launch_weights(a, "reduce_tagged", programs=10, tiles=50, slots=4, ranks=4, pad_chunks=0))
    # instruction 8, the tile loop's header, is never program 0's alone whatever its line says
    assert [w[i] for i in range(13)] == [10, 40, 40, 10, 1, 0, 0, 1, 50, 150, 150, 50, 10]
    w = dict(aot.launch_weights(a, "reduce_tagged", programs=10, tiles=50, slots=4, ranks=4, pad_chunks=3))
    assert [w[5], w[6]] == [3, 3]


def test_launch_model_weighs_the_vector_and_element_wise_paths_of_a_tile():
    """A slotted launch compiled for any alignment runs each tile on one of two paths: the model
    counts the vector path for the launch's fast tiles and the element-wise one (more global
    accesses; or as many and more instructions, the masks' tests) for its slow tiles, the rest of the loop for every tile; a branch to a NOP (which
    the disassembly reader leaves out) goes to the next instruction, so the vector path still
    rejoins the loop."""
    aot = _aot_module()
    sass = [
        (0x00, "MOV R0, RZ"),
        (0x10, "LDG.E.64 R2, desc[UR4][R4.64]"),   # tile loop header: the descriptor
        (0x20, "@P0 BRA 0x70"),                     # which path
        (0x30, "LDG.E.128 R8, desc[UR4][R2.64]"),  # vector path
        (0x40, "FMUL R5, R5, R5"),
        (0x50, "BRA 0xa0"),                         # to a NOP: the join is the next instruction kept
        (0x70, "LDG.E.U16 R8, desc[UR4][R2.64]"),  # element-wise path
        (0x80, "LDG.E.U16 R9, desc[UR4][R2.64+0x2]"),
        (0x90, "FMUL R5, R5, R5"),
        (0xb0, "FADD R6, R6, R5"),                  # the join
        (0xc0, "@P1 BRA 0x10"),                     # tile loop latch
        (0xd0, "EXIT"),
    ]
    succ = aot._sass_successors(sass)
    assert succ[5] == [9] and succ[2] == [3, 6]
    cfg = aot._cfg_loops(sass, succ)
    assert cfg["loops"] == [(1, list(range(1, 11)))]
    a = {"instrs": sass, "cfg": cfg}
    assert aot.tile_arms(a, frozenset(range(1, 11)), 1) == ({3, 4, 5}, {6, 7, 8})
    w = dict(aot.launch_weights(a, "compress_slots", programs=10, tiles=50, slots=3, ranks=4, slow_tiles=2))
    assert [w[i] for i in range(12)] == [10, 50, 50, 48, 48, 48, 2, 2, 2, 50, 50, 10]
    w = dict(aot.launch_weights(a, "compress_slots", programs=10, tiles=50, slots=3, ranks=4))
    assert [w[i] for i in range(12)] == [10] + [50] * 10 + [10]
    # the path without masks (`slots.WHOLE_PATH`): as many accesses on both paths, the masked one longer
    whole = sass[:3] + [(0x30, "LDG.E.U16 R8, desc[UR4][R2.64]"), (0x40, "LDG.E.U16 R9, desc[UR4][R2.64+0x2]"),
                        (0x50, "BRA 0xc0"), (0x70, "ISETP.GE.AND P2, PT, R7, R10, PT"),
                        (0x80, "ISETP.GE.AND P3, PT, R7, R11, PT"), (0x90, "@!P2 LDG.E.U16 R8, desc[UR4][R2.64]"),
                        (0xa0, "@!P3 LDG.E.U16 R9, desc[UR4][R2.64+0x2]"), (0xd0, "FADD R6, R6, R5"),
                        (0xe0, "@P1 BRA 0x10"), (0xf0, "EXIT")]
    a = {"instrs": whole, "cfg": aot._cfg_loops(whole, aot._sass_successors(whole))}
    assert aot.tile_arms(a, frozenset(range(1, 12)), 1) == ({3, 4, 5}, {6, 7, 8, 9})
    same = whole[:7] + whole[8:]  # as many accesses and instructions on both: no paths told apart
    a = {"instrs": same, "cfg": aot._cfg_loops(same, aot._sass_successors(same))}
    assert aot.tile_arms(a, frozenset(range(1, 11)), 1) is None


def test_summary_table_spans_each_launch_over_calls_at_aligned_and_odd_sizes():
    """The docs' table of the collectives' launches (`--summary`): per target and codec, each
    launch's % of copy bandwidth over its calls, aligned / odd, as lowest (down) - highest (up);
    one figure where they meet, "-" where the rows have none; plain launches left out."""
    aot = _aot_module()
    row = {"ok": True, "target": "sm_90", "codec": "int4", "collective": "all_reduce"}
    rows = [{**row, "kernel": "reduce_tagged", "odd": False, "pct_copy_bw_bound": 56.1},
            {**row, "kernel": "reduce_tagged", "odd": False, "pct_copy_bw_bound": 69.3},
            {**row, "kernel": "reduce_tagged", "odd": True, "pct_copy_bw_bound": 65.0},
            {**row, "kernel": "compress_slots", "odd": False, "pct_copy_bw_bound": 100.0},
            {**row, "kernel": "compress", "collective": None, "odd": None, "pct_copy_bw_bound": 10.0}]
    lines = aot.summary_table(rows).splitlines()
    assert lines[0] == "| target | codec | compress | reduce, compressed out | reduce, dense out | decompress |"
    assert lines[2:] == ["| sm_90 | INT4 | 100 / - | 56-70 / 65 | - / - | - / - |"]


def test_odd_sizes_are_held_to_their_aligned_twins():
    """An odd-sized collective launch below 95% of the same launch at the aligned size is a
    problem unless an EXCEPTIONS entry names it (and then only if slower than the committed
    table); at or above it, or a plain launch, is not."""
    aot = _aot_module()
    row = {"kernel": "compress_slots", "target": "sm_80", "codec": "int8", "group_size": 128, "hadamard": True,
           "scales": "dual", "rounding": "nearest", "dtype": "bf16", "num_warps": 8, "num_stages": 1,
           "collective": "all_reduce", "world": 8, "message_mib": 16, "ok": True, "spill_bytes": 0}
    aligned = {**row, "odd": False, "numel": 1 << 20, "pct_copy_bw_bound": 100.0}
    slow = {**row, "odd": True, "numel": (1 << 20) - 1, "pct_copy_bw_bound": 90.0}  # above sm_80's floor
    assert len(aot.check_floors([aligned, slow])) == 1 and "aligned size" in aot.check_floors([aligned, slow])[0]
    assert aot.check_floors([aligned, {**slow, "pct_copy_bw_bound": 99.0}]) == []
    excepted = {**slow, "collective": "reduce_scatter"}  # the entry for pieces that start off alignment
    assert aot.check_floors([{**aligned, "collective": "reduce_scatter"}, excepted]) == []
    assert len(aot.check_floors([{**aligned, "collective": "reduce_scatter"}, excepted],
                                [{**excepted, "pct_copy_bw_bound": 97.0}])) == 1


#: A tagged reduce as ptxas lays it out for sm_80: a tile loop (1..12) with the loop over ranks
#: (2..5) inside, each left by a predicated CALL.REL.NOINC to the code after it (which never
#: returns), a warp-divergence fallback (BRA.DIV, 14..15) and a slow-path subroutine (16..17).
_SM80_REDUCE = [
    (0x00, "MOV R0, RZ"),
    (0x10, "LDG.E.128 R4, [R2.64]"),          # tile loop header: the first rank's codes, 16 B a thread
    (0x20, "LDG.E.128 R4, [R2.64]"),          # rank loop header: another rank's codes
    (0x30, "FADD R5, R5, R4"),
    (0x40, "@!P4 CALL.REL.NOINC 0x60"),       # the rank loop's exit
    (0x50, "BRA 0x20"),                       # rank loop latch
    (0x60, "BSYNC B1"),
    (0x70, "BRA.DIV ~URZ, 0xe0"),             # a diverged warp's fallback: not taken
    (0x80, "SHFL.BFLY PT, R7, R5, 0x1, 0x1f"),
    (0x90, "CALL.REL.NOINC 0x100"),           # a slow path: returns
    (0xa0, "STG.E.128 [R6.64], R8"),          # the tile's output, 16 B a thread
    (0xb0, "@P1 CALL.REL.NOINC 0xd0"),        # the tile loop's exit
    (0xc0, "BRA 0x10"),                       # tile loop latch
    (0xd0, "EXIT"),
    (0xe0, "CALL.REL.NOINC 0x100"),           # the fallback
    (0xf0, "BRA 0xa0"),
    (0x100, "FFMA R1, R1, R1, R1"),           # the subroutine
    (0x110, "RET.REL.NODEC R20 0x0"),
]


def _old_calls(instrs):
    """The model's former reading: every CALL returns."""
    return {i: True for i, (_, text) in enumerate(instrs) if " CALL" in f" {text}"}


def _reduce_row(aot, sass, programs=2, tiles=8, ranks=2):
    """A tagged reduce's row from its SASS: 8 tiles of one warp, each reading `ranks` ranks' 16-byte
    vectors (the first before the loop over ranks) and writing one (the bytes the launch must move:
    (ranks + 1) x 16 B x 32 lanes a tile)."""
    a = {"instrs": sass, "cfg": aot._cfg_loops(sass, aot._sass_successors(sass))}
    w = aot.launch_weights(a, "reduce_tagged", programs=programs, tiles=tiles, slots=ranks, ranks=ranks)
    moved = aot.loop_bytes(a, w, "reduce_tagged", num_warps=1, lanes=32)
    return a, {"target": "sm_80", "loop_bytes_ratio": round(moved / (tiles * (ranks + 1) * 16 * 32), 3)}


def test_a_call_to_code_that_does_not_return_is_a_branch(monkeypatch):
    """ptxas ends sm_80 loops with a predicated CALL.REL.NOINC to the code after the loop, which
    never returns: a conditional branch (taken: its target; not taken: the next instruction), so
    the whole tile loop is reached and the loop over ranks sits inside it. A CALL to a subroutine
    returns, a BRA.DIV's fallback is not taken. The former reading (every CALL returns) took the
    loop over ranks for the tile loop; the bytes its loads and stores move per tile against what
    the launch must move (`model_misreads`) say so."""
    aot = _aot_module()
    succ = aot._sass_successors(_SM80_REDUCE)
    assert succ[4] == [5, 6] and succ[11] == [12, 13] and succ[9] == [10] and succ[7] == [8] and succ[15] == [10]
    a, row = _reduce_row(aot, _SM80_REDUCE)
    assert a["cfg"]["loops"] == [(1, list(range(1, 13))), (2, [2, 3, 4, 5])]
    assert a["cfg"]["reached"] == list(range(14))  # neither the fallback nor the subroutine
    assert aot.loop_nest(a, "reduce_tagged")["tile"] == 1 and aot.loop_nest(a, "reduce_tagged")["rank"] == 2
    assert row["loop_bytes_ratio"] == 1.0 and aot.model_misreads(row) == []
    slow = aot._slow_calls(_SM80_REDUCE, [(i, 1) for i in range(1, 13)])
    assert slow == {"slow_calls_per_tile": 1, "slow_instr_per_tile": 2}  # the loop exits are no slow paths

    monkeypatch.setattr(aot, "_sass_calls", _old_calls)
    a, row = _reduce_row(aot, _SM80_REDUCE)
    assert a["cfg"]["loops"] == [(2, [2, 3, 4, 5])] and aot.loop_nest(a, "reduce_tagged")["tile"] == 2
    assert row["loop_bytes_ratio"] == round(1 / 3, 3)
    assert "misread" in " ".join(aot.model_misreads(row))
    assert aot.model_misreads({**row, "target": "gfx942"}) == []  # the bytes are NVIDIA's check


#: A slotted compress as ptxas could lay it out for sm_80: each slot's tag (1..3), then the tile
#: loop (4..15) whose first load is the slot lookup's, with an inner loop (5..9) left by a
#: predicated CALL.REL.NOINC.
_SM80_SLOTTED = [
    (0x00, "MOV R0, RZ"),
    (0x10, "LDG.E.64 R2, [R4.64]"),           # a slot's descriptor (the tag loop)
    (0x20, "STG.E [R6.64], R3"),              # its tag
    (0x30, "@P0 BRA 0x10"),
    (0x40, "LDG.E.64 R8, [R4.64+0x50]"),      # tile loop header: the slot lookup
    (0x50, "LDG.E.128 R12, [R10.64]"),        # an inner loop
    (0x60, "FMUL R12, R12, R12"),
    (0x70, "FMUL R13, R13, R13"),
    (0x80, "@!P4 CALL.REL.NOINC 0xa0"),
    (0x90, "BRA 0x50"),
    (0xa0, "BSYNC B0"),
    (0xb0, "F2FP.BF16.F32.PACK_AB R16, R12, R13"),
    (0xc0, "F2FP.BF16.F32.PACK_AB R17, R12, R13"),
    (0xd0, "STG.E.128 [R14.64], R16"),
    (0xe0, "@P1 CALL.REL.NOINC 0x100"),
    (0xf0, "BRA 0x40"),
    (0x100, "EXIT"),
]


def test_the_tile_loop_holds_the_slot_lookup(monkeypatch):
    """In a slotted kernel the tile loop the model counts holds the descriptor loads of the
    per-tile slot lookup (`desc_in_tile_loop`); read with every CALL returning, the tile loop's
    end is unreachable, the inner loop is taken for it and the check fails."""
    aot = _aot_module()

    def check():
        a = {"instrs": _SM80_SLOTTED, "cfg": aot._cfg_loops(_SM80_SLOTTED, aot._sass_successors(_SM80_SLOTTED)),
             "desc_loads": {"all": [1, 4], "tile": [4]}}
        return aot.loop_nest(a, "compress_slots")["tile"], aot.desc_in_tile_loop(a, "compress_slots")

    assert check() == (4, True)
    assert aot.model_misreads({"target": "sm_80", "desc_in_tile_loop": True}) == []
    monkeypatch.setattr(aot, "_sass_calls", _old_calls)
    assert check() == (5, False)
    assert "descriptor" in " ".join(aot.model_misreads({"target": "sm_80", "desc_in_tile_loop": False}))


def test_the_launches_are_those_the_library_makes_for_the_call(monkeypatch):
    """The model counts the launches the library's own `Call` and plan make for a call
    (`check_launches`): a 16 MiB all_gather runs 2 pipeline slices, its depth taken from its
    largest tensor (the output). Taken from the input shard, as the model did, it was 1 slice."""
    import torch

    from taco_triton.collectives import _call, _plan
    from taco_triton.config import CompressionConfig

    aot = _aot_module()
    gpu = aot.TARGETS["sm_90"]
    hv = aot.HotVariant("all_gather", 8, 16, False, CompressionConfig())
    launches = aot.hot_launches(hv, gpu)
    assert [(x["slice"], x["kernel"]) for x in launches] == [
        (0, "compress_slots"), (0, "decompress_slots"), (1, "compress_slots"), (1, "decompress_slots")]
    assert aot.check_launches(hv, launches) == []
    for c in ("all_reduce", "reduce_scatter"):
        other = aot.HotVariant(c, 4, 16, True, CompressionConfig())
        assert aot.check_launches(other, aot.hot_launches(other, gpu)) == []

    def input_depth_plan(hv, device=torch.device("meta")):  # the former model: depth from the input
        call, shape, tensors = aot.library_call(hv, device)
        src, dst, _ = shape.flats(tensors)
        call.depth = _call.depth(src.numel() * src.element_size(), "auto")
        chunks, m = shape.chunks(src, dst, call.p)
        return _plan.Plan(call, shape, chunks, device, m), src, dst

    monkeypatch.setattr(aot, "hot_plan", input_depth_plan)
    problems = aot.check_launches(hv, aot.hot_launches(hv, gpu))
    assert len(problems) == 1 and "2 slices" in problems[0], problems
    assert "launches" in " ".join(aot.model_misreads({"target": "sm_90", "launch_check": problems[0]}))


def _aot_module():
    """bench/aot.py imported here for its pure functions. Importing it drops TRITON_INTERPRET (the
    tool compiles), which this process still needs: it is put back."""
    interpret = os.environ.get("TRITON_INTERPRET")
    try:
        return load_script(ROOT / "bench" / "aot.py", "taco_bench_aot")
    finally:
        if interpret is not None:
            os.environ["TRITON_INTERPRET"] = interpret


def test_amd_analysis_sees_a_loop_whose_label_carries_a_comment():
    """LLVM writes loop headers as `.LBB0_1:  ; %loop`: the label must still close the loop, or
    the loop body is missed and the instructions per element come out far too low."""
    from types import SimpleNamespace

    aot = _aot_module()
    asm = "\n".join([
        "\ts_load_dwordx2 s[0:1], s[0:1], 0x0",
        "\ts_mov_b32 s2, 0",
        ".LBB0_1:                                ; %loop",
        "\t\t\t\t\t\t; =>This Inner Loop Header: Depth=1",
        "\tglobal_load_dword v1, v0, s[0:1]",
        "\tv_add_f32_e32 v1, v1, v1          ; doubled",
        "\tglobal_store_dword v0, v1, s[0:1]",
        "\ts_add_i32 s2, s2, 1",
        "\ts_cmp_lt_i32 s2, 8",
        "\ts_cbranch_scc1 .LBB0_1",
        "\ts_endpgm",
        ".Lfunc_end0:",
        "\t.vgpr_count:     2",
    ])
    kernel = SimpleNamespace(asm={"amdgcn": asm}, metadata=SimpleNamespace(shared=0))
    a = aot.analyze_hip(kernel, aot.TARGETS["gfx942"])
    assert a["loops"] == 1
    assert a["instr_per_tile"] == 6  # the loop body: load, add, store, counter, compare, branch
    assert a["static_instr"] == 9 and a["regs"] == 2


_DOTS_SCRIPT = """
import json, sys
sys.path.insert(0, {root!r})
from tests.helpers import load_script
from taco_triton.config import CompressionConfig
aot = load_script(__import__("pathlib").Path({root!r}) / "bench" / "aot.py", "taco_bench_aot")
gpu = aot.TARGETS["sm_90"]
v = aot.Variant("reduce_dense", CompressionConfig(), "fp32", 4, 2)
print(json.dumps(aot.dot_precisions(aot.compile_launch(aot.build_launch(v, gpu), gpu).asm["ttir"])))
"""


def test_fp32_transform_operands_are_split_into_exact_bf16_pieces_on_hopper():
    """The reduce to dense transforms FP32 sums. On NVIDIA a dot of FP32 operands without an
    input precision is one TF32 pass (operands rounded to 10 mantissa bits, far outside
    `bounds.U_DOT["gpu"]`); the kernels split them into three bf16 pieces instead (exact, see
    `_common._dot`). Its sm_90 build (one compile) must hold three bf16 dots and no FP32 one."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _DOTS_SCRIPT.format(root=str(ROOT))], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    dots = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [t for t, _ in dots] == ["bf16"] * 3, dots


def test_dot_precision_parser_reads_default_and_explicit_precisions():
    aot = _aot_module()
    ttir = "\n".join([
        "%y = tt.dot %a, %b, %c, inputPrecision = tf32 : tensor<64x128xf32> * tensor<128x128xf32> -> tensor<64x128xf32>",
        "%z = tt.dot %a, %b, %c, inputPrecision = tf32x3 : tensor<64x128xf32> * tensor<128x128xf32> -> tensor<64x128xf32>",
        "%w = tt.dot %a, %b, %c : tensor<64x128xbf16> * tensor<128x128xbf16> -> tensor<64x128xf32>",
    ])
    assert aot.dot_precisions(ttir) == [("f32", "tf32"), ("f32", "tf32x3"), ("bf16", "ieee")]


def test_odd_sizes_are_modelled_as_the_aligned_main_launch_and_its_tail():
    """A compress or decompress of a size that is not a multiple of 16 runs as two launches
    (`kernels._tile.aligned_split`); the model builds both and weighs each loop by its tiles."""
    from taco_triton.config import CompressionConfig

    aot = _aot_module()
    gpu = aot.TARGETS["sm_90"]
    for kernel in ("compress", "decompress"):
        main, tail = aot.build_launches(aot.Variant(kernel, CompressionConfig(), "bf16", 4, 2, aot.ODD_NUMEL), gpu)
        assert main.args["numel"] == aot.ODD_NUMEL // 8192 * 8192 and main.args["numel"] % 16 == 0 and not main.meta["TAIL"]
        assert tail.args["numel"] == aot.ODD_NUMEL and tail.meta["TAIL"] and tail.n_tiles == 1
        assert len(aot.build_launches(aot.Variant(kernel, CompressionConfig(), "bf16", 4, 2), gpu)) == 1
    a = {"instr_per_tile": 100.0, "slow_instr_per_tile": 0.0, "mma": [((8, "16"), 2.0)], "static_instr": 50,
         "spill_bytes": 0, "slow_calls_per_tile": 1, "regs": 128}
    b = {**a, "instr_per_tile": 500.0, "slow_instr_per_tile": 40.0, "spill_bytes": 8, "slow_calls_per_tile": 3,
         "regs": 200}
    got = aot.combine([(3, a), (1, b)])
    assert got["instr_per_tile"] == 200.0 and got["slow_instr_per_tile"] == 10.0
    assert got["mma"] == [((8, "16"), 1.5), ((8, "16"), 0.5)] and got["static_instr"] == 100
    assert got["spill_bytes"] == 8 and got["slow_calls_per_tile"] == 3 and got["regs"] == 128
    assert aot.combine([(5, a)]) is a


def _row(**kw):
    r = {"kernel": "compress", "target": "sm_90", "codec": "fp8_e4m3", "group_size": 128, "hadamard": True,
         "scales": "dual", "rounding": "nearest", "dtype": "bf16", "num_warps": 4, "num_stages": 2, "numel": 1 << 26,
         "ok": True, "error": "", "spill_bytes": 0, "pct_copy_bw_bound": 100.0}
    return {**r, **kw}


def test_floor_check_names_every_kind_of_failure(monkeypatch):
    aot = _aot_module()
    monkeypatch.setattr(aot, "EXCEPTIONS", (({"target": "sm_90", "rounding": "stochastic"}, "random bits"),))
    fine = _row()
    excepted = _row(rounding="stochastic", pct_copy_bw_bound=50.0)
    unnamed = _row(group_size=256, pct_copy_bw_bound=84.9)
    amd = _row(target="gfx942", pct_copy_bw_bound=70.0)  # exactly at its floor
    spilled = _row(target="sm_80", spill_bytes=16)
    broken = _row(target="sm_89", ok=False, error="CompilationError: x")
    problems = aot.check_floors([fine, excepted, unnamed, amd, spilled, broken])
    assert len(problems) == 3, problems
    assert "84.9% < floor 85.0%" in problems[0] and "/256/" in problems[0]
    assert "spills 16 B and no EXCEPTIONS entry" in problems[1] and "did not compile" in problems[2]
    # an entry excuses a spill only with a reason that speaks of it
    spills = [_row(rounding="stochastic", spill_bytes=8, pct_copy_bw_bound=90.0)]
    assert len(aot.check_floors(spills)) == 1 and "gives a spill's reason" in aot.check_floors(spills)[0]
    monkeypatch.setattr(aot, "EXCEPTIONS", aot.EXCEPTIONS + (({"rounding": "stochastic"}, "spills 8 B: registers"),))
    assert aot.check_floors(spills) == []
    # an excepted launch may not get slower than the committed table
    slower = aot.check_floors([excepted], baseline=[{**excepted, "pct_copy_bw_bound": 50.1}])
    assert slower == [slower[0]] and "50.0% < 50.1% of the committed table" in slower[0]
    assert aot.check_floors([excepted], baseline=[{**excepted, "pct_copy_bw_bound": 49.0}]) == []
    table = aot.exceptions_table([fine, excepted, _row(rounding="stochastic", pct_copy_bw_bound=60.0)])
    assert "| target=sm_90, rounding=stochastic | 2 | 50.0 - 60.0 | - | random bits |" in table


@pytest.fixture(scope="module")
def quick_rows(tmp_path_factory):
    out = tmp_path_factory.mktemp("aot") / "quick.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "aot.py"), "--quick", "--targets", "sm_90,gfx942",
                           "--json", str(out)], env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_quick_launches_meet_the_floors_on_hopper_and_mi300(quick_rows):
    """Every `--quick` launch on sm_90 (>= 85% of copy bandwidth) and gfx942 (>= 70%), by the
    model, or an `EXCEPTIONS` entry (README: "Below the floor") names it and it is no slower
    than the committed table bench/results/aot_quick.csv."""
    import pandas as pd

    aot = _aot_module()
    assert {r["target"] for r in quick_rows} == {"sm_90", "gfx942"}
    baseline = json.loads(pd.read_csv(ROOT / "bench" / "results" / "aot_quick.csv").to_json(orient="records"))
    problems = aot.check_floors(quick_rows, baseline)
    assert not problems, "\n".join(problems)


def test_amd_instructions_are_split_into_the_scheduler_classes():
    """gfx942's CU issues each class (VALU incl. MFMA, SALU/SMEM, VMEM, LDS, branch) to its own
    unit, one per class per SIMD turn and one per wave per turn: the model counts the loop body by
    class and its issue cost is the largest class with enough waves, the whole count with one."""
    from types import SimpleNamespace

    aot = _aot_module()
    asm = "\n".join([
        "\ts_mov_b32 s2, 0",
        ".LBB0_1:                                ; %loop",
        "\tglobal_load_dwordx4 v[0:3], v8, s[0:1]",
        "\ts_waitcnt vmcnt(0)",
        "\tv_pk_mul_f32 v[0:1], v[0:1], v[2:3]",
        "\tv_mfma_f32_32x32x8_bf16 v[0:15], v[0:1], v[2:3], 0",
        "\tv_cvt_pk_fp8_f32 v4, v0, v1",
        "\tds_write_b32 v8, v4",
        "\ts_nop 1",
        "\tds_read_b32 v5, v8",
        "\tbuffer_store_dword v5, v8, s[4:7], 0 offen",
        "\ts_load_dword s9, s[0:1], 0x10",
        "\ts_add_i32 s2, s2, 1",
        "\ts_cmp_lt_i32 s2, 8",
        "\ts_cbranch_scc1 .LBB0_1",
        "\ts_endpgm",
        ".Lfunc_end0:",
        "\t.vgpr_count:     16",
    ])
    kernel = SimpleNamespace(asm={"amdgcn": asm}, metadata=SimpleNamespace(shared=0))
    a = aot.analyze_hip(kernel, aot.TARGETS["gfx942"])
    assert a["instr_per_tile"] == 13
    assert a["classes"] == {"valu": 3, "salu": 3, "vmem": 2, "lds": 2, "branch": 1, "internal": 2}
    gpu = aot.TARGETS["gfx942"]  # 32 waves per CU: occupancy 1/8 is one wave per SIMD
    per_class = {c: float(n) for c, n in a["classes"].items()}
    assert aot.amd_issue_per_elem(per_class, 1 / 8, gpu) == (13.0, "waves")  # one wave: all serial
    assert aot.amd_issue_per_elem(per_class, 2 / 8, gpu) == (6.5, "waves")
    assert aot.amd_issue_per_elem(per_class, 1.0, gpu) == (3.0, "VALU")      # 8 waves: the largest class
    assert aot.amd_issue_per_elem({**per_class, "salu": 5.0}, 1.0, gpu) == (5.0, "SALU")


def test_back_edges_to_one_loop_header_are_one_loop():
    """AMDGCN often ends a loop body in several places, each branching back to the same latch
    block: that is one loop (each instruction once per tile), not loops nested in each other
    (which would count the first part RANKS times)."""
    from types import SimpleNamespace

    aot = _aot_module()
    asm = "\n".join([
        "\ts_mov_b32 s2, 0",
        ".LBB0_1:                                ; %latch",
        "\ts_add_i32 s2, s2, 1",
        "\tv_add_f32_e32 v1, v1, v1",
        "\ts_cbranch_execz .LBB0_1",
        "\tv_mul_f32_e32 v1, v1, v1",
        "\ts_cmp_lt_i32 s2, 8",
        "\ts_cbranch_scc1 .LBB0_1",
        "\ts_endpgm",
        ".Lfunc_end0:",
    ])
    kernel = SimpleNamespace(asm={"amdgcn": asm}, metadata=SimpleNamespace(shared=0))
    a = aot.analyze_hip(kernel, aot.TARGETS["gfx942"])
    assert a["instr_per_tile"] == 6  # add, add, branch, mul, compare, branch: each once
    assert a["classes"] == {"valu": 2, "salu": 2, "vmem": 0, "lds": 0, "branch": 2, "internal": 0}


def test_launch_choices_are_the_library_heuristic_of_the_target_family():
    """The model compiles what the library launches: on AMD ("hip") the heuristic's 8 waves, on
    NVIDIA its 4 warps (8 with stochastic rounding); both reduce rows are the library's "reduce"
    launch, sub-byte rules included."""
    import torch

    from taco_triton.config import CompressionConfig
    from taco_triton.kernels._launch import heuristic

    aot = _aot_module()
    cfg = CompressionConfig()
    assert heuristic("compress", cfg) == {"num_warps": 4, "num_stages": 2}
    assert heuristic("compress", cfg.replace(rounding="stochastic")) == {"num_warps": 8, "num_stages": 2}
    assert heuristic("decompress", cfg, "hip") == {"num_warps": 8, "num_stages": 2}
    for kernel in aot.KERNELS:
        assert aot.launch_choices(kernel, cfg, torch.bfloat16, "hip")[0]["num_warps"] == 8
        assert aot.launch_choices(kernel, cfg, torch.bfloat16, "cuda")[0]["num_warps"] == 4
    int6 = CompressionConfig(codec="int6", group_size=512)  # a "reduce" rule: 8 warps
    assert aot.launch_choices("reduce_dense", int6, torch.bfloat16)[0] == heuristic("reduce", int6)
    assert {v.num_warps for v in aot.variants("ci", "hip") if v.config == cfg} >= {8}
