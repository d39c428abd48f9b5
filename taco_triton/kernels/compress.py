"""Fused compress: load -> (pre-scale) -> block Hadamard -> dual scales -> 8-bit codes, one pass.

A persistent grid: each program loads the Hadamard table once, then loops over tiles of two
super-blocks (8192 elements). A tile is held in registers, so a super-block's FP32 scale is known
before any code is written and the input is read exactly once. The transform is one tensor-core
dot per tile against the launcher's table H/(2G), exact in the input's own 16-bit dtype (products
with a power of two are exact; they accumulate in FP32); FP32 and pre-scaled inputs are split
into three bf16 pieces on NVIDIA (exact products) and use FP32 matrix instructions on AMD. The tail is masked (loads return 0 past
numel), never padded in memory. Reference: `taco_triton.reference.compress_reference`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import alloc
from ..config import SUPERBLOCK_ELEMS, CompressionConfig
from ..layout import WireLayout
from ._common import STOCHASTIC, codec_constexprs, hadamard_rows, load_tables, row_absmax
from ._launch import Launch, Target, launch_meta, launch_params, target_of
from ._tables import SB_PER_TILE, hadamard_tables
from ._tile import quantize_store, taco_prescale, tile_rows


@triton.jit
def _compress_kernel(
    x_ptr, codes_ptr, scale_a_ptr, scale_b_ptr, h_ptr, h16_ptr, numel, n_groups, n_sb, n_tiles, seed,
    G: tl.constexpr, GPS: tl.constexpr, SBT: tl.constexpr, CODEC: tl.constexpr, CODE_MAX: tl.constexpr,
    MBITS: tl.constexpr, EMIN: tl.constexpr, SUB: tl.constexpr, BITS: tl.constexpr, PACK_K: tl.constexpr, HADAMARD: tl.constexpr, DUAL: tl.constexpr,
    ROUND: tl.constexpr, HW: tl.constexpr, FP8_HW: tl.constexpr, OP16: tl.constexpr, DOT_PREC: tl.constexpr,
):
    ROWS: tl.constexpr = SBT * GPS
    if HADAMARD:
        h, h16 = load_tables(h_ptr, h16_ptr, G, DOT_PREC)
    for tile in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        rows, offs, row_ok = tile_rows(tile, n_groups, ROWS, G)
        x = tl.load(x_ptr + offs, mask=offs < numel, other=0.0)
        if not OP16:
            x = x.to(tl.float32)
        if DUAL:
            pre = 1.0
        else:  # TACO's RMS pre-scale (cancels mathematically; kept to reproduce its layout)
            x = x.to(tl.float32)
            xs = tl.where(x == x, x, 0.0)
            finite = row_absmax(x) <= 3.4028234663852886e38
            pre = taco_prescale(tl.div_rn(tl.sum(xs * xs, axis=1), G * 1.0), finite, CODE_MAX)
            x = x * pre[:, None]
        if HADAMARD:
            y = hadamard_rows(x, h, h16, ROWS, G, DOT_PREC)
        else:
            y = x.to(tl.float32)
        quantize_store(y, tile, rows, row_ok, offs, n_sb, codes_ptr, scale_a_ptr, scale_b_ptr, seed, pre,
                       CODEC, CODE_MAX, MBITS, EMIN, SBT, GPS, DUAL, ROUND, HW, FP8_HW, G, BITS, PACK_K)


def compress_launch(x, codes, a, b, numel: int, config: CompressionConfig, target: Target, params: dict,
                    device: torch.device | None = None) -> Launch:
    """The launch that compresses `numel` elements of x into (codes, a, b) (tensors or ShapedPointers)."""
    layout = WireLayout.of(numel, config)
    op16 = target.compiled and x.dtype in (torch.bfloat16, torch.float16) and config.scales == "dual"
    h, h16 = hadamard_tables(config.group_size, 0.5 / config.group_size,
                             x.dtype if op16 else torch.float32, device, shaped=device is None)
    n_tiles = -(-layout.n_superblocks // SB_PER_TILE)
    meta = launch_meta(
        target, x.dtype, params, G=config.group_size, GPS=SUPERBLOCK_ELEMS // config.group_size, SBT=SB_PER_TILE,
        **codec_constexprs(config.spec, codes.data_ptr()), HADAMARD=config.hadamard, DUAL=config.scales == "dual",
        ROUND=int(STOCHASTIC) if config.stochastic else 0,
    )
    meta["OP16"] = op16
    return Launch(_compress_kernel, n_tiles,
                  (x, codes, a, b, h, h16, numel, layout.n_groups, layout.n_superblocks, n_tiles, config.seed), meta, device)


def compress_triton(x: torch.Tensor, config: CompressionConfig, out: torch.Tensor | None = None) -> torch.Tensor:
    """Launch the fused compress kernel. `x` contiguous bf16/fp16/fp32; returns the wire buffer."""
    if not x.is_contiguous():
        raise ValueError(f"compress_triton needs a contiguous `x`, got strides {x.stride()} for shape {tuple(x.shape)}")
    layout = WireLayout.of(x.numel(), config)
    data = alloc.empty(layout.nbytes, torch.uint8, x.device) if out is None else out
    if layout.n_groups == 0:
        return data
    codes, a, b = layout.split(data)
    params = launch_params("compress", x.device, x.dtype, config, x.numel())
    compress_launch(x, codes, a, b, x.numel(), config, target_of(x.device), params, x.device).run()
    return data
