"""The wire contract of the compressed collectives, as plain integers: the stages each collective
runs per pipeline slice, how a message is cut into chunks and slices, and the bytes each
process-group call moves.

It sits below both `estimate` and the collectives: the collectives' shapes (`collectives._shapes`)
take their stages and chunks from here and their plans cut slices with `pieces`; `estimate` counts
launches and bytes with the same functions, so a new collective is one entry here and one shape,
and the model follows. The slot geometry (tag, padding, alignment) is `kernels.slots`; the ring
cost of each process-group call is `estimate.ring_bytes`.
"""
from __future__ import annotations

from .config import SUPERBLOCK_ELEMS, CompressionConfig
from .kernels import slots
from .layout import WireLayout

COMPRESS, REDUCE, DECOMPRESS = "compress", "reduce", "decompress"
ALL_TO_ALL, ALL_GATHER, SEND = "all_to_all", "all_gather", "send"

STAGES = {
    # TACO's two-shot: compress P chunks, all_to_all, fused dequantize-sum-requantize, all_gather,
    # decompress every chunk (its own too, so every rank ends bitwise identical)
    "all_reduce": ((COMPRESS, ALL_TO_ALL), (REDUCE, ALL_GATHER), (DECOMPRESS, None)),
    "reduce_scatter": ((COMPRESS, ALL_TO_ALL), (REDUCE, None)),  # the reduce writes the dense shard
    "all_gather": ((COMPRESS, ALL_GATHER), (DECOMPRESS, None)),
    "p2p": ((COMPRESS, SEND), (DECOMPRESS, None)),  # the sender runs the first, the receiver the second
}
"""Per collective, each stage's codec step (one kernel launch per pipeline slice) and the
process-group call that moves what it wrote (None for the last)."""

AUTO_SLICE_BYTES = 8 << 20
"""Each pipeline slice of "auto" depth carries at least this many input bytes."""
MAX_PIPELINE = 16
"""The most pipeline slices a call may ask for."""


def depth(nbytes: int, pipeline) -> int:
    """The number of pipeline slices of a message of `nbytes` ("auto": one per `AUTO_SLICE_BYTES`,
    at most half of `MAX_PIPELINE`); ValueError for anything but "auto" or an int in range."""
    if pipeline == "auto":
        return max(1, min(MAX_PIPELINE // 2, nbytes // AUTO_SLICE_BYTES))
    if isinstance(pipeline, bool) or not isinstance(pipeline, int) or not 1 <= pipeline <= MAX_PIPELINE:
        raise ValueError(f"pipeline must be 'auto' or an int in [1, {MAX_PIPELINE}], got {pipeline!r}")
    return pipeline


def chunks(collective: str, numel: int, p: int) -> tuple[list[tuple[int, int]], int]:
    """(chunks, shard): how a message of `numel` elements (all_reduce's tensor, reduce_scatter's
    input, all_gather's output, a p2p message) is cut among `p` ranks. all_reduce: one
    super-block-aligned chunk per rank (the last ones may be short or empty), no shard;
    reduce_scatter: rank j's shard of the input per rank; all_gather: this rank's shard, whole;
    p2p: the message."""
    if collective == "all_reduce":
        c = slots.round_up(-(-numel // p), SUPERBLOCK_ELEMS)
        return [(min(j * c, numel), min((j + 1) * c, numel)) for j in range(p)], 0
    if collective == "reduce_scatter":
        m = numel // p
        return [(j * m, (j + 1) * m) for j in range(p)], m
    if collective == "all_gather":
        m = numel // p
        return [(0, m)], m
    if collective == "p2p":
        return [(0, numel)], numel
    raise ValueError(f"collective must be one of {list(STAGES)}, got {collective!r}")


def pieces(chunks: list[tuple[int, int]], depth: int) -> list[list[tuple[int, int]]]:
    """Cut every chunk [s, e) into `depth` super-block-aligned pieces: pieces[k][j] of chunk j."""
    longest = max(e - s for s, e in chunks)
    step = slots.round_up(max(1, -(-longest // depth)), SUPERBLOCK_ELEMS)
    n_slices = max(1, -(-longest // step))
    return [[(min(s + k * step, e), min(s + (k + 1) * step, e)) for s, e in chunks] for k in range(n_slices)]


def slot_strides(piece: list[tuple[int, int]], config: CompressionConfig) -> list[int]:
    """The slot stride of each piece of a slice (its wire bytes, tag and padding)."""
    return [slots.slot_bytes(WireLayout.of(b - a, config).nbytes) for a, b in piece]


def buffers(collective: str, numel: int, config: CompressionConfig, p: int, depth: int = 1) -> list[dict]:
    """Per pipeline slice, {process-group call: bytes of the buffer this rank hands it}, as the
    collectives build them: the all_to_all sends every chunk's slot (P slots, each its own
    stride), the all_gather this rank's slot padded to the slice's widest (every rank's slot
    has one stride), a p2p send the message's one slot."""
    parts, _ = chunks(collective, numel, p)
    out = []
    for piece in pieces(parts, depth):
        strides = slot_strides(piece, config)
        sizes = {ALL_TO_ALL: sum(strides), ALL_GATHER: max(strides), SEND: strides[0]}
        out.append({comm: sizes[comm] for _, comm in STAGES[collective] if comm is not None})
    return out


def launches(collective: str, n_slices: int) -> int:
    """Kernel launches of a compressed call of `n_slices` pipeline slices: one per stage and slice."""
    return len(STAGES[collective]) * n_slices
