"""Error feedback: a gradient carries what its last quantization dropped into the next reduction.

One residual per buffer (a key the caller picks, e.g. a DDP bucket's storage): before a reduction
the residual is added to the gradient, and the new residual is what quantizing the sum loses, as
the compressed collective's first quantization computes it (the same config, per slice where the
collective cuts the message into slices). That is exact only with nearest rounding, which is
deterministic, so a stochastic config is refused.
"""
from __future__ import annotations

import torch

from .. import codec


def feed_back(residuals: dict, key, flat: torch.Tensor, cfg, chunks: int, site: str) -> None:
    """Add `residuals[key]` (FP32, created as zeros) to the contiguous 1-D `flat` in place, and keep
    as the new residual what quantizing the result with `cfg` in `chunks` equal slices loses.

    Raises:
        ValueError: `cfg` rounds stochastically, or `flat` is not a contiguous 1-D tensor (naming
            `site`).
    """
    if cfg.stochastic:
        raise ValueError(
            f"error feedback needs rounding='nearest' (the residual must be exactly what this rank's "
            f"quantization drops), but {site} got {cfg}"
        )
    if flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError(f"error feedback needs a contiguous 1-D buffer at {site}, got shape {tuple(flat.shape)} "
                         f"and strides {flat.stride()}")
    res = residuals.get(key)
    if res is None:
        res = residuals[key] = torch.zeros(flat.numel(), dtype=torch.float32, device=flat.device)
    y = flat.float() + res
    flat.copy_(y)
    sent = torch.cat([codec.decompress(codec.compress(part, cfg)).float().view(-1) for part in flat.chunk(chunks)])
    res.copy_(y - sent)
