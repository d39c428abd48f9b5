"""Compressed all_reduce, reduce_scatter and all_gather with torch.distributed semantics.

all_reduce is two-shot, as in TACO: every rank compresses P chunks of its tensor, an
all-to-all delivers chunk r of every rank to rank r, one fused kernel dequantizes, sums and
requantizes them (in the transformed domain: no inverse/forward Hadamard between sum and
requantization), an all-gather delivers the compressed sums to everyone and each rank
decompresses all of them - its own too, so every rank ends with bitwise-identical results.
reduce_scatter is the first half (the fused kernel writes the dense sum); all_gather compresses
the local shard once.

Overlap: the message is cut into `pipeline` slices; slice k+1 is compressed while slice k is on
the wire (async process-group work; on GPUs NCCL runs on its own stream). Collectives are issued
in the same order on every rank, driven from the calling thread, so concurrent collectives on a
group can never interleave differently across ranks.
"""
from __future__ import annotations

import itertools
from collections import deque
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from .. import ops
from ..config import INPUT_DTYPES, SUPERBLOCK_ELEMS, CompressionConfig
from ..env import check_collectives
from ..layout import WireLayout
from . import _pg

#: Messages below this many bytes go through the native collective when the codec runs on a GPU.
#: Not yet measured on GPUs (TACO's authors use 10 MiB); see README. On CPU tensors the codec is the
#: torch reference (~14 MB/s per core measured, bench/collectives.py), slower than the link at
#: every size for links >= 0.25 Gbit/s, so there the default is native unless min_bytes is given.
DEFAULT_MIN_BYTES = 1 << 20
#: Each pipeline slice of "auto" depth carries at least this many input bytes.
AUTO_SLICE_BYTES = 8 << 20
MAX_PIPELINE = 16
_ALIGN = 16  # every wire-buffer slot starts 16-byte aligned (vector loads, FP32 scale views)
_calls = itertools.count()


class Pending:
    """Handle of an async compressed collective; like torch.distributed's Work.

    The first communication is already in flight when it is returned; `wait()` runs the rest of
    the pipeline and returns True once the result is in the output tensor.
    """

    def __init__(self, steps: Iterator[None]):
        self._steps = steps
        self._done = False
        self._advance(1)

    def _advance(self, n: int | None) -> None:
        for _ in itertools.islice(self._steps, n):
            pass

    def wait(self, timeout=None) -> bool:
        """Finish the pipeline. `timeout` is accepted for Work compatibility; the process
        group's own timeout bounds each communication."""
        if not self._done:
            self._advance(None)
            self._done = True
        return True

    def is_completed(self) -> bool:
        return self._done


def _run(steps: Iterator[None], async_op: bool):
    if async_op:
        return Pending(steps)
    for _ in steps:
        pass
    return None


