"""Fused compress: load -> (pre-scale) -> block Hadamard -> dual scales -> 8-bit codes, one pass.

A persistent grid: each program loads the Hadamard table once, then loops over tiles of two
super-blocks (8192 elements). A tile is held in registers, so a super-block's FP32 scale is known
before any code is written and the input is read exactly once. The transform is one tensor-core
dot per tile against the launcher's table H/(2G), exact in the input's own 16-bit dtype (products
with a power of two are exact; they accumulate in FP32); FP32 and pre-scaled inputs are split
into three bf16 pieces on NVIDIA (exact products) and use FP32 matrix instructions on AMD. The tail is masked (loads return 0 past
numel), never padded in memory. Reference: `taco_triton.reference.compress_reference`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import alloc
from ..config import SUPERBLOCK_ELEMS, CompressionConfig
from ..layout import WireLayout
from ._common import STOCHASTIC, codec_constexprs, encoder_constexprs, hadamard_rows, load_tables, row_absmax
from . import slots
from ._launch import FusedOp, Launch, Prepared, Target, in_order, launch_meta, op16, row_gather
from ._tables import SB_PER_TILE, hadamard_tables
from ._tile import TILE_ELEMS, aligned_split, load_dense, quantize_store, taco_prescale, tile_rows
from ._slot_io import (
    A_OFF,
    ALIGN,
    B_OFF,
    DESC,
    N_GROUPS,
    N_SB,
    NBYTES,
    SLOT_END,
    SLOT_OFF,
    TAG,
    TILE_BASE,
    dense_piece,
    salt_in_kernel,
    slot_of,
    write_tag,
)


@triton.jit
def _compress_tile(
    x_ptr, codes_ptr, scale_a_ptr, scale_b_ptr, h, h16, tile, numel, n_groups, n_sb, seed,
    G: tl.constexpr, GPS: tl.constexpr, SBT: tl.constexpr, CODEC: tl.constexpr, CODE_MAX: tl.constexpr,
    MBITS: tl.constexpr, EMIN: tl.constexpr, BITS: tl.constexpr, PACK_K: tl.constexpr, HADAMARD: tl.constexpr,
    DUAL: tl.constexpr, ROUND: tl.constexpr, HW: tl.constexpr, FP8_HW: tl.constexpr, OP16: tl.constexpr,
    DOT_PREC: tl.constexpr, KRON: tl.constexpr, CDNA: tl.constexpr = 0, K_CHUNKS: tl.constexpr = False,
    elem_off=0, fast=None, SPLIT: tl.constexpr = False, ROW_GATHER: tl.constexpr = False,
):
    """Compress tile number `tile` of the tensor at x_ptr + elem_off (both kernels below run this
    per tile; fast, SPLIT: `_tile.load_dense`)."""
    ROWS: tl.constexpr = SBT * GPS
    rows, offs, row_ok = tile_rows(tile, n_groups, ROWS, G)
    x = load_dense(x_ptr, elem_off, offs, numel, fast, SPLIT, tile)
    if not OP16:
        x = x.to(tl.float32)
    if DUAL:
        pre = 1.0
    else:  # TACO's RMS pre-scale (cancels mathematically; kept to reproduce its layout)
        x = x.to(tl.float32)
        finite = row_absmax(x, CDNA) <= 3.4028234663852886e38
        # a non-finite group's sum of squares is not used: its pre-scale is 1. x G^-1 is x / G
        # bit for bit (G a power of two) without a division's slow path
        pre = taco_prescale(tl.sum(x * x, axis=1) * (1.0 / G), finite, CODE_MAX)
        x = x * pre[:, None]
    if HADAMARD:
        y = hadamard_rows(x, h, h16, ROWS, G, DOT_PREC, KRON, K_CHUNKS)
    else:
        y = x.to(tl.float32)
    quantize_store(y, row_absmax(y, CDNA), tile, rows, row_ok, offs, n_sb, codes_ptr, scale_a_ptr, scale_b_ptr, seed, pre,
                   CODEC, CODE_MAX, MBITS, EMIN, SBT, GPS, DUAL, ROUND, HW, FP8_HW, G, BITS, PACK_K, CDNA, ROW_GATHER)


@triton.jit(do_not_specialize=["tile0"])
def _compress_kernel(
    x_ptr, codes_ptr, scale_a_ptr, scale_b_ptr, h_ptr, h16_ptr, numel, n_groups, n_sb, n_tiles, seed, tile0,
    G: tl.constexpr, GPS: tl.constexpr, SBT: tl.constexpr, CODEC: tl.constexpr, CODE_MAX: tl.constexpr,
    MBITS: tl.constexpr, EMIN: tl.constexpr, BITS: tl.constexpr, PACK_K: tl.constexpr, HADAMARD: tl.constexpr, DUAL: tl.constexpr,
    ROUND: tl.constexpr, HW: tl.constexpr, FP8_HW: tl.constexpr, OP16: tl.constexpr, DOT_PREC: tl.constexpr, KRON: tl.constexpr = 0, TAIL: tl.constexpr = False,
    CDNA: tl.constexpr = 0, K_CHUNKS: tl.constexpr = False, ROW_GATHER: tl.constexpr = False,
):
    h, h16 = h_ptr, h16_ptr
    if HADAMARD:
        h, h16 = load_tables(h_ptr, h16_ptr, G, DOT_PREC)
    if TAIL:  # the one-program tail launch of `_tile.aligned_split`: tile number tile0 alone
        _compress_tile(x_ptr, codes_ptr, scale_a_ptr, scale_b_ptr, h, h16, tile0, numel, n_groups, n_sb, seed,
                       G, GPS, SBT, CODEC, CODE_MAX, MBITS, EMIN, BITS, PACK_K, HADAMARD, DUAL, ROUND, HW, FP8_HW,
                       OP16, DOT_PREC, KRON, CDNA, K_CHUNKS, 0, None, False, ROW_GATHER)
    else:
        for tile in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
            _compress_tile(x_ptr, codes_ptr, scale_a_ptr, scale_b_ptr, h, h16, tile, numel, n_groups, n_sb, seed,
                           G, GPS, SBT, CODEC, CODE_MAX, MBITS, EMIN, BITS, PACK_K, HADAMARD, DUAL, ROUND, HW, FP8_HW,
                           OP16, DOT_PREC, KRON, CDNA, K_CHUNKS, 0, None, False, ROW_GATHER)


@triton.jit(do_not_specialize=["seed"])
def _compress_slots_kernel(
    x_ptr, out_ptr, desc_ptr, h_ptr, h16_ptr, n_chunks, n_tiles, seed, seq_ptr,
    G: tl.constexpr, GPS: tl.constexpr, SBT: tl.constexpr, CODEC: tl.constexpr, CODE_MAX: tl.constexpr,
    MBITS: tl.constexpr, EMIN: tl.constexpr, BITS: tl.constexpr, PACK_K: tl.constexpr, HADAMARD: tl.constexpr, DUAL: tl.constexpr,
    ROUND: tl.constexpr, HW: tl.constexpr, FP8_HW: tl.constexpr, OP16: tl.constexpr, DOT_PREC: tl.constexpr, KRON: tl.constexpr = 0,
    ELEM_ALIGN: tl.constexpr = 1, CDNA: tl.constexpr = 0, K_CHUNKS: tl.constexpr = False, MAX_SLOTS: tl.constexpr = 1,
    TWO_PATHS: tl.constexpr = 0, ROW_GATHER: tl.constexpr = False,
):
    """Compress n_chunks pieces of x, each into its slot of one wire buffer, and write each slot's
    tag and zero padding: the whole send buffer of a collective's pipeline slice in one launch.

    desc_ptr: the slots' descriptor rows (`slots.py`). The launch's n_tiles tiles are numbered
    across chunks (a chunk's tiles start where the previous chunk's ended, TILE_BASE) and dealt
    to programs round robin, so small chunks do not all land on the first programs; a program
    finds each of its tiles' slot (`slot_of`) and reads only that slot's descriptor, and slot j's
    tag is written by program j mod the programs (MAX_SLOTS: a power of two >= n_chunks). Chunk j's stochastic seed is `slots.salt(seed, j)` (the caller salts
    `seed` with the rank, call and slice); with `seq_ptr` (None: not compiled in) `seed` is first
    salted with the int64 it points to, a counter CUDA graph replays advance on the device
    (`slots.seed_counter`). ELEM_ALIGN: every piece starts at, and holds, a multiple of this many
    elements (the launcher checks), so loads keep their vector width. TWO_PATHS (ELEM_ALIGN 1,
    `slots.two_paths`): each tile takes the fast path (`slots.VECTOR_PATH`: 16-byte vectors;
    `slots.WHOLE_PATH`: no masks) when its descriptor's FAST_TILES says it can (`slots.fast_tiles`),
    else the element-wise one with masks; the same values either way.
    """
    if ROUND == STOCHASTIC:  # noqa: SIM102 - a constexpr test, kept apart from the None test
        if seq_ptr is not None:
            seed = salt_in_kernel(seed, tl.load(seq_ptr))
    h, h16 = h_ptr, h16_ptr
    if HADAMARD:
        h, h16 = load_tables(h_ptr, h16_ptr, G, DOT_PREC)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    for j in range(pid, n_chunks, nprog):  # each slot's tag and padding, by one program
        d = desc_ptr + j * DESC
        write_tag(out_ptr + tl.multiple_of(tl.load(d + SLOT_OFF), ALIGN), tl.load(d + NBYTES), tl.load(d + SLOT_END),
                  tl.load(d + TAG))
    # the lookup's vector at least 8 wide: with 2 or 4 lanes ptxas held sm_80's INT6 compress at 128
    # registers and spilled 8 B; 8 wide it takes 143 and none, as at P = 8 (bench/aot.py)
    LOOKUP: tl.constexpr = MAX_SLOTS if MAX_SLOTS >= 8 else 8
    for g in range(pid, n_tiles, nprog):  # tile g of the launch: tile g - TILE_BASE of its slot
        j = slot_of(desc_ptr, n_chunks, g, LOOKUP)
        d = desc_ptr + j * DESC
        t = g - tl.load(d + TILE_BASE)
        slot = out_ptr + tl.multiple_of(tl.load(d + SLOT_OFF), ALIGN)  # slots are 16-byte aligned
        a_ptr = (slot + tl.multiple_of(tl.load(d + A_OFF), 4)).to(tl.pointer_type(tl.float32))
        b_ptr = slot + tl.load(d + B_OFF)
        if not DUAL:
            b_ptr = (slot + tl.multiple_of(tl.load(d + B_OFF), 4)).to(tl.pointer_type(tl.float32))
        chunk_seed = seed
        if ROUND == STOCHASTIC:
            chunk_seed = salt_in_kernel(seed, j)
        base, elem_off, numel, fast = dense_piece(d, t, x_ptr, ELEM_ALIGN, TWO_PATHS)
        _compress_tile(base, slot, a_ptr, b_ptr, h, h16, t, numel, tl.load(d + N_GROUPS), tl.load(d + N_SB),
                       chunk_seed, G, GPS, SBT, CODEC, CODE_MAX, MBITS, EMIN, BITS, PACK_K, HADAMARD, DUAL, ROUND, HW,
                       FP8_HW, OP16, DOT_PREC, KRON, CDNA, K_CHUNKS, elem_off, fast, TWO_PATHS, ROW_GATHER)


def _int4_words(config: CompressionConfig) -> bool:
    """Whether INT4 codes are stored as words of 8 (`_common.codec_constexprs`); chosen with
    bench/aot.py on sm_90. Not after a one-dot transform (G <= 128): the dot's result holds 2
    neighbouring codes per thread, and gathering a word's 8 goes through shared memory (G=32:
    0.61 -> 0.65 instructions per element). Not for stochastic rounding without the transform
    (192 -> 241 registers, 1.40 -> 1.46). Elsewhere words save instructions (G=32 without the
    transform: 0.62 -> 0.60; G=512 with it: 0.73 -> 0.69)."""
    if config.hadamard:
        return config.group_size >= 256
    return not config.stochastic


def _meta(x_dtype, config: CompressionConfig, target: Target, params: dict, code_address: int, **extra) -> dict:
    """The constexprs of both compress kernels (`extra`: those of one) and the launch options."""
    operands16 = op16("compress", target, x_dtype, config)
    # FP32 input at G = 128 on NVIDIA's mma.sync targets (sm_80 .. sm_89, sm_120): the dot by K chunks
    # (`_common._dot_k_chunks`; one dot spilled 1240 B on sm_89, 1144 B on sm_120, by bench/aot.py)
    k_chunks = (target.backend == "cuda" and (int(target.arch) < 90 or int(target.arch) >= 120)
                and config.group_size == 128 and config.scales == "dual" and not operands16)
    codec = codec_constexprs(config.spec, code_address, int4_words=_int4_words(config))
    return launch_meta(
        target, params, G=config.group_size, GPS=SUPERBLOCK_ELEMS // config.group_size, SBT=SB_PER_TILE,
        **codec, ROW_GATHER=row_gather("compress", target, codec["PACK_K"]),
        **encoder_constexprs(config.spec), HADAMARD=config.hadamard, DUAL=config.scales == "dual",
        ROUND=int(STOCHASTIC) if config.stochastic else 0, OP16=operands16, K_CHUNKS=k_chunks, **extra,
    )


def _tables(x_dtype, config: CompressionConfig, meta: dict, device):
    return hadamard_tables(config.group_size, 0.5 / config.group_size, x_dtype if meta["OP16"] else torch.float32,
                           device, shaped=device is None)


def compress_launch(x, codes, a, b, numel: int, config: CompressionConfig, target: Target, params: dict,
                    device: torch.device | None = None) -> Launch:
    """The launch that compresses `numel` elements of x into (codes, a, b) (tensors or ShapedPointers)."""
    return compress_launches(x, codes, a, b, numel, config, target, params, device, split=False)[0]


def compress_launches(x, codes, a, b, numel: int, config: CompressionConfig, target: Target, params: dict,
                      device: torch.device | None = None, split: bool = True) -> tuple[Launch, ...]:
    """The launches that compress `numel` elements of x into (codes, a, b): one, or with `split`
    and a size that is not a multiple of 16, an aligned main launch and a one-program tail
    (`_tile.aligned_split`). All take the same pointer arguments (x_ptr, codes_ptr, scale_a_ptr,
    scale_b_ptr)."""
    layout = WireLayout.of(numel, config)
    meta = _meta(x.dtype, config, target, params, codes.data_ptr(), TAIL=False)
    h, h16 = _tables(x.dtype, config, meta, device)
    n_tiles = -(-layout.n_superblocks // SB_PER_TILE)
    main = aligned_split(numel) if split else 0

    def launch(tiles: int, meta: dict, numel: int, n_groups: int, n_sb: int, n_tiles: int, tile0: int) -> Launch:
        return Launch(_compress_kernel, tiles, dict(
            x_ptr=x, codes_ptr=codes, scale_a_ptr=a, scale_b_ptr=b, h_ptr=h, h16_ptr=h16, numel=numel,
            n_groups=n_groups, n_sb=n_sb, n_tiles=n_tiles, seed=config.seed, tile0=tile0), meta, device)

    if main == 0:
        return (launch(n_tiles, meta, numel, layout.n_groups, layout.n_superblocks, n_tiles, 0),)
    t0 = main // TILE_ELEMS
    return (launch(t0, meta, main, main // config.group_size, main // SUPERBLOCK_ELEMS, t0, 0),
            launch(1, {**meta, "TAIL": True}, numel, layout.n_groups, layout.n_superblocks, n_tiles, t0))


def compress_slots_launch(x, out, desc, n_slots: int, n_tiles: int, config: CompressionConfig, target: Target,
                          params: dict, device: torch.device | None = None, seed: int | None = None,
                          elem_align: int = 1, seq_ptr: torch.Tensor | None = None, two_paths: int = 0) -> Launch:
    """The launch that compresses `n_slots` pieces of x into their slots of `out` (uint8 wire
    buffer, slots 16-byte aligned), tags and padding included; `desc` the slots' descriptor table
    (`slots.descriptors`), `n_tiles` their tiles in all, `params` from
    `launch_params("compress_slots", ...)`, `seed` the salted seed (default: the config's),
    `elem_align` a number of elements every piece's first element and size are multiples of (16
    keeps vector loads; 1 assumes nothing), `two_paths` with 1: the fast path the tiles that can
    take it take (`slots.two_paths`, 0 for none), `seq_ptr` a device counter the stochastic seed is
    salted with on the device (`slots.seed_counter`; None: not used)."""
    meta = _meta(x.dtype, config, target, params, out.data_ptr(), ELEM_ALIGN=elem_align,
                 TWO_PATHS=slots.kernel_paths(int(two_paths), target, config.spec.bits) if elem_align == 1 else 0,
                 MAX_SLOTS=triton.next_power_of_2(max(n_slots, 1)))
    h, h16 = _tables(x.dtype, config, meta, device)
    return Launch(_compress_slots_kernel, n_tiles,
                  dict(x_ptr=x, out_ptr=out, desc_ptr=desc, h_ptr=h, h16_ptr=h16, n_chunks=n_slots, n_tiles=n_tiles,
                       seed=config.seed if seed is None else seed, seq_ptr=seq_ptr), meta, device)


class CompressOp(FusedOp):
    """Every launch of the fused compress, decided in this one place: the kernel (dense, or
    slotted with tags), its launch parameters (asked under the kernel's own name), a dense
    launch's aligned split, a slotted launch's tiles and alignment (from its pieces and layouts),
    the variant whose stochastic seeds CUDA graph replays salt on the device, and what a repeated
    call passes, by name. `ops` (dense), the collectives' and p2p's plans (slotted) and
    bench/aot.py (both) build their launches here, so a change of a kernel's parameters is a
    change of this file.

    Constructed as `_launch.FusedOp` (config, device, target, params).
    """

    #: What a repeated call passes: call argument -> the kernel parameter(s) it fills.
    DENSE_CALL = {"x": "x_ptr", "codes": "codes_ptr", "scale_a": "scale_a_ptr", "scale_b": "scale_b_ptr"}
    SLOTS_CALL = {"x": "x_ptr", "wire": "out_ptr", "seed": "seed"}

    def dense_launches(self, x, codes, a, b, numel: int, split: bool = True) -> tuple[Launch, ...]:
        """`compress_launches` with this op's parameters (kernel "compress")."""
        return compress_launches(x, codes, a, b, numel, self.config, self.target,
                                 self.params("compress", x.dtype, numel), self.device, split)

    def dense(self, x, codes, a, b, numel: int):
        """`run(x, codes, scale_a, scale_b)`: the dense launches prepared, run in order."""
        return in_order(Prepared(ln, self.DENSE_CALL).call for ln in self.dense_launches(x, codes, a, b, numel))

    def slots_launch(self, x, wire, desc, pieces, layouts, graph_seeds: bool = False) -> Launch:
        """The slotted launch over `pieces` of x (their `layouts`; `desc` their descriptor table)
        into `wire`; `graph_seeds`: the variant CUDA graphs capture (seeds salted on the device
        with `slots.seed_counter`), for stochastic rounding."""
        seq_ptr = slots.seed_counter(self.device) if graph_seeds and self.config.stochastic else None
        params = self.params("compress_slots", x.dtype, max(lay.numel for lay in layouts))
        return compress_slots_launch(x, wire, desc, len(pieces), slots.total_tiles(layouts), self.config, self.target,
                                     params, self.device, seq_ptr=seq_ptr, **slots.alignment(pieces))

    @classmethod
    def prepare_slots(cls, launch: Launch):
        """`run(x, wire, seed)` of a slotted launch."""
        return Prepared(launch, cls.SLOTS_CALL).call


def compress_triton(x: torch.Tensor, config: CompressionConfig, out: torch.Tensor | None = None) -> torch.Tensor:
    """Launch the fused compress kernel. `x` contiguous bf16/fp16/fp32; returns the wire buffer."""
    if not x.is_contiguous():
        raise ValueError(f"compress_triton needs a contiguous `x`, got strides {x.stride()} for shape {tuple(x.shape)}")
    layout = WireLayout.of(x.numel(), config)
    data = alloc.empty(layout.nbytes, torch.uint8, x.device) if out is None else out
    if layout.n_groups == 0:
        return data
    codes, a, b = layout.split(data)
    for launch in CompressOp(config, x.device).dense_launches(x, codes, a, b, x.numel()):
        launch.run()
    return data
