"""Error feedback for the data-parallel axis (`enable(error_feedback=True)`): each gradient bucket
carries what this rank's quantization dropped into the next step's reduction.

The residual is exactly what the compressed collective's first quantization loses only when that
quantization is deterministic, so error feedback needs nearest rounding: the derived DP policy
then rounds to nearest, and a DP config with stochastic rounding raises ValueError at the first
compressed reduction.
"""
from __future__ import annotations

import torch

from ... import codec


def feed_back_error(residuals: dict, tensor, cfg, chunks, site) -> None:
    """Add this bucket's residual (kept in `residuals` by buffer) to its gradient, and keep as the
    new residual what quantizing the result loses (the compressed collective's first quantization,
    computed here the same way: nearest rounding is deterministic; per slice (`chunks`) for
    reduce_scatter)."""
    if cfg.stochastic:
        raise ValueError(
            f"error feedback needs rounding='nearest' (the residual must be exactly what this rank's "
            f"quantization drops), but {site} got {cfg}"
        )
    if not tensor.is_contiguous():
        raise ValueError(f"error feedback needs a contiguous gradient buffer at {site}, got strides {tensor.stride()}")
    flat = tensor.view(-1)
    key = (flat.data_ptr(), flat.numel())
    res = residuals.get(key)
    if res is None:
        res = residuals[key] = torch.zeros(flat.numel(), dtype=torch.float32, device=flat.device)
    y = flat.float() + res
    flat.copy_(y)
    sent = torch.cat([codec.decompress(codec.compress(part, cfg)).float().view(-1)
                      for part in flat.chunk(chunks)])
    res.copy_(y - sent)