def _round_up(n: int, a: int) -> int:
    return -(-n // a) * a


def _depth(nbytes: int, pipeline) -> int:
    if pipeline == "auto":
        return max(1, min(MAX_PIPELINE // 2, nbytes // AUTO_SLICE_BYTES))
    if not isinstance(pipeline, int) or not 1 <= pipeline <= MAX_PIPELINE:
        raise ValueError(f"pipeline must be 'auto' or an int in [1, {MAX_PIPELINE}], got {pipeline!r}")
    return pipeline


def _pieces(chunks: list[tuple[int, int]], depth: int) -> list[list[tuple[int, int]]]:
    """Cut every chunk [s, e) into `depth` super-block-aligned pieces: pieces[k][j] of chunk j."""
    longest = max(e - s for s, e in chunks)
    step = _round_up(max(1, -(-longest // depth)), SUPERBLOCK_ELEMS)
    n_slices = max(1, -(-longest // step))
    return [[(min(s + k * step, e), min(s + (k + 1) * step, e)) for s, e in chunks] for k in range(n_slices)]


def _salted(cfg: CompressionConfig, *salt: int) -> CompressionConfig:
    """A per-rank, per-call seed so stochastic rounding is independent across ranks and calls."""
    if not cfg.stochastic:
        return cfg
    h = cfg.seed
    for s in salt:
        h = (h * 1_000_003 + s + 0x9E3779B9) % 2**31
    return cfg.replace(seed=h)


def _prepare(kind, tensors, group, config, op, min_bytes, check, backend):
    config = CompressionConfig() if config is None else config
    if not isinstance(config, CompressionConfig):
        raise TypeError(f"config must be a CompressionConfig or None, got {type(config).__name__}")
    if op not in ("sum", "avg"):
        raise ValueError(f"op must be 'sum' or 'avg', got {op!r}")
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"taco_triton.{kind} expects tensors, got {type(t).__name__}")
    do_check = check_collectives() if check is None else check
    if do_check:
        sig = (kind, tuple(tuple(t.shape) for t in tensors), str(tensors[0].dtype), config, op)
        _pg.check_same_across_ranks(kind, sig, group)
    message = max(tensors, key=lambda t: t.numel())  # the whole buffer: comparable across collectives
    if min_bytes is None:
        if ops.resolve_backend(backend, message.device) == "torch":
            return config, False  # the CPU reference codec is slower than any link we measured
        min_bytes = DEFAULT_MIN_BYTES
    compress = config.enabled and message.dtype in INPUT_DTYPES and message.numel() * message.element_size() >= min_bytes
    return config, compress


def _native_op(op: str, group):
    if op == "avg" and dist.get_backend(group) == "nccl":
        return dist.ReduceOp.AVG, False
    return dist.ReduceOp.SUM, op == "avg"  # gloo has no AVG: sum, then divide


def _native(work_fn: Callable, divide: torch.Tensor | None, p: int, async_op: bool):
    def steps():
        work = work_fn(async_op)
        yield
        if async_op:
            work.wait()
        if divide is not None:
            divide.div_(p)

    return _run(steps(), async_op)


def _flat_inplace(t: torch.Tensor):
    """A contiguous flat view to work in, and what to copy back into `t` afterwards (or None)."""
    if t.is_contiguous():
        return t.view(-1), None
    return t.contiguous().view(-1), t


def _slots(numels, config):
    lays = [WireLayout.of(n, config) for n in numels]
    strides = [_round_up(lay.nbytes, _ALIGN) for lay in lays]
    return lays, strides


def _pipeline(pieces, stages) -> Iterator[None]:
    """Software pipeline over pieces: piece k enters stages[0] (which launches its communication)
    while piece k-1 moves through stages[1], and so on; each stage returns the next one's input.
    Yields after each launch, so an async handle returns with the first message in flight. The
    order of collectives is a pure function of the pieces: the same on every rank."""
    queues = [deque() for _ in stages]

    def advance(i):  # run stage i on the oldest waiting state
        out = stages[i](queues[i].popleft())
        if i + 1 < len(stages):
            queues[i + 1].append(out)

    for k, piece in enumerate(pieces):
        queues[0].append((k, piece))
        advance(0)
        yield
        for i in range(1, len(stages)):
            if len(queues[i]) > 1:
                advance(i)
    for i in range(1, len(stages)):
        while queues[i]:
            advance(i)


def _launch_all_to_all(flat, k, piece, config, group, p, rank, call, backend):
    """Compress piece j of every chunk into one send buffer; chunk `rank` of every rank comes back."""
    numels = [b - a for a, b in piece]
    lays, strides = _slots(numels, config)
    send = _compress_pieces(flat, piece, config, strides, rank, call, k, backend)
    recv = torch.empty(p * strides[rank], dtype=torch.uint8, device=flat.device)
    work = _pg.all_to_all(recv, send, [strides[rank]] * p, strides, group, True)
    return piece, lays, strides, send, recv, work


def _compress_pieces(flat, piece, config, strides, rank, call, k, backend):
    """One send buffer holding every piece's wire bytes, each in its 16-byte-aligned slot."""
    send = torch.empty(sum(strides), dtype=torch.uint8, device=flat.device)
    off = 0
    for j, ((a, b), stride) in enumerate(zip(piece, strides)):
        lay = WireLayout.of(b - a, config)
        if lay.nbytes:
            ops.compress_into(flat[a:b], _salted(config, rank, call, k, j), send[off : off + lay.nbytes], backend)
        send[off + lay.nbytes : off + stride].zero_()
        off += stride
    return send


def all_reduce(
    tensor: torch.Tensor, group=None, config: CompressionConfig | None = None, op: str = "sum",
    async_op: bool = False, *, min_bytes: int | None = None, pipeline="auto", backend: str = "auto",
    check: bool | None = None,
):
    """In-place all-reduce like `dist.all_reduce`, with about half the bytes on the wire.

    Args:
        tensor: any shape; bf16/fp16/fp32 are compressed, other dtypes run natively.
        group: process group (None: the default group).
        config: `CompressionConfig` (None: the default). `enabled=False`, or a message smaller
            than `min_bytes`, runs the native collective. The message is the whole buffer
            (all_reduce: the tensor; reduce_scatter: the input; all_gather: the output).
        min_bytes: None means `DEFAULT_MIN_BYTES` where the codec runs on a GPU, and native
            collectives where it would be the torch reference on CPU (measured slower than
            the link at every size for links >= 0.25 Gbit/s); pass an int to compress anyway.
        op: "sum" or "avg".
        async_op: return a handle whose `wait()` completes the operation.
        pipeline: slices in flight ("auto" or 1..16): compression of one overlaps the
            communication of the previous.
        backend: codec backend, as in `taco_triton.compress`.
        check: first compare (shape, dtype, config, op) across ranks and raise ValueError naming
            the ranks that differ (None: env TACO_TRITON_CHECK_COLLECTIVES).

    Every rank ends with bitwise-identical values. Groups that held NaN/Inf on any rank are NaN.
    """
    config, compress = _prepare("all_reduce", [tensor], group, config, op, min_bytes, check, backend)
    p = dist.get_world_size(group)
    if not compress or p == 1:
        red, divide = _native_op(op, group)
        return _native(lambda a: _pg.all_reduce(tensor, red, group, a), tensor if divide else None, p, async_op)
    return _run(_all_reduce_steps(tensor, group, config, op, pipeline, backend, p), async_op)


def _all_reduce_steps(tensor, group, config, op, pipeline, backend, p) -> Iterator[None]:
    rank, call = dist.get_rank(group), next(_calls)
    flat, copy_back = _flat_inplace(tensor)
    n = flat.numel()
    c = _round_up(-(-n // p), SUPERBLOCK_ELEMS)
    chunks = [(min(j * c, n), min((j + 1) * c, n)) for j in range(p)]
    scale = 1.0 / p if op == "avg" else 1.0

    def launch(kp):
        return _launch_all_to_all(flat, *kp, config, group, p, rank, call, backend)

    def reduce(state):
        piece, lays, strides, send, recv, work = state
        work.wait()
        slot = max(strides)
        own = torch.zeros(slot, dtype=torch.uint8, device=flat.device)
        if lays[rank].nbytes:
            ops.reduce_into(recv.view(p, strides[rank]), lays[rank].numel, _salted(config, p + rank, call),
                            scale, out=own[: lays[rank].nbytes], backend=backend)
        gathered = torch.empty(p * slot, dtype=torch.uint8, device=flat.device)
        work = _pg.all_gather(gathered, own, group, True, compressed=True)
        return piece, lays, slot, own, gathered, work

    def finish(state):
        piece, lays, slot, own, gathered, work = state
        work.wait()
        for j, ((a, b), lay) in enumerate(zip(piece, lays)):
            if lay.nbytes:
                ops.decompress_into(gathered[j * slot : j * slot + lay.nbytes], flat[a:b], config, backend)

    yield from _pipeline(_pieces(chunks, _depth(n * flat.element_size(), pipeline)), [launch, reduce, finish])
    if copy_back is not None:
        copy_back.copy_(flat.view_as(copy_back))


def reduce_scatter(
    output: torch.Tensor, input: torch.Tensor, group=None, config: CompressionConfig | None = None,
    op: str = "sum", async_op: bool = False, *, min_bytes: int | None = None, pipeline="auto",
    backend: str = "auto", check: bool | None = None,
):
    """Like `dist.reduce_scatter_tensor`: `input` is P equal slices along dim 0 (flattened),
    rank r's `output` gets the reduction of every rank's slice r. Arguments as in `all_reduce`."""
    p = dist.get_world_size(group)
    if input.numel() != p * output.numel() or input.dtype != output.dtype:
        raise ValueError(
            f"reduce_scatter: input must have world_size ({p}) times the output's elements and its dtype; "
            f"got input {tuple(input.shape)} {input.dtype}, output {tuple(output.shape)} {output.dtype}"
        )
    config, compress = _prepare("reduce_scatter", [output, input], group, config, op, min_bytes, check, backend)
    if not compress or p == 1:
        red, divide = _native_op(op, group)
        return _native(lambda a: _pg.reduce_scatter(output, input.contiguous(), red, group, a),
                       output if divide else None, p, async_op)
    return _run(_reduce_scatter_steps(output, input, group, config, op, pipeline, backend, p), async_op)


def _reduce_scatter_steps(output, input, group, config, op, pipeline, backend, p) -> Iterator[None]:
    rank, call = dist.get_rank(group), next(_calls)
    flat_in = input.contiguous().view(-1)
    out_flat, copy_back = _flat_inplace(output)
    m = out_flat.numel()
    chunks = [(j * m, (j + 1) * m) for j in range(p)]
    scale = 1.0 / p if op == "avg" else 1.0

    def launch(kp):
        return _launch_all_to_all(flat_in, *kp, config, group, p, rank, call, backend)

    def finish(state):
        piece, lays, strides, send, recv, work = state
        work.wait()
        a, b = piece[rank]
        lo, hi = a - rank * m, b - rank * m
        if hi > lo:
            ops.reduce_into(recv.view(p, strides[rank]), hi - lo, config, scale, dense_out=out_flat[lo:hi], backend=backend)

    yield from _pipeline(_pieces(chunks, _depth(m * out_flat.element_size() * p, pipeline)), [launch, finish])
    if copy_back is not None:
        copy_back.copy_(out_flat.view_as(copy_back))


def all_gather(
    output: torch.Tensor, input: torch.Tensor, group=None, config: CompressionConfig | None = None,
    async_op: bool = False, *, min_bytes: int | None = None, pipeline="auto", backend: str = "auto",
    check: bool | None = None,
):
    """Like `dist.all_gather_into_tensor`: `output` is P slices along dim 0, slice r from rank r.
    The local shard is compressed once. Arguments as in `all_reduce`."""
    p = dist.get_world_size(group)
    if output.numel() != p * input.numel() or input.dtype != output.dtype:
        raise ValueError(
            f"all_gather: output must have world_size ({p}) times the input's elements and its dtype; "
            f"got input {tuple(input.shape)} {input.dtype}, output {tuple(output.shape)} {output.dtype}"
        )
    config, compress = _prepare("all_gather", [output, input], group, config, "sum", min_bytes, check, backend)
    if not compress or p == 1:
        return _native(lambda a: _pg.all_gather(output, input.contiguous(), group, a), None, p, async_op)
    return _run(_all_gather_steps(output, input, group, config, pipeline, backend, p), async_op)


def _all_gather_steps(output, input, group, config, pipeline, backend, p) -> Iterator[None]:
    rank, call = dist.get_rank(group), next(_calls)
    flat_in = input.contiguous().view(-1)
    out_flat, copy_back = _flat_inplace(output)
    m = flat_in.numel()

    def launch(kp):
        k, piece = kp
        (a, b), = piece
        lay = WireLayout.of(b - a, config)
        slot = _round_up(lay.nbytes, _ALIGN)
        own = _compress_pieces(flat_in, piece, config, [slot], rank, call, k, backend)
        gathered = torch.empty(p * slot, dtype=torch.uint8, device=flat_in.device)
        return a, b, lay, slot, own, gathered, _pg.all_gather(gathered, own, group, True, compressed=True)

    def finish(state):
        a, b, lay, slot, own, gathered, work = state
        work.wait()
        for j in range(p):
            ops.decompress_into(gathered[j * slot : j * slot + lay.nbytes], out_flat[j * m + a : j * m + b], config, backend)

    pieces = [pc for pc in _pieces([(0, m)], _depth(m * flat_in.element_size() * p, pipeline)) if pc[0][1] > pc[0][0]]
    yield from _pipeline(pieces, [launch, finish])
    if copy_back is not None:
        copy_back.copy_(out_flat.view_as(copy_back))
