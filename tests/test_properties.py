"""Property tests: error bounds derived from the format hold for every codec x G x Hadamard x dtype.

Inputs are drawn by hypothesis: kind (dense, near-zero, heavy tails, outlier channels, zero
groups), magnitude from 1e-30 to the dtype's maximum, odd shapes. The bounds (taco_triton.bounds)
come from the code grid's half-spacing, the subnormal spacing floor, INT8's half step and the
scales; nothing is fitted. Profiles: HYPOTHESIS_PROFILE=fast (default) or thorough.
"""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import taco_triton as taco
from taco_triton import bounds

from .helpers import DTYPES, U_DOT_HERE, all_configs, cfg_id, make_input

KINDS = ["dense", "near_zero", "heavy", "outliers", "zero_groups"]


@st.composite
def tensors(draw):
    dtype = DTYPES[draw(st.sampled_from(list(DTYPES)))]
    rows = draw(st.integers(1, 4))
    cols = draw(st.sampled_from([1, 7, 100, 384, 513, 1000]))
    kind = draw(st.sampled_from(KINDS))
    max_exp = math.floor(math.log10(torch.finfo(dtype).max))
    exp10 = draw(st.integers(-30, max_exp))
    at_max = draw(st.booleans()) and exp10 == max_exp
    magnitude = torch.finfo(dtype).max if at_max else 10.0**exp10
    return make_input(kind, (rows, cols), dtype, seed=draw(st.integers(0, 2**16)), magnitude=magnitude)


def check_bounds(x: torch.Tensor, cfg: taco.CompressionConfig, backend: str) -> None:
    c = taco.compress(x, cfg, backend=backend)
    y, y_dec, bound = bounds.transformed_error_bound(x, c, U_DOT_HERE)
    err = (y_dec - y).abs()
    worst = float((err / bound.clamp_min(1e-300)).max()) if err.numel() else 0.0
    assert bool((err <= bound).all()), f"transformed-domain error exceeds the format bound ({worst:.4f}x)"
    sigma, lo, hi = bounds.scale_bounds(x, c, U_DOT_HERE)
    assert bool(((sigma >= lo) & (sigma <= hi)).all()), "a group scale outside the range the format allows"
    out = taco.decompress(c, backend=backend)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert bool(torch.isfinite(out).all())
    l2 = float((out.double() - x.double()).norm())
    assert l2 <= bounds.l2_error_bound(x, c, x.dtype, U_DOT_HERE)


@pytest.mark.parametrize("cfg", all_configs(), ids=cfg_id)
@given(x=tensors())
def test_bounds_reference(cfg, x):
    check_bounds(x, cfg, "torch")


@pytest.mark.parametrize(
    "cfg",
    all_configs() + [taco.CompressionConfig(scales="taco_fp32x2"), taco.CompressionConfig(rounding="stochastic", seed=5),
                     taco.CompressionConfig(codec="int8", rounding="stochastic", seed=5)],
    ids=cfg_id,
)
@settings(max_examples=3)
@given(x=tensors())
def test_bounds_triton(cfg, x):
    check_bounds(x, cfg, "triton")


@pytest.mark.parametrize("cfg", [taco.CompressionConfig(scales="taco_fp32x2"), taco.CompressionConfig(rounding="stochastic", seed=1),
                                 taco.CompressionConfig(codec="int8", group_size=32, rounding="stochastic")], ids=cfg_id)
@given(x=tensors())
def test_bounds_reference_other_modes(cfg, x):
    check_bounds(x, cfg, "torch")
