"""The one place the library allocates output tensors.

With TACO_TRITON_POISON_ALLOC=1 every output is pre-filled with a poison value (NaN for floats,
0xFF for bytes) instead of left uninitialised, so a kernel that forgets to write a region
produces results that tests catch. The test suite turns it on; it costs a fill, so it is off
by default.
"""
from __future__ import annotations

import torch

from .env import poison_alloc as poisoning


def empty(shape, dtype: torch.dtype, device) -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype, device=device)
    if poisoning():
        out.fill_(float("nan") if dtype.is_floating_point else 0xFF)
    return out
