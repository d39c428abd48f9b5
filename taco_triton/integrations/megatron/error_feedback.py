"""Error feedback for the data-parallel axis (`enable(error_feedback=True)`): each gradient bucket
carries what this rank's quantization dropped into the next step's reduction (`residuals.feed_back`).

The residual is exactly what the compressed collective's first quantization loses only when that
quantization is deterministic, so error feedback needs nearest rounding: the derived DP policy
then rounds to nearest, and a DP config with stochastic rounding raises ValueError at the first
compressed reduction.
"""
from __future__ import annotations

from ..residuals import feed_back


def feed_back_error(residuals: dict, tensor, cfg, chunks, site) -> None:
    """Add this bucket's residual (kept in `residuals` by buffer) to its gradient, and keep as the
    new residual what quantizing the result loses (per slice (`chunks`) for reduce_scatter)."""
    if not tensor.is_contiguous():
        raise ValueError(f"error feedback needs a contiguous gradient buffer at {site}, got strides {tensor.stride()}")
    flat = tensor.view(-1)
    feed_back(residuals, (flat.data_ptr(), flat.numel()), flat, cfg, chunks, site)
