"""Fused decompress: 8-bit codes -> scales -> inverse block Hadamard -> saturating cast, one pass.

The +-1 transform runs on the decoded codes and the group scale is applied after it (one
multiply per element). Outputs are clamped to the output dtype's finite range, so quantization
error at the dtype's maximum never produces Inf; NaN groups stay NaN. Reference:
`taco_triton.reference.decompress_reference`.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..config import CompressionConfig
from ..layout import WireLayout
from ._launch import launch_params
from ._common import CODEC_IDS, hadamard_rows, launch_flags
from ._tile import load_codes, store_dense


@triton.jit
def _decompress_kernel(
    codes_ptr, scale_a_ptr, scale_b_ptr, out_ptr, numel, n_groups, out_max, inf_above,
    G: tl.constexpr, GPS: tl.constexpr, CODEC: tl.constexpr, HADAMARD: tl.constexpr,
    DUAL: tl.constexpr, HW_CAST: tl.constexpr, DOT_PREC: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * GPS + tl.arange(0, GPS)
    row_ok = rows < n_groups
    offs = rows[:, None] * G + tl.arange(0, G)[None, :]
    vals, sigma, pre = load_codes(pid, rows, row_ok, offs, codes_ptr, scale_a_ptr, scale_b_ptr, CODEC, DUAL, HW_CAST)
    if HADAMARD:  # +-1 transform of the codes first, then one scale multiply per element
        y = hadamard_rows(vals, GPS, G, DOT_PREC) * (2.0 * sigma)[:, None]
    else:
        y = vals * sigma[:, None]
    if not DUAL:
        y = tl.div_rn(y, pre[:, None])
    store_dense(y, out_ptr, offs, numel, out_max, inf_above, HW_CAST)


def decompress_triton(data: torch.Tensor, out: torch.Tensor, config: CompressionConfig, inf_above: float = math.inf) -> torch.Tensor:
    """Launch the fused decompress kernel into `out` (contiguous bf16/fp16/fp32); `inf_above` as
    in `reference.saturate_cast`."""
    if not out.is_contiguous():
        raise ValueError(f"decompress_triton needs a contiguous `out`, got strides {out.stride()} for shape {tuple(out.shape)}")
    layout = WireLayout.of(out.numel(), config)
    if layout.n_groups == 0:
        return out
    codes, a, b = layout.split(data)
    _decompress_kernel[(layout.n_superblocks,)](
        codes, a, b, out, out.numel(), layout.n_groups, torch.finfo(out.dtype).max, inf_above,
        G=config.group_size, GPS=layout.groups_per_superblock, CODEC=CODEC_IDS[config.codec],
        HADAMARD=config.hadamard, DUAL=config.scales == "dual", **launch_flags(out.is_cuda),
        **launch_params("decompress", out.device, out.dtype, config, out.numel()),
    )
    return out
