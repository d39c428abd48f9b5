"""@triton.jit helpers shared by the fused kernels; each mirrors a function in `reference.py`.

Codec ids (constexpr CODEC): 0 = fp8_e4m3, 1 = fp8_e5m2, 2 = int8.
Rounding ids (constexpr ROUND): 0 = nearest-even, 1 = ceil, 2 = stochastic.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..env import interpreting

CODEC_IDS = {"fp8_e4m3": 0, "fp8_e5m2": 1, "int8": 2}


def launch_flags(is_cuda: bool) -> dict:
    """Constexprs that differ between hardware and the interpreter.

    HW_CAST: the interpreter's FP8 cast is not round-to-nearest-even (FINDINGS 3), so it uses the
    integer-bit encoder; GPUs use the hardware cast. DOT_PREC: Hopper tensor cores with three TF32
    passes give FP32-level accuracy; the interpreter computes in IEEE FP32 anyway.
    """
    hw = is_cuda and not interpreting()
    return {"HW_CAST": hw, "DOT_PREC": "tf32x3" if hw else "ieee"}


@triton.jit
def pm1_hadamard(N: tl.constexpr):
    """The +-1 Sylvester-Hadamard matrix of size N (FP32): (-1)^popcount(i & j)."""
    i = tl.arange(0, N)[:, None]
    j = tl.arange(0, N)[None, :]
    v = i & j
    v = v ^ (v >> 8)
    v = v ^ (v >> 4)
    v = v ^ (v >> 2)
    v = v ^ (v >> 1)
    return (1 - 2 * (v & 1)).to(tl.float32)


@triton.jit
def hadamard_rows(x, ROWS: tl.constexpr, G: tl.constexpr, DOT_PREC: tl.constexpr):
    """x @ H_G for each of the ROWS rows of x ([ROWS, G] FP32), unnormalised.

    G <= 128: one dot with H_G. G = 256, 512: H_G = H_(G/16) (x) H_16 (Kronecker), two dots with
    a transpose between, so no operand exceeds 32x32 and every dot dimension stays >= 16.
    """
    if G <= 128:
        y = tl.dot(x, pm1_hadamard(G), input_precision=DOT_PREC)
    else:
        A: tl.constexpr = G // 16
        y = tl.dot(tl.reshape(x, [ROWS * A, 16]), pm1_hadamard(16), input_precision=DOT_PREC)
        y = tl.reshape(tl.trans(tl.reshape(y, [ROWS, A, 16]), 0, 2, 1), [ROWS * 16, A])
        y = tl.dot(y, pm1_hadamard(A), input_precision=DOT_PREC)
        y = tl.reshape(tl.trans(tl.reshape(y, [ROWS, 16, A]), 0, 2, 1), [ROWS, G])
    return y


@triton.jit
def mix32(x):
    """MurmurHash3's 32-bit finaliser (uint32 in, uint32 out)."""
    x = x ^ (x >> 16)
    x = x * 0x85EBCA6B
    x = x ^ (x >> 13)
    x = x * 0xC2B2AE35
    return x ^ (x >> 16)


@triton.jit
def random_bits(seed, offs):
    """32 reproducible random bits per int64 element index; equals reference.random_bits."""
    lo = (offs & 0xFFFFFFFF).to(tl.uint32)
    hi = (offs >> 32).to(tl.uint32)
    return mix32(lo ^ mix32(hi ^ mix32(seed.to(tl.uint32))))


@triton.jit
def round_shift(m, s, ROUND: tl.constexpr, rand):
    """m >> s (int32 m < 2^24, s >= 1) rounded nearest-even, up, or stochastically.

    As reference._round_shift: s clamps at 25 (nearest, ceil) or 31 (stochastic, in uint32).
    """
    if ROUND == 2:
        s = tl.minimum(s, 31)
        low = tl.full(s.shape, 0xFFFFFFFF, tl.uint32) >> (32 - s).to(tl.uint32)
        return ((m.to(tl.uint32) + (rand & low)) >> s.to(tl.uint32)).to(tl.int32)
    s = tl.minimum(s, 25)
    low = (1 << s) - 1
    if ROUND == 1:
        return (m + low) >> s
    else:
        q = m >> s
        rem = m & low
        half = 1 << (s - 1)
        up = (rem > half) | ((rem == half) & ((q & 1) == 1))
        return q + up.to(tl.int32)


@triton.jit
def split_float(v):
    """(sign, e, M) of FP32 v with |v| = M 2^(e-23), M carrying the implicit bit, e >= -126."""
    b = v.to(tl.int32, bitcast=True)
    sign = (b >> 31) & 1
    raw_e = (b >> 23) & 0xFF
    mant = b & 0x7FFFFF
    m = tl.where(raw_e > 0, mant | 0x800000, mant)
    e = tl.maximum(raw_e, 1) - 127
    return sign, e, m


