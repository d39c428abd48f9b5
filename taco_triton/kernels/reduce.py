"""Fused reduce for the collectives: dequantize P ranks' chunks, sum in FP32, requantize. One pass.

After the all-to-all each rank holds P wire buffers of the same chunk. This kernel reads them,
sums in the transformed domain (the Hadamard is linear: no inverse/forward transform between sum
and requantization) and writes either the compressed sum (all_reduce: it is all-gathered next) or
the decompressed sum (reduce_scatter), whose inverse transform takes the FP32 sums as three exact
bf16 pieces on NVIDIA (exact products, FP32 accumulation) and FP32 on AMD. A persistent grid over tiles of two super-blocks, as
compress. TACO's released code has no fused version of this step.
Reference: `taco_triton.reference.reduce_reference`.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .. import alloc
from ..config import SUPERBLOCK_ELEMS, CompressionConfig
from ..layout import WireLayout
from ._common import (
    STOCHASTIC,
    codec_constexprs,
    encoder_constexprs,
    hadamard_rows,
    load_tables,
    load_values,
    row_absmax,
    runtime_one,
)
from . import slots
from ._launch import FusedOp, Launch, Prepared, Target, launch_meta, row_gather
from ._tables import SB_PER_TILE, TILE_ELEMS, hadamard_tables
from ._tile import check_inf_above, load_scales, quantize_store, store_dense, taco_prescale, tile_rows
from ._slot_io import read_tag, record_error, salt_in_kernel, write_tag


@triton.jit
def _rank_term(c_ptr, a_ptr, b_ptr, tile, rows, offs, row_ok, n_sb, bad, one, ROWS: tl.constexpr, G: tl.constexpr,
               GPS: tl.constexpr, SBT: tl.constexpr, CODEC: tl.constexpr, BITS: tl.constexpr, PACK_K: tl.constexpr,
               DUAL: tl.constexpr, FP8_HW: tl.constexpr, CDNA: tl.constexpr, DOT_PREC: tl.constexpr,
               TAGGED: tl.constexpr):
    """One rank's values of a tile, FP32: its codes times their group's factor."""
    vals = load_values(c_ptr, rows, offs, row_ok, one, ROWS, G, BITS, PACK_K, CODEC, FP8_HW, CDNA, DOT_PREC == "tf32x3")
    sigma = load_scales(tile, rows, row_ok, n_sb, a_ptr, b_ptr, DUAL, SBT, GPS)
    if TAGGED:  # a NaN factor per row makes the whole sum NaN: one select per row, not per element
        sigma = tl.where(bad, float("nan"), sigma)
    return vals * sigma[:, None]


@triton.jit(do_not_specialize=["seed", "k", "seq"])
def _reduce_kernel(
    in_codes_ptr, in_a_ptr, in_b_ptr, stride_codes, stride_a, stride_b, n_ranks,
    out_codes_ptr, out_a_ptr, out_b_ptr, out_ptr, h_ptr, h16_ptr, numel, n_groups, n_sb, n_tiles, seed, scale,
    out_max, inf_above, err_ptr, tag_in, tag_out, tag_pos, tag_end, k, seq, a_off, b_off, seq_ptr,
    G: tl.constexpr, GPS: tl.constexpr, SBT: tl.constexpr, CODEC: tl.constexpr, CODE_MAX: tl.constexpr,
    MBITS: tl.constexpr, EMIN: tl.constexpr, BITS: tl.constexpr, PACK_K: tl.constexpr, HADAMARD: tl.constexpr,
    DUAL: tl.constexpr, ROUND: tl.constexpr, DENSE: tl.constexpr, HW: tl.constexpr, FP8_HW: tl.constexpr,
    DOT_PREC: tl.constexpr, OVERFLOW: tl.constexpr, TAGGED: tl.constexpr = False, KRON: tl.constexpr = 0,
    CDNA: tl.constexpr = 0, SCALED: tl.constexpr = True, SPLIT: tl.constexpr = False, ROW_GATHER: tl.constexpr = False,
):
    """Sum n_ranks wire buffers tile by tile (see `reduce_launch`). SPLIT (the collectives' dense
    output of a size that is not a multiple of 16, a reduce_scatter's odd shard): its whole tiles
    store 16-byte vectors, the last, partial one element by element (`_tile.store_dense`); the
    plain reduce keeps one path."""
    ROWS: tl.constexpr = SBT * GPS
    if DENSE and HADAMARD:
        h, h16 = load_tables(h_ptr, h16_ptr, G, DOT_PREC)
    if ROUND == STOCHASTIC:  # noqa: SIM102 - a constexpr test, kept apart from the None test
        if seq_ptr is not None:  # CUDA graph replays: a counter they advance (`slots.seed_counter`)
            seed = salt_in_kernel(seed, tl.load(seq_ptr))
    bad = False
    if TAGGED:  # slotted rows: every rank's row carries tag_in after its tag_pos wire bytes (slots.py)
        # the scale regions are at byte offsets a_off, b_off of each row and of the output slot
        in_a_ptr = (in_codes_ptr + tl.multiple_of(a_off, 4)).to(tl.pointer_type(tl.float32))
        in_b_ptr = in_codes_ptr + b_off
        if not DUAL:
            in_b_ptr = (in_codes_ptr + tl.multiple_of(b_off, 4)).to(tl.pointer_type(tl.float32))
        if not DENSE:
            out_a_ptr = (out_codes_ptr + tl.multiple_of(a_off, 4)).to(tl.pointer_type(tl.float32))
            out_b_ptr = out_codes_ptr + b_off
            if not DUAL:
                out_b_ptr = (out_codes_ptr + tl.multiple_of(b_off, 4)).to(tl.pointer_type(tl.float32))
        pid = tl.program_id(0)
        src = -1  # the first rank whose tag differs
        for r in range(n_ranks):
            src = tl.where((read_tag(in_codes_ptr + r * stride_codes, tag_pos) != tag_in) & (src < 0), r, src)
        bad = src >= 0
        if bad & (pid == 0):
            record_error(err_ptr, k, src, read_tag(in_codes_ptr + src * stride_codes, tag_pos), tag_in, seq)
        if not DENSE:  # noqa: SIM102 - a constexpr test, kept apart from the runtime one
            if pid == 0:
                write_tag(out_codes_ptr, tag_pos, tag_end, tag_out)
    one = runtime_one(n_groups)
    for tile in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        rows, offs, row_ok = tile_rows(tile, n_groups, ROWS, G)
        # the first rank's products are the sum's start, as in the reference (no zeroed tile and
        # no first add: 96 instructions per tile on sm_90; and -0 stays -0); the launcher checks n_ranks >= 1
        acc = _rank_term(in_codes_ptr, in_a_ptr, in_b_ptr, tile, rows, offs, row_ok, n_sb, bad, one, ROWS, G, GPS, SBT,
                         CODEC, BITS, PACK_K, DUAL, FP8_HW, CDNA, DOT_PREC, TAGGED)
        c_ptr, a_ptr, b_ptr = in_codes_ptr, in_a_ptr, in_b_ptr  # advanced per rank: 64-bit pointer math
        for _p in range(1, n_ranks):
            c_ptr += stride_codes
            a_ptr += stride_a
            b_ptr += stride_b
            acc += _rank_term(c_ptr, a_ptr, b_ptr, tile, rows, offs, row_ok, n_sb, bad, one, ROWS, G, GPS, SBT,
                              CODEC, BITS, PACK_K, DUAL, FP8_HW, CDNA, DOT_PREC, TAGGED)
        if SCALED:  # x * 1.0 is x bit for bit: a plain sum skips the multiply per element
            acc = acc * scale
        if DENSE:
            if HADAMARD:
                acc = hadamard_rows(acc, h, h16, ROWS, G, DOT_PREC, KRON) * 2.0
            store_dense(acc, out_ptr, offs, numel, out_max, inf_above, HW, OVERFLOW, 0,
                        (tile + 1) * ROWS * G <= numel, SPLIT)
        else:
            amax = row_absmax(acc, CDNA)
            if DUAL:
                pre_out = 1.0
            else:  # mean(x^2) of the original domain: 4G mean(y^2) under H/(2G)
                finite = amax <= 3.4028234663852886e38
                # a non-finite group's sum of squares is not used: its pre-scale is 1
                ms = tl.sum(acc * acc, axis=1) * (1.0 / G)  # = / G exactly
                if HADAMARD:
                    ms = ms * (4.0 * G)
                pre_out = taco_prescale(ms, finite, CODE_MAX)
                acc = acc * pre_out[:, None]
                # the absmax of the scaled rows, bit for bit: rounding is monotonic and pre_out > 0
                amax = amax * pre_out
            quantize_store(acc, amax, tile, rows, row_ok, offs, n_sb, out_codes_ptr, out_a_ptr, out_b_ptr, seed, pre_out,
                           CODEC, CODE_MAX, MBITS, EMIN, SBT, GPS, DUAL, ROUND, HW, FP8_HW, G, BITS, PACK_K,
                           CDNA, ROW_GATHER)


def _row_views(bufs: torch.Tensor, layout: WireLayout):
    """Per-rank (codes, a, b) views of a [P, stride] buffer, stride a multiple of 4 bytes."""
    codes = bufs[:, : layout.scale_a_offset]
    a = bufs[:, layout.scale_a_offset : layout.scale_b_offset].view(torch.float32)
    b = bufs[:, layout.scale_b_offset : layout.nbytes]
    if layout.scales != "dual":
        b = b.view(torch.float32)
    return codes, a, b


def reduce_launch(in_c, in_a, in_b, strides: tuple, n_ranks: int, o_c, o_a, o_b, target_out, numel: int,
                  config: CompressionConfig, scale: float, dense: bool, target: Target, params: dict,
                  device: torch.device | None = None, inf_above: float = math.inf, tags=None,
                  seq_ptr: torch.Tensor | None = None) -> Launch:
    """The launch that sums n_ranks wire buffers (element strides `strides` of codes, a, b per rank).

    tags: None, or (errors, tag_in, tag_out, slot_end) for the collectives' slotted buffers: each
    rank's row carries tag_in after its wire bytes, checked on the device (a mismatch makes the
    sum NaN and fills the `slots.ErrorRecord` tensor `errors`); the compressed sum gets tag_out and
    zero padding up to slot_end. The kernel then finds the scale regions itself, at their byte
    offsets in each row (and in the output slot): in_a, in_b (o_a, o_b) may be the uint8 rows
    (the output slot) themselves, so a call needs no views. The arguments k (slice) and seq (call) name the
    call in an error record (0 here; the collectives pass theirs per call). seq_ptr: as in
    `compress.compress_slots_launch`. Raises ValueError for n_ranks < 1."""
    if n_ranks < 1:
        raise ValueError(f"the reduce sums at least one rank's buffer, got n_ranks={n_ranks}")
    if dense:
        check_inf_above(inf_above, target_out.dtype)
    layout = WireLayout.of(numel, config)
    code_addresses = (in_c.data_ptr(), strides[0]) + (() if dense else (o_c.data_ptr(),))
    h, h16 = hadamard_tables(config.group_size, 1.0, torch.float32, device, shaped=device is None)
    n_tiles = -(-layout.n_superblocks // SB_PER_TILE)
    codec = codec_constexprs(config.spec, *code_addresses)
    meta = launch_meta(
        target, params, G=config.group_size, GPS=SUPERBLOCK_ELEMS // config.group_size, SBT=SB_PER_TILE,
        **codec, **encoder_constexprs(config.spec), ROW_GATHER=not dense and row_gather("reduce", target, codec["PACK_K"]),
        HADAMARD=config.hadamard, DUAL=config.scales == "dual", ROUND=int(STOCHASTIC) if config.stochastic else 0,
        DENSE=dense, OVERFLOW=inf_above != math.inf, TAGGED=tags is not None, SCALED=scale != 1.0,
        SPLIT=dense and tags is not None and numel % slots.VECTOR_ELEMS != 0 and numel > TILE_ELEMS,
    )
    errors, tag_in, tag_out, tag_end = (target_out, 0, 0, 0) if tags is None else tags
    return Launch(_reduce_kernel, n_tiles, dict(
        in_codes_ptr=in_c, in_a_ptr=in_a, in_b_ptr=in_b, stride_codes=strides[0], stride_a=strides[1],
        stride_b=strides[2], n_ranks=n_ranks, out_codes_ptr=o_c, out_a_ptr=o_a, out_b_ptr=o_b, out_ptr=target_out,
        h_ptr=h, h16_ptr=h16, numel=numel, n_groups=layout.n_groups, n_sb=layout.n_superblocks, n_tiles=n_tiles,
        seed=config.seed, scale=scale, out_max=torch.finfo(target_out.dtype).max if dense else 0.0,
        inf_above=inf_above, err_ptr=errors, tag_in=tag_in, tag_out=tag_out, tag_pos=layout.nbytes, tag_end=tag_end,
        k=0, seq=0, a_off=layout.scale_a_offset, b_off=layout.scale_b_offset, seq_ptr=seq_ptr), meta, device)


class ReduceOp(FusedOp):
    """Every launch of the fused reduce, decided in this one place (as `compress.CompressOp`): the
    collectives' tagged reduce over P wire rows of one slot stride (the scale regions found at
    their byte offsets in each row, so a call passes the rows once), into a requantized slot
    (all_reduce) or the dense output (reduce_scatter); its launch parameters under the kernel's
    own name; the graph-seed variant; and what a repeated call passes, by name. The collectives'
    plans and bench/aot.py build their launches here; `reduce_triton` (the eager op) is below.

    Constructed as `_launch.FusedOp` (config, device, target, params).
    """

    #: What a repeated call passes: the rows fill the codes and both scale pointers, the output
    #: (a slot, or the dense tensor) every output pointer.
    SLOTS_CALL = {"rows": ("in_codes_ptr", "in_a_ptr", "in_b_ptr"),
                  "out": ("out_codes_ptr", "out_a_ptr", "out_b_ptr", "out_ptr"),
                  "seed": "seed", "err": "err_ptr", "k": "k", "seq": "seq"}

    def slots_launch(self, rows, stride: int, n_ranks: int, out, numel: int, scale: float, dense: bool, err,
                     tag_in: int, tag_out: int, slot_end: int, inf_above: float = math.inf,
                     graph_seeds: bool = False) -> Launch:
        """The tagged reduce of `n_ranks` rows of `rows` (uint8, `stride` bytes apart), each holding
        `numel` elements' wire bytes and `tag_in`, into `out`: the dense sum (`dense`, values
        beyond `inf_above` become +-inf) or a slot of `slot_end` bytes tagged `tag_out`; a tag
        mismatch writes `err`. `graph_seeds`: as `CompressOp.slots_launch`."""
        scale_words = stride // 4  # FP32 scales: the row stride in their elements
        strides = (stride, scale_words, stride if self.config.scales == "dual" else scale_words)
        seq_ptr = slots.seed_counter(self.device) if graph_seeds and self.config.stochastic else None
        return reduce_launch(rows, rows, rows, strides, n_ranks, out, out, out, out, numel, self.config, scale, dense,
                             self.target, self.params("reduce", torch.uint8, numel), self.device,
                             inf_above if dense else math.inf, tags=(err, tag_in, tag_out, slot_end), seq_ptr=seq_ptr)

    def rows_launch(self, in_c, in_a, in_b, strides: tuple, n_ranks: int, o_c, o_a, o_b, out, numel: int,
                    scale: float, dense: bool, inf_above: float = math.inf) -> Launch:
        """The untagged reduce `reduce_triton` runs: n_ranks rows given as (codes, a, b) views
        with their element `strides`, into (o_c, o_a, o_b) of a wire buffer or the dense `out`."""
        return reduce_launch(in_c, in_a, in_b, strides, n_ranks, o_c, o_a, o_b, out, numel, self.config, scale, dense,
                             self.target, self.params("reduce", torch.uint8, numel), self.device, inf_above)

    @classmethod
    def prepare_slots(cls, launch: Launch):
        """`run(rows, out, seed, err, k, seq)` of a tagged reduce."""
        return Prepared(launch, cls.SLOTS_CALL).call


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
    target_out = dense_out if dense else out
    if layout.n_groups == 0:
        return target_out
    in_c, in_a, in_b = _row_views(bufs, layout)
    o_c, o_a, o_b = (dense_out,) * 3 if dense else layout.split(out)
    ReduceOp(config, bufs.device).rows_launch(in_c, in_a, in_b, (in_c.stride(0), in_a.stride(0), in_b.stride(0)),
                                              bufs.shape[0], o_c, o_a, o_b, target_out, numel, scale, dense,
                                              inf_above).run()
    return target_out
