"""Fused decompress: 8-bit codes -> scales -> inverse block Hadamard -> saturating cast, one pass.

A persistent grid over tiles of two super-blocks, as compress. The +-1 transform runs on the
decoded codes (exact in fp16 for every codec, so one fp16 tensor-core pass is exact up to FP32
accumulation; at G = 256/512 the second stage's FP32 sums are split into three exact bf16
pieces on NVIDIA, FP32 on AMD) and the group scale is applied after it (one multiply per element). Outputs are
clamped to the output dtype's finite range, so quantization error at the dtype's maximum never
produces Inf; NaN groups stay NaN. Reference: `taco_triton.reference.decompress_reference`.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..config import SUPERBLOCK_ELEMS, CompressionConfig
from ..layout import WireLayout
from ._common import codec_constexprs, decode_codes, hadamard_rows, load_codes, load_tables
from ._launch import Launch, Target, launch_meta, launch_params, target_of
from ._tables import SB_PER_TILE, hadamard_tables
from ._tile import load_scales, store_dense, tile_rows


@triton.jit
def _decompress_kernel(
    codes_ptr, scale_a_ptr, scale_b_ptr, out_ptr, h_ptr, h16_ptr, numel, n_groups, n_sb, n_tiles, out_max, inf_above,
    G: tl.constexpr, GPS: tl.constexpr, SBT: tl.constexpr, CODEC: tl.constexpr, CODE_MAX: tl.constexpr,
    MBITS: tl.constexpr, EMIN: tl.constexpr, SUB: tl.constexpr, BITS: tl.constexpr, PACK_K: tl.constexpr, HADAMARD: tl.constexpr, DUAL: tl.constexpr,
    HW: tl.constexpr, FP8_HW: tl.constexpr, OP16: tl.constexpr, DOT_PREC: tl.constexpr, OVERFLOW: tl.constexpr,
):
    ROWS: tl.constexpr = SBT * GPS
    if HADAMARD:
        h, h16 = load_tables(h_ptr, h16_ptr, G, DOT_PREC)
    for tile in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        rows, offs, row_ok = tile_rows(tile, n_groups, ROWS, G)
        codes = load_codes(codes_ptr, rows, offs, row_ok, ROWS, G, BITS, PACK_K)
        sigma, pre = load_scales(tile, rows, row_ok, n_sb, scale_a_ptr, scale_b_ptr, DUAL, SBT, GPS)
        if HADAMARD:  # +-1 transform of the codes first, then one scale multiply per element
            vals = decode_codes(codes, CODEC, FP8_HW, tl.float16 if OP16 else tl.float32)
            y = hadamard_rows(vals, h, h16, ROWS, G, DOT_PREC) * (2.0 * sigma)[:, None]
        else:
            y = decode_codes(codes, CODEC, FP8_HW, tl.float32) * sigma[:, None]
        if not DUAL:
            y = tl.div_rn(y, pre[:, None])
        store_dense(y, out_ptr, offs, numel, out_max, inf_above, HW, OVERFLOW)


def decompress_launch(codes, a, b, out, numel: int, config: CompressionConfig, target: Target, params: dict,
                      device: torch.device | None = None, inf_above: float = math.inf) -> Launch:
    """The launch that decompresses (codes, a, b) into `numel` elements of out (tensors or ShapedPointers)."""
    layout = WireLayout.of(numel, config)
    op16 = target.compiled
    h, h16 = hadamard_tables(config.group_size, 1.0, torch.float16 if op16 else torch.float32, device,
                             shaped=device is None)
    n_tiles = -(-layout.n_superblocks // SB_PER_TILE)
    meta = launch_meta(
        target, out.dtype, params, G=config.group_size, GPS=SUPERBLOCK_ELEMS // config.group_size, SBT=SB_PER_TILE,
        **codec_constexprs(config.spec, codes.data_ptr()), HADAMARD=config.hadamard, DUAL=config.scales == "dual",
        OVERFLOW=inf_above != math.inf,
    )
    meta["OP16"] = op16
    return Launch(_decompress_kernel, n_tiles,
                  (codes, a, b, out, h, h16, numel, layout.n_groups, layout.n_superblocks, n_tiles,
                   torch.finfo(out.dtype).max, inf_above), meta, device)


def decompress_triton(data: torch.Tensor, out: torch.Tensor, config: CompressionConfig,
                      inf_above: float = math.inf) -> torch.Tensor:
    """Launch the fused decompress kernel into `out` (contiguous bf16/fp16/fp32); `inf_above` as
    in `reference.saturate_cast`."""
    if not out.is_contiguous():
        raise ValueError(f"decompress_triton needs a contiguous `out`, got strides {out.stride()} for shape {tuple(out.shape)}")
    layout = WireLayout.of(out.numel(), config)
    if layout.n_groups == 0:
        return out
    codes, a, b = layout.split(data)
    params = launch_params("decompress", out.device, out.dtype, config, out.numel())
    decompress_launch(codes, a, b, out, out.numel(), config, target_of(out.device), params, out.device, inf_above).run()
    return out
