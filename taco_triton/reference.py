"""Pure-torch reference of every stage of the codec: the test oracle and the CPU backend.

(Longer than the project's ~500 lines per module: the stages, the CPU backend's faster routes through
them and the bit-level conventions they share with the kernels stay in one file, so the oracle reads
in pipeline order beside what it checks.)

Each stage is a function of its own, in pipeline order:

1. `to_groups`       flatten and cut into groups of G (the last group zero-padded here; the
                     kernels mask instead of padding).
2. `hadamard_forward` / `hadamard_inverse`: block Walsh-Hadamard transform of size G. Forward is
                     y = x H / (2G), with H the +-1 Sylvester matrix. This is
                     the normalised transform up to a constant factor, chosen so that both
                     directions scale by powers of two only (exact) and |y| <= max|x| / 2 can never
                     overflow, even for inputs at the dtype's maximum. Inverse: x = 2 y H.
3. `dual_scales` / `taco_scales`: the group scales (see `CompressionConfig.scales`).
4. `encode_codes` / `decode_codes`: one byte per code. FP8 codes equal torch's
                     round-to-nearest-even cast; integer codes (8, 6 or 4 bits) are the int8 of
                     their value. `encode_codes_bits` is the integer-bit encoder the kernels use
                     in Triton's interpreter and for stochastic rounding, kept here so it is
                     tested against torch's cast. `pack_codes` / `unpack_codes`: the wire form
                     of sub-byte codes (INT6: four in three bytes, INT4: two per byte).
5. `compress_reference` / `decompress_reference` / `reduce_reference`: the whole pipeline on the
                     wire layout. They are the CPU backend, so they take faster routes than the
                     stages (fewer passes, in-place steps, look-up tables to decode, the 1/(2G)
                     folded into H for 16-bit inputs); the tests check that they give bit for bit
                     what the stages give.

The Hadamard matmul runs as one fixed-shape product per super-block (`_times_h`): how a BLAS
sums a row can depend on how many rows it is given (MKL changes its kernel for row blocks under
four), so transforming each super-block alone makes a group's bits independent of how a tensor
is sliced (the collectives' pipeline slices are super-block aligned).

Bit-level conventions shared with the kernels (`taco_triton/kernels/`):
- Non-finite groups: any NaN/Inf in a group's input marks the group with scale code 255 (dual) or
  a NaN absmax scale (taco_fp32x2); its codes are 0 and it decompresses to NaN.
- Unsigned E4M4 group scales: code = E<<4 | m, value (1 + m/16) 2^(E-15) for E >= 1 and
  m 2^-18 for E = 0, rounded up (never clips the group max). 1.0 is code 240; 255 means NaN.
"""
from __future__ import annotations

import functools
import math

import torch

from . import alloc
from .config import CODEC_SPECS, SUPERBLOCK_ELEMS, CodecSpec, CompressionConfig
from .layout import WireLayout

UE4M4_NAN = 255
#: Group scales below this are scaled by TINY_SCALE before their reciprocal (which would overflow).
TINY_SIGMA = 2.0**-126
TINY_SCALE = 2.0**64
_MASK32 = 0xFFFFFFFF


