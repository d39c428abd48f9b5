"""Slotted wire buffers: many pieces of a tensor in one buffer, each in its own slot, one launch.

A collective's pipeline slice moves P pieces (one per rank) in one buffer: piece j's wire bytes
start at a 16-byte-aligned slot offset, a 4-byte tag follows them, zeros pad the slot to its
stride. The batched kernels (`compress.compress_slots`, `decompress.decompress_slots`) take a
descriptor table, one int64 row per slot, built once per call signature and kept on the
device, so one launch handles every slot and the host builds nothing per call.

The tag after a slot is the sender's fingerprint of the call and the slot's place in it
(`collectives._pg.tag`). The kernels that read a slot compare its tag with the expected one on
the device: a mismatch makes that slot's outputs NaN and writes an error record into a small
host-visible buffer (`ErrorRecord`), which the host reads later without blocking.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..layout import WireLayout
from ._tables import SB_PER_TILE

#: Fields of a descriptor row (int64): where the slot's piece is and how it is laid out.
ELEM_OFF: tl.constexpr = tl.constexpr(0)   # first element of the piece in the dense tensor
NUMEL: tl.constexpr = tl.constexpr(1)
SLOT_OFF: tl.constexpr = tl.constexpr(2)   # byte offset of the slot in the wire buffer
N_GROUPS: tl.constexpr = tl.constexpr(3)
N_SB: tl.constexpr = tl.constexpr(4)
N_TILES: tl.constexpr = tl.constexpr(5)
A_OFF: tl.constexpr = tl.constexpr(6)      # scale regions, relative to the slot
B_OFF: tl.constexpr = tl.constexpr(7)
NBYTES: tl.constexpr = tl.constexpr(8)     # the tag follows the wire bytes
SLOT_END: tl.constexpr = tl.constexpr(9)   # the slot's stride: padding up to here is zero
TILE_BASE: tl.constexpr = tl.constexpr(10)  # tiles of the slots before this one
TAG: tl.constexpr = tl.constexpr(11)
SRC: tl.constexpr = tl.constexpr(12)       # the rank (or chunk) the slot belongs to, for errors
DESC: tl.constexpr = tl.constexpr(16)

TAG_BYTES = 4
ALIGN = 16
#: Fields of an error record: set, slice, source rank, tag found, tag expected, call number.
ERR_FIELDS = 8
_M = 1_000_003
_ADD = 0x9E3779B9


def round_up(n: int, a: int) -> int:
    return -(-n // a) * a


def salt(seed: int, *values: int) -> int:
    """The per-call stochastic seed: `seed` mixed with each of `values` (what the kernels mix in
    for each slot, as `salt_in_kernel`)."""
    h = seed
    for s in values:
        h = (h * _M + s + _ADD) % 2**31
    return h


@triton.jit
def salt_in_kernel(h, s):
    """`salt(h, s)` on the device (h < 2^31, so the int64 product cannot overflow)."""
    return (h.to(tl.int64) * 1000003 + s + 2654435769) % 2147483648


@triton.jit
def write_tag(slot_ptr, nbytes, end, tag):
    """The 4 tag bytes (little endian) at slot_ptr + nbytes, then zeros up to `end`, so no
    uninitialised byte goes on the wire."""
    i = tl.arange(0, 32)
    pos = nbytes + i
    val = tl.where(i < 4, (tag >> (8 * i).to(tl.int64)) & 0xFF, 0)
    tl.store(slot_ptr + pos, val.to(tl.uint8), mask=pos < end)
    z = tl.arange(0, 1024)
    for s in range(nbytes + 32, end, 1024):  # a short last chunk's slot in a longer one's stride
        tl.store(slot_ptr + s + z, tl.zeros([1024], tl.uint8), mask=s + z < end)


@triton.jit
def read_tag(slot_ptr, nbytes):
    """The 4-byte little-endian tag at slot_ptr + nbytes, as int64."""
    i = tl.arange(0, 4)
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


def descriptors(pieces, layouts, slot_offsets, slot_ends, tags, sources) -> list[list[int]]:
    """Descriptor rows (host ints) of slots: pieces [(first element, end)], their wire layouts,
    slot byte offsets and strides, tags (uint32 as int) and source ranks."""
    rows, base = [], 0
    for (a, b), lay, off, end, tag, src in zip(pieces, layouts, slot_offsets, slot_ends, tags, sources):
        n_tiles = -(-lay.n_superblocks // SB_PER_TILE)
        row = [a, b - a, off, lay.n_groups, lay.n_superblocks, n_tiles, lay.scale_a_offset, lay.scale_b_offset,
               lay.nbytes, end, base, tag, src]
        rows.append(row + [0] * (DESC.value - len(row)))
        base += n_tiles
    return rows


def elem_align(pieces) -> int:
    """16 when every piece [a, b) starts at and holds a multiple of 16 elements (the batched
    kernels then keep 16-element vector loads and stores), else 1."""
    return 16 if all(a % 16 == 0 and (b - a) % 16 == 0 for a, b in pieces) else 1


def total_tiles(layouts: list[WireLayout]) -> int:
    return sum(-(-lay.n_superblocks // SB_PER_TILE) for lay in layouts)


def table(rows: list[list[int]], device) -> torch.Tensor:
    """The descriptor rows as a device tensor (built once per signature, kept by its plan)."""
    return torch.tensor(rows, dtype=torch.int64).to(device)


class ErrorRecord:
    """A small int64 buffer the kernels write when a tag check fails, readable by the host
    without a synchronization: host memory (pinned and mapped into the GPU's address space on
    CUDA, so the kernels write it directly), read through a NumPy view once the work that may
    have written it is complete."""

    def __init__(self, device: torch.device):
        pinned = device.type == "cuda"
        self.tensor = torch.zeros(ERR_FIELDS, dtype=torch.int64, pin_memory=pinned)
        self._view = self.tensor.numpy()  # shares memory: reading it is no torch op
        self.device = device

    def take(self):
        """(slice, source, tag found, tag expected, call number) of a recorded mismatch, clearing
        it; None when there is none."""
        v = self._view
        if not v[0]:
            return None
        out = tuple(int(x) for x in v[1:6])
        v[:] = 0
        return out
