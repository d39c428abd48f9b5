"""Slotted wire buffers: many pieces of a tensor in one buffer, each in its own slot, one launch.

A collective's pipeline slice moves P pieces (one per rank) in one buffer: piece j's wire bytes
start at a 16-byte-aligned slot offset, a 4-byte tag follows them, zeros pad the slot to its
stride. The batched kernels (`compress.compress_slots`, `decompress.decompress_slots`) take a
descriptor table, one int64 row per slot, built once per call signature and kept on the
device, so one launch handles every slot and the host builds nothing per call.

The tag after a slot is the sender's fingerprint of the call and the slot's place in it
(`tag`). The kernels that read a slot compare its tag with the expected one on
the device: a mismatch makes that slot's outputs NaN and writes the call's error record, a small
host-visible buffer (`ErrorRecord`, one per call in flight), which the host reads later without
blocking.

This module is the host side and imports no Triton (the collectives import it with the package, and
a CPU user sets TRITON_INTERPRET before the kernels are decorated); the device side, the same
fields as constexprs and the tag helpers, is `_slot_io.py`.
"""
from __future__ import annotations

import struct
import zlib

import torch

from ..layout import WireLayout
from ..state import STATE
from ._tables import SB_PER_TILE, TILE_ELEMS

#: Fields of a descriptor row (int64): where the slot's piece is and how it is laid out.
ELEM_OFF = 0   # first element of the piece in the dense tensor
NUMEL = 1
SLOT_OFF = 2   # byte offset of the slot in the wire buffer
N_GROUPS = 3
N_SB = 4
N_TILES = 5
A_OFF = 6      # scale regions, relative to the slot
B_OFF = 7
NBYTES = 8     # the tag follows the wire bytes
SLOT_END = 9   # the slot's stride: padding up to here is zero
TILE_BASE = 10  # tiles of the slots before this one
TAG = 11
SRC = 12       # the rank (or chunk) the slot belongs to, for errors
FAST_TILES = 13  # the slot's leading tiles that take the kernels' fast path (`fast_tiles`)
DESC = 16

#: Bytes of the tag after a slot's wire bytes (the sender's fingerprint of the call and the slot):
#: a CRC-32, little endian (`tag`, `tag_bytes`).
TAG_BYTES = 4
#: Every slot starts ALIGN-byte aligned (16-byte vector loads, FP32 scale views).
ALIGN = 16
#: Elements per vector access of the batched kernels: a piece that starts at and holds multiples
#: of it keeps vector loads and stores (`elem_align`, `fast_tiles`, `_tile.aligned_split`).
VECTOR_ELEMS = 16
#: Fields of an error record: set, slice, source rank, tag found, tag expected, call number.
ERR_FIELDS = 8
#: The stochastic seed's salt (`salt`; the kernels' `_slot_io.salt_in_kernel`): h -> (h * MUL + v + ADD) mod MOD.
SALT_MUL, SALT_ADD, SALT_MOD = 1_000_003, 0x9E3779B9, 2**31


