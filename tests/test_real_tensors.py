"""Codec error on real TP tensors of a pretrained model: the measured levels, and the goals.

The claims checked are the ones earlier measurements on these tensors and the format make, each
able to fail:
- the default dual-scale layout stays within 5% of TACO's released FP32x2 layout on every
  tensor (the design goal), at a higher compression ratio;
- every round trip is inside its format-derived L2 bound;
- INT8 with Hadamard beats FP8 with Hadamard by >= 3x on every tensor (measured: ~3.5x);
- on outlier-heavy tensors (a channel > 100x the rms) Hadamard cuts INT8's error >= 3x, and
  raises FP8's (measured: 1.3% -> 2.3%).
"""
import sys
from pathlib import Path

import pytest
import torch

import taco_triton as taco
from taco_triton import bounds
from taco_triton.realdata import model_available

pytestmark = pytest.mark.skipif(not model_available(), reason="needs the [real] extra (pretrained model)")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))


@pytest.fixture(scope="module")
def table():
    import real_tensors
    from taco_triton.realdata import capture_tp_tensors

    tensors = capture_tp_tensors(tp=4, rank=0, n_texts=16, max_tokens=64)
    df = real_tensors.measure(tensors)
    return tensors, df, df.pivot(index="tensor", columns="config", values="rel_l2")


def test_default_within_5pct_of_taco_released_layout_at_higher_ratio(table):
    _, df, wide = table
    ratio = wide["fp8_e4m3 G128 H (default)"] / wide["taco_fp32x2 (TACO released)"]
    assert float(ratio.max()) <= 1.05
    r = df.groupby("config").ratio_vs_bf16.mean()
    assert r["fp8_e4m3 G128 H (default)"] >= 1.95 > r["taco_fp32x2 (TACO released)"]


def test_round_trips_within_format_bound(table):
    tensors, _, _ = table
    import real_tensors

    for name in list(tensors)[:8]:
        xb = tensors[name].bfloat16()
        for cfg in real_tensors.CONFIGS.values():
            c = taco.compress(xb, cfg, backend="torch")
            err = float((taco.decompress(c, backend="torch").double() - xb.double()).norm())
            assert err <= bounds.l2_error_bound(xb, c, torch.bfloat16), (name, cfg)


def test_findings_2_orderings(table):
    tensors, df, wide = table
    assert bool((wide["fp8_e4m3 G128 H (default)"] >= 3 * wide["int8 G128 H"]).all())
    outliers = df.groupby("tensor").outlier_ratio.first() > 100
    assert outliers.any(), "the capture should hold outlier-channel tensors"
    w = wide[outliers]
    assert bool((w["int8 G128 noH"] >= 3 * w["int8 G128 H"]).all())
    assert bool((w["fp8_e4m3 G128 H (default)"] > w["fp8_e4m3 G128 noH"]).all())



def test_int6_beats_fp8_default_with_fewer_bytes(table):
    """INT6, G=32, Hadamard: below the FP8 default's error on every tensor at >= 2.5x vs bf16; INT4 at
    G=32 >= 3.6x (the ratios are the layout's arithmetic: 2 / (bits/8 + 1/G + 4/4096))."""
    _, df, wide = table
    assert bool((wide["int6 G32 H"] < wide["fp8_e4m3 G128 H (default)"]).all())
    r = df.groupby("config").ratio_vs_bf16.mean()
    assert r["int6 G32 H"] >= 2.5 and r["int4 G32 H"] >= 3.6
    assert r["int6 G32 H"] == pytest.approx(2 / (6 / 8 + 1 / 32 + 4 / 4096), rel=1e-3)


@pytest.fixture(scope="module")
def budget_measurement(table):
    """calibrate's measurement of the bench's candidates on the 24 tensors together, made once:
    `calibrate(samples, max_error=b)` is `choose(measure(samples, ...), max_error=b)`."""
    import real_tensors

    from taco_triton.calibrate import measure

    tensors, _, _ = table
    return measure([x.bfloat16() for x in tensors.values()], list(real_tensors.CONFIGS.values()), backend="torch")


@pytest.mark.parametrize("budget,codec", [(0.03, "int6"), (0.025, "int8"), (0.01, "int8")],
                         ids=["3%-int6", "2.5%-int8", "1%-int8"])
def test_error_budget_calibration_picks(budget_measurement, budget, codec):
    """calibrate(max_error=...) over the bench's candidates and the 24 tensors together: INT6 at
    3%, INT8 at 2.5% and 1%. INT6 G=32's worst tensor is at 2.35%, but the margin for held-out
    tensors (here mostly the spread between 24 different sites) puts its bound above 2.5%."""
    from taco_triton.calibrate import choose

    res = choose(budget_measurement, max_error=budget)
    assert res.config.codec == codec, res.table[res.table.chosen]
    row = res.table[res.table.chosen].iloc[0]
    assert row.rel_l2_max <= row.rel_l2_bound <= budget
