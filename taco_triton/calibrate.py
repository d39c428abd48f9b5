"""Data-driven choice of a config: measure every candidate on sample tensors, pick the best.

This is TACO's "data-driven reshaping" made explicit: instead of fixing the group size and
transform, measure them on the tensors that will actually be communicated.
"""
from __future__ import annotations

import itertools
import math
import numbers
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from .config import CODECS, GROUP_SIZES, SUPERBLOCK_ELEMS, CompressionConfig


@dataclass(frozen=True)
class CalibrationResult:
    """The chosen config and the table of every measurement behind the choice.

    `table` (pandas DataFrame) has one row per candidate: codec, group_size, hadamard,
    bytes_per_element (wire bytes incl. scales, over the samples), ratio_vs_bf16, rel_l2_mean,
    rel_l2_max (relative L2 error ||x - x'|| / ||x|| over the samples), rate_bytes_per_element
    (the config's wire bytes per element on whole super-blocks, what the budget is compared
    with), within_budget, chosen.
    """

    config: CompressionConfig
    table: "object"


def default_candidates(base: CompressionConfig | None = None) -> list[CompressionConfig]:
    """Every codec (8-, 6- and 4-bit) x group size x Hadamard on/off, other fields from `base`."""
    base = base or CompressionConfig()
    return [
        base.replace(codec=c, group_size=g, hadamard=h)
        for c, g, h in itertools.product(CODECS, GROUP_SIZES, (False, True))
    ]


