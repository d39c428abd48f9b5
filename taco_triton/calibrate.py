"""Data-driven choice of a config: measure every candidate on sample tensors, pick the best.

This is TACO's "data-driven reshaping" made explicit: instead of fixing the group size and
transform, measure them on the tensors that will actually be communicated.

An error budget is a promise about the tensors that will be sent, not only about the samples,
so each candidate's error is compared with a bound on held-out tensors of the same kind
(`rel_l2_bound`, the samples' worst error plus a `margin`), from two measured spreads:

- within a sample: its squared error and squared norm summed over pieces of `PIECE_ELEMS`
  elements (every group lies in one piece). With E_j, X_j per piece, R^2 = sum E / sum X, and
  d_j = E_j - R^2 X_j, a tensor of the same N pieces has R^2 within s_d / (mean X sqrt(N)) of
  the population value (the ratio estimator's standard error); a held-out tensor and the sample
  both deviate, so the bound on R^2 is R^2 + z sqrt(2) s_d / (mean X sqrt(N)).
- between samples (two or more): mean(R^2) + z sd(R^2) sqrt(1 + 1/n), the normal prediction
  bound for one more sample.

`rel_l2_bound` is the square root of the larger of the two (and never below `rel_l2_max`);
z = `HELD_OUT_Z`. Both spreads describe tensors like the samples: a source that was never
sampled (another rank, a site that behaves differently) is not covered, which is why
`CompressionPolicy` calibrates on every rank's samples.
"""
from __future__ import annotations

import itertools
import math
import numbers
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from .config import CODECS, GROUP_SIZES, SUPERBLOCK_ELEMS, CompressionConfig
from .kernels import slots

# The public names; measure, merge and choose are the steps `CompressionPolicy` runs across ranks.
__all__ = ["HELD_OUT_Z", "PIECE_ELEMS", "TABLE_COLUMNS", "CalibrationResult", "calibrate", "default_candidates"]

HELD_OUT_Z = 3.0
"""One-sided normal quantile of the held-out bound (a tensor like the samples exceeds it with
probability about 0.13% when the spreads are normal)."""
PIECE_ELEMS = max(GROUP_SIZES)
"""Elements per piece of the within-sample spread: the largest group size, so every group (and
its Hadamard block) lies in one piece."""
TABLE_COLUMNS = ["codec", "group_size", "hadamard", "scales", "rounding", "bytes_per_element", "ratio_vs_bf16",
                 "rel_l2_mean", "rel_l2_max", "rel_l2_bound", "margin", "rate_bytes_per_element", "n_samples"]
"""Columns of the public table (`CalibrationResult.table`), in order."""
# per-candidate sums and maxima that measurements of several sample sets (ranks) merge
_SUMS = ("nbytes", "numel", "n_samples", "rel_l2_sum", "r2_sum", "r2_sqsum")
_MAXES = ("rel_l2_max", "piece_bound2_max")


@dataclass(frozen=True)
class CalibrationResult:
    """The chosen config and the table of every measurement behind the choice.

    `table` (pandas DataFrame) has one row per candidate: codec, group_size, hadamard, scales,
    rounding, bytes_per_element (wire bytes incl. scales, over the samples), ratio_vs_bf16,
    rel_l2_mean, rel_l2_max (relative L2 error ||x - x'|| / ||x|| over the samples),
    rel_l2_bound (the bound on held-out tensors like the samples, what `max_error` is compared
    with; see the module docstring), margin (rel_l2_bound - rel_l2_max), rate_bytes_per_element
    (the config's wire bytes per element on whole super-blocks, what the byte budget is compared
    with), n_samples, within_budget, chosen.

    Args:
        config: the chosen config.
        table: the measurements, one row per candidate (columns above).
    """

    config: CompressionConfig
    table: "object"


