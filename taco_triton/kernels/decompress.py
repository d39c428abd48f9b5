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
from ._common import E4M3, INT8, codec_constexprs, decode_target_codes, hadamard_rows, load_codes, load_tables
from . import slots
from ._launch import FusedOp, Launch, Prepared, Target, in_order, launch_meta, op16
from ._tables import SB_PER_TILE, hadamard_tables
from ._tile import TILE_ELEMS, aligned_split, check_inf_above, load_scales, pin_rows, store_dense, tile_rows
from ._slot_io import (
    A_OFF,
    ALIGN,
    B_OFF,
    DESC,
    N_GROUPS,
    N_SB,
    NBYTES,
    SLOT_OFF,
    SRC,
    TAG,
    TILE_BASE,
    dense_piece,
    read_tag,
    record_error,
    slot_of,
)


@triton.jit
def _decompress_tile(
    codes_ptr, scale_a_ptr, scale_b_ptr, out_ptr, h, h16, tile, numel, n_groups, n_sb, out_max, inf_above, bad,
    G: tl.constexpr, GPS: tl.constexpr, SBT: tl.constexpr, CODEC: tl.constexpr, BITS: tl.constexpr,
    PACK_K: tl.constexpr, HADAMARD: tl.constexpr, DUAL: tl.constexpr, HW: tl.constexpr, FP8_HW: tl.constexpr,
    OP16: tl.constexpr, DOT_PREC: tl.constexpr, OVERFLOW: tl.constexpr, CHECKED: tl.constexpr, KRON: tl.constexpr,
    CDNA: tl.constexpr = 0, elem_off=0, fast=None, SPLIT: tl.constexpr = False,
):
    """Decompress tile number `tile` of one wire buffer; CHECKED: all NaN where `bad` (a slot
    whose tag did not match): each row's scale factor is NaN then, and so every product with it,
    one select per row instead of one per element. The output is out_ptr + elem_off (fast, SPLIT:
    `_tile.store_dense`)."""
    ROWS: tl.constexpr = SBT * GPS
    rows, offs, row_ok = tile_rows(tile, n_groups, ROWS, G)
    codes = load_codes(codes_ptr, rows, offs, row_ok, ROWS, G, BITS, PACK_K)
    if DUAL or not HADAMARD:
        sigma = load_scales(tile, rows, row_ok, n_sb, scale_a_ptr, scale_b_ptr, DUAL, SBT, GPS)
    if HADAMARD:  # +-1 transform of the codes first, then one scale multiply per element
        vals = decode_target_codes(codes, CODEC, FP8_HW, CDNA, tl.float16 if OP16 else tl.float32, DOT_PREC == "tf32x3")
        # one dot (the two-stage transform of larger G was not affected) and a decode of more than
        # a hardware FP8 conversion (sm_89+: repeating that one cost less than the shared-memory
        # round trip, 0.51 -> 0.64 instructions per element on sm_89): see `pin_rows`
        if G <= 128 and not (FP8_HW and CODEC != INT8):
            vals = pin_rows(vals, rows)
        # E4M3 decoded in software on NVIDIA (sm_80): the transposed dot decodes each code twice, not
        # four times (`hadamard_rows`); no gain at G = 32, or where the decode is cheap
        y = hadamard_rows(vals, h, h16, ROWS, G, DOT_PREC, KRON, False,
                          CODEC == E4M3 and G >= 64 and DOT_PREC == "tf32x3" and not FP8_HW)
        if not DUAL:  # after the dot: taco_fp32x2's division per group, held across it, spilled on sm_80
            sigma = load_scales(tile, rows, row_ok, n_sb, scale_a_ptr, scale_b_ptr, DUAL, SBT, GPS)
        f = 2.0 * sigma
        if CHECKED:
            f = tl.where(bad, float("nan"), f)
        y = y * f[:, None]
    else:
        if CHECKED:
            sigma = tl.where(bad, float("nan"), sigma)
        y = decode_target_codes(codes, CODEC, FP8_HW, CDNA, tl.float32, DOT_PREC == "tf32x3") * sigma[:, None]
    store_dense(y, out_ptr, offs, numel, out_max, inf_above, HW, OVERFLOW, elem_off, fast, SPLIT, tile)


