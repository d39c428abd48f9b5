"""What the demo prints around its tables: the Hadamard note under section 1 (from the table's own
measurements) and the training summary of section 5 (`train_gpt.summarize`: none first, a legend)."""
from __future__ import annotations

import re

import torch

from taco_triton import demo
from taco_triton.examples import train_gpt


def test_the_hadamard_note_states_what_the_table_measured():
    """Before: section 1 showed FP8 with the Hadamard (the default) at a higher error than without
    and said nothing. The note's figures are the table's, and its words follow them."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 384, generator=g)
    x[:, ::97] *= 150.0  # outlier channels: the integer codes need the Hadamard here
    table = demo.codec_table({"outliers": x.bfloat16(), "dense": torch.randn(64, 384, generator=g).bfloat16()})
    note = demo.hadamard_note(table)
    assert len(note.splitlines()) == 2 and "TACO paper" in note

    def mean(codec, hadamard):
        row = table[(table.codec == codec) & (table.G == 128) & (table.hadamard == hadamard) & (table.scales == "dual")]
        return float(row["rel_l2_%_mean"].iloc[0])

    fp8 = re.search(r"FP8 E4M3 errs (less|more) with it here \(mean ([\d.]+)% with, ([\d.]+)% without\)", note)
    int8 = re.search(r"INT8 (less|more) \(([\d.]+)% vs ([\d.]+)%\)", note)
    for m, codec in ((fp8, "fp8_e4m3"), (int8, "int8")):
        assert m, note
        with_h, without = mean(codec, True), mean(codec, False)
        assert (float(m.group(2)), float(m.group(3))) == (round(with_h, 3), round(without, 3))
        assert m.group(1) == ("less" if with_h < without else "more")
    assert int8.group(1) == "less"  # outlier channels: INT8 without the Hadamard loses them


def test_the_training_summary_lists_none_first_then_the_modes_as_given():
    """Before: pandas' groupby sorted the modes (none last)."""
    rows = [{"mode": m, "step": s, "val_loss": 2.0 + i / 10, "val_loss_native": 2.0, "wire_bytes": 1 << 20,
             "step_ms": 1.0} for i, m in enumerate(["int8", "fp8", "none", "int6"]) for s in (1, 2)]
    _, summary = train_gpt.summarize(rows)
    assert list(summary.index) == ["none", "int8", "fp8", "int6"]
    assert summary.loc["int8", "val_loss_vs_none_%"] < 0 < summary.loc["int6", "val_loss_vs_none_%"]
    for column in ("final_val_loss", "final_val_loss_native", "val_loss_vs_none_%", "wire_vs_none"):
        assert column in summary.columns and f"{column}:" in train_gpt.SUMMARY_LEGEND
