"""The device side of slotted wire buffers (`slots.py`): the descriptor fields as constexprs, the
tags and error records as `@triton.jit` helpers, and the stochastic seed's salt on the device."""
from __future__ import annotations

import triton
import triton.language as tl

from . import slots

# Descriptor fields (`slots.py` numbers them): globals a kernel reads must be constexprs.
ELEM_OFF: tl.constexpr = tl.constexpr(slots.ELEM_OFF)
NUMEL: tl.constexpr = tl.constexpr(slots.NUMEL)
SLOT_OFF: tl.constexpr = tl.constexpr(slots.SLOT_OFF)
N_GROUPS: tl.constexpr = tl.constexpr(slots.N_GROUPS)
N_SB: tl.constexpr = tl.constexpr(slots.N_SB)
N_TILES: tl.constexpr = tl.constexpr(slots.N_TILES)
A_OFF: tl.constexpr = tl.constexpr(slots.A_OFF)
B_OFF: tl.constexpr = tl.constexpr(slots.B_OFF)
NBYTES: tl.constexpr = tl.constexpr(slots.NBYTES)
SLOT_END: tl.constexpr = tl.constexpr(slots.SLOT_END)
TILE_BASE: tl.constexpr = tl.constexpr(slots.TILE_BASE)
TAG: tl.constexpr = tl.constexpr(slots.TAG)
SRC: tl.constexpr = tl.constexpr(slots.SRC)
FAST_TILES: tl.constexpr = tl.constexpr(slots.FAST_TILES)
DESC: tl.constexpr = tl.constexpr(slots.DESC)
TAG_BYTES: tl.constexpr = tl.constexpr(slots.TAG_BYTES)
ALIGN: tl.constexpr = tl.constexpr(slots.ALIGN)
VECTOR_ELEMS: tl.constexpr = tl.constexpr(slots.VECTOR_ELEMS)
WHOLE_PATH: tl.constexpr = tl.constexpr(slots.WHOLE_PATH)
WHOLE_RUN_PATH: tl.constexpr = tl.constexpr(slots.WHOLE_RUN_PATH)
SALT_MUL: tl.constexpr = tl.constexpr(slots.SALT_MUL)
SALT_ADD: tl.constexpr = tl.constexpr(slots.SALT_ADD)
SALT_MOD: tl.constexpr = tl.constexpr(slots.SALT_MOD)


@triton.jit
def salt_in_kernel(h, s):
    """`salt(h, s)` on the device (h < 2^31, so the int64 product cannot overflow)."""
    return (h.to(tl.int64) * SALT_MUL + s + SALT_ADD) % SALT_MOD


@triton.jit
def write_tag(slot_ptr, nbytes, end, tag):
    """The TAG_BYTES tag bytes (little endian) at slot_ptr + nbytes, then zeros up to `end`, so no
    uninitialised byte goes on the wire."""
    i = tl.arange(0, 32)
    pos = nbytes + i
    val = tl.where(i < TAG_BYTES, (tag >> (8 * i).to(tl.int64)) & 0xFF, 0)
    tl.store(slot_ptr + pos, val.to(tl.uint8), mask=pos < end)
    z = tl.arange(0, 1024)
    for s in range(nbytes + 32, end, 1024):  # a short last chunk's slot in a longer one's stride
        tl.store(slot_ptr + s + z, tl.zeros([1024], tl.uint8), mask=s + z < end)


@triton.jit
def read_tag(slot_ptr, nbytes):
    """The TAG_BYTES-byte little-endian tag at slot_ptr + nbytes, as int64."""
    i = tl.arange(0, TAG_BYTES)
    b = tl.load(slot_ptr + nbytes + i).to(tl.int64)
    return tl.sum(b << (8 * i).to(tl.int64), axis=0)


@triton.jit
def record_error(err_ptr, k, src, got, want, seq):
    """Fill the error record (one program writes; every program that saw it writes the same)."""
    tl.store(err_ptr + 1, k.to(tl.int64))
    tl.store(err_ptr + 2, src.to(tl.int64))
    tl.store(err_ptr + 3, got)
    tl.store(err_ptr + 4, want)
    tl.store(err_ptr + 5, seq.to(tl.int64))
    tl.store(err_ptr, 1)


@triton.jit
def aligned_vec(v):
    """`v` rounded down to a multiple of VECTOR_ELEMS, which the compiler can see is one: an
    element offset or count equal to `v` on the tiles that take the vector path of a launch with
    two paths (`slots.two_paths`, `slots.fast_tiles`), so their accesses keep 16-byte vectors."""
    return (v // VECTOR_ELEMS) * VECTOR_ELEMS


@triton.jit
def dense_piece(d, t, ptr, ELEM_ALIGN: tl.constexpr, TWO_PATHS: tl.constexpr):
    """(pointer, element offset, size, fast path or not) of tile t of the slot whose descriptor
    row is at d, in the dense tensor at ptr: with ELEM_ALIGN > 1 the piece's pointer itself, made
    here as the plain kernels take theirs; with TWO_PATHS (`slots.two_paths`) the offset apart and
    whether the tile is one of the slot's FAST_TILES (`slots.fast_tiles`, `_tile.load_dense`)."""
    elem_off = tl.load(d + ELEM_OFF)
    numel = tl.load(d + NUMEL)
    fast = False
    if ELEM_ALIGN > 1:  # every piece aligned: the masks of whole vectors are uniform, accesses stay vectors
        numel = tl.multiple_of(numel, ELEM_ALIGN)
        ptr, elem_off = ptr + tl.multiple_of(elem_off, ELEM_ALIGN), 0
    elif TWO_PATHS:  # a tile takes the fast path (vectors, or no masks) where the descriptor says it can
        fast = t < tl.load(d + FAST_TILES)
    return ptr, elem_off, numel, fast


@triton.jit
def slot_of(desc_ptr, n_slots, g, MAX_SLOTS: tl.constexpr):
    """The slot that holds tile `g` of a launch whose tiles are dealt across slots (a slot's tiles
    start at its descriptor's TILE_BASE, the tiles of the slots before it): the last slot whose
    TILE_BASE is at most g (an empty slot shares the next one's base and is passed over). One
    vector load of the table's TILE_BASE column (MAX_SLOTS >= n_slots, a power of two) and a
    count: no loop over slots, no division."""
    j = tl.arange(0, MAX_SLOTS)
    bases = tl.load(desc_ptr + j * DESC + TILE_BASE, mask=j < n_slots, other=9223372036854775807)
    return tl.sum((bases <= g).to(tl.int32), axis=0) - 1