def default_candidates(base: CompressionConfig | None = None) -> list[CompressionConfig]:
    """Every codec (8-, 6- and 4-bit) x group size x Hadamard on/off, other fields from `base`.

    Args:
        base: the config the other fields (scales, rounding, seed) come from; default
            `CompressionConfig()`.

    Returns:
        The 50 candidate configs, codec-major.
    """
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
    return cfg.replace(seed=slots.salt(cfg.seed, call))


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
        max_error: budget on the relative L2 error of the tensors that will be sent, e.g.
            0.025, compared with each candidate's `rel_l2_bound` (the samples' worst error plus
            the margin for held-out tensors of the same kind; see the module docstring). Given,
            the choice is the config with the fewest bytes per element (its rate) within both
            budgets, ties going to the lower mean error; None (default) picks the lowest mean
            error within the byte budget.
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
    if max_error is not None:  # checked before the measuring, which takes a while
        check_budget("max_error", max_error, " (a relative L2 error)")
    check_budget("max_bytes_per_element", max_bytes_per_element)
    samples = _as_samples(samples)
    candidates = list(candidates) if candidates is not None else default_candidates()
    return choose(measure(samples, candidates, backend=backend), max_bytes_per_element, max_error)


def _error_stats(x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(R^2, the within-sample bound on R^2 of a held-out tensor like x) for x decoded as y;
    R = ||x - y|| / ||x|| (see the module docstring)."""
    x64 = x.detach().double().flatten()
    e2, x2 = (x64 - y.detach().double().flatten()) ** 2, x64 ** 2
    norm2 = float(x2.sum())
    if norm2 == 0:
        return (0.0, 0.0) if float(e2.sum()) == 0 else (math.inf, math.inf)
    r2 = float(e2.sum()) / norm2
    piece = max(1, min(PIECE_ELEMS, x64.numel() // 8))  # at least 8 pieces where the sample allows
    n = x64.numel() // piece
    if n < 2:
        return r2, r2
    e_p, x_p = e2[: n * piece].view(n, piece).sum(1), x2[: n * piece].view(n, piece).sum(1)
    se = float((e_p - r2 * x_p).std()) / float(x_p.mean()) / math.sqrt(x64.numel() / piece)
    return r2, r2 + HELD_OUT_Z * math.sqrt(2) * se


def measure(samples, candidates: Sequence[CompressionConfig], *, backend: str = "auto"):
    """Measure every candidate on the samples, as it will run (see `calibrate`).

    Returns a pandas DataFrame, one row per candidate in order: the public columns
    (`TABLE_COLUMNS`), the candidate (`config`) and the sums and maxima that `merge` combines.
    `choose` picks from it; `calibrate` is `choose(measure(...))`.
    """
    import pandas as pd

    from .codec import compress, decompress

    samples = _as_samples(samples)
    candidates = list(candidates)
    if not candidates:
        raise ValueError("calibrate needs at least one candidate config")
    rows = []
    for cfg in candidates:
        if not isinstance(cfg, CompressionConfig):
            raise TypeError(f"calibrate candidates must be CompressionConfig, got {type(cfg).__name__}")
        row = dict(config=cfg, **{k: 0.0 for k in _SUMS}, **{k: 0.0 for k in _MAXES})
        for i, s in enumerate(samples):
            c = compress(s, as_sent(cfg, i), backend=backend)
            r2, bound2 = _error_stats(s, decompress(c, backend=backend))
            rel = math.sqrt(r2)
            row["nbytes"] += c.nbytes
            row["numel"] += s.numel()
            row["n_samples"] += 1
            row["rel_l2_sum"] += rel
            row["r2_sum"] += r2
            row["r2_sqsum"] += r2 * r2
            row["rel_l2_max"] = max(row["rel_l2_max"], rel)
            row["piece_bound2_max"] = max(row["piece_bound2_max"], bound2)
        rows.append(row)
    return _derive(pd.DataFrame(rows))


def _derive(t):
    """Add the public columns that follow from the sums and maxima."""
    cfgs = t["config"]
    t["codec"], t["group_size"] = [c.codec for c in cfgs], [c.group_size for c in cfgs]
    t["hadamard"], t["scales"], t["rounding"] = [c.hadamard for c in cfgs], [c.scales for c in cfgs], [c.rounding for c in cfgs]
    t["bytes_per_element"] = t.nbytes / t.numel.clip(lower=1)
    t["ratio_vs_bf16"] = 2 / t.bytes_per_element.where(t.bytes_per_element > 0)
    n = t.n_samples
    t["rel_l2_mean"] = t.rel_l2_sum / n
    mean2 = t.r2_sum / n
    var2 = ((t.r2_sqsum - n * mean2 ** 2) / (n - 1).clip(lower=1)).clip(lower=0)
    between = (mean2 + HELD_OUT_Z * var2 ** 0.5 * (1 + 1 / n) ** 0.5).where(n >= 2, 0.0)
    bound2 = pd_max(pd_max(t.piece_bound2_max, between), t.rel_l2_max ** 2)
    t["rel_l2_bound"] = bound2 ** 0.5
    t["margin"] = t.rel_l2_bound - t.rel_l2_max
    t["rate_bytes_per_element"] = [c.bytes_per_element(SUPERBLOCK_ELEMS) for c in cfgs]
    t["n_samples"] = t.n_samples.astype(int)
    return t


def pd_max(a, b):
    """Elementwise maximum of two pandas Series."""
    return a.where(a >= b, b)


def merge(tables):
    """One measurement of the same candidates on several sample sets (e.g. one per rank), as if
    all their samples had been measured together. ValueError if the candidates differ."""
    import pandas as pd

    tables = list(tables)
    first = list(tables[0]["config"])
    for t in tables[1:]:
        if list(t["config"]) != first:
            raise ValueError("calibrate: the measurements to merge were made on different candidates")
    both = pd.concat([t[["config", *_SUMS, *_MAXES]].assign(_pos=range(len(t))) for t in tables])
    agg = {**{k: "sum" for k in _SUMS}, **{k: "max" for k in _MAXES}, "config": "first"}
    merged = both.groupby("_pos", sort=True).agg(agg).reset_index(drop=True)
    return _derive(merged)


def choose(table, max_bytes_per_element: float = 1.0625, max_error: float | None = None) -> CalibrationResult:
    """The choice of `calibrate` from a `measure` (or `merge`) table; see `calibrate` for the
    budgets and the ValueError when none fits."""
    if max_error is not None:
        check_budget("max_error", max_error, " (a relative L2 error)")
    check_budget("max_bytes_per_element", max_bytes_per_element)
    table = table.copy()
    table["within_budget"] = table.rate_bytes_per_element <= max_bytes_per_element
    if max_error is not None:
        table["within_budget"] &= table.rel_l2_bound <= max_error
    fit = table[table.within_budget]
    if fit.empty:
        cheapest = table.loc[table.rate_bytes_per_element.idxmin()]
        msg = (f"no candidate fits max_bytes_per_element={max_bytes_per_element}; the cheapest needs "
               f"{cheapest.rate_bytes_per_element:.4f} ({cheapest.codec}, G={cheapest.group_size})")
        if max_error is not None:
            best = table.loc[table.rel_l2_bound.idxmin()]
            msg = (f"no candidate fits max_error={max_error} with max_bytes_per_element={max_bytes_per_element}; "
                   f"the most accurate ({best.codec}, G={best.group_size}, hadamard={best.hadamard}) has worst "
                   f"relative L2 error {best.rel_l2_max:.4g} on the samples, {best.rel_l2_bound:.4g} with the "
                   f"margin for held-out tensors, at {best.rate_bytes_per_element:.4f} bytes per element")
        raise ValueError(msg)
    order = ["rel_l2_mean", "bytes_per_element"] if max_error is None else ["rate_bytes_per_element", "rel_l2_mean"]
    best = fit.sort_values(order, kind="stable").index[0]
    table["chosen"] = table.index == best
    return CalibrationResult(config=table.loc[best, "config"],
                             table=table[[*TABLE_COLUMNS, "within_budget", "chosen"]].reset_index(drop=True))
