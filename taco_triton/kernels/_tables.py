"""Host-side constants the kernels load: the Hadamard tables, built once per (G, scale, dtype, device).

A kernel program loads its table once and keeps it for every tile it processes (persistent grid),
instead of rebuilding the +-1 matrix from bit tricks in every program.
"""
from __future__ import annotations

import functools

import torch

from ..config import SUPERBLOCK_ELEMS
from ..reference import hadamard_matrix
from ._launch import ShapedPointer

#: Super-blocks per tile: 2 x 4096 elements, so G = 128 gives a 64-row tile (one m64 MMA).
SB_PER_TILE = 2
#: Elements of a tile (SB_PER_TILE super-blocks, the same for every G).
TILE_ELEMS = SB_PER_TILE * SUPERBLOCK_ELEMS


@functools.lru_cache(maxsize=64)
def _table(n: int, scale: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return (hadamard_matrix(n, torch.float64, device) * scale).to(dtype).contiguous()


def hadamard_tables(g: int, scale: float, dtype: torch.dtype, device, shaped: bool = False):
    """(h, h16): the tables of the transform x -> x (scale * H_G).

    G <= 128: h = scale * H_G in `dtype` (exact: scale is a power of two); h16 is h again (unused).
    G = 256, 512: H_G = H_(G/16) (x) H_16; h16 = H_16 / 16 in `dtype` for the first stage
    (applied to the 16-bit input: exact, a power of two) and h = 16 * scale * H_(G/16) in FP32 for
    the second (applied to FP32 sums). The 1/16 keeps the first stage's sums within the input's
    largest magnitude: with a +-1 table, 16 inputs near FP32's maximum (any finite value above
    2^124) summed to Inf and the group came out non-finite.
    """
    if g <= 128:
        if shaped:
            return ShapedPointer(dtype), ShapedPointer(dtype)
        h = _table(g, scale, dtype, torch.device(device))
        return h, h
    if shaped:
        return ShapedPointer(torch.float32), ShapedPointer(dtype)
    return (_table(g // 16, 16.0 * scale, torch.float32, torch.device(device)),
            _table(16, 1.0 / 16, dtype, torch.device(device)))
