"""@triton.jit building blocks that act on one program's tile: a super-block of GPS groups of G.

Compress is load -> (pre-scale) -> transform -> `quantize_store`; decompress is `load_codes` ->
inverse transform -> `store_dense`; the collectives' fused reduce is a sum of `load_transformed`
over ranks -> `quantize_store` or `store_dense`. Each mirrors a function in `reference.py`.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._common import (
    codec_consts,
    decode_codes,
    decode_ue4m4,
    encode_codes,
    encode_ue4m4_ceil,
    random_bits,
    to_out_dtype,
)


@triton.jit
def taco_prescale(ms, finite, CODE_MAX: tl.constexpr):
    """TACO's pre-scale from a group's mean square: clamp(code_max / sqrt(ms + 1e-6), 1e-3, 1e3)."""
    pre = tl.div_rn(CODE_MAX, tl.sqrt_rn(ms + 1e-6))
    return tl.where(finite, tl.minimum(tl.maximum(pre, 1e-3), 1e3), 1.0)


@triton.jit
def quantize_store(
    y, finite, pre, pid, rows, row_ok, offs, codes_ptr, a_ptr, b_ptr, seed,
    CODEC: tl.constexpr, DUAL: tl.constexpr, ROUND: tl.constexpr, HW_CAST: tl.constexpr,
):
    """Scales and codes of a transformed tile y [GPS, G]; stores codes and both scale arrays.

    dual: super-block scale S = max finite amax / code_max, E4M4 group codes rounded up (255 for
    non-finite groups). taco_fp32x2: pre (already applied to y) and absmax scale q per group.
    """
    CODE_MAX, _mbits, _emin, _sub = codec_consts(CODEC)
    amax = tl.where(finite, tl.max(tl.abs(y), axis=1), 0.0)
    if DUAL:
        sb_amax = tl.max(amax, axis=0)
        sb_scale = tl.div_rn(sb_amax, CODE_MAX)
        ratio = tl.where(sb_amax > 0, tl.div_rn(amax, tl.where(sb_amax > 0, sb_amax, 1.0)), 0.0)
        dcode = tl.where(finite, encode_ue4m4_ceil(ratio), 255)
        sigma = sb_scale * decode_ue4m4(dcode)
        tl.store(a_ptr + pid, sb_scale)
        tl.store(b_ptr + rows, dcode.to(tl.uint8), mask=row_ok)
    else:
        sigma = tl.where(finite, tl.div_rn(amax, CODE_MAX), float("nan"))
        tl.store(a_ptr + rows, pre, mask=row_ok)
        tl.store(b_ptr + rows, sigma, mask=row_ok)
    s = sigma[:, None]
    ok = (s > 0) & (y == y) & (tl.abs(y) != float("inf"))
    v = tl.where(ok, tl.div_rn(y, tl.where(ok, s, 1.0)), 0.0)
    v = tl.minimum(tl.maximum(v, -CODE_MAX), CODE_MAX)
    if ROUND == 2:
        rand = random_bits(seed, offs)
    else:
        rand = 0
    tl.store(codes_ptr + offs, encode_codes(v, rand, CODEC, ROUND, HW_CAST), mask=row_ok[:, None])


@triton.jit
def load_codes(pid, rows, row_ok, offs, codes_ptr, a_ptr, b_ptr, CODEC: tl.constexpr, DUAL: tl.constexpr, HW_CAST: tl.constexpr):
    """(decoded codes [GPS, G], group scale sigma [GPS], pre-scale [GPS] or 1) of one tile."""
    codes = tl.load(codes_ptr + offs, mask=row_ok[:, None], other=0)
    if DUAL:
        dcode = tl.load(b_ptr + rows, mask=row_ok, other=0).to(tl.int32)
        sigma = tl.load(a_ptr + pid) * decode_ue4m4(dcode)
        pre = tl.full(sigma.shape, 1.0, tl.float32)
    else:
        sigma = tl.load(b_ptr + rows, mask=row_ok, other=0.0)
        pre = tl.load(a_ptr + rows, mask=row_ok, other=1.0)
    return decode_codes(codes, CODEC, HW_CAST), sigma, pre


@triton.jit
def store_dense(y, out_ptr, offs, numel, out_max, inf_above, HW_CAST: tl.constexpr):
    """Clamp y to the output dtype's finite range (NaN stays NaN), cast, store the valid part.
    Magnitudes above `inf_above` (inf: never) become +-inf: an overflowed reduced sum stays visible."""
    clamped = tl.where(y > out_max, out_max, tl.where(y < -out_max, -out_max, y))
    y = tl.where(y > inf_above, float("inf"), tl.where(y < -inf_above, float("-inf"), clamped))
    tl.store(out_ptr + offs, to_out_dtype(y, out_ptr, HW_CAST), mask=offs < numel)
