"""@triton.jit building blocks that act on one program's tile: SBT super-blocks of GPS groups of G.

A tile is ROWS = SBT * GPS groups (rows) of G elements, 8192 elements for every G: 64 rows at
G = 128, so the transform's dot is one m64 warpgroup MMA on Hopper. Compress is load -> transform
-> `quantize_store`; decompress is `load_scales` + codes -> transform -> `store_dense`; the
collectives' fused reduce sums decoded tiles over ranks, then `quantize_store` or `store_dense`.
Each mirrors a function in `reference.py`.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._common import (
    FLT_MAX,
    INT8,
    NEAREST,
    STOCHASTIC,
    TINY_SCALE,
    TINY_SIGMA,
    decode_ue4m4,
    encode_codes,
    encode_fp8_fnuz,
    encode_ue4m4_ceil,
    saturating_encoder,
    random_bits,
    store_codes,
    zeroes_dead_rows,
    to_out_dtype,
)
from . import slots
from ._slot_io import WHOLE_PATH, WHOLE_RUN_PATH, aligned_vec
from ._tables import TILE_ELEMS


def aligned_split(numel: int) -> int:
    """Elements of the aligned main launch of a single-tensor launcher, 0 for one launch.

    Triton specializes a launch on whether `numel` is a multiple of 16; when it is not, the masks
    of 8-element runs are not provably uniform and the dense loads and stores become scalar
    accesses (bench/aot.py: gfx942 decompress 26.4% -> 21.8% of copy bandwidth). So such a size
    runs as a main launch over its whole tiles (`numel // TILE_ELEMS * TILE_ELEMS` elements, a
    multiple of 16: vector accesses) and a one-program launch over the last, partial tile (its own
    specialization, constexpr TAIL: it runs that one tile number, no loop, so the main launch
    compiles exactly as a plain one). Both take the same pointers and the global element indices,
    so every tile, its masks and its stochastic random stream are those of one launch over
    everything: the bytes are the same. Aligned sizes and sizes under one tile: 0.
    """
    if numel % slots.VECTOR_ELEMS == 0 or numel < TILE_ELEMS:
        return 0
    return numel // TILE_ELEMS * TILE_ELEMS


def check_inf_above(inf_above: float, dtype) -> None:
    """ValueError unless `inf_above` (see `store_dense`) is infinite or at least the magnitude from
    which a cast to `dtype` (bf16, fp16, fp32; round to nearest) gives +-inf: its largest finite
    value plus half an ulp there."""
    import math

    import torch

    fi = torch.finfo(dtype)
    edge = fi.max + 2.0 ** (math.floor(math.log2(fi.max)) + math.log2(fi.eps) - 1)
    if inf_above < edge:
        raise ValueError(f"inf_above={inf_above!r} is below {edge!r}, where a cast to {dtype} rounds to inf: "
                         "values between would saturate in the reference and not here")


@triton.jit
def tile_rows(tile, n_groups, ROWS: tl.constexpr, G: tl.constexpr):
    """(rows [ROWS] int64, element offsets [ROWS, G] int64, rows < n_groups) of tile number `tile`."""
    rows = tl.arange(0, ROWS).to(tl.int64) + tile * ROWS  # n_groups < 2^31: tile * ROWS fits int32
    return rows, rows[:, None] * G + tl.arange(0, G)[None, :], rows < n_groups


@triton.jit
def whole_tile_ptrs(ptr, off, tile, ROWS: tl.constexpr, G: tl.constexpr):
    """The addresses [ROWS, G] of tile number `tile` of the piece at ptr + off, for a whole tile on
    `slots.WHOLE_PATH`: the tile's first element once, as a scalar, and int32 offsets within the
    tile. Written as `tile_rows` writes them (int64 rows times G, per element), ptxas computed
    each element's 64-bit offset apart and held them across the tile loop (bench/aot.py, sm_90
    all_gather's INT4 decompress of an odd size: 255 registers and 296 B of spills; this way 254
    and none)."""
    start = off + tile.to(tl.int64) * (ROWS * G)
    return ptr + start + (tl.arange(0, ROWS)[:, None] * G + tl.arange(0, G)[None, :])


@triton.jit
def load_whole_tile(ptr, off, tile, ROWS: tl.constexpr, G: tl.constexpr):
    """Tile number `tile` [ROWS, G] of the piece at ptr + off, a whole tile (no mask), on
    `slots.WHOLE_RUN_PATH`: loaded as one run of ROWS * G elements from the tile's first element
    (a scalar, computed once) and reshaped in order. Each thread's elements then lie at fixed
    distances from one address, which ptxas folds into the loads' immediates, where the 2-D
    offsets of `whole_tile_ptrs` cost an address computation per element (sm_90 all_gather's INT4
    decompress of an odd size, that path's instructions per tile: 297 -> 138); the reshape then
    moves the tile to the layout its math takes, which costs more than it saves for some codecs
    and targets (`slots.kernel_paths`)."""
    N: tl.constexpr = ROWS * G
    return tl.reshape(tl.load(ptr + (off + tile.to(tl.int64) * N) + tl.arange(0, N)), [ROWS, G])


@triton.jit
def store_whole_tile(v, ptr, off, tile):
    """Store v [ROWS, G] as tile number `tile` of the piece at ptr + off, a whole tile (no mask),
    as `load_whole_tile` loads one."""
    N: tl.constexpr = v.shape[0] * v.shape[1]
    tl.store(ptr + (off + tile.to(tl.int64) * N) + tl.arange(0, N), tl.reshape(v, [N]))


@triton.jit
def load_dense(base, off, offs, numel, fast, SPLIT: tl.constexpr, tile=0):
    """A tile's dense input at base + off + offs (0 past numel). SPLIT (a slotted launch with two
    paths per tile, `slots.two_paths`, or the tagged dense reduce's): where `fast`, VECTOR_PATH (or
    True) writes the same address and mask with `aligned_vec`, so the compiler sees multiples of 16
    elements and keeps 16-byte vector loads; WHOLE_PATH (a whole tile, number `tile`) loads without a
    mask, element by element: no address there is known to be 16-byte aligned, but no element
    needs a test (`whole_tile_ptrs`; WHOLE_RUN_PATH, the same tiles: `load_whole_tile`).
    Only the load is on the branch: the tile's math is one copy (two inlined copies of the tile
    raised registers from 136 to 198 on gfx942, by bench/aot.py). The rounding is done inside
    the branch, not before it: two arms of the same operations on different values are merged
    into one block by the compiler (MLIR's block merging), whose pointer, a block argument, has
    no known alignment, and both arms then load element by element."""
    if SPLIT == WHOLE_PATH or SPLIT == WHOLE_RUN_PATH:
        if fast:
            if SPLIT == WHOLE_RUN_PATH:
                x = load_whole_tile(base, off, tile, offs.shape[0], offs.shape[1])
            else:
                x = tl.load(whole_tile_ptrs(base, off, tile, offs.shape[0], offs.shape[1]))
        else:
            x = tl.load(base + off + offs, mask=offs < numel, other=0.0)
    elif SPLIT:
        if fast:
            x = tl.load(base + aligned_vec(off) + offs, mask=offs < aligned_vec(numel), other=0.0)
        else:
            x = tl.load(base + off + offs, mask=offs < numel, other=0.0)
    else:
        x = tl.load(base + off + offs, mask=offs < numel, other=0.0)
    return x


@triton.jit
def pin_rows(vals, rows):
    """vals [ROWS, G] unchanged (times 1, per row, from `rows`), computed where it stands.

    A dot operand made by elementwise ops from loaded data (codes decoded to 16-bit values) is
    rewritten by Triton to convert the loaded data to the dot's register layout first and then
    run the ops there: in that layout each warp holds every row of the operand that its share of
    the output needs, so each element is decoded once per warp along the output's columns (4x on
    gfx942 at G = 128, with 4 or 8 waves; 2-4x on sm_80). A factor the compiler cannot fold
    stops the rewrite: the decode runs once per element and the decoded tile moves to the dot's
    layout through shared memory (bench/aot.py, decompress at G = 128: gfx942 57 -> 100%, sm_80
    62 -> 100% of copy bandwidth). Exact: rows >= 0, and x * 1 is x for every x, -0 and NaN too.
    """
    return vals * (rows >= 0).to(vals.dtype)[:, None]


@triton.jit
def taco_prescale(ms, finite, CODE_MAX: tl.constexpr):
    """TACO's pre-scale from a group's mean square: clamp(code_max / sqrt(ms + 1e-6), 1e-3, 1e3)."""
    pre = tl.div_rn(CODE_MAX, tl.sqrt_rn(ms + 1e-6))
    return tl.where(finite, tl.minimum(tl.maximum(pre, 1e-3), 1e3), 1.0)


@triton.jit
def per_row(v, SBT: tl.constexpr, GPS: tl.constexpr):
    """Broadcast one value per super-block [SBT] to its GPS rows [SBT * GPS]."""
    return tl.reshape(tl.broadcast_to(v[:, None], [SBT, GPS]), [SBT * GPS])


@triton.jit
def one_thread_per_row(v, ROWS: tl.constexpr):
    """v [ROWS] (one value per row of a tile), the same values, held in a layout of one row per thread.

    A value reduced from a tile (`row_absmax`) stays in the tile's layout, where each row is
    held by the several threads that hold its elements (4-8 on NVIDIA), and every per-row step
    after it runs in each of them: the scale work's two correctly rounded divisions (the group
    code's ratio to the super-block, the reciprocal) and the E4M4 code, 4-8 times per row. A
    gather by `tl.arange` takes the index's layout, one element per thread, so that work runs
    once per row (twice where the threads outnumber the rows), and the per-row factors return to
    the tile's layout through shared memory (bench/aot.py, sm_90 tagged reduce of all_reduce at
    P = 2: FP8 0.793 -> 0.682 warp-instructions per element). The values and so the bytes are
    the same: a gather by 0..ROWS-1 moves them, nothing rounds.
    """
    idx = tl.arange(0, ROWS)
    for _ in range((tl.program_id(0) >= 0).to(tl.int32)):
        idx = idx + (tl.program_id(0) < 0).to(tl.int32)
    return tl.gather(v, idx, 0)


@triton.jit
def dual_scales_store(amax, finite, tile, rows, row_ok, n_sb, sb_ptr, gs_ptr,
                      CODE_MAX: tl.constexpr, SBT: tl.constexpr, GPS: tl.constexpr):
    """Dual scales of a tile's rows (reference.dual_scales); stores them, returns sigma [ROWS].

    S = max finite amax of the super-block / code_max (FP32, one per super-block); the group code
    is amax / (S code_max) in unsigned E4M4, rounded up (255 marks a non-finite group).
    """
    sb_amax = tl.max(tl.reshape(amax, [SBT, GPS]), axis=1)
    sb_scale = tl.div_rn(sb_amax, CODE_MAX)
    sb = tl.arange(0, SBT).to(tl.int64) + tile * SBT
    tl.store(sb_ptr + sb, sb_scale, mask=sb < n_sb)
    sb_amax_r = per_row(sb_amax, SBT, GPS)
    ratio = tl.where(sb_amax_r > 0, tl.div_rn(amax, tl.where(sb_amax_r > 0, sb_amax_r, 1.0)), 0.0)
    dcode = tl.where(finite, encode_ue4m4_ceil(ratio), 255)
    tl.store(gs_ptr + rows, dcode.to(tl.uint8), mask=row_ok)
    return per_row(sb_scale, SBT, GPS) * decode_ue4m4(dcode)


@triton.jit
def quantize_store(
    y, amax, tile, rows, row_ok, offs, n_sb, codes_ptr, a_ptr, b_ptr, seed, pre,
    CODEC: tl.constexpr, CODE_MAX: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr,
    SBT: tl.constexpr, GPS: tl.constexpr, DUAL: tl.constexpr, ROUND: tl.constexpr,
    HW: tl.constexpr, FP8_HW: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr, PACK_K: tl.constexpr,
    CDNA: tl.constexpr = 0, ROW_GATHER: tl.constexpr = False,
):
    """Scales and codes of a transformed tile y [ROWS, G] (FP32); stores codes and both scales.
    `amax`: `row_absmax(y)` (a caller that has y's absmax from an earlier step passes it).

    Codes are v = y * (1 / sigma) per element, one correctly rounded reciprocal per group
    (reference.scale_to_codes does the same). Groups below TINY_SIGMA, whose reciprocal would
    overflow, are scaled by 2^64 first (exact: a power of two, far from FP32's maximum), so no
    branch is needed. v is +0 in non-finite and all-zero groups (their codes are 0) and clamped
    to +-code_max where the encoder does not saturate by itself. CDNA 3 (gfx94x): FP8 codes
    rounded to nearest through the FNUZ hardware conversions. taco_fp32x2 (DUAL false): `pre` (already applied to y) and the absmax
    scale per group. ROW_GATHER (`_launch.row_gather`): the per-row work in a layout of one row per
    thread (`one_thread_per_row`).
    """
    if ROW_GATHER:
        amax = one_thread_per_row(amax, SBT * GPS)
    finite = amax <= FLT_MAX  # false for NaN and Inf
    amax = tl.where(finite, amax, 0.0)
    if DUAL:
        sigma = dual_scales_store(amax, finite, tile, rows, row_ok, n_sb, a_ptr, b_ptr, CODE_MAX, SBT, GPS)
    else:
        sigma = tl.where(finite, tl.div_rn(amax, CODE_MAX), float("nan"))
        tl.store(a_ptr + rows, pre, mask=row_ok)
        tl.store(b_ptr + rows, sigma, mask=row_ok)
    live = finite & (sigma > 0)
    k = tl.where(sigma < TINY_SIGMA, TINY_SCALE, 1.0)
    rcp = tl.where(live, tl.div_rn(1.0, tl.where(live, sigma * k, 1.0)), 0.0)
    v = (y * k[:, None]) * rcp[:, None]
    if not zeroes_dead_rows(PACK_K):  # a select: NaN rows become +0 (else `store_codes` zeroes their codes)
        v = tl.where(live[:, None], v, 0.0)
    if not saturating_encoder(CODEC, ROUND, FP8_HW):
        v = tl.minimum(tl.maximum(v, -CODE_MAX), CODE_MAX)
    if ROUND == STOCHASTIC:
        rand = random_bits(seed, offs)
    else:
        rand = 0
    if CDNA == 3 and ROUND == NEAREST and CODEC != INT8:
        code = encode_fp8_fnuz(v, CODEC)
    else:
        code = encode_codes(v, rand, CODEC, MBITS, EMIN, ROUND, HW, FP8_HW)
    store_codes(codes_ptr, code, rows, offs, row_ok, live, SBT * GPS, G, BITS, PACK_K)


@triton.jit
def load_scales(tile, rows, row_ok, n_sb, a_ptr, b_ptr, DUAL: tl.constexpr, SBT: tl.constexpr, GPS: tl.constexpr):
    """The decode factor of each group [ROWS] of one tile: a code's value times it is the group's
    value (reference.group_factors). Dual scales: super-block scale x decoded E4M4 group code.
    taco_fp32x2: sigma / pre, one correctly rounded division per group (a division per element
    took 5 of the fused reduce's 10 warp-instructions per element on sm_90)."""
    if DUAL:
        sb = tl.arange(0, SBT).to(tl.int64) + tile * SBT
        sb_scale = tl.load(a_ptr + sb, mask=sb < n_sb, other=0.0)
        dcode = tl.load(b_ptr + rows, mask=row_ok, other=0).to(tl.int32)
        return per_row(sb_scale, SBT, GPS) * decode_ue4m4(dcode)
    else:
        sigma = tl.load(b_ptr + rows, mask=row_ok, other=0.0)
        pre = tl.load(a_ptr + rows, mask=row_ok, other=1.0)
        return tl.div_rn(sigma, pre)


@triton.jit
def store_dense(y, out_ptr, offs, numel, out_max, inf_above, HW: tl.constexpr, OVERFLOW: tl.constexpr,
                off=0, fast=None, SPLIT: tl.constexpr = False, tile=0):
    """Clamp y to the output dtype's finite range (NaN stays NaN), cast, store the valid part at
    out_ptr + off + offs (off, fast, SPLIT, tile: as in `load_dense`, for the store).

    OVERFLOW: magnitudes above `inf_above` become +-inf, so an overflowed reduced sum stays visible
    (reference.saturate_cast); a constexpr, so plain decompression does not pay for the test. The
    launchers check that `inf_above` is at least where the cast rounds to +-inf (`check_inf_above`),
    so there y unclamped casts to +-inf: one test of the magnitude and one select per element
    where the reference takes two of each (NaN fails the test and keeps the clamp's NaN)."""
    c = tl.clamp(y, -out_max, out_max, propagate_nan=tl.PropagateNan.ALL)
    if OVERFLOW:
        c = tl.where(tl.abs(y) > inf_above, y, c)
    v = to_out_dtype(c, out_ptr, HW)
    if SPLIT == WHOLE_PATH or SPLIT == WHOLE_RUN_PATH:
        if fast:
            if SPLIT == WHOLE_RUN_PATH:
                store_whole_tile(v, out_ptr, off, tile)
            else:
                tl.store(whole_tile_ptrs(out_ptr, off, tile, v.shape[0], v.shape[1]), v)
        else:
            tl.store(out_ptr + off + offs, v, mask=offs < numel)
    elif SPLIT:
        if fast:
            tl.store(out_ptr + aligned_vec(off) + offs, v, mask=offs < aligned_vec(numel))
        else:
            tl.store(out_ptr + off + offs, v, mask=offs < numel)
    else:
        tl.store(out_ptr + off + offs, v, mask=offs < numel)
