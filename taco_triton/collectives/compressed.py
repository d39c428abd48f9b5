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
from typing import Callable

import torch
import torch.distributed as dist

from .. import ops
from ..config import INPUT_DTYPES, SUPERBLOCK_ELEMS, CompressionConfig
from ..env import check_collectives
from ..layout import WireLayout
from . import _pg

#: Messages below this many bytes go through the native collective when the codec runs on a GPU.
#: Not yet measured on GPUs (TACO's authors use 10 MiB); see docs/speed/index.md. On CPU tensors the codec is the
#: torch reference (~14 MB/s per core measured, bench/collectives.py), slower than the link at
#: every size for links >= 0.25 Gbit/s, so there the default is native unless min_bytes is given.
DEFAULT_MIN_BYTES = 1 << 20
#: Each pipeline slice of "auto" depth carries at least this many input bytes.
AUTO_SLICE_BYTES = 8 << 20
MAX_PIPELINE = 16
_ALIGN = 16  # every wire-buffer slot starts 16-byte aligned (vector loads, FP32 scale views)
_calls = itertools.count()


class Pending:
    """Handle of an async collective; like torch.distributed's Work.

    Everything that enters the process group was issued when the collective was called (see the
    module docstring), so waiting on handles in any order, or never before the next collective,
    changes nothing. `wait()` finishes what is left on this rank: on the native path the
    process group's work and the copy back into a non-contiguous tensor; on CUDA it makes the
    current stream wait for the collective (no host sync). A handle that failed stays failed:
    every later `wait()` raises the same error and `is_completed()` stays False.
    """

    def __init__(self, finish: Callable[[], None]):
        self._finish = finish
        self._done = False
        self._error: BaseException | None = None

    def wait(self, timeout=None) -> bool:
        """Finish the operation; True once the result is in the output tensor. `timeout` is
        accepted for Work compatibility; the process group's own timeout bounds communication."""
        if self._error is not None:
            raise self._error
        if not self._done:
            try:
                self._finish()
            except BaseException as e:
                self._error = e
                raise
            self._done = True
        return True

    def is_completed(self) -> bool:
        """True once `wait()` has returned successfully."""
        return self._done

    def exception(self) -> BaseException | None:
        """The error this handle failed with, or None."""
        return self._error


def _stream_fence(device: torch.device) -> Callable[[], None]:
    """What wait() does after a compressed collective: on CUDA, make the stream current at wait
    time wait for the work queued at call time; elsewhere the work is already done."""
    if device.type != "cuda":
        return lambda: None
    event = torch.cuda.Event()
    event.record()
    return lambda: torch.cuda.current_stream().wait_event(event)


