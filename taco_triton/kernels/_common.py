"""@triton.jit helpers shared by the fused kernels; each mirrors a function in `reference.py`.

(Longer than the project's ~500 lines per module: the helpers call each other (the encoders, the
packing, the transform's dot forms), and Triton resolves a jitted callee through the caller's
module globals, so one module keeps every kernel's view of them the same.)

The numeric constants of a codec (largest code, mantissa bits, smallest normal exponent) live in
one place, `taco_triton.config.CODEC_SPECS`; the launchers pass them in as constexprs
(`codec_constexprs` to every kernel, `encoder_constexprs` to those that encode). Below, the ids that select code paths at compile time have names.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..config import CodecSpec
from ..reference import packing

# Codec ids (constexpr CODEC). Integer codes of every width share INT8's id: one byte per code
# (the int8 of the value) everywhere in a kernel but on the wire, where BITS picks the packing.
E4M3: tl.constexpr = tl.constexpr(0)
E5M2: tl.constexpr = tl.constexpr(1)
INT8: tl.constexpr = tl.constexpr(2)
CODEC_IDS = {"fp8_e4m3": 0, "fp8_e5m2": 1, "int8": 2, "int6": 2, "int4": 2}

# Rounding ids (constexpr ROUND) of `round_shift` and the encoders.
NEAREST: tl.constexpr = tl.constexpr(0)
CEIL: tl.constexpr = tl.constexpr(1)
STOCHASTIC: tl.constexpr = tl.constexpr(2)

FLT_MAX: tl.constexpr = tl.constexpr(3.4028234663852886e38)
#: Below this group scale 1/sigma would overflow FP32, so such groups are scaled by TINY_SCALE
#: first (`reference.scale_to_codes` does the same).
TINY_SIGMA: tl.constexpr = tl.constexpr(2.0**-126)
TINY_SCALE: tl.constexpr = tl.constexpr(2.0**64)


#: INT6 codes moved as 32-bit words: 16 codes in three words (instead of 4 codes in three bytes).
#: As PACK_K it selects the word path in `store_codes` / `load_codes`.
INT6_WORD_CODES: tl.constexpr = tl.constexpr(16)
#: INT4 codes stored as 32-bit words: 8 codes per word (instead of 2 codes per byte); PACK_K as above.
INT4_WORD_CODES: tl.constexpr = tl.constexpr(8)


def codec_constexprs(spec: CodecSpec, *code_addresses: int, int4_words: bool = True) -> dict:
    """The constexprs every kernel needs for one codec, read from the codec's spec: its id
    (CODEC), code width (BITS) and how codes are packed (PACK_K).

    `code_addresses`: the byte addresses (and per-rank byte strides) of the packed codes the
    launch reads or writes. When all are 4-byte aligned, INT6 codes move as 32-bit words, 16
    codes per three words (PACK_K = 16): a third of the memory instructions of byte access; INT4
    codes are stored as words of 8 codes (PACK_K = 8, read as bytes) unless `int4_words` is
    false. A group's codes (G * BITS / 8 bytes, G >= 32) are a whole number of words, so only the
    buffer's own alignment decides; an unaligned view (a slice of a larger buffer) takes the byte
    path. The wire bytes are the same on every path.
    """
    pack_k = packing(spec.bits)[0]
    if code_addresses and all(int(a) % 4 == 0 for a in code_addresses):
        if spec.bits == 6:
            pack_k = INT6_WORD_CODES.value
        elif spec.bits == 4 and int4_words:
            pack_k = INT4_WORD_CODES.value
    return {"CODEC": CODEC_IDS[spec.name], "BITS": spec.bits, "PACK_K": pack_k}


def encoder_constexprs(spec: CodecSpec) -> dict:
    """The codec's constants the encoder needs (`quantize_store`, `taco_prescale`): the largest
    code (CODE_MAX), mantissa bits (MBITS) and smallest normal exponent (EMIN). Decoders do not."""
    return {"CODE_MAX": spec.code_max, "MBITS": spec.mbits, "EMIN": spec.emin}


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
    if ROUND == STOCHASTIC:
        s = tl.minimum(s, 31)
        low = tl.full(s.shape, 0xFFFFFFFF, tl.uint32) >> (32 - s).to(tl.uint32)
        return ((m.to(tl.uint32) + (rand & low)) >> s.to(tl.uint32)).to(tl.int32)
    s = tl.minimum(s, 25)
    low = (1 << s) - 1
    if ROUND == CEIL:
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
    return (eq + 14) * 16 + round_shift(m, s, CEIL, 0)


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
def encode_fp8_rne(v, MBITS: tl.constexpr, EMIN: tl.constexpr):
    """FP8 codes (int32, sign in bit 7) of finite FP32 v, round-to-nearest-even, by one FP32 add.

    With E = max(exponent of |v|, EMIN), the code grid's step near |v| is 2^(E - MBITS), and
    C = 2^(E + 23 - MBITS) is a power of two whose FP32 ulp is that step: s = |v| + C rounds |v|
    to the grid in one correctly rounded add (ties to even: C / step = 2^23 is even), and stays
    in C's binade (|v| < 2^(E + 1)). So s's bits minus C's are the grid index k, and the code is
    ((E - EMIN) << MBITS) + k (reference.encode_codes_bits), E read from C's exponent field; a
    round-up to the next binade (k = 2^(MBITS + 1)) carries into the exponent by itself,
    subnormal codes (E = EMIN) fall out of the same formula. About 8 instructions per element
    (the integer-bit encoder: about 22). Bit-identical to the integer-bit encoder
    (reference.encode_codes_bits) for every |v| up to the midpoint between code_max and the next
    step (464 for E4M3, 61440 for E5M2); below it |v| rounds to at most code_max, so values a few
    ulps past code_max need no clamp (`saturating_encoder`). Larger values, NaN and Inf give no
    meaningful code (`quantize_store` never passes them).
    """
    b = v.to(tl.int32, bitcast=True)
    c_bits = tl.maximum(b & 0x7F800000, (EMIN + 127) << 23) + ((23 - MBITS) << 23)
    s_bits = (tl.abs(v) + c_bits.to(tl.float32, bitcast=True)).to(tl.int32, bitcast=True)
    # (E - EMIN) << MBITS = (c_bits >> (23 - MBITS)) - ((127 + 23 - MBITS + EMIN) << MBITS)
    mag = (s_bits - c_bits) + ((c_bits >> (23 - MBITS)) - ((127 + 23 - MBITS + EMIN) << MBITS))
    return mag | ((b >> 24) & 0x80)


@triton.jit
def encode_codes(v, rand, CODEC: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr,
                 ROUND: tl.constexpr, HW: tl.constexpr, FP8_HW: tl.constexpr):
    """u8 codes of scaled values |v| <= code_max (reference.encode_codes_bits / encode_codes).

    Round to nearest even: the hardware's saturating FP8 conversions where they exist (FP8_HW:
    sm_89+), elsewhere (the interpreter, sm_80, AMD's FP8 flavours) `encode_fp8_rne`; INT8 by the
    magic-number add. Stochastic rounding: an integer-bit encoder. All match torch's casts bit for
    bit; `saturating_encoder` says which need |v| <= code_max.
    """
    if FP8_HW and ROUND == NEAREST and CODEC == E4M3:
        return v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    elif FP8_HW and ROUND == NEAREST and CODEC == E5M2:
        return v.to(tl.float8e5).to(tl.uint8, bitcast=True)
    elif ROUND == NEAREST and CODEC != INT8:
        return encode_fp8_rne(v, MBITS, EMIN).to(tl.uint8)
    elif ROUND == NEAREST and CODEC == INT8:
        # |v| <= 127(1 + 2^-21): adding 1.5 * 2^23 rounds v to an integer, ties to even, and leaves
        # it in the low mantissa bits in two's complement; one add on every target
        return ((v + 12582912.0).to(tl.int32, bitcast=True) & 0xFF).to(tl.uint8)
    else:
        sign, e, m = split_float(v)
        if CODEC == INT8:
            s = 23 - e
            mag = round_shift(m, s, ROUND, rand)
            code = tl.where(sign == 1, -mag, mag) & 0xFF
        else:
            eq = tl.maximum(e, EMIN)
            s = 23 - MBITS + eq - e
            mag = ((eq - EMIN) << MBITS) + round_shift(m, s, ROUND, rand)
            code = mag | (sign << 7)
        return code.to(tl.uint8)


@triton.jit
def _sext6(v, SHIFT: tl.constexpr):
    """The 6-bit code at bit SHIFT of int32 v, sign-extended (to the top, then arithmetic shift)."""
    return (v << (26 - SHIFT)) >> 26


@triton.jit
def _push(acc, x, S: tl.constexpr):
    """uint32 acc shifted right by S with the low S bits of x entering at the top: one funnel shift
    (whatever x holds above bit S falls off). Building a word by pushing its codes from the lowest
    needs no masking of the codes: the encoder's bits above a code are never looked at."""
    return (acc >> S) | (x << (32 - S))


@triton.jit
def _store_int6_words(codes_ptr, code, rows, row_ok, ROWS: tl.constexpr, G: tl.constexpr):
    """INT6 codes [ROWS, G] as three little-endian int32 words per 16 codes (code k at bits
    [6k, 6k + 6) of the 96, the same bytes as `store_codes`' 3-byte words). The 16 codes of a
    word triple are taken apart with `tl.split` in four halvings (bit 0 of k first), so they stay
    in the thread that holds them. codes_ptr must be 4-byte aligned."""
    NW: tl.constexpr = G // 16
    c = code.to(tl.int32) & 63
    n0, n1 = tl.split(tl.reshape(c, [ROWS, NW, 8, 2]))      # k & 1
    m00, m01 = tl.split(tl.reshape(n0, [ROWS, NW, 4, 2]))   # (k >> 1) & 1
    m10, m11 = tl.split(tl.reshape(n1, [ROWS, NW, 4, 2]))
    l000, l001 = tl.split(tl.reshape(m00, [ROWS, NW, 2, 2]))  # (k >> 2) & 1
    l010, l011 = tl.split(tl.reshape(m01, [ROWS, NW, 2, 2]))
    l100, l101 = tl.split(tl.reshape(m10, [ROWS, NW, 2, 2]))
    l110, l111 = tl.split(tl.reshape(m11, [ROWS, NW, 2, 2]))
    c0, c8 = tl.split(l000)  # l_dcb holds codes d + 2c + 4b and that + 8
    c4, c12 = tl.split(l001)
    c2, c10 = tl.split(l010)
    c6, c14 = tl.split(l011)
    c1, c9 = tl.split(l100)
    c5, c13 = tl.split(l101)
    c3, c11 = tl.split(l110)
    c7, c15 = tl.split(l111)
    w0 = c0 | (c1 << 6) | (c2 << 12) | (c3 << 18) | (c4 << 24) | (c5 << 30)
    w1 = (c5 >> 2) | (c6 << 4) | (c7 << 10) | (c8 << 16) | (c9 << 22) | (c10 << 28)
    w2 = (c10 >> 4) | (c11 << 2) | (c12 << 8) | (c13 << 14) | (c14 << 20) | (c15 << 26)
    wp = codes_ptr.to(tl.pointer_type(tl.int32))
    base = rows[:, None] * (G * 6 // 32) + tl.arange(0, NW)[None, :] * 3
    tl.store(wp + base, w0, mask=row_ok[:, None])
    tl.store(wp + base + 1, w1, mask=row_ok[:, None])
    tl.store(wp + base + 2, w2, mask=row_ok[:, None])


@triton.jit
def _store_int4_words(codes_ptr, code, rows, row_ok, live, ROWS: tl.constexpr, G: tl.constexpr):
    """INT4 codes [ROWS, G] as one uint32 word per 8 codes (code k at bits [4k, 4k + 4), the same
    bytes as `store_codes`' byte path), taken apart with `tl.split` as in `_store_int6_words` and
    pushed in from the lowest (8 funnel shifts a word). codes_ptr must be 4-byte aligned."""
    NW: tl.constexpr = G // 8
    c = code.to(tl.uint32)
    n0, n1 = tl.split(tl.reshape(c, [ROWS, NW, 4, 2]))     # k & 1
    m00, m01 = tl.split(tl.reshape(n0, [ROWS, NW, 2, 2]))  # (k >> 1) & 1
    m10, m11 = tl.split(tl.reshape(n1, [ROWS, NW, 2, 2]))
    c0, c4 = tl.split(m00)  # m_ba holds codes b + 2a and that + 4
    c2, c6 = tl.split(m01)
    c1, c5 = tl.split(m10)
    c3, c7 = tl.split(m11)
    w = _push(_push(_push(_push(_push(_push(_push(_push(c0, c0, 4), c1, 4), c2, 4), c3, 4), c4, 4), c5, 4), c6, 4), c7, 4)
    wp = codes_ptr.to(tl.pointer_type(tl.uint32))
    tl.store(wp + rows[:, None] * NW + tl.arange(0, NW)[None, :], tl.where(live[:, None], w, 0), mask=row_ok[:, None])


@triton.jit
def _int6_word_triples(codes_ptr, rows, row_ok, G: tl.constexpr):
    """The three int32 words [ROWS, G // 16] of each 16 INT6 codes (`_store_int6_words`), 0 in
    masked rows."""
    wp = codes_ptr.to(tl.pointer_type(tl.int32))
    base = rows[:, None] * (G * 6 // 32) + tl.arange(0, G // 16)[None, :] * 3
    return (tl.load(wp + base, mask=row_ok[:, None], other=0), tl.load(wp + base + 1, mask=row_ok[:, None], other=0),
            tl.load(wp + base + 2, mask=row_ok[:, None], other=0))


@triton.jit
def _int6_in_order(l000, l001, l010, l011, l100, l101, l110, l111, ROWS: tl.constexpr, G: tl.constexpr):
    """[ROWS, G] from the 16 codes of each word triple given in pairs, l_dcb holding codes
    d + 2c + 4b and that + 8 (the inverse of `_store_int6_words`' halvings): joins only, so the
    codes stay in the thread that holds them."""
    NW: tl.constexpr = G // 16
    m00 = tl.reshape(tl.join(l000, l001), [ROWS, NW, 4])
    m01 = tl.reshape(tl.join(l010, l011), [ROWS, NW, 4])
    m10 = tl.reshape(tl.join(l100, l101), [ROWS, NW, 4])
    m11 = tl.reshape(tl.join(l110, l111), [ROWS, NW, 4])
    n0 = tl.reshape(tl.join(m00, m01), [ROWS, NW, 8])
    n1 = tl.reshape(tl.join(m10, m11), [ROWS, NW, 8])
    return tl.reshape(tl.join(n0, n1), [ROWS, G])


@triton.jit
def _load_int6_words(codes_ptr, rows, row_ok, ROWS: tl.constexpr, G: tl.constexpr):
    """The inverse of `_store_int6_words`: u8 codes [ROWS, G], 0 in masked rows."""
    w0, w1, w2 = _int6_word_triples(codes_ptr, rows, row_ok, G)
    c5 = _sext6((w1 << 2) | ((w0 >> 30) & 3), 0)    # straddles words 0 and 1
    c10 = _sext6((w2 << 4) | ((w1 >> 28) & 15), 0)  # straddles words 1 and 2
    l000 = tl.join(_sext6(w0, 0), _sext6(w1, 16))   # codes 0, 8
    l001 = tl.join(_sext6(w0, 24), _sext6(w2, 8))   # 4, 12
    l010 = tl.join(_sext6(w0, 12), c10)             # 2, 10
    l011 = tl.join(_sext6(w1, 4), _sext6(w2, 20))   # 6, 14
    l100 = tl.join(_sext6(w0, 6), _sext6(w1, 22))   # 1, 9
    l101 = tl.join(c5, _sext6(w2, 14))              # 5, 13
    l110 = tl.join(_sext6(w0, 18), _sext6(w2, 2))   # 3, 11
    l111 = tl.join(_sext6(w1, 10), _sext6(w2, 26))  # 7, 15
    c = _int6_in_order(l000, l001, l010, l011, l100, l101, l110, l111, ROWS, G)
    return c.to(tl.int8).to(tl.uint8, bitcast=True)


@triton.jit
def runtime_one(n):
    """1, made from a run-time value n >= 0 the compiler knows nothing of (a kernel argument), for
    `_field_f32`: its constants multiplied by it cannot be folded into its instructions, so each
    is computed once per launch and held in a register. Folded, each LOP3 would have two constant
    operands where the instruction takes one, and ptxas loads the second into a register before
    every use (sm_90, INT4 tagged reduce: 49 moves per rank and tile, 338 -> 390 instructions)."""
    return (n >= 0).to(tl.int32)


@triton.jit
def _field_f32(v, one, BITS: tl.constexpr, S: tl.constexpr):
    """The BITS-bit two's-complement code at bit S of int32 v as an exact FP32 value (S + BITS <= 23).

    One LOP3 puts the field's bits, its sign bit flipped (code + 2^(BITS-1): 0 .. 2^BITS - 1), in
    the mantissa of a float whose exponent makes the field's lowest bit weigh 1: the float is
    2^(23-S) + code + 2^(BITS-1), and one FADD takes the constant off. Both steps are exact, so
    the value is the code's own, as the conversion of the sign-extended integer gives it, in two
    instructions where the extract, sign-extend and integer conversion (a quarter-rate instruction
    on NVIDIA) take three. `one`: `runtime_one`.
    """
    HALF: tl.constexpr = 1 << (BITS - 1)
    MASK: tl.constexpr = ((1 << BITS) - 1) << S
    X: tl.constexpr = ((150 - S) << 23) | (HALF << S)  # the float 2^(23-S) + 2^(BITS-1): code 0
    f = ((v & MASK) ^ (one * X)).to(tl.float32, bitcast=True)
    return f - (2.0 ** (23 - S) + HALF)


@triton.jit
def _int4_words_f32(codes_ptr, rows, row_ok, one, ROWS: tl.constexpr, G: tl.constexpr):
    """INT4 codes [ROWS, G] stored as words of 8 (`_store_int4_words`) as exact FP32 values, 0 in
    masked rows: the low half-word's 4 codes in place, the high half's after one shift."""
    NW: tl.constexpr = G // 8
    wp = codes_ptr.to(tl.pointer_type(tl.int32))
    w = tl.load(wp + rows[:, None] * NW + tl.arange(0, NW)[None, :], mask=row_ok[:, None], other=0)
    hi = w >> 16  # the sign bits shifted in lie above every field read
    # [r, w, i, j, k] = code 4i + 2j + k (the innermost join is the last index)
    c = tl.join(tl.join(tl.join(_field_f32(w, one, 4, 0), _field_f32(hi, one, 4, 0)),
                        tl.join(_field_f32(w, one, 4, 8), _field_f32(hi, one, 4, 8))),
                tl.join(tl.join(_field_f32(w, one, 4, 4), _field_f32(hi, one, 4, 4)),
                        tl.join(_field_f32(w, one, 4, 12), _field_f32(hi, one, 4, 12))))
    return tl.reshape(c, [ROWS, G])


@triton.jit
def _int6_words_f32(codes_ptr, rows, row_ok, one, ROWS: tl.constexpr, G: tl.constexpr):
    """INT6 codes [ROWS, G] stored as word triples (`_store_int6_words`) as exact FP32 values, 0
    in masked rows. Fields ending above bit 23 are read after a shift by 12; the two that straddle
    words are put together first."""
    w0, w1, w2 = _int6_word_triples(codes_ptr, rows, row_ok, G)
    s0, s1, s2 = w0 >> 12, w1 >> 12, w2 >> 12
    c5 = (w1 << 2) | ((w0 >> 30) & 3)    # straddles words 0 and 1
    c10 = (w2 << 4) | ((w1 >> 28) & 15)  # straddles words 1 and 2
    l000 = tl.join(_field_f32(w0, one, 6, 0), _field_f32(w1, one, 6, 16))   # codes 0, 8
    l001 = tl.join(_field_f32(s0, one, 6, 12), _field_f32(w2, one, 6, 8))   # 4, 12
    l010 = tl.join(_field_f32(w0, one, 6, 12), _field_f32(c10, one, 6, 0))  # 2, 10
    l011 = tl.join(_field_f32(w1, one, 6, 4), _field_f32(s2, one, 6, 8))    # 6, 14
    l100 = tl.join(_field_f32(w0, one, 6, 6), _field_f32(s1, one, 6, 10))   # 1, 9
    l101 = tl.join(_field_f32(c5, one, 6, 0), _field_f32(w2, one, 6, 14))   # 5, 13
    l110 = tl.join(_field_f32(s0, one, 6, 6), _field_f32(w2, one, 6, 2))    # 3, 11
    l111 = tl.join(_field_f32(w1, one, 6, 10), _field_f32(s2, one, 6, 14))  # 7, 15
    return _int6_in_order(l000, l001, l010, l011, l100, l101, l110, l111, ROWS, G)


@triton.jit
def load_values(codes_ptr, rows, offs, row_ok, one, ROWS: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr,
                PACK_K: tl.constexpr, CODEC: tl.constexpr, FP8_HW: tl.constexpr, CDNA: tl.constexpr,
                NV: tl.constexpr = False):
    """A tile's codes [ROWS, G] from the wire as FP32 values (`decode_target_codes` of
    `load_codes`), 0 in masked rows. INT6 and INT4 words go to FP32 straight from the loaded
    words (`_field_f32`: two instructions per code), the same values, but on AMD's CDNA, where a
    bit-field extract with sign extension is one instruction (v_bfe_i32) and the mask and the xor
    two: there the word path of `load_codes` measured fewer (gfx942, P = 8: INT4 tagged reduce
    1.86 -> 1.77 warp-instructions per element, INT6 1.43 -> 1.32). `one`: `runtime_one`."""
    if PACK_K == INT4_WORD_CODES and CDNA == 0:
        return _int4_words_f32(codes_ptr, rows, row_ok, one, ROWS, G)
    elif PACK_K == INT6_WORD_CODES and CDNA == 0:
        return _int6_words_f32(codes_ptr, rows, row_ok, one, ROWS, G)
    else:
        codes = load_codes(codes_ptr, rows, offs, row_ok, ROWS, G, BITS, PACK_K)
        return decode_target_codes(codes, CODEC, FP8_HW, CDNA, tl.float32, NV)


@triton.jit
def store_codes(codes_ptr, code, rows, offs, row_ok, live, ROWS: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr,
                PACK_K: tl.constexpr):
    """Store a tile's u8 codes [ROWS, G] (integer codes: the int8 of the value) on the wire.

    `live` [ROWS]: where `zeroes_dead_rows` says so, the codes of rows where it is false are
    written as 0 whatever `code` holds there (a select per packed word, not one per code);
    elsewhere the caller has zeroed them and `code` is stored as it is.

    BITS < 8 (reference.pack_codes): each word of PACK_K (2 or 4) codes, code j in bits
    [j BITS, (j+1) BITS), goes out as its W = PACK_K BITS / 8 little-endian bytes; a group takes
    G BITS / 8 bytes. The codes of a word are taken apart with `tl.split` (neighbours in a row),
    which keeps them in the thread that holds them.
    """
    if BITS == 8:
        tl.store(codes_ptr + offs, code, mask=row_ok[:, None])
    elif PACK_K == INT6_WORD_CODES:
        _store_int6_words(codes_ptr, code, rows, row_ok, ROWS, G)
    elif PACK_K == INT4_WORD_CODES:
        _store_int4_words(codes_ptr, code, rows, row_ok, live, ROWS, G)
    else:
        W: tl.constexpr = PACK_K * BITS // 8
        NW: tl.constexpr = G // PACK_K
        c = code.to(tl.int32) & ((1 << BITS) - 1)
        if PACK_K == 2:
            c0, c1 = tl.split(tl.reshape(c, [ROWS, NW, 2]))
            word = c0 | (c1 << BITS)
        else:  # [r, w, i, j] = code 4w + 2i + j
            even, odd = tl.split(tl.reshape(c, [ROWS, NW, 2, 2]))
            c0, c2 = tl.split(even)
            c1, c3 = tl.split(odd)
            word = c0 | (c1 << BITS) | (c2 << (2 * BITS)) | (c3 << (3 * BITS))
        base = rows[:, None] * (G * BITS // 8) + tl.arange(0, NW)[None, :] * W
        for j in tl.static_range(W):
            tl.store(codes_ptr + base + j, ((word >> (8 * j)) & 0xFF).to(tl.uint8), mask=row_ok[:, None])


@triton.jit
def load_codes(codes_ptr, rows, offs, row_ok, ROWS: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr,
               PACK_K: tl.constexpr):
    """A tile's u8 codes [ROWS, G] from the wire, 0 in masked rows (reference.unpack_codes).

    BITS < 8: the W bytes of each word of PACK_K codes are loaded and its codes put back in row
    order with `tl.join` (the inverse of `store_codes`' split: neighbours stay in one thread).
    """
    if BITS == 8:
        return tl.load(codes_ptr + offs, mask=row_ok[:, None], other=0)
    elif PACK_K == INT6_WORD_CODES:
        return _load_int6_words(codes_ptr, rows, row_ok, ROWS, G)
    else:  # INT4 words are read as their bytes, 2 codes each (the compiler merges the loads)
        K: tl.constexpr = 2 if PACK_K == INT4_WORD_CODES else PACK_K
        W: tl.constexpr = K * BITS // 8
        NW: tl.constexpr = G // K
        base = rows[:, None] * (G * BITS // 8) + tl.arange(0, NW)[None, :] * W
        word = tl.zeros([ROWS, NW], dtype=tl.int32)
        for j in tl.static_range(W):
            word = word | (tl.load(codes_ptr + base + j, mask=row_ok[:, None], other=0).to(tl.int32) << (8 * j))
        # code j to the top of an int32, then an arithmetic shift down sign-extends it
        c0 = (word << (32 - BITS)) >> (32 - BITS)
        c1 = (word << (32 - 2 * BITS)) >> (32 - BITS)
        if K == 2:
            c = tl.join(c0, c1)
        else:
            c2 = (word << (32 - 3 * BITS)) >> (32 - BITS)
            c3 = (word << (32 - 4 * BITS)) >> (32 - BITS)
            c = tl.join(tl.join(c0, c2), tl.join(c1, c3))  # [r, w, i, j] = code 4w + 2i + j
        return tl.reshape(c, [ROWS, G]).to(tl.int8).to(tl.uint8, bitcast=True)


@triton.jit
def zeroes_dead_rows(PACK_K: tl.constexpr):
    """True when `store_codes` writes 0 for the codes of rows that are not live by itself, one
    select per packed word: INT4 words (1 select per 8 codes; the compiler moves a select of the
    values past the encoder and applies it per code). On INT6 words the same spilled 8-16 B in
    compress with the transform on sm_80/86/89 (G=256) and sm_100 (G=32), by bench/aot.py."""
    return PACK_K == INT4_WORD_CODES


@triton.jit
def saturating_encoder(CODEC: tl.constexpr, ROUND: tl.constexpr, FP8_HW: tl.constexpr):
    """True when `encode_codes` needs no clamp of v to +-code_max (values at most a few FP32 ulps
    past it saturate or round to the largest code by themselves): every round-to-nearest encoder."""
    return ROUND == NEAREST


@triton.jit
def decode_codes(codes, CODEC: tl.constexpr, FP8_HW: tl.constexpr, OUT_DTYPE: tl.constexpr,
                 NV: tl.constexpr = False):
    """Values of u8 codes in OUT_DTYPE (reference.decode_codes); exact in fp16 for every codec.

    Without hardware FP8 conversions (sm_80, AMD, the interpreter) the code's bits are placed in
    an fp16's fields: every E4M3 and E5M2 value, subnormals, Inf and NaN included, is an fp16.
    NV (compiled for NVIDIA): E4M3 goes through Triton's fp8e4b15 conversion, the same bit
    placement done by one PTX sequence per four codes (about 2 instructions per code instead of
    about 9; the interpreter's own fp8e4b15 conversion gets subnormals wrong, so not there).
    """
    if CODEC == INT8:
        return codes.to(tl.int8, bitcast=True).to(OUT_DTYPE)
    elif FP8_HW and CODEC == E4M3:
        return codes.to(tl.float8e4nv, bitcast=True).to(OUT_DTYPE)
    elif FP8_HW and CODEC == E5M2:
        return codes.to(tl.float8e5, bitcast=True).to(OUT_DTYPE)
    elif CODEC == E5M2:  # an E5M2 code is the top byte of the fp16 with the same value
        return (codes.to(tl.int16) << 8).to(tl.float16, bitcast=True).to(OUT_DTYPE)
    elif NV:  # E4M3 read as Triton's fp8e4b15 (bias 15: the value times 2^-8), 4 codes at a time
        v = codes.to(tl.float8e4b15, bitcast=True).to(tl.float16)
        v = tl.where(tl.abs(v) > 1.75, float("nan"), v) * 256.0  # code 0x7F: 1.875 there, NaN here
        return v.to(OUT_DTYPE)
    else:  # E4M3 bits moved into fp16's fields, then the exponent bias (7 vs 15) fixed by 2^8
        c = codes.to(tl.int16)
        v = (((c & 0x80) << 8) | ((c & 0x7F) << 7)).to(tl.float16, bitcast=True).to(tl.float32) * 256.0
        return tl.where((c & 0x7F) == 0x7F, float("nan"), v).to(OUT_DTYPE)


@triton.jit
def row_absmax(y, CDNA: tl.constexpr = 0):
    """[ROWS] largest |y| of each row (FP32 y); NaN if the row holds a NaN, Inf if it holds an Inf.

    Under the Hadamard transform every output of a row mixes every input, so a NaN/Inf input
    poisons the whole output row: this one reduction finds both the group's amax and whether
    the group was finite, with no separate scan of the input.
    """
    if CDNA > 0:
        # AMD: a NaN-propagating float max is three instructions (compare, select, max). The
        # largest |y| is the largest bit pattern with the sign cleared: non-negative floats order
        # as their bits, Inf above every finite value and NaN above Inf (a NaN comes out as some
        # NaN). NVIDIA's one max instruction propagates NaN and takes |y| as an operand.
        bits = tl.max(y.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1)
        return bits.to(tl.float32, bitcast=True)
    else:
        return tl.reduce(tl.abs(y), 1, _max_nan)


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def load_table(h_ptr, N: tl.constexpr):
    """An [N, N] matrix stored row-major at h_ptr (the launcher's cached Hadamard table)."""
    i = tl.arange(0, N)
    return tl.load(h_ptr + i[:, None] * N + i[None, :])


@triton.jit
def _dot_table(t, DOT_PREC: tl.constexpr):
    """A table as `_dot` consumes it: FP32 tables (signed powers of two, exact in bf16) become
    bf16 where FP32 operands are split into bf16 pieces (DOT_PREC "tf32x3", NVIDIA)."""
    if DOT_PREC == "tf32x3" and t.dtype == tl.float32:
        return t.to(tl.bfloat16)
    else:
        return t


@triton.jit
def load_tables(h_ptr, h16_ptr, G: tl.constexpr, DOT_PREC: tl.constexpr = "ieee"):
    """(h, h16): the transform's tables (see `hadamard_rows`), loaded once per program. Converted
    here, outside the tile loop, so the bf16 copy `_dot` needs is built once (converted inside
    the loop, sm_90 kept it in registers and spilled)."""
    return (_dot_table(load_table(h_ptr, G if G <= 128 else G // 16), DOT_PREC),
            _dot_table(load_table(h16_ptr, 16), DOT_PREC))


@triton.jit
def _bf16_pieces(a):
    """FP32 a as three bf16 pieces hi + mid + lo (see `_dot`), all formed before any dot uses
    them: a and its rest die first (a dot per piece computed on the way kept a live and spilled
    on sm_80 / sm_89). Exact; NaN pieces for +-Inf / NaN a (a row holding an Inf comes out NaN
    where an FP32 dot gives +-Inf: zeroing the NaN costs a select per element, 100% -> 95.6% for
    INT6 G=32 on sm_90)."""
    hi = (a.to(tl.uint32, bitcast=True) & 0xFFFF0000).to(tl.float32, bitcast=True)
    r = a - hi
    mid = (r.to(tl.uint32, bitcast=True) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return hi.to(tl.bfloat16), mid.to(tl.bfloat16), (r - mid).to(tl.bfloat16)


@triton.jit
def _dot(a, b, DOT_PREC: tl.constexpr, TABLE_LEFT: tl.constexpr = False):
    """a @ b accumulated in FP32, b a table of signed powers of two (exact in bf16); with
    TABLE_LEFT a is the table and b the data (batched: [B, M, K] @ [B, K, N]).

    16-bit a: one dot, exact products. FP32 a on NVIDIA (DOT_PREC "tf32x3"; Triton's default there
    would be one TF32 pass, rounding a to 10 mantissa bits): a is split into three bf16 pieces,
    hi = a with its low 16 bits cleared, mid = the same of a - hi, lo = a - hi - mid, each a bf16
    exactly and summing to a (8 + 8 + 8 significand bits; lo is rounded where it falls below
    bf16's subnormal spacing 2^-133, i.e. for |a| < 2^-110), and three bf16 dots
    accumulate hi, mid, lo against b in FP32: exact products, only the FP32 accumulation rounds.
    Non-finite a: a NaN gives NaN as an FP32 dot does; a row with an Inf gives NaN rather than
    +-Inf (compress codes such a group the same either way; the reduce to dense gets one only
    when the FP32 sum of the ranks overflowed, and then writes NaN for the group).
    It is cheaper than Triton's tf32x3 (three bf16 passes instead of three TF32 passes, and no
    FP32 copies of the pieces), which spilled on sm_80 and sm_90. FP32 a elsewhere: DOT_PREC
    ("ieee": AMD's FP32 matrix instructions, the interpreter).
    """
    if TABLE_LEFT:  # a is the table, b the data: the same with the dot's operands swapped
        data, table = b, a
    else:
        data, table = a, b
    if data.dtype == tl.float32 and DOT_PREC == "tf32x3":
        t = table.to(tl.bfloat16)
        p_hi, p_mid, p_lo = _bf16_pieces(data)
        acc = _ordered_dot(p_hi, t, None, TABLE_LEFT)
        acc = _ordered_dot(p_mid, t, acc, TABLE_LEFT)
        return _ordered_dot(p_lo, t, acc, TABLE_LEFT)
    elif data.dtype == tl.float32:
        return tl.dot(a, b, input_precision=DOT_PREC, out_dtype=tl.float32)
    else:
        return tl.dot(a, b, out_dtype=tl.float32)


@triton.jit
def _ordered_dot(data, table, acc, TABLE_LEFT: tl.constexpr):
    """table @ data (TABLE_LEFT) or data @ table, added to acc (None: a fresh FP32 sum)."""
    if TABLE_LEFT:
        return tl.dot(table, data, acc, out_dtype=tl.float32)
    else:
        return tl.dot(data, table, acc, out_dtype=tl.float32)


@triton.jit
def _dot_k_chunks(a, b, DOT_PREC: tl.constexpr):
    """`_dot` as a sum of dots over 32-column chunks of a (rows of b), halving K recursively.

    For FP32 a on mma.sync targets: each warp holds all rows of its A operand, so the three bf16
    pieces of a [64, 128] a take 384 registers per thread at once; by chunks of 32 they take 96
    (bench/aot.py, sm_80 compress of FP32 input: 32 registers and an 8 KB stack in one dot, 64 B
    of spill in chunks). Each chunk's dot accumulates in FP32 and the partial sums add in FP32:
    another summation order of the same products, within the same error bound.
    """
    if a.shape[1] >= 64:
        M: tl.constexpr = a.shape[0]
        K2: tl.constexpr = a.shape[1] // 2
        N: tl.constexpr = b.shape[1]
        a0, a1 = tl.split(tl.permute(tl.reshape(a, [M, 2, K2]), 0, 2, 1))
        b0, b1 = tl.split(tl.permute(tl.reshape(b, [2, K2, N]), 1, 2, 0))
        return _dot_k_chunks(a1, b1, DOT_PREC) + _dot_k_chunks(a0, b0, DOT_PREC)
    else:
        return _dot(a, b, DOT_PREC)


@triton.jit
def hadamard_rows(x, h, h16, ROWS: tl.constexpr, G: tl.constexpr, DOT_PREC: tl.constexpr, KRON: tl.constexpr = 0,
                  K_CHUNKS: tl.constexpr = False, TRANSPOSED: tl.constexpr = False):
    """x @ T for each of the ROWS rows of x, T the launcher's [G, G] table (scaled +-1 matrix).

    G <= 128: one dot with the table h. G = 256, 512: T = h (x) h16 (Kronecker, h of size G/16
    carrying the scale), two dots, so no operand exceeds 32x32; the second stage's operands are
    FP32 sums. KRON (`_launch.target_flags`) says how the second stage reaches the group's other
    axis: 0, transposes around a second dot [ROWS 16, G/16] @ h; 1, a batched dot with the table
    on the left, h^T @ [G/16, 16] per row, no transpose. By bench/aot.py the batched form is the
    cheaper one on sm_90 (compress G=256 73% -> 81% of copy bandwidth) and the dearer one on
    sm_80, sm_100 (compress G=256 63% -> 55%) and AMD.

    Precision: 16-bit operands (bf16/fp16 inputs, decoded codes) times a power of two are exact
    products, accumulated in FP32. Every dot with FP32 operands (FP32 or pre-scaled inputs of
    compress, the summed ranks of the reduce to dense, the second stage of G = 256/512) runs at
    DOT_PREC: on NVIDIA ("tf32x3") three exact bf16 pieces (`_dot`: exact products,
    FP32 accumulation in the tensor cores' order, `bounds.U_DOT["gpu"]`), IEEE FP32 on AMD and in
    the interpreter.
    K_CHUNKS (G <= 128, FP32 x, NVIDIA): the dot by `_dot_k_chunks`.
    TRANSPOSED (G <= 128, 16-bit x): y = (T^T x^T)^T, the table as the dot's first operand. On
    mma.sync targets the [64, 128] output of G = 128 is split over 4 warps by columns, so every
    warp holds (and the decompress decodes) all of x, 4 times over; transposed, the warps split
    2 x 2 and x is held twice (bench/aot.py, sm_80 decompress: 1.08 -> 0.91 instructions per
    element). Where the decode is one hardware conversion (sm_89+) it costs more than it saves.
    """
    A: tl.constexpr = G // 16
    if G <= 128 and TRANSPOSED and x.dtype != tl.float32:
        y = tl.trans(tl.dot(tl.trans(h), tl.trans(x), out_dtype=tl.float32))
    elif G <= 128 and K_CHUNKS and DOT_PREC == "tf32x3" and x.dtype == tl.float32:
        y = _dot_k_chunks(x, h, DOT_PREC)
    elif G <= 128:
        y = _dot(x, h, DOT_PREC)
    else:
        y = _dot(tl.reshape(x, [ROWS * A, 16]), h16, DOT_PREC)
    if G > 128 and KRON == 1:
        ht = tl.broadcast_to(tl.trans(h)[None, :, :], [ROWS, A, A])
        y = tl.reshape(_dot(ht, tl.reshape(y, [ROWS, A, 16]), DOT_PREC, True), [ROWS, G])
    elif G > 128:
        y = tl.reshape(tl.trans(tl.reshape(y, [ROWS, A, 16]), 0, 2, 1), [ROWS * 16, A])
        y = _dot(y, h, DOT_PREC)
        y = tl.reshape(tl.trans(tl.reshape(y, [ROWS, 16, A]), 0, 2, 1), [ROWS, G])
    return y


@triton.jit
def to_out_dtype(y, out_ptr, HW: tl.constexpr):
    """Cast FP32 y to the element type of out_ptr, round-to-nearest-even everywhere.

    The interpreter's FP32 -> BF16 cast truncates (measured: ~half of random values off by one
    ulp, also with fp_downcast_rounding="rtne"), so there the rounding is done on the bits first
    and the cast only drops zeros. y is already clamped to the finite range, so no carry reaches
    Inf; NaN stays NaN.
    """
    if (not HW) and out_ptr.dtype.element_ty == tl.bfloat16:
        b = y.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        y = b.to(tl.float32, bitcast=True)
    return y.to(out_ptr.dtype.element_ty)


@triton.jit
def encode_fp8_fnuz(v, CODEC: tl.constexpr):
    """OCP FP8 codes of |v| <= code_max, rounded to nearest even, through AMD CDNA3's FNUZ
    conversions (v_cvt_pk_fp8_f32 / v_cvt_pk_bf8_f32: two values per instruction).

    e4m3fnuz and e5m2fnuz have the exponent bias of OCP's e4m3fn and e5m2 plus one, so the FNUZ
    code of v / 2 has the bits of the OCP code of v, subnormals included (halving is exact and
    maps one grid onto the other, so round-to-nearest-even picks the same code). The formats
    differ only where the encoder never goes: FNUZ has no -0 (a negative v that rounds to zero
    gives +0, so the sign bit is put back from v) and its largest magnitudes (v / 2 above 224) are
    OCP's NaN codes, which |v| <= code_max never reaches. Equals `encode_codes` (nearest).
    """
    half = v * 0.5
    if CODEC == E4M3:
        fnuz = half.to(tl.float8e4b8).to(tl.uint8, bitcast=True)
    else:
        fnuz = half.to(tl.float8e5b16).to(tl.uint8, bitcast=True)
    sign = ((v.to(tl.uint32, bitcast=True) >> 24) & 0x80).to(tl.uint8)
    return (fnuz & 0x7F) | sign


@triton.jit
def decode_fp8_fnuz(codes, OUT_DTYPE: tl.constexpr):
    """Values of OCP E4M3 codes (u8) in OUT_DTYPE through AMD CDNA3's FNUZ conversion
    (v_cvt_pk_f32_fp8: two codes per instruction); equals `decode_codes` for E4M3.

    A code read as e4m3fnuz is half its OCP value (bias one higher) but for the two codes whose
    meaning differs: 0x80 (FNUZ NaN, OCP -0) and +-0x7F (FNUZ +-240, OCP NaN). (E5M2 codes keep
    `decode_codes`' two-instruction fp16 path.)
    """
    f = codes.to(tl.float8e4b8, bitcast=True).to(tl.float32)
    # both tests on the FNUZ value (its only NaN is 0x80, its only +-240 are +-0x7F): a compare
    # with |f| is one instruction (abs is an operand modifier), on the code two (mask, compare)
    v = tl.where(tl.abs(f) == 240.0, float("nan"), f * 2.0)
    return tl.where(f != f, -0.0, v).to(OUT_DTYPE)  # noqa: PLR0124 - f != f is True for NaN


@triton.jit
def decode_target_codes(codes, CODEC: tl.constexpr, FP8_HW: tl.constexpr, CDNA: tl.constexpr,
                        OUT_DTYPE: tl.constexpr, NV: tl.constexpr = False):
    """`decode_codes`, E4M3 to FP32 through the FNUZ conversion on gfx94x (CDNA 3). To fp16
    (the transform's 16-bit operands) `decode_codes`' bit placement is fewer instructions there."""
    if CDNA == 3 and CODEC == E4M3 and OUT_DTYPE == tl.float32:
        return decode_fp8_fnuz(codes, OUT_DTYPE)
    else:
        return decode_codes(codes, CODEC, FP8_HW, OUT_DTYPE, NV)