@triton.jit(do_not_specialize=["tile0"])
def _decompress_kernel(
    codes_ptr, scale_a_ptr, scale_b_ptr, out_ptr, h_ptr, h16_ptr, numel, n_groups, n_sb, n_tiles, out_max, inf_above,
    tile0,
    G: tl.constexpr, GPS: tl.constexpr, SBT: tl.constexpr, CODEC: tl.constexpr, BITS: tl.constexpr,
    PACK_K: tl.constexpr, HADAMARD: tl.constexpr, DUAL: tl.constexpr, HW: tl.constexpr, FP8_HW: tl.constexpr, OP16: tl.constexpr, DOT_PREC: tl.constexpr, OVERFLOW: tl.constexpr, KRON: tl.constexpr = 0,
    TAIL: tl.constexpr = False, CDNA: tl.constexpr = 0,
):
    h, h16 = h_ptr, h16_ptr
    if HADAMARD:
        h, h16 = load_tables(h_ptr, h16_ptr, G, DOT_PREC)
    if TAIL:  # the one-program tail launch of `_tile.aligned_split`: tile number tile0 alone
        _decompress_tile(codes_ptr, scale_a_ptr, scale_b_ptr, out_ptr, h, h16, tile0, numel, n_groups, n_sb, out_max,
                         inf_above, False, G, GPS, SBT, CODEC, BITS, PACK_K, HADAMARD, DUAL, HW, FP8_HW, OP16, DOT_PREC,
                         OVERFLOW, False, KRON, CDNA)
    else:
        for tile in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
            _decompress_tile(codes_ptr, scale_a_ptr, scale_b_ptr, out_ptr, h, h16, tile, numel, n_groups, n_sb, out_max,
                             inf_above, False, G, GPS, SBT, CODEC, BITS, PACK_K, HADAMARD, DUAL, HW, FP8_HW, OP16, DOT_PREC,
                             OVERFLOW, False, KRON, CDNA)


@triton.jit(do_not_specialize=["k", "seq"])
def _decompress_slots_kernel(
    data_ptr, out_ptr, desc_ptr, err_ptr, h_ptr, h16_ptr, n_chunks, n_tiles, out_max, inf_above, k, seq,
    G: tl.constexpr, GPS: tl.constexpr, SBT: tl.constexpr, CODEC: tl.constexpr, BITS: tl.constexpr,
    PACK_K: tl.constexpr, HADAMARD: tl.constexpr, DUAL: tl.constexpr, HW: tl.constexpr, FP8_HW: tl.constexpr, OP16: tl.constexpr, DOT_PREC: tl.constexpr, OVERFLOW: tl.constexpr, KRON: tl.constexpr = 0,
    ELEM_ALIGN: tl.constexpr = 1, CDNA: tl.constexpr = 0, MAX_SLOTS: tl.constexpr = 1, TWO_PATHS: tl.constexpr = 0,
):
    """Decompress n_chunks slots of one received buffer into their pieces of out, in one launch.

    Each slot's tag is checked: a slot whose tag differs from the expected one (descriptor TAG)
    decodes to all NaN (each tile of it checks the tag) and fills the error record at err_ptr with
    (slice k, the slot's source, the tag found, the tag expected, call seq), written by program 0
    alone (the last such slot). Tiles are dealt, and ELEM_ALIGN and TWO_PATHS choose their
    paths, as in `_compress_slots_kernel`.
    """
    h, h16 = h_ptr, h16_ptr
    if HADAMARD:
        h, h16 = load_tables(h_ptr, h16_ptr, G, DOT_PREC)
    if tl.program_id(0) == 0:  # the error record: the last slot whose tag differs, as the host reads it
        for j in range(n_chunks):
            d = desc_ptr + j * DESC
            got = read_tag(data_ptr + tl.multiple_of(tl.load(d + SLOT_OFF), ALIGN), tl.load(d + NBYTES))
            if got != tl.load(d + TAG):
                record_error(err_ptr, k, tl.load(d + SRC), got, tl.load(d + TAG), seq)
    for g in range(tl.program_id(0), n_tiles, tl.num_programs(0)):  # as `_compress_slots_kernel`
        j = slot_of(desc_ptr, n_chunks, g, MAX_SLOTS)
        d = desc_ptr + j * DESC
        slot = data_ptr + tl.multiple_of(tl.load(d + SLOT_OFF), ALIGN)  # slots are 16-byte aligned
        bad = read_tag(slot, tl.load(d + NBYTES)) != tl.load(d + TAG)
        a_ptr = (slot + tl.multiple_of(tl.load(d + A_OFF), 4)).to(tl.pointer_type(tl.float32))
        b_ptr = slot + tl.load(d + B_OFF)
        if not DUAL:
            b_ptr = (slot + tl.multiple_of(tl.load(d + B_OFF), 4)).to(tl.pointer_type(tl.float32))
        t = g - tl.load(d + TILE_BASE)
        base, elem_off, numel, fast = dense_piece(d, t, out_ptr, ELEM_ALIGN, TWO_PATHS)
        _decompress_tile(slot, a_ptr, b_ptr, base, h, h16, t, numel, tl.load(d + N_GROUPS), tl.load(d + N_SB),
                         out_max, inf_above, bad, G, GPS, SBT, CODEC, BITS, PACK_K, HADAMARD, DUAL, HW, FP8_HW, OP16,
                         DOT_PREC, OVERFLOW, True, KRON, CDNA, elem_off, fast, TWO_PATHS)