def _round_up(n: int, a: int) -> int:
    return -(-n // a) * a


def _depth(nbytes: int, pipeline) -> int:
    if pipeline == "auto":
        return max(1, min(MAX_PIPELINE // 2, nbytes // AUTO_SLICE_BYTES))
    if isinstance(pipeline, bool) or not isinstance(pipeline, int) or not 1 <= pipeline <= MAX_PIPELINE:
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


class _Call:
    """What one collective call decided before touching any byte: path, slices, fingerprint."""

    def __init__(self, kind, tensors, group, config, op, min_bytes, pipeline, check, backend):
        """tensors[0] is the one written (all_reduce's tensor, the others' output)."""
        self.kind, self.group, self.op = kind, group, op
        config = CompressionConfig() if config is None else config
        if not isinstance(config, CompressionConfig):
            raise TypeError(f"config must be a CompressionConfig or None, got {type(config).__name__}")
        if op not in ("sum", "avg"):
            raise ValueError(f"op must be 'sum' or 'avg', got {op!r}")
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"taco_triton.{kind} expects tensors, got {type(t).__name__}")
        dtype = tensors[0].dtype
        if any(st == 0 and n > 1 for st, n in zip(tensors[0].stride(), tensors[0].shape)):  # expand(): shared elements
            raise ValueError(f"taco_triton.{kind}: the output tensor has overlapping elements (strides "
                             f"{tensors[0].stride()} for shape {tuple(tensors[0].shape)}); pass a tensor that owns each element")
        if op == "avg" and not (dtype.is_floating_point or dtype.is_complex):
            raise ValueError(f"taco_triton.{kind}: op='avg' needs a floating dtype, got {dtype}")
        if min_bytes is not None and (isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0):
            raise ValueError(f"min_bytes must be None or an int >= 0, got {min_bytes!r}")
        message = max(tensors, key=lambda t: t.numel())  # the whole buffer: comparable across collectives
        nbytes = message.numel() * message.element_size()
        self.backend = ops.resolve_backend(backend, message.device)
        depth = _depth(nbytes, pipeline)  # validates `pipeline` on every path
        if min_bytes is None:
            # the CPU reference codec is slower than any link we measured: native there
            min_bytes = None if self.backend == "torch" else DEFAULT_MIN_BYTES
        self.compress = (min_bytes is not None and config.enabled and dtype in INPUT_DTYPES and nbytes >= min_bytes)
        self.config = config if self.compress else None
        self.depth = depth if self.compress else None
        self.p = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.signature = (kind, tuple(t.numel() for t in tensors), str(dtype), op, self.compress, self.config,
                          self.depth, self.backend if self.compress else None)
        self.fp = _pg.fingerprint(self.signature)
        self.seq = next(_calls)
        do_check = check_collectives() if check is None else check
        if do_check and self.p > 1:
            _pg.agree(kind, self.signature, message.device, group)

    def inf_above(self, dtype: torch.dtype) -> float:
        """Reduced values beyond this decompress to +-inf (see `overflow_threshold`)."""
        return overflow_threshold(self.config, dtype)

    def tag(self, stage: int, k: int, j: int) -> bytes:
        return _pg.tag(self.fp, stage, k, j)

    def verify(self, rows: torch.Tensor, nbytes: list[int], expected: list[bytes], k: int) -> None:
        """Check the tag after each received slot: a message from another call, slice or
        signature raises ValueError instead of being decoded."""
        for r, (n, want) in enumerate(zip(nbytes, expected)):
            got = bytes(rows[r, n : n + _TAG].cpu().numpy().tobytes())
            if got != want:
                raise ValueError(
                    f"taco_triton.{self.kind}: slice {k} from rank {r} carries tag {got.hex()}, this rank "
                    f"expected {want.hex()} for {self.signature}: the ranks issued different collectives "
                    "(config, size, dtype, op, pipeline or order differ)"
                )


_TAG = 4  # bytes of the tag after every slot


def overflow_threshold(config: CompressionConfig, dtype: torch.dtype) -> float:
    """Decompressed reduced values above this magnitude become +-inf, below it they saturate.

    A reduced value went through two roundings of the code format (each rank's quantization and
    the requantized sum), each within `spec.relative_rounding` of the value; one that lands past
    the output dtype's largest finite value by less than that margin is rounding and saturates,
    beyond it the sum itself overflowed and is +-inf, as in the native collective.
    """
    return torch.finfo(dtype).max * (1.0 + 2.0 * config.spec.relative_rounding)


def _native_op(op: str, group):
    if op == "avg" and dist.get_backend(group) == "nccl":
        return dist.ReduceOp.AVG, False
    return dist.ReduceOp.SUM, op == "avg"  # gloo has no AVG: sum, then divide


def _native(issue: Callable[[torch.Tensor, bool], object], out: torch.Tensor, divide: int | None, async_op: bool):
    """Run a native collective into `out` (through a contiguous copy: gloo misreads views), then
    divide for avg. The process group gets the work at call time; the rest runs at wait()."""
    flat, copy_back = _flat_inplace(out)
    work = issue(flat.view(out.shape), async_op)

    def finish():
        if async_op:
            work.wait()
        if divide is not None:
            flat.div_(divide)
        if copy_back is not None:
            copy_back.copy_(flat.view(out.shape))

    return _run(finish, async_op)


def _run(finish: Callable[[], None], async_op: bool):
    if async_op:
        return Pending(finish)
    finish()
    return None


def _flat_inplace(t: torch.Tensor):
    """A contiguous flat tensor to work in, and what to copy back into `t` afterwards (or None)."""
    if t.is_contiguous():
        return t.view(-1), None
    return t.contiguous().view(-1), t


def _slots(numels, config):
    """Wire layouts and 16-byte-aligned slot strides (payload, then the tag) of each piece."""
    lays = [WireLayout.of(n, config) for n in numels]
    strides = [_round_up(lay.nbytes + _TAG, _ALIGN) for lay in lays]
    return lays, strides


def _pipeline(pieces, stages) -> None:
    """Software pipeline over pieces: piece k enters stages[0] (which launches its communication)
    while piece k-1 moves through stages[1], and so on; each stage returns the next one's input.
    It all runs now, in the calling thread: the order of what enters the process group is a pure
    function of the pieces, the same on every rank and independent of when anyone waits."""
    queues = [deque() for _ in stages]

    def advance(i):  # run stage i on the oldest waiting state
        out = stages[i](queues[i].popleft())
        if i + 1 < len(stages):
            queues[i + 1].append(out)

    for k, piece in enumerate(pieces):
        queues[0].append((k, piece))
        advance(0)
        for i in range(1, len(stages)):
            if len(queues[i]) > 1:
                advance(i)
    for i in range(1, len(stages)):
        while queues[i]:
            advance(i)


def _launch_all_to_all(call: _Call, flat, k, piece):
    """Compress piece k of every chunk into one send buffer; chunk `rank` of every rank comes back."""
    lays, strides = _slots([b - a for a, b in piece], call.config)
    send = _compress_pieces(call, flat, k, piece, strides, stage=0)
    recv = torch.empty(call.p * strides[call.rank], dtype=torch.uint8, device=flat.device)
    work = _pg.all_to_all(recv, send, [strides[call.rank]] * call.p, strides, call.group, True)
    return k, piece, lays, strides, recv, work


def _compress_pieces(call: _Call, flat, k, piece, strides, stage):
    """One send buffer holding every piece's wire bytes and tag, each in its 16-byte-aligned slot."""
    send = torch.zeros(sum(strides), dtype=torch.uint8, device=flat.device)
    off = 0
    for j, ((a, b), stride) in enumerate(zip(piece, strides)):
        lay = WireLayout.of(b - a, call.config)
        if lay.nbytes:
            cfg = _salted(call.config, call.rank, call.seq, k, j)
            ops.compress_into(flat[a:b], cfg, send[off : off + lay.nbytes], call.backend)
        _put_tag(send, off + lay.nbytes, call.tag(stage, k, j if stage == 0 else call.rank))
        off += stride
    return send


def _put_tag(buf: torch.Tensor, at: int, tag: bytes) -> None:
    buf[at : at + _TAG] = torch.frombuffer(bytearray(tag), dtype=torch.uint8).to(buf.device)


def _member(group) -> bool:
    """False on a rank outside `group` (torch.distributed's collectives are no-ops there)."""
    return group is None or dist.get_rank(group) >= 0


@_pg.records_as("all_reduce")
def all_reduce(
    tensor: torch.Tensor, group=None, config: CompressionConfig | None = None, op: str = "sum",
    async_op: bool = False, *, min_bytes: int | None = None, pipeline="auto", backend: str = "auto",
    check: bool | None = None,
):
    """In-place all-reduce like `dist.all_reduce`, with about half the bytes on the wire.

    Args:
        tensor: any shape, any strides; bf16/fp16/fp32 are compressed, other dtypes run natively.
        group: process group (None: the default group). On a rank outside it: nothing, None.
        config: `CompressionConfig` (None: the default). `enabled=False`, or a message smaller
            than `min_bytes`, runs the native collective. The message is the whole buffer
            (all_reduce: the tensor; reduce_scatter: the input; all_gather: the output).
        min_bytes: None means `DEFAULT_MIN_BYTES` where the codec runs on a GPU, and native
            collectives where it would be the torch reference on CPU (measured slower than
            the link at every size for links >= 0.25 Gbit/s); pass an int to compress anyway.
        op: "sum" or "avg" ("avg" needs a floating dtype).
        async_op: return a `Pending` handle whose `wait()` completes the operation.
        pipeline: slices in flight ("auto" or 1..16): compression of one overlaps the
            communication of the previous.
        backend: codec backend, as in `taco_triton.compress`.
        check: exchange an 8-byte fingerprint of (kind, sizes, dtype, op, path, config, slices,
            backend) first and raise ValueError on every rank, naming each rank's values, if
            they differ. None: on unless env TACO_TRITON_CHECK_COLLECTIVES=0.

    Every rank ends with bitwise-identical values. Groups that held NaN/Inf on any rank are NaN;
    a sum that overflows the dtype is +-inf (see `overflow_threshold`). Autograd does not see the
    collective, as with `dist.all_reduce`.
    """
    if not _member(group):
        return None
    tensor = tensor.detach() if isinstance(tensor, torch.Tensor) else tensor  # invisible to autograd, as native
    call = _Call("all_reduce", [tensor], group, config, op, min_bytes, pipeline, check, backend)
    if not call.compress or call.p == 1:
        red, divide = _native_op(op, group)
        return _native(lambda t, a: _pg.all_reduce(t, red, group, a), tensor, call.p if divide else None, async_op)
    _all_reduce_compressed(call, tensor)
    return _run(_stream_fence(tensor.device), async_op)


def _all_reduce_compressed(call: _Call, tensor: torch.Tensor) -> None:
    p, rank, config = call.p, call.rank, call.config
    flat, copy_back = _flat_inplace(tensor)
    n = flat.numel()
    c = _round_up(-(-n // p), SUPERBLOCK_ELEMS)
    chunks = [(min(j * c, n), min((j + 1) * c, n)) for j in range(p)]
    scale = 1.0 / p if call.op == "avg" else 1.0
    inf_above = call.inf_above(flat.dtype)

    def launch(kp):
        return _launch_all_to_all(call, flat, *kp)

    def reduce(state):
        k, piece, lays, strides, recv, work = state
        work.wait()
        rows = recv.view(p, strides[rank])
        call.verify(rows, [lays[rank].nbytes] * p, [call.tag(0, k, rank)] * p, k)
        slot = max(strides)
        own = torch.zeros(slot, dtype=torch.uint8, device=flat.device)
        if lays[rank].nbytes:
            ops.reduce_into(rows, lays[rank].numel, _salted(config, p + rank, call.seq),
                            scale, out=own[: lays[rank].nbytes], backend=call.backend)
        _put_tag(own, lays[rank].nbytes, call.tag(1, k, rank))
        gathered = torch.empty(p * slot, dtype=torch.uint8, device=flat.device)
        work = _pg.all_gather(gathered, own, call.group, True, compressed=True)
        return k, piece, lays, slot, gathered, work

    def finish(state):
        k, piece, lays, slot, gathered, work = state
        work.wait()
        rows = gathered.view(p, slot)
        call.verify(rows, [lay.nbytes for lay in lays], [call.tag(1, k, j) for j in range(p)], k)
        for j, ((a, b), lay) in enumerate(zip(piece, lays)):
            if lay.nbytes:
                ops.decompress_into(rows[j, : lay.nbytes], flat[a:b], config, call.backend, inf_above=inf_above)

    _pipeline(_pieces(chunks, call.depth), [launch, reduce, finish])
    if copy_back is not None:
        copy_back.copy_(flat.view_as(copy_back))


@_pg.records_as("reduce_scatter")
def reduce_scatter(
    output: torch.Tensor, input: torch.Tensor, group=None, config: CompressionConfig | None = None,
    op: str = "sum", async_op: bool = False, *, min_bytes: int | None = None, pipeline="auto",
    backend: str = "auto", check: bool | None = None,
):
    """Like `dist.reduce_scatter_tensor`: `input` is P equal slices along dim 0 (flattened),
    rank r's `output` gets the reduction of every rank's slice r. Arguments as in `all_reduce`."""
    if not _member(group):
        return None
    output, input = _detached(output, input)
    p = dist.get_world_size(group)
    _check_pair("reduce_scatter", "input", input, output, p)
    call = _Call("reduce_scatter", [output, input], group, config, op, min_bytes, pipeline, check, backend)
    if not call.compress or p == 1:
        red, divide = _native_op(op, group)
        return _native(lambda t, a: _pg.reduce_scatter(t, input.contiguous(), red, group, a),
                       output, p if divide else None, async_op)
    _reduce_scatter_compressed(call, output, input)
    return _run(_stream_fence(output.device), async_op)


def _detached(*tensors):
    return [t.detach() if isinstance(t, torch.Tensor) else t for t in tensors]


def _check_pair(kind: str, big_name: str, big, small, p: int) -> None:
    """`big` must hold P times `small`'s elements, in its dtype (before any byte moves)."""
    for t in (big, small):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"taco_triton.{kind} expects tensors, got {type(t).__name__}")
    if big.numel() != p * small.numel() or big.dtype != small.dtype:
        raise ValueError(
            f"{kind}: {big_name} must have world_size ({p}) times the other's elements and its dtype; "
            f"got {big_name} {tuple(big.shape)} {big.dtype}, other {tuple(small.shape)} {small.dtype}"
        )


def _reduce_scatter_compressed(call: _Call, output, input) -> None:
    p, rank = call.p, call.rank
    flat_in = input.contiguous().view(-1)
    out_flat, copy_back = _flat_inplace(output)
    m = out_flat.numel()
    chunks = [(j * m, (j + 1) * m) for j in range(p)]
    scale = 1.0 / p if call.op == "avg" else 1.0
    inf_above = call.inf_above(out_flat.dtype)

    def launch(kp):
        return _launch_all_to_all(call, flat_in, *kp)

    def finish(state):
        k, piece, lays, strides, recv, work = state
        work.wait()
        rows = recv.view(p, strides[rank])
        call.verify(rows, [lays[rank].nbytes] * p, [call.tag(0, k, rank)] * p, k)
        a, b = piece[rank]
        lo, hi = a - rank * m, b - rank * m
        if hi > lo:
            ops.reduce_into(rows, hi - lo, call.config, scale, dense_out=out_flat[lo:hi], backend=call.backend,
                            inf_above=inf_above)

    _pipeline(_pieces(chunks, call.depth), [launch, finish])
    if copy_back is not None:
        copy_back.copy_(out_flat.view_as(copy_back))


@_pg.records_as("all_gather")
def all_gather(
    output: torch.Tensor, input: torch.Tensor, group=None, config: CompressionConfig | None = None,
    async_op: bool = False, *, min_bytes: int | None = None, pipeline="auto", backend: str = "auto",
    check: bool | None = None,
):
    """Like `dist.all_gather_into_tensor`: `output` is P slices along dim 0, slice r from rank r.
    The local shard is compressed once. Arguments as in `all_reduce`."""
    if not _member(group):
        return None
    output, input = _detached(output, input)
    p = dist.get_world_size(group)
    _check_pair("all_gather", "output", output, input, p)
    call = _Call("all_gather", [output, input], group, config, "sum", min_bytes, pipeline, check, backend)
    if not call.compress or p == 1:
        return _native(lambda t, a: _pg.all_gather(t, input.contiguous(), group, a), output, None, async_op)
    _all_gather_compressed(call, output, input)
    return _run(_stream_fence(output.device), async_op)


def _all_gather_compressed(call: _Call, output, input) -> None:
    p = call.p
    flat_in = input.contiguous().view(-1)
    out_flat, copy_back = _flat_inplace(output)
    m = flat_in.numel()

    def launch(kp):
        k, piece = kp
        (a, b), = piece
        lays, (slot,) = _slots([b - a], call.config)
        own = _compress_pieces(call, flat_in, k, piece, [slot], stage=1)
        gathered = torch.empty(p * slot, dtype=torch.uint8, device=flat_in.device)
        return k, a, b, lays[0], slot, gathered, _pg.all_gather(gathered, own, call.group, True, compressed=True)

    def finish(state):
        k, a, b, lay, slot, gathered, work = state
        work.wait()
        rows = gathered.view(p, slot)
        call.verify(rows, [lay.nbytes] * p, [call.tag(1, k, j) for j in range(p)], k)
        for j in range(p):
            ops.decompress_into(rows[j, : lay.nbytes], out_flat[j * m + a : j * m + b], call.config, call.backend)

    pieces = [pc for pc in _pieces([(0, m)], call.depth) if pc[0][1] > pc[0][0]]
    _pipeline(pieces, [launch, finish])
    if copy_back is not None:
        copy_back.copy_(out_flat.view_as(copy_back))
