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
from ._common import (
    CODEC_IDS,
    codec_consts,
    decode_ue4m4,
    encode_codes,
    encode_ue4m4_ceil,
    group_all_finite,
    hadamard_rows,
    launch_flags,
    random_bits,
)


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
    CODE_MAX, _mbits, _emin, _sub = codec_consts(CODEC)

    finite = group_all_finite(x)
    if not DUAL:  # TACO's RMS pre-scale (cancels mathematically; kept to reproduce its layout)
        xs = tl.where(x == x, x, 0.0)
        ms = tl.div_rn(tl.sum(xs * xs, axis=1), G * 1.0)
        pre = tl.div_rn(CODE_MAX, tl.sqrt_rn(ms + 1e-6))
        pre = tl.where(finite, tl.minimum(tl.maximum(pre, 1e-3), 1e3), 1.0)
        x = x * pre[:, None]
    if HADAMARD:
        x = hadamard_rows(x * (0.5 / G), GPS, G, DOT_PREC)
    amax = tl.where(finite, tl.max(tl.abs(x), axis=1), 0.0)

    if DUAL:
        sb_amax = tl.max(amax, axis=0)
        sb_scale = tl.div_rn(sb_amax, CODE_MAX)
        ratio = tl.where(sb_amax > 0, tl.div_rn(amax, tl.where(sb_amax > 0, sb_amax, 1.0)), 0.0)
        dcode = tl.where(finite, encode_ue4m4_ceil(ratio), 255)
        sigma = sb_scale * decode_ue4m4(dcode)
        tl.store(scale_a_ptr + pid, sb_scale)
        tl.store(scale_b_ptr + rows, dcode.to(tl.uint8), mask=row_ok)
    else:
        sigma = tl.where(finite, tl.div_rn(amax, CODE_MAX), float("nan"))
        tl.store(scale_a_ptr + rows, pre, mask=row_ok)
        tl.store(scale_b_ptr + rows, sigma, mask=row_ok)

    s = sigma[:, None]
    ok = (s > 0) & (x == x) & (tl.abs(x) != float("inf"))
    v = tl.where(ok, tl.div_rn(x, tl.where(ok, s, 1.0)), 0.0)
    v = tl.minimum(tl.maximum(v, -CODE_MAX), CODE_MAX)
    if ROUND == 2:
        rand = random_bits(seed, offs)
    else:
        rand = 0
    codes = encode_codes(v, rand, CODEC, ROUND, HW_CAST)
    tl.store(codes_ptr + offs, codes, mask=row_ok[:, None])


def compress_triton(x: torch.Tensor, config: CompressionConfig, out: torch.Tensor | None = None) -> torch.Tensor:
    """Launch the fused compress kernel. `x` contiguous bf16/fp16/fp32; returns the wire buffer."""
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