def _meta(out_dtype, config: CompressionConfig, target: Target, params: dict, code_address: int,
          inf_above: float, **extra) -> dict:
    """The constexprs of both decompress kernels (`extra`: those of one) and the launch options."""
    check_inf_above(inf_above, out_dtype)
    return launch_meta(
        target, params, G=config.group_size, GPS=SUPERBLOCK_ELEMS // config.group_size, SBT=SB_PER_TILE,
        **codec_constexprs(config.spec, code_address), HADAMARD=config.hadamard, DUAL=config.scales == "dual",
        OVERFLOW=inf_above != math.inf, OP16=op16("decompress", target, out_dtype, config), **extra,
    )


def _tables(config: CompressionConfig, meta: dict, device):
    return hadamard_tables(config.group_size, 1.0, torch.float16 if meta["OP16"] else torch.float32, device,
                           shaped=device is None)


def decompress_launch(codes, a, b, out, numel: int, config: CompressionConfig, target: Target, params: dict,
                      device: torch.device | None = None, inf_above: float = math.inf) -> Launch:
    """The launch that decompresses (codes, a, b) into `numel` elements of out (tensors or ShapedPointers)."""
    return decompress_launches(codes, a, b, out, numel, config, target, params, device, inf_above, split=False)[0]


def decompress_launches(codes, a, b, out, numel: int, config: CompressionConfig, target: Target, params: dict,
                        device: torch.device | None = None, inf_above: float = math.inf,
                        split: bool = True) -> tuple[Launch, ...]:
    """The launches that decompress (codes, a, b) into `numel` elements of out: one, or with
    `split` and a size that is not a multiple of 16, an aligned main launch and a one-program
    tail (`_tile.aligned_split`). All take the same pointer arguments (codes_ptr, scale_a_ptr,
    scale_b_ptr, out_ptr)."""
    layout = WireLayout.of(numel, config)
    meta = _meta(out.dtype, config, target, params, codes.data_ptr(), inf_above, TAIL=False)
    h, h16 = _tables(config, meta, device)
    n_tiles = -(-layout.n_superblocks // SB_PER_TILE)
    main = aligned_split(numel) if split else 0

    top = torch.finfo(out.dtype).max

    def launch(tiles: int, meta: dict, numel: int, n_groups: int, n_sb: int, n_tiles: int, tile0: int) -> Launch:
        return Launch(_decompress_kernel, tiles, dict(
            codes_ptr=codes, scale_a_ptr=a, scale_b_ptr=b, out_ptr=out, h_ptr=h, h16_ptr=h16, numel=numel,
            n_groups=n_groups, n_sb=n_sb, n_tiles=n_tiles, out_max=top, inf_above=inf_above, tile0=tile0), meta, device)

    if main == 0:
        return (launch(n_tiles, meta, numel, layout.n_groups, layout.n_superblocks, n_tiles, 0),)
    t0 = main // TILE_ELEMS
    return (launch(t0, meta, main, main // config.group_size, main // SUPERBLOCK_ELEMS, t0, 0),
            launch(1, {**meta, "TAIL": True}, numel, layout.n_groups, layout.n_superblocks, n_tiles, t0))


def decompress_slots_launch(data, out, desc, errors, n_slots: int, n_tiles: int, config: CompressionConfig,
                            target: Target, params: dict, device: torch.device | None = None,
                            inf_above: float = math.inf, elem_align: int = 1, two_paths: int = 0) -> Launch:
    """The launch that checks the tags of `n_slots` slots of `data` and decompresses each into its
    piece of `out` (flat, contiguous); `desc` the slots' descriptor table, `errors` the
    `slots.ErrorRecord` tensor. The arguments k (slice) and seq (call) name the call in an error
    record: 0 here; `Prepared` passes them per call. `elem_align`, `two_paths`: as in
    `compress.compress_slots_launch`, for the pieces of `out`."""
    meta = _meta(out.dtype, config, target, params, data.data_ptr(), inf_above, ELEM_ALIGN=elem_align,
                 TWO_PATHS=slots.kernel_paths(int(two_paths), target, config.spec.bits) if elem_align == 1 else 0,
                 MAX_SLOTS=triton.next_power_of_2(max(n_slots, 1)))
    h, h16 = _tables(config, meta, device)
    return Launch(_decompress_slots_kernel, n_tiles,
                  dict(data_ptr=data, out_ptr=out, desc_ptr=desc, err_ptr=errors, h_ptr=h, h16_ptr=h16,
                       n_chunks=n_slots, n_tiles=n_tiles, out_max=torch.finfo(out.dtype).max, inf_above=inf_above, k=0, seq=0),
                  meta, device)


class DecompressOp(FusedOp):
    """Every launch of the fused decompress, decided in this one place (as `compress.CompressOp`):
    the kernel (dense, or slotted with tag checks), its launch parameters under the kernel's own
    name, the aligned split, a slotted launch's tiles and alignment, and what a repeated call
    passes, by name. `ops`, the collectives' and p2p's plans and bench/aot.py build their launches
    here.

    Constructed as `_launch.FusedOp` (config, device, target, params).
    """

    #: What a repeated call passes: call argument -> the kernel parameter(s) it fills.
    DENSE_CALL = {"codes": "codes_ptr", "scale_a": "scale_a_ptr", "scale_b": "scale_b_ptr", "out": "out_ptr"}
    SLOTS_CALL = {"wire": "data_ptr", "out": "out_ptr", "err": "err_ptr", "k": "k", "seq": "seq"}

    def dense_launches(self, codes, a, b, out, numel: int, inf_above: float = math.inf,
                       split: bool = True) -> tuple[Launch, ...]:
        """`decompress_launches` with this op's parameters (kernel "decompress")."""
        return decompress_launches(codes, a, b, out, numel, self.config, self.target,
                                   self.params("decompress", out.dtype, numel), self.device, inf_above, split)

    def dense(self, codes, a, b, out, numel: int, inf_above: float = math.inf):
        """`run(codes, scale_a, scale_b, out)`: the dense launches prepared, run in order."""
        return in_order(Prepared(ln, self.DENSE_CALL).call
                        for ln in self.dense_launches(codes, a, b, out, numel, inf_above))

    def slots_launch(self, wire, out, desc, err, pieces, layouts, inf_above: float = math.inf) -> Launch:
        """The slotted launch that checks the tags of `wire`'s slots and decompresses each into its
        piece of `out` (`pieces`, their `layouts`; `desc` their descriptor table; `err` the
        error record the checks write)."""
        params = self.params("decompress_slots", out.dtype, max(lay.numel for lay in layouts))
        return decompress_slots_launch(wire, out, desc, err, len(pieces), slots.total_tiles(layouts), self.config,
                                       self.target, params, self.device, inf_above, **slots.alignment(pieces))

    @classmethod
    def prepare_slots(cls, launch: Launch):
        """`run(wire, out, err, k, seq)` of a slotted launch (k, seq: the slice and call an error
        record names)."""
        return Prepared(launch, cls.SLOTS_CALL).call


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
    for launch in DecompressOp(config, out.device).dense_launches(codes, a, b, out, out.numel(), inf_above):
        launch.run()
    return out
