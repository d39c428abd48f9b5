"""Fused compress: load -> (pre-scale) -> block Hadamard -> dual scales -> 8-bit codes, one pass.

One program owns one super-block (SUPERBLOCK_ELEMS elements = GPS groups of G): it holds the
whole tile in registers, so the super-block's FP32 scale is known before any code is written and
the input is read exactly once. The tail is masked (loads return 0 past numel), never padded in
memory. Reference: `taco_triton.reference.compress_reference`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import alloc
from ..config import CompressionConfig
from ..layout import WireLayout
from ._launch import launch_params
from ._common import CODEC_IDS, codec_consts, group_all_finite, hadamard_rows, launch_flags
from ._tile import quantize_store, taco_prescale


@triton.jit
def _compress_kernel(
    x_ptr, codes_ptr, scale_a_ptr, scale_b_ptr, numel, n_groups, seed,
    G: tl.constexpr, GPS: tl.constexpr, CODEC: tl.constexpr, HADAMARD: tl.constexpr,
    DUAL: tl.constexpr, ROUND: tl.constexpr, HW_CAST: tl.constexpr, DOT_PREC: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * GPS + tl.arange(0, GPS)
    row_ok = rows < n_groups
    offs = rows[:, None] * G + tl.arange(0, G)[None, :]
    x = tl.load(x_ptr + offs, mask=offs < numel, other=0.0).to(tl.float32)
    finite = group_all_finite(x)
    if DUAL:
        pre = 1.0
    else:  # TACO's RMS pre-scale (cancels mathematically; kept to reproduce its layout)
        CODE_MAX, _mbits, _emin, _sub = codec_consts(CODEC)
        xs = tl.where(x == x, x, 0.0)
        pre = taco_prescale(tl.div_rn(tl.sum(xs * xs, axis=1), G * 1.0), finite, CODE_MAX)
        x = x * pre[:, None]
    if HADAMARD:
        x = hadamard_rows(x * (0.5 / G), GPS, G, DOT_PREC)
    quantize_store(x, finite, pre, pid, rows, row_ok, offs, codes_ptr, scale_a_ptr, scale_b_ptr, seed,
                   CODEC, DUAL, ROUND, HW_CAST)


def compress_triton(x: torch.Tensor, config: CompressionConfig, out: torch.Tensor | None = None) -> torch.Tensor:
    """Launch the fused compress kernel. `x` contiguous bf16/fp16/fp32; returns the wire buffer."""
    if not x.is_contiguous():
        raise ValueError(f"compress_triton needs a contiguous `x`, got strides {x.stride()} for shape {tuple(x.shape)}")
    layout = WireLayout.of(x.numel(), config)
    data = alloc.empty(layout.nbytes, torch.uint8, x.device) if out is None else out
    if layout.n_groups == 0:
        return data
    codes, a, b = layout.split(data)
    grid = (layout.n_superblocks,)
    _compress_kernel[grid](
        x, codes, a, b, x.numel(), layout.n_groups, config.seed,
        G=config.group_size, GPS=layout.groups_per_superblock, CODEC=CODEC_IDS[config.codec],
        HADAMARD=config.hadamard, DUAL=config.scales == "dual",
        ROUND=2 if config.stochastic else 0, **launch_flags(x.is_cuda),
        **launch_params("compress", x.device, x.dtype, config, x.numel()),
    )
    return data
