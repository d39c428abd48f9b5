"""Fused reduce for the collectives: dequantize P ranks' chunks, sum in FP32, requantize. One pass.

After the all-to-all each rank holds P wire buffers of the same chunk. This kernel reads them,
sums in the transformed domain (the Hadamard is linear: no inverse/forward transform between sum
and requantization) and writes either the compressed sum (all_reduce: it is all-gathered next) or
the decompressed sum (reduce_scatter). TACO's released code has no fused version of this step.
Reference: `taco_triton.reference.reduce_reference`.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .. import alloc
from ..config import CompressionConfig
from ..layout import WireLayout
from ._common import CODEC_IDS, codec_consts, group_all_finite, hadamard_rows, launch_flags
from ._launch import launch_params
from ._tile import load_codes, quantize_store, store_dense, taco_prescale


@triton.jit
def _reduce_kernel(
    in_codes_ptr, in_a_ptr, in_b_ptr, stride_codes, stride_a, stride_b, n_ranks,
    out_codes_ptr, out_a_ptr, out_b_ptr, out_ptr, numel, n_groups, seed, scale, out_max, inf_above,
    G: tl.constexpr, GPS: tl.constexpr, CODEC: tl.constexpr, HADAMARD: tl.constexpr,
    DUAL: tl.constexpr, ROUND: tl.constexpr, DENSE: tl.constexpr, HW_CAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * GPS + tl.arange(0, GPS)
    row_ok = rows < n_groups
    offs = rows[:, None] * G + tl.arange(0, G)[None, :]
    acc = tl.zeros([GPS, G], dtype=tl.float32)
    c_ptr, a_ptr, b_ptr = in_codes_ptr, in_a_ptr, in_b_ptr  # advanced per rank: 64-bit pointer math
    for _p in range(n_ranks):
        vals, sigma, pre = load_codes(pid, rows, row_ok, offs, c_ptr, a_ptr, b_ptr, CODEC, DUAL, HW_CAST)
        t = vals * sigma[:, None]
        if not DUAL:
            t = tl.div_rn(t, pre[:, None])
        acc += t
        c_ptr += stride_codes
        a_ptr += stride_a
        b_ptr += stride_b
    acc = acc * scale
    if DENSE:
        if HADAMARD:
            acc = hadamard_rows(acc, GPS, G, DOT_PREC) * 2.0
        store_dense(acc, out_ptr, offs, numel, out_max, inf_above, HW_CAST)
    else:
        finite = group_all_finite(acc)
        if DUAL:
            pre_out = 1.0
        else:
            CODE_MAX, _mbits, _emin, _sub = codec_consts(CODEC)
            accf = tl.where(acc == acc, acc, 0.0)
            ms = tl.div_rn(tl.sum(accf * accf, axis=1), G * 1.0)
            if HADAMARD:
                ms = ms * (4.0 * G)
            pre_out = taco_prescale(ms, finite, CODE_MAX)
            acc = acc * pre_out[:, None]
        quantize_store(acc, finite, pre_out, pid, rows, row_ok, offs, out_codes_ptr, out_a_ptr, out_b_ptr, seed,
                       CODEC, DUAL, ROUND, HW_CAST)


def _row_views(bufs: torch.Tensor, layout: WireLayout):
    """Per-rank (codes, a, b) views of a [P, stride] buffer, stride a multiple of 4 bytes."""
    codes = bufs[:, : layout.scale_a_offset]
    a = bufs[:, layout.scale_a_offset : layout.scale_b_offset].view(torch.float32)
    b = bufs[:, layout.scale_b_offset : layout.nbytes]
    if layout.scales != "dual":
        b = b.view(torch.float32)
    return codes, a, b


def reduce_triton(
    bufs: torch.Tensor, numel: int, config: CompressionConfig, scale: float = 1.0,
    out: torch.Tensor | None = None, dense_out: torch.Tensor | None = None, inf_above: float = math.inf,
) -> torch.Tensor:
    """Launch the fused reduce over `bufs` ([P, stride] uint8, stride % 4 == 0).

    Writes the compressed sum into `out` (allocated if None), or with `dense_out` (bf16/fp16/fp32,
    `numel` elements, contiguous) the decompressed sum there. Returns what it wrote.
    """
    layout = WireLayout.of(numel, config)
    if bufs.dim() != 2 or bufs.dtype != torch.uint8 or bufs.stride(1) != 1 or bufs.stride(0) % 4 or bufs.shape[1] < layout.nbytes:
        raise ValueError(f"bufs must be [P, stride>={layout.nbytes}] uint8 rows with stride % 4 == 0, "
                         f"got {tuple(bufs.shape)} {bufs.dtype} strides {bufs.stride()}")
    dense = dense_out is not None
    if not dense and out is None:
        out = alloc.empty(layout.nbytes, torch.uint8, bufs.device)
    target = dense_out if dense else out
    if layout.n_groups == 0:
        return target
    in_c, in_a, in_b = _row_views(bufs, layout)
    if dense:
        o_c = o_a = o_b = dense_out
    else:
        o_c, o_a, o_b = layout.split(out)
    _reduce_kernel[(layout.n_superblocks,)](
        in_c, in_a, in_b, in_c.stride(0), in_a.stride(0), in_b.stride(0), bufs.shape[0],
        o_c, o_a, o_b, target, numel, layout.n_groups, config.seed, scale,
        torch.finfo(dense_out.dtype).max if dense else 0.0, inf_above,
        G=config.group_size, GPS=layout.groups_per_superblock, CODEC=CODEC_IDS[config.codec],
        HADAMARD=config.hadamard, DUAL=config.scales == "dual", ROUND=2 if config.stochastic else 0,
        DENSE=dense, **launch_flags(bufs.is_cuda),
        **launch_params("reduce", bufs.device, torch.uint8, config, numel),
    )
    return target