# --------------------------------------------------------------------------- 1. groups
def to_groups(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """Flatten `x` to FP32 and reshape to [n_groups, G], zero-padding the last group."""
    flat = x.reshape(-1).float()
    n_groups = -(-flat.numel() // group_size)
    pad = n_groups * group_size - flat.numel()
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(n_groups, group_size)


# --------------------------------------------------------------------------- 2. Hadamard
def hadamard_matrix(g: int, dtype=torch.float32, device=None) -> torch.Tensor:
    """The +-1 Sylvester-Hadamard matrix of size g: H[i, j] = (-1)^popcount(i & j). Symmetric."""
    return _hadamard_matrix(g, dtype, torch.device(device or "cpu"))


@functools.lru_cache(maxsize=64)
def _hadamard_matrix(g: int, dtype, device, scale: float = 1.0) -> torch.Tensor:
    i = torch.arange(g, device=device)
    v = i[:, None] & i[None, :]
    parity = torch.zeros_like(v)
    for k in range(g.bit_length()):  # a fixed trip count, so torch.compile traces it without breaks
        parity ^= (v >> k) & 1
    return ((1 - 2 * parity) * scale).to(dtype)


def _times_h(rows: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """rows [n, G] @ h [G, G], as one [4096/G, G] x [G, G] product per super-block.

    Row 0 starts a super-block; rows are zero-padded to whole super-blocks (no copy when they
    already are). Every super-block goes through a product of the same shape, so its bits do not
    depend on how many rows are transformed together.
    """
    n, g = rows.shape
    per_sb = SUPERBLOCK_ELEMS // g
    n_sb = -(-n // per_sb)
    if n_sb * per_sb != n:
        rows = torch.cat([rows, rows.new_zeros(n_sb * per_sb - n, g)])
    out = torch.bmm(rows.view(n_sb, per_sb, g), h.expand(n_sb, g, g))
    return out.view(n_sb * per_sb, g)[:n]


def hadamard_forward(groups: torch.Tensor) -> torch.Tensor:
    """y = x H / (2G) per row; the 1/(2G) is applied first, so the sum cannot overflow.

    Row 0 of `groups` is the first group of a super-block (see `_times_h`).
    """
    g = groups.shape[-1]
    return _times_h(groups * (0.5 / g), hadamard_matrix(g, groups.dtype, groups.device))


def hadamard_inverse(y: torch.Tensor) -> torch.Tensor:
    """x = 2 y H per row: the exact inverse of `hadamard_forward` (H H = G I)."""
    return _times_h(y, hadamard_matrix(y.shape[-1], y.dtype, y.device)) * 2.0


# --------------------------------------------------------------------------- bit helpers
def _f32_bits(v: torch.Tensor) -> torch.Tensor:
    return v.float().contiguous().view(torch.int32).to(torch.int64) & _MASK32


def _f32_from_bits(b: torch.Tensor) -> torch.Tensor:
    return (b & _MASK32).to(torch.uint32).view(torch.int32).view(torch.float32)


def _split_float(v: torch.Tensor):
    """(sign, e, M) of FP32 values: |v| = M * 2^(e - 23), M with the implicit bit, e >= -126."""
    b = _f32_bits(v)
    sign = b >> 31
    raw_e = (b >> 23) & 0xFF
    mant = b & 0x7FFFFF
    full = torch.where(raw_e > 0, mant | 0x800000, mant)
    e = torch.clamp(raw_e, min=1) - 127
    return sign, e, full


def _round_shift(m: torch.Tensor, s: torch.Tensor, mode: str, rand: torch.Tensor | None = None):
    """m >> s rounded: "nearest" (half to even), "ceil", or "stochastic" (with 32 random bits).

    m < 2^24. Nearest and ceil clamp s at 25, where the result is already exactly 0 or 1.
    Stochastic rounds up with probability (m mod 2^s) / 2^s, exact for s <= 31; beyond that
    (values under 2^-8 of the code grid's smallest step) s is clamped at 31, which leaves a bias of
    at most 2^-31 steps. Everything fits in uint32, as in the kernels.
    """
    one = torch.ones_like(s)
    if mode == "stochastic":
        s = torch.clamp(s, max=31)
        return (m + (rand & ((one << s) - 1))) >> s
    s = torch.clamp(s, max=25)
    if mode == "ceil":
        return (m + (one << s) - 1) >> s
    q = m >> s
    rem = m & ((one << s) - 1)
    half = one << (s - 1)
    up = (rem > half) | ((rem == half) & ((q & 1) == 1))
    return q + up.to(q.dtype)


def mix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser on int64 tensors holding uint32 values."""
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _MASK32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _MASK32
    return x ^ (x >> 16)


def random_bits(seed: int, index: torch.Tensor) -> torch.Tensor:
    """32 reproducible random bits per int64 element index (counter-based: no state)."""
    lo = index & _MASK32
    hi = index >> 32
    return mix32(lo ^ mix32(hi ^ mix32(torch.full_like(index, seed))))


# --------------------------------------------------------------------------- 3. scales
def encode_ue4m4_ceil(r: torch.Tensor) -> torch.Tensor:
    """Unsigned E4M4 code of r in [0, 1], rounded up (so the decoded scale never clips)."""
    _, e, m = _split_float(r)
    eq = torch.clamp(e, min=-14)
    s = 19 + eq - e
    return (eq + 14) * 16 + _round_shift(m, s, "ceil")


def decode_ue4m4(code: torch.Tensor) -> torch.Tensor:
    """FP32 value of unsigned E4M4 codes (255 -> NaN)."""
    c = code.to(torch.int64)
    big_e, m = c >> 4, c & 15
    normal = _f32_from_bits(((big_e - 15 + 127) << 23) | (m << 19))
    sub = m.float() * 2.0**-18
    out = torch.where(big_e > 0, normal, sub)
    return torch.where(c == UE4M4_NAN, torch.full_like(out, float("nan")), out)


def group_finite(groups: torch.Tensor) -> torch.Tensor:
    """[n_groups] bool: every element of the group is finite."""
    return torch.isfinite(groups).all(dim=1)


def dual_scales(y: torch.Tensor, finite: torch.Tensor, spec: CodecSpec, groups_per_sb: int):
    """Superblock FP32 scales S, group codes d (u8) and the effective group scales S * d(code).

    S = max over the superblock's finite groups of amax / code_max, so the largest group gets
    d = 1 exactly (code 240) and is scaled absmax-to-code_max like TACO's FP32 scales.
    """
    n_groups = y.shape[0]
    amax = torch.where(finite, y.abs().amax(dim=1), y.new_zeros(n_groups))
    n_sb = -(-n_groups // groups_per_sb)
    padded = torch.cat([amax, amax.new_zeros(n_sb * groups_per_sb - n_groups)])
    sb_amax = padded.view(n_sb, groups_per_sb).amax(dim=1)
    sb_scale = sb_amax / spec.code_max
    sb_of_group = sb_amax.repeat_interleave(groups_per_sb)[:n_groups]
    ratio = torch.where(sb_of_group > 0, amax / sb_of_group, torch.zeros_like(amax))
    codes = torch.where(finite, encode_ue4m4_ceil(ratio), torch.full_like(amax, UE4M4_NAN, dtype=torch.int64))
    sigma = sb_scale.repeat_interleave(groups_per_sb)[:n_groups] * decode_ue4m4(codes)
    return sb_scale, codes.to(torch.uint8), sigma


def mean_square(groups: torch.Tensor) -> torch.Tensor:
    """Per-group mean of squares, NaN/Inf elements counted as 0."""
    finite = torch.where(torch.isfinite(groups), groups, 0.0)
    return (finite * finite).sum(dim=1) / groups.shape[1]


def taco_prescale(ms: torch.Tensor, finite: torch.Tensor, spec: CodecSpec) -> torch.Tensor:
    """TACO's adaptive pre-scale from a mean square: clamp(code_max / sqrt(ms + 1e-6), 1e-3, 1e3).

    1 for non-finite groups.
    """
    return torch.where(finite, torch.clamp(spec.code_max / torch.sqrt(ms + 1e-6), 1e-3, 1e3), 1.0)


def taco_scales(y: torch.Tensor, finite: torch.Tensor, spec: CodecSpec) -> torch.Tensor:
    """TACO's absmax scale per group, q = amax / code_max (NaN for non-finite groups)."""
    q = y.abs().amax(dim=1) / spec.code_max
    return torch.where(finite, q, torch.full_like(q, float("nan")))


# --------------------------------------------------------------------------- 4. codes
def scale_to_codes(y: torch.Tensor, sigma: torch.Tensor, spec: CodecSpec) -> torch.Tensor:
    """v = y * (1 / sigma) per group, clamped to +-code_max (0 where sigma is 0 or NaN).

    One correctly rounded reciprocal per group and one multiply per element, as the kernels do
    (a division per element costs them more than the rest of quantization). Groups with
    sigma < 2^-126, whose reciprocal would overflow FP32, are first scaled by 2^64 (exact).
    """
    s = sigma[:, None]
    live = s > 0  # false for NaN (non-finite groups)
    k = torch.where(s < TINY_SIGMA, TINY_SCALE, 1.0)
    rcp = 1.0 / torch.where(live, s * k, torch.ones_like(s))
    v = torch.where(live, (y * k) * rcp, torch.zeros_like(y))
    return v.clamp(-spec.code_max, spec.code_max)


def encode_codes(v: torch.Tensor, spec: CodecSpec) -> torch.Tensor:
    """Round-to-nearest-even codes (u8) of scaled values |v| <= code_max, via torch's own casts."""
    if spec.is_float:
        return v.to(spec.torch_dtype).view(torch.uint8)
    return torch.round(v).to(torch.int8).view(torch.uint8)


def encode_codes_bits(v: torch.Tensor, spec: CodecSpec, mode: str = "nearest", rand=None) -> torch.Tensor:
    """The kernels' integer-bit encoder: nearest-even, or stochastic with 32 random bits each.

    For FP8: with |v| = M 2^(e-23), the code grid's exponent is eq = max(e, emin), so dropping
    s = 23 - mbits + (eq - e) bits of M gives the code's significand n, and the code is
    (eq - emin) << mbits plus n; a carry out of n moves into the exponent by itself.
    INT8 drops s = 23 - e bits (quantum 1).
    """
    sign, e, m = _split_float(v)
    if spec.is_float:
        eq = torch.clamp(e, min=spec.emin)
        s = 23 - spec.mbits + eq - e
        mag = ((eq - spec.emin) << spec.mbits) + _round_shift(m, s, mode, rand)
        return (mag | (sign << 7)).to(torch.uint8)
    s = 23 - e
    mag = _round_shift(m, s, mode, rand)
    return (torch.where(sign == 1, -mag, mag) & 0xFF).to(torch.uint8)


def decode_codes(codes: torch.Tensor, spec: CodecSpec) -> torch.Tensor:
    """FP32 values of u8 codes (one byte per code: `unpack_codes` first for packed ones)."""
    return codes.view(spec.torch_dtype).float()


def packing(bits: int) -> tuple[int, int]:
    """(codes per word K, bytes per word W) of `bits`-bit codes: the smallest run of codes that
    fills whole bytes (INT6: 4 codes in 3 bytes; INT4: 2 in 1). A word is at most 32 bits (the
    kernels assemble it in one uint32)."""
    k = 8 // math.gcd(bits, 8)
    if k * bits > 32:
        raise ValueError(f"{bits}-bit codes pack into {k * bits}-bit words; at most 32 are supported")
    return k, k * bits // 8


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[n, G] u8 codes (int8 of values within +-(2^(bits-1) - 1)) -> [n, G * bits / 8] wire bytes.

    Each word of K codes holds code j in bits [j * bits, (j + 1) * bits), two's complement,
    and goes on the wire little-endian."""
    if bits == 8:
        return codes
    k, w = packing(bits)
    n, g = codes.shape
    c = (codes.to(torch.int64) & ((1 << bits) - 1)).view(n, g // k, k)
    word = (c << (torch.arange(k, device=codes.device) * bits)).sum(dim=2)  # disjoint bit fields
    shifts = torch.arange(w, device=codes.device) * 8
    return ((word[:, :, None] >> shifts) & 0xFF).to(torch.uint8).view(n, g * bits // 8)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `pack_codes`: [n, G * bits / 8] wire bytes -> [n, G] u8 codes (int8 of the value)."""
    if bits == 8:
        return packed
    k, w = packing(bits)
    n, nbytes = packed.shape
    b = packed.to(torch.int64).view(n, nbytes // w, w)
    word = (b << (torch.arange(w, device=packed.device) * 8)).sum(dim=2)
    c = (word[:, :, None] >> (torch.arange(k, device=packed.device) * bits)) & ((1 << bits) - 1)
    c = c - ((c >> (bits - 1)) << bits)  # sign-extend
    return c.to(torch.int8).view(torch.uint8).view(n, nbytes * 8 // bits)


# --------------------------------------------------------------------------- 5. pipeline
def transform(x: torch.Tensor, config: CompressionConfig) -> torch.Tensor:
    """Stages 1-2: the [n_groups, G] FP32 values that get quantized (the "transformed domain")."""
    groups = to_groups(x, config.group_size)
    return hadamard_forward(groups) if config.hadamard else groups


@functools.lru_cache(maxsize=16)
def _ue4m4_table(device: torch.device) -> torch.Tensor:
    """`decode_ue4m4` of every code 0..255, ascending up to code 240 (1.0)."""
    return decode_ue4m4(torch.arange(256, device=device))


def _row_amax(y: torch.Tensor) -> torch.Tensor:
    """max |y| per row, NaN or Inf where the row holds one (so isfinite of it is `group_finite`;
    after the Hadamard too, as a non-finite input reaches every output of its row). Two plain
    row reductions: torch runs them several times faster than abs().amax() or an inf-norm."""
    return torch.maximum(y.amax(dim=1).abs_(), y.amin(dim=1).abs_())


@functools.lru_cache(maxsize=16)
def _code_values(codec: str, device: torch.device) -> torch.Tensor:
    """`decode_codes` of every byte 0..255: a look-up table (torch's own FP8 cast is slow on CPU)."""
    return decode_codes(torch.arange(256, dtype=torch.uint8, device=device), CODEC_SPECS[codec])


def _superblock_rows(x: torch.Tensor, layout: WireLayout, scale: float = 1.0) -> torch.Tensor:
    """x flattened into a new FP32 [n_superblocks * 4096/G, G] tensor, zero-padded to whole
    super-blocks, times `scale` (exact: a power of two, applied in FP32 as in `hadamard_forward`)."""
    flat = torch.empty(layout.n_superblocks * SUPERBLOCK_ELEMS, dtype=torch.float32, device=x.device)
    flat[x.numel():].zero_()
    src = x.reshape(-1)
    if scale == 1.0:
        flat[: x.numel()].copy_(src)
    else:
        torch.mul(src.float(), scale, out=flat[: x.numel()])
    return flat.view(-1, layout.group_size)


def _quantize(y: torch.Tensor, amax: torch.Tensor, finite: torch.Tensor, pre, config: CompressionConfig,
              layout: WireLayout, scratch: bool = False) -> torch.Tensor:
    """Stages 3-4 (`dual_scales` / `taco_scales`, `scale_to_codes`, the encoders) written for speed.

    y: [n_groups or more, G], its row maxima `amax` and `finite` flags (consistent with y: a row
    with a positive scale is all finite). Rows past n_groups are zero padding. With `scratch`, y
    is overwritten.
    """
    spec = CODEC_SPECS[config.codec]
    n, gps = layout.n_groups, layout.groups_per_superblock
    data = alloc.empty(layout.nbytes, torch.uint8, y.device)
    codes, scale_a, scale_b = layout.split(data)
    if config.scales == "dual":
        amax = torch.where(finite, amax, 0.0)
        amax = torch.nn.functional.pad(amax, (0, max(0, layout.n_superblocks * gps - amax.numel())))
        sb_amax = amax[: layout.n_superblocks * gps].view(-1, gps).amax(dim=1)
        torch.div(sb_amax, spec.code_max, out=scale_a)
        sb_of_group = sb_amax.repeat_interleave(gps)[:n]
        ratio = torch.where(sb_of_group > 0, amax[:n] / sb_of_group, 0.0)
        ue = torch.where(finite[:n], encode_ue4m4_ceil(ratio), UE4M4_NAN)
        scale_b.copy_(ue)
        sigma = scale_a.repeat_interleave(gps)[:n] * _ue4m4_table(y.device).index_select(0, ue)
    else:
        scale_a.copy_(pre[:n])
        sigma = torch.where(finite[:n], amax[:n] / spec.code_max, float("nan"))
        scale_b.copy_(sigma)
    ok = sigma > 0  # else the group is all zero codes (zero, underflowing or non-finite)
    tiny = sigma < TINY_SIGMA  # as `scale_to_codes`: y * 2^64 first, then the reciprocal of sigma * 2^64
    k = torch.where(tiny, TINY_SCALE, 1.0)
    rcp = 1.0 / torch.where(ok, sigma * k, 1.0)
    v = y[:n] if scratch else y[:n].clone()
    if bool(tiny.any()):
        v.mul_(k[:, None])
    v.mul_(rcp[:, None])
    v.clamp_(-spec.code_max, spec.code_max)
    byte_codes = codes if spec.bits == 8 else torch.empty(v.shape, dtype=torch.uint8, device=v.device)
    if config.stochastic:
        idx = torch.arange(v.numel(), dtype=torch.int64, device=v.device).view_as(v)
        byte_codes.copy_(encode_codes_bits(v, spec, "stochastic", random_bits(config.seed, idx)))
    elif spec.is_float:
        byte_codes.view(spec.torch_dtype).copy_(v)
    else:
        byte_codes.view(torch.int8).copy_(v.round_())
    byte_codes.mul_(ok.to(torch.uint8)[:, None])
    if spec.bits != 8:
        codes.copy_(pack_codes(byte_codes, spec.bits))
    return data


def quantize_groups(
    y: torch.Tensor, finite: torch.Tensor, pre: torch.Tensor | None, config: CompressionConfig, numel: int
) -> torch.Tensor:
    """Stages 3-4 on transformed groups y [n_groups, G]: the wire buffer of a `numel`-element tensor.

    `pre` is TACO's pre-scale (already applied to y) for taco_fp32x2, None for dual scales.
    `finite` is `group_finite` of the untransformed groups.
    """
    return _quantize(y, _row_amax(y), finite, pre, config, WireLayout.of(numel, config))


def compress_reference(x: torch.Tensor, config: CompressionConfig) -> torch.Tensor:
    """Compress `x` into its wire buffer (1-D uint8 of `WireLayout.of(x.numel(), config).nbytes`)."""
    spec = CODEC_SPECS[config.codec]
    layout = WireLayout.of(x.numel(), config)
    g = config.group_size
    h_scale = 0.5 / g if config.hadamard else 1.0
    pre = None
    if config.scales == "taco_fp32x2":
        rows = _superblock_rows(x, layout)
        finite = torch.isfinite(_row_amax(rows))
        pre = taco_prescale(mean_square(rows), finite, spec)
        rows.mul_(pre[:, None]).mul_(h_scale)
        h_scale = 1.0
    elif x.dtype == torch.float32:
        rows, h_scale = _superblock_rows(x, layout, h_scale), 1.0
    else:  # a 16-bit value times 1/(2G) is exact in FP32, so the scale moves into H at no cost
        rows = _superblock_rows(x, layout)
    y = _times_h(rows, _hadamard_matrix(g, torch.float32, rows.device, h_scale)) if config.hadamard else rows
    amax = _row_amax(y)
    if pre is None:
        finite = torch.isfinite(amax)
    return _quantize(y, amax, finite, pre, config, layout, scratch=True)


def _load(data: torch.Tensor, numel: int, config: CompressionConfig, pad: bool):
    """`load_codes`, the decoded codes zero-padded to whole super-blocks if `pad`."""
    layout = WireLayout.of(numel, config)
    spec = CODEC_SPECS[config.codec]
    codes, a, b = layout.split(data)
    codes = unpack_codes(codes, spec.bits)
    n = layout.n_groups
    rows = layout.n_superblocks * layout.groups_per_superblock if pad else n
    vals = torch.empty(rows, layout.group_size, dtype=torch.float32, device=data.device)
    if spec.is_float:
        torch.index_select(_code_values(config.codec, data.device), 0, codes.reshape(-1).int(),
                           out=vals[:n].view(-1))
    else:
        vals[:n].copy_(codes.view(torch.int8))
    vals[n:].zero_()
    if config.scales == "dual":
        sigma = a.repeat_interleave(layout.groups_per_superblock)[:n] * _ue4m4_table(data.device).index_select(
            0, b.int())
        return vals, sigma, None
    return vals, b, a


def load_codes(data: torch.Tensor, numel: int, config: CompressionConfig):
    """(decoded codes [n_groups, G], group scales sigma [n_groups], pre-scales or None)."""
    return _load(data, numel, config, pad=False)


def group_factors(sigma: torch.Tensor, pre: torch.Tensor | None) -> torch.Tensor:
    """What a group's code values are multiplied by to decode them: sigma, divided by TACO's
    pre-scale for taco_fp32x2. One division per group, not per element (the order TACO's own
    decoder uses, value * sigma / pre, costs a division per element; the two differ by at most
    an FP32 rounding, both within two roundings of the exact value)."""
    return sigma if pre is None else sigma / pre


def saturate_cast(y: torch.Tensor, dtype: torch.dtype, inf_above: float = math.inf) -> torch.Tensor:
    """Cast to `dtype`, clamping finite overflow to the dtype's largest value (NaN stays NaN).

    Magnitudes above `inf_above` become +-inf instead (the collectives pass a threshold just past
    the largest value, so a reduced sum that overflowed stays visible as in the native collective).
    """
    big = torch.finfo(dtype).max
    # Casting first gives the same values (rounding is monotonic and `big` is representable), on
    # half the bytes when dtype is 16-bit.
    out = y.to(dtype).clamp(-big, big)
    if inf_above != math.inf:
        out = torch.where(y > inf_above, math.inf, torch.where(y < -inf_above, -math.inf, out))
    return out


def decompress_reference(
    data: torch.Tensor, numel: int, config: CompressionConfig, dtype: torch.dtype = torch.float32,
    inf_above: float = math.inf,
) -> torch.Tensor:
    """Inverse of `compress_reference`: a flat tensor of `numel` values of `dtype` (`inf_above`:
    see `saturate_cast`)."""
    vals, sigma, pre = _load(data, numel, config, pad=config.hadamard)
    n = sigma.numel()
    f = group_factors(sigma, pre)
    if config.hadamard:  # +-1 transform of the codes first, then one scale multiply per element
        y = _times_h(vals, hadamard_matrix(config.group_size, device=vals.device))[:n]
        y.mul_((2.0 * f)[:, None])
    else:
        y = vals.mul_(f[:, None])
    return saturate_cast(y.view(-1)[:numel], dtype, inf_above)


def reduce_reference(
    bufs: torch.Tensor, numel: int, config: CompressionConfig, scale: float = 1.0,
    dense_dtype: torch.dtype | None = None, inf_above: float = math.inf,
) -> torch.Tensor:
    """The collectives' fused step: dequantize P wire buffers of one chunk, sum, requantize.

    bufs: [P, stride] uint8, row p holding rank p's wire buffer of the same `numel`-element chunk
    in its first `nbytes`. The sum runs in FP32 over p = 0..P-1, in the transformed domain (the
    Hadamard is linear, so no inverse/forward transform between sum and requantization), then is
    multiplied by `scale` (1/P for "avg"). Returns the chunk's wire buffer, or with `dense_dtype`
    its decompressed values (what reduce_scatter keeps).
    """
    layout = WireLayout.of(numel, config)
    n, g = layout.n_groups, config.group_size
    acc = None
    for p in range(bufs.shape[0]):
        vals, sigma, pre = _load(bufs[p, : layout.nbytes], numel, config, pad=True)
        vals[:n].mul_(group_factors(sigma, pre)[:, None])
        acc = vals if acc is None else acc.add_(vals)
    if scale != 1.0:  # x * 1.0 is x, bit for bit
        acc.mul_(scale)
    a = acc[:n]
    amax = _row_amax(a)
    finite = torch.isfinite(amax)
    if dense_dtype is not None:
        y = _times_h(acc, hadamard_matrix(g, device=acc.device)).mul_(2.0)[:n] if config.hadamard else a
        return saturate_cast(y.reshape(-1)[:numel], dense_dtype, inf_above)
    pre = None
    if config.scales == "taco_fp32x2":  # mean(x^2) of the original domain: 4G mean(y^2) under H/(2G)
        ms = mean_square(a) * (4.0 * g if config.hadamard else 1.0)
        pre = taco_prescale(ms, finite, CODEC_SPECS[config.codec])
        a.mul_(pre[:, None])
        amax = _row_amax(a)
    return _quantize(a, amax, finite, pre, config, layout, scratch=True)