def check_budget(name: str, value, what: str = "") -> float:
    """`value` as a float if it is a positive finite real number; ValueError naming `name` otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (
            math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive number{what}, got {value!r} (NaN and infinity are not budgets)")
    return float(value)


def _as_samples(samples) -> list[torch.Tensor]:
    """The samples as a list; one tensor is one sample (iterating it would make every row, or
    every element, a sample of its own)."""
    samples = [samples] if isinstance(samples, torch.Tensor) else list(samples)
    if not samples:
        raise ValueError("calibrate needs at least one sample tensor")
    for i, s in enumerate(samples):
        if not isinstance(s, torch.Tensor):
            raise TypeError(f"calibrate sample {i} must be a torch.Tensor, got {type(s).__name__}")
        if s.numel() == 0:
            raise ValueError(f"calibrate sample {i} is empty (shape {tuple(s.shape)})")
        if not bool(torch.isfinite(s).all()):
            raise ValueError(f"calibrate sample {i} (shape {tuple(s.shape)}) holds NaN/Inf")
    return samples


def as_sent(cfg: CompressionConfig, call: int) -> CompressionConfig:
    """`cfg` as the `call`-th message would be compressed: stochastic rounding draws a fresh
    seed per message (the collectives salt it per call and rank), so each sample is measured
    with its own seed, never all with one."""
    if not cfg.stochastic:
        return cfg
    return cfg.replace(seed=(cfg.seed * 1_000_003 + call + 0x9E3779B9) % 2**31)


def relative_l2(x: torch.Tensor, y: torch.Tensor) -> float:
    """||x - y|| / ||x|| in float64 (0 when both are zero)."""
    x64, y64 = x.double(), y.double()
    den = float(x64.norm())
    num = float((x64 - y64).norm())
    return num / den if den > 0 else (0.0 if num == 0 else float("inf"))


def calibrate(
    samples: Iterable[torch.Tensor],
    candidates: Sequence[CompressionConfig] | None = None,
    max_bytes_per_element: float = 1.0625,
    *,
    max_error: float | None = None,
    backend: str = "auto",
) -> CalibrationResult:
    """Pick a config for these samples: the lowest error within a byte budget or, with
    `max_error`, the fewest bytes within an error budget (both budgets apply together).

    Every candidate is measured as it will run: with its own scale layout and rounding (a
    stochastic candidate with a different seed per sample, as successive messages get).

    Args:
        samples: tensors like the ones that will be communicated (finite values): a sequence of
            tensors, or one tensor (one sample).
        candidates: configs to consider; default `default_candidates()` (5 codecs x 5 group
            sizes x Hadamard on/off, with the default config's scales and rounding: pass
            `default_candidates(base)` to calibrate around another base config).
        max_bytes_per_element: budget in wire bytes per element, scales included, compared with
            each config's rate on whole super-blocks of 4096 elements: C/G + 1/G + 4/4096 bytes
            ("dual" scales; C = G bits / 8 code bytes per group) or C/G + 8/G ("taco_fp32x2").
            The default 1.0625 (ratio 1.88x vs bf16) admits all dual configs, whatever the
            samples' sizes (a sample smaller than a super-block pays its FP32 scale over fewer
            elements; `bytes_per_element` shows that).
        max_error: budget on the worst relative L2 error over the samples (`rel_l2_max`), e.g.
            0.025. Given, the choice is the config with the fewest bytes per element (its rate)
            within both budgets, ties going to the lower mean error; None (default) picks the
            lowest mean error within the byte budget.
        backend: as in `taco_triton.compress`.

    Returns:
        `CalibrationResult` with the chosen config and the whole measurement table.

    Raises:
        ValueError: no candidate meets the budgets (naming the closest one); a budget that is
            not a positive finite number; an empty or non-finite sample.
        TypeError: a sample that is not a tensor.

    Example:
        >>> res = calibrate([torch.randn(64, 384)])
        >>> res.config.codec, res.table.shape[0]
        ('int8', 50)
        >>> calibrate([torch.randn(64, 384)], max_error=0.05).config.codec
        'int6'
    """
    import pandas as pd

    from .codec import compress, decompress

    if max_error is not None:
        check_budget("max_error", max_error, " (a relative L2 error)")
    check_budget("max_bytes_per_element", max_bytes_per_element)
    samples = _as_samples(samples)
    candidates = list(candidates) if candidates is not None else default_candidates()
    if not candidates:
        raise ValueError("calibrate needs at least one candidate config")
    rows = []
    total = sum(s.numel() for s in samples)
    for cfg in candidates:
        errs, nbytes = [], 0
        for i, s in enumerate(samples):
            c = compress(s, as_sent(cfg, i), backend=backend)
            nbytes += c.nbytes
            errs.append(relative_l2(s, decompress(c, backend=backend)))
        bpe = nbytes / max(total, 1)
        rate = cfg.bytes_per_element(SUPERBLOCK_ELEMS)
        rows.append(dict(
            codec=cfg.codec, group_size=cfg.group_size, hadamard=cfg.hadamard, scales=cfg.scales,
            bytes_per_element=bpe, ratio_vs_bf16=2 / bpe if bpe else float("nan"),
            rel_l2_mean=sum(errs) / len(errs), rel_l2_max=max(errs),
            rate_bytes_per_element=rate, within_budget=rate <= max_bytes_per_element, config=cfg,
        ))
    table = pd.DataFrame(rows)
    if max_error is not None:
        table["within_budget"] &= table.rel_l2_max <= max_error
    fit = table[table.within_budget]
    if fit.empty:
        cheapest = table.loc[table.rate_bytes_per_element.idxmin()]
        msg = (f"no candidate fits max_bytes_per_element={max_bytes_per_element}; the cheapest needs "
               f"{cheapest.rate_bytes_per_element:.4f} ({cheapest.codec}, G={cheapest.group_size})")
        if max_error is not None:
            best = table.loc[table.rel_l2_max.idxmin()]
            msg = (f"no candidate fits max_error={max_error} with max_bytes_per_element={max_bytes_per_element}; "
                   f"the most accurate ({best.codec}, G={best.group_size}, hadamard={best.hadamard}) has worst "
                   f"relative L2 error {best.rel_l2_max:.4g} at {best.rate_bytes_per_element:.4f} bytes per element")
        raise ValueError(msg)
    order = ["rel_l2_mean", "bytes_per_element"] if max_error is None else ["rate_bytes_per_element", "rel_l2_mean"]
    best = fit.sort_values(order, kind="stable").index[0]
    table["chosen"] = table.index == best
    return CalibrationResult(config=table.loc[best, "config"], table=table.drop(columns="config"))
