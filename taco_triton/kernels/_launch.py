"""Launch parameters (num_warps, num_stages) for the fused kernels: the one place they are chosen.

The tile itself is fixed by the format (one super-block per program), so what varies is how
many warps share it and how deeply loads are pipelined. Lookup order: the autotune cache
(`autotune` package: shipped per-GPU files, then the user's cache, then online tuning when
TACO_AUTOTUNE=online), then the heuristic below. In the interpreter every choice runs the same
code, so the heuristic answers without looking anything up. `forced` pins the parameters for a
block of launches: the autotuner times each candidate through the ordinary wrappers this way.
"""
from __future__ import annotations

import contextlib
import contextvars

import torch

from ..config import CompressionConfig
from ..env import autotune_mode, interpreting


def heuristic(kernel: str, config: CompressionConfig) -> dict:
    """A safe default: 4 warps (8 for the two-stage Hadamard of G >= 256), 1 stage."""
    warps = 8 if (config.hadamard and config.group_size >= 256) else 4
    return {"num_warps": warps, "num_stages": 1}


# A context variable, not a module global: a forced block in one thread (the tuner timing a
# candidate) must not change the launches of another.
_FORCED: contextvars.ContextVar[dict | None] = contextvars.ContextVar("taco_forced_launch", default=None)


@contextlib.contextmanager
def forced(params: dict):
    """Launch every fused kernel inside this block with `params` ({"num_warps": .., "num_stages": ..})."""
    token = _FORCED.set(dict(params))
    try:
        yield
    finally:
        _FORCED.reset(token)


def launch_params(kernel: str, device: torch.device, dtype: torch.dtype, config: CompressionConfig, numel: int) -> dict:
    """Launch parameters for `kernel` ("compress", "decompress", ...) on this problem."""
    pinned = _FORCED.get()
    if pinned is not None:
        return pinned
    if device.type != "cuda" or interpreting():
        autotune_mode()  # unused here, but a TACO_AUTOTUNE typo raises on every backend, not only on GPUs
        return heuristic(kernel, config)
    try:
        from autotune import runtime
    except ImportError:
        return heuristic(kernel, config)
    found = runtime.lookup(kernel, device, dtype, config, numel)
    return found if found is not None else heuristic(kernel, config)