@triton.jit
def encode_ue4m4_ceil(r):
    """Unsigned E4M4 scale code of r in [0, 1], rounded up (reference.encode_ue4m4_ceil)."""
    _, e, m = split_float(r)
    eq = tl.maximum(e, -14)
    s = 19 + eq - e
    return (eq + 14) * 16 + round_shift(m, s, 1, 0)


@triton.jit
def decode_ue4m4(code):
    """FP32 value of unsigned E4M4 codes (int32 in); 255 -> NaN."""
    big_e = code >> 4
    m = code & 15
    normal = (((big_e - 15 + 127) << 23) | (m << 19)).to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * 3.814697265625e-06  # 2^-18
    out = tl.where(big_e > 0, normal, sub)
    return tl.where(code == 255, float("nan"), out)


@triton.jit
def codec_consts(CODEC: tl.constexpr):
    """(code_max, mbits, emin, subnormal spacing 2^(emin - mbits)) of a codec id."""
    if CODEC == 0:
        return 448.0, 3, -6, 0.001953125
    elif CODEC == 1:
        return 57344.0, 2, -14, 1.52587890625e-05
    else:
        return 127.0, 0, 0, 1.0


@triton.jit
def encode_codes(v, rand, CODEC: tl.constexpr, ROUND: tl.constexpr, HW_CAST: tl.constexpr):
    """u8 codes of scaled values |v| <= code_max (reference.encode_codes_bits / encode_codes)."""
    if HW_CAST and ROUND == 0 and CODEC == 0:
        return v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    elif HW_CAST and ROUND == 0 and CODEC == 1:
        return v.to(tl.float8e5).to(tl.uint8, bitcast=True)
    else:
        sign, e, m = split_float(v)
        if CODEC == 2:
            s = 23 - e
            mag = round_shift(m, s, ROUND, rand)
            code = tl.where(sign == 1, -mag, mag) & 0xFF
        else:
            _cmax, MBITS, EMIN, _sub = codec_consts(CODEC)
            eq = tl.maximum(e, EMIN)
            s = 23 - MBITS + eq - e
            mag = ((eq - EMIN) << MBITS) + round_shift(m, s, ROUND, rand)
            code = mag | (sign << 7)
        return code.to(tl.uint8)


@triton.jit
def decode_codes(codes, CODEC: tl.constexpr, HW_CAST: tl.constexpr):
    """FP32 values of u8 codes (reference.decode_codes)."""
    if CODEC == 2:
        return codes.to(tl.int8, bitcast=True).to(tl.float32)
    elif HW_CAST and CODEC == 0:
        return codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    elif HW_CAST and CODEC == 1:
        return codes.to(tl.float8e5, bitcast=True).to(tl.float32)
    else:
        _cmax, MBITS, EMIN, SUB = codec_consts(CODEC)
        c = codes.to(tl.int32)
        sign = c >> 7
        big_e = (c >> MBITS) & ((1 << (7 - MBITS)) - 1)
        m = c & ((1 << MBITS) - 1)
        normal = ((sign << 31) | ((big_e - (1 - EMIN) + 127) << 23) | (m << (23 - MBITS))).to(tl.float32, bitcast=True)
        sub = m.to(tl.float32) * SUB
        sub = tl.where(sign == 1, -sub, sub)
        out = tl.where(big_e > 0, normal, sub)
        if CODEC == 0:
            out = tl.where((c & 0x7F) == 0x7F, float("nan"), out)
        else:
            top = big_e == 31
            inf = tl.where(sign == 1, -float("inf"), float("inf"))
            out = tl.where(top, tl.where(m == 0, inf, float("nan")), out)
        return out


@triton.jit
def group_all_finite(x):
    """[ROWS] int1: every element of the row is finite."""
    bad = (x != x) | (tl.abs(x) == float("inf"))
    return tl.max(bad.to(tl.int32), axis=1) == 0


@triton.jit
def to_out_dtype(y, out_ptr, HW_CAST: tl.constexpr):
    """Cast FP32 y to the element type of out_ptr, round-to-nearest-even everywhere.

    The interpreter's FP32 -> BF16 cast truncates (measured: ~half of random values off by one
    ulp, also with fp_downcast_rounding="rtne"), so there the rounding is done on the bits first
    and the cast only drops zeros. y is already clamped to the finite range, so no carry reaches
    Inf; NaN stays NaN.
    """
    if (not HW_CAST) and out_ptr.dtype.element_ty == tl.bfloat16:
        b = y.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        y = b.to(tl.float32, bitcast=True)
    return y.to(out_ptr.dtype.element_ty)