def round_up(n: int, a: int) -> int:
    """`n` rounded up to a multiple of `a`."""
    return -(-n // a) * a


def slot_bytes(nbytes: int) -> int:
    """The stride of a slot that holds `nbytes` wire bytes: the bytes, the tag, zeros up to the
    next `ALIGN` boundary (the collectives' and p2p's buffers, and what `estimate` counts)."""
    return round_up(nbytes + TAG_BYTES, ALIGN)


def salt(seed: int, *values: int) -> int:
    """The per-call stochastic seed: `seed` mixed with each of `values` (what the kernels mix in
    for each slot, as `salt_in_kernel`)."""
    h = seed
    for s in values:
        h = (h * SALT_MUL + s + SALT_ADD) % SALT_MOD
    return h


def tag(fingerprint: int, *where: int) -> int:
    """The tag carried after a slot (uint32 as int): a CRC-32 of the call's fingerprint and the
    slot's place in it (`where`: the process-group call, slice, slot; p2p: 0)."""
    return zlib.crc32(struct.pack(f"<I{len(where)}q", fingerprint, *where))


def tag_bytes(t: int) -> bytes:
    """A tag as the bytes on the wire."""
    return t.to_bytes(TAG_BYTES, "little")


def tag_of(wire_bytes) -> int:
    """The tag read from its bytes on the wire (bytes, or a uint8 tensor on any device)."""
    if isinstance(wire_bytes, torch.Tensor):
        wire_bytes = bytes(wire_bytes.cpu().tolist())
    return int.from_bytes(bytes(wire_bytes), "little")


def tag_hex(t: int) -> str:
    """A tag as error messages print it: its wire bytes in hex."""
    return tag_bytes(t).hex()


def salted(config, *values: int):
    """`config` with its seed salted with `values` (`salt`: the rank, the call, the slice, ...) when
    it rounds stochastically, so rounding is independent across ranks and calls; else `config`."""
    return config.replace(seed=salt(config.seed, *values)) if config.stochastic else config


def seed_counter(device: torch.device) -> torch.Tensor:
    """The int64 counter on `device` that the stochastic seeds of calls captured in a CUDA graph
    are salted with on the device (the kernels' `seq_ptr`): each such call adds 1 to it, on the
    device, before its kernels, so every replay rounds with fresh seeds, as torch's graph-safe
    generators advance their offset. Made once per device (before any capture) and kept, since
    graphs hold its address."""
    key = (device.type, device.index)
    counter = STATE.seed_counters.get(key)
    if counter is None:
        counter = STATE.seed_counters[key] = torch.zeros(1, dtype=torch.int64, device=device)
    return counter


def descriptors(pieces, layouts, slot_offsets, slot_ends, tags, sources) -> list[list[int]]:
    """Descriptor rows (host ints) of slots: pieces [(first element, end)], their wire layouts,
    slot byte offsets and strides, tags (uint32 as int) and source ranks. FAST_TILES is each
    piece's `fast_tiles` for the fast path the launch over these pieces compiles (`two_paths`)."""
    rows, base = [], 0
    paths = two_paths(pieces)
    for (a, b), lay, off, end, tag, src in zip(pieces, layouts, slot_offsets, slot_ends, tags, sources):
        n_tiles = -(-lay.n_superblocks // SB_PER_TILE)
        row = [a, b - a, off, lay.n_groups, lay.n_superblocks, n_tiles, lay.scale_a_offset, lay.scale_b_offset,
               lay.nbytes, end, base, tag, src, fast_tiles(a, b, paths)]
        rows.append(row + [0] * (DESC - len(row)))
        base += n_tiles
    return rows


def elem_align(pieces) -> int:
    """16 when every piece [a, b) starts at and holds a multiple of 16 elements (the batched
    kernels then keep 16-element vector loads and stores in every tile), else 1."""
    v = VECTOR_ELEMS
    return v if all(a % v == 0 and (b - a) % v == 0 for a, b in pieces) else 1


#: The fast path of a launch with two paths per tile (`two_paths`; the kernels' TWO_PATHS): 16-byte
#: vectors for the whole tiles of pieces that start aligned, or, where a piece starts off alignment,
#: element-wise accesses without masks for the whole tiles of every piece. WHOLE_RUN_PATH: a kernel's
#: variant of WHOLE_PATH, the same tiles addressed as one run each (`kernel_paths`).
VECTOR_PATH, WHOLE_PATH, WHOLE_RUN_PATH = 1, 2, 3


def two_paths(pieces) -> int:
    """The fast path a launch of elem_align 1 compiles beside its element-wise one (0: none, the
    launch's pieces are all aligned, `elem_align`), the path its descriptors' FAST_TILES leading
    tiles take (`fast_tiles`):

    - VECTOR_PATH when every piece starts at a multiple of 16 elements and only sizes are not (an
      all_reduce's last piece, an all_gather's or a p2p message's one piece): all but the partial
      last tiles keep 16-byte vectors.
    - WHOLE_PATH when a piece starts elsewhere (reduce_scatter's input and all_gather's output at
      r * m for an odd shard size m): no 16-byte-aligned address to access, so every tile goes
      element by element, but a whole tile needs no mask (one test and one predicate per element
      where the masked path has them; bench/aot.py, sm_90 all_gather's INT4 decompress of an odd
      size: the tile loop's instructions 1,403 on the masked path alone).
    """
    if elem_align(pieces) != 1:
        return 0
    return VECTOR_PATH if all(a % VECTOR_ELEMS == 0 for a, _ in pieces) else WHOLE_PATH


def kernel_paths(paths: int, target, bits: int) -> int:
    """The slotted kernels' TWO_PATHS for a launch whose pieces ask for `paths` (`two_paths`;
    `target` a `_launch.Target`): WHOLE_PATH's whole tiles addressed as one run each
    (WHOLE_RUN_PATH, `_tile.load_whole_tile`) for codes narrower than a byte on NVIDIA, by
    2-D offsets (`_tile.whole_tile_ptrs`) otherwise. Chosen with bench/aot.py (the odd reduce_scatter
    compress and all_gather decompress at P = 8, 16 and 64 MiB): the run folds each thread's
    addresses into the accesses' immediates but reaches the tile's layout through a reshape. INT6
    and INT4 (G = 32) on sm_80 .. sm_100: 5-20% fewer instructions (sm_100 INT4 decompress 0.467 ->
    0.377 warp-instructions per element, 0.407 aligned); FP8 and INT8 (G = 128): 6-23% more in the
    compress (sm_80 INT8 0.572 -> 0.704), about the same in the decompress; gfx942: 4-5% fewer in
    the sub-byte compress, 7-13% more in every decompress. The interpreter follows the rule, so the
    tests run both (by codec); the descriptors count the same tiles either way."""
    if paths != WHOLE_PATH or bits >= 8:
        return paths
    return WHOLE_RUN_PATH if not target.compiled or target.backend == "cuda" else paths


def alignment(pieces) -> dict:
    """The batched launchers' `elem_align` and `two_paths` for a launch over `pieces`."""
    return {"elem_align": elem_align(pieces), "two_paths": two_paths(pieces)}


def fast_tiles(a: int, b: int, paths: int = VECTOR_PATH) -> int:
    """How many leading tiles of piece [a, b) the batched kernels run on the fast path of a launch
    compiled with `paths` (`two_paths`; the rest element by element, with masks). VECTOR_PATH, 16-element
    vector loads and stores: every tile when the piece starts at and holds a multiple of 16 elements; its whole
    tiles when it starts at one and holds a size that is not (only the last, partial tile's mask
    is not uniform over 16-element runs); none when it starts elsewhere. WHOLE_PATH (and its
    variant WHOLE_RUN_PATH), no masks: the piece's whole tiles, wherever it starts. Both paths compute the same values, so the bytes do
    not depend on it."""
    n = b - a
    if paths in (WHOLE_PATH, WHOLE_RUN_PATH):
        return n // TILE_ELEMS
    if a % VECTOR_ELEMS:
        return 0
    if n % VECTOR_ELEMS == 0:
        return -(-n // TILE_ELEMS)
    return n // TILE_ELEMS


def slow_tiles(rows) -> int:
    """The tiles of a launch's descriptor rows that take the element-wise path with masks (`fast_tiles`)."""
    return sum(r[N_TILES] - r[FAST_TILES] for r in rows)


def total_tiles(layouts: list[WireLayout]) -> int:
    return sum(-(-lay.n_superblocks // SB_PER_TILE) for lay in layouts)


def table(rows: list[list[int]], device) -> torch.Tensor:
    """The descriptor rows as a device tensor (built once per signature, kept by its plan)."""
    return torch.tensor(rows, dtype=torch.int64).to(device)


class ErrorRecord:
    """One call's error record: ERR_FIELDS int64 the kernels of that call (and no other) write when
    a tag check fails, readable by the host without a synchronization: host memory (pinned and
    mapped into the GPU's address space on CUDA, so the kernels write it directly), read through
    a NumPy view once the call's work is complete. A row of an `ErrorRecords` pool."""

    __slots__ = ("_view", "tensor")

    def __init__(self, row: torch.Tensor):
        self.tensor = row
        self._view = row.numpy()  # shares memory: reading it is no torch op

    def take(self):
        """(slice, source, tag found, tag expected, call number) of a recorded mismatch, clearing
        it; None when there is none. Only once no kernel may write the record any more."""
        v = self._view
        if not v[0]:
            return None
        out = tuple(int(x) for x in v[1:6])
        v[:] = 0
        return out


class ErrorRecords:
    """The error records of one plan's (or p2p message's) calls in flight: each call claims a zeroed
    record, its kernels write only that one, and the host gives it back (`release`, after `take`)
    once the call's work is complete; so no record is cleared while a kernel may write it. More
    records are made when more calls are in flight than there are free ones (`CHUNK` at a time)."""

    CHUNK = 8

    def __init__(self, device: torch.device):
        self.device = device
        self._free: list[ErrorRecord] = []
        self._grow()

    def _grow(self) -> None:
        rows = torch.zeros(self.CHUNK, ERR_FIELDS, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        self._free.extend(ErrorRecord(rows[i]) for i in reversed(range(self.CHUNK)))

    def claim(self) -> ErrorRecord:
        """A zeroed record for one call."""
        if not self._free:
            self._grow()
        return self._free.pop()

    def release(self, record: ErrorRecord) -> None:
        """Give back a record whose call's work is complete and which was read (so it is zero)."""
        self._free.append(record)
