"""Compressed all_reduce, reduce_scatter and all_gather with torch.distributed semantics.

all_reduce is two-shot, as in TACO: every rank compresses P chunks of its tensor, an
all-to-all delivers chunk r of every rank to rank r, one fused kernel dequantizes, sums and
requantizes them (in the transformed domain: no inverse/forward Hadamard between sum and
requantization), an all-gather delivers the compressed sums to everyone and each rank
decompresses all of them - its own too, so every rank ends with bitwise-identical results.
reduce_scatter is the first half (the fused kernel writes the dense sum); all_gather compresses
the local shard once.

Launches: on the Triton path a pipeline slice costs one launch per stage whatever P is. One
compress launch writes all P chunks into their 16-byte-aligned slots of the send buffer, each
with its tag and zero padding; one fused reduce; one decompress launch for all P received
slots: 3 per slice for all_reduce, 2 for reduce_scatter and all_gather. What a call needs besides
the data (slice geometry, tags, the slots' descriptor tables on the device, launch parameters,
grids, constexprs) is a `_Plan` built by the first call of a (group, signature, device) and
reused, with its wire buffers (`_Plan.buffers` states when reuse is safe). A call repeated with
the same arguments and tensor metadata goes straight to its plan's launches (`_Steady`).

No host synchronization in the steady state: the receiving kernels check every slot's tag on
the device; a mismatch makes the outputs it fed NaN and fills the call's own small host-visible
error record (pinned host memory on CUDA; one per call in flight), which the host reads once that
call's work is complete, without waiting for it, and raises in that call (`_read`,
`check_errors`). The rank-agreement exchange (a fingerprint all_gather whose result the host
reads) runs on the first call of each (group, signature) and is cached; check="always" runs it
on every call. Limitation of the cache: a rank that changes its signature
alone after the first call is caught by the tags if the message sizes still match; if they do not,
the process group sees mismatched collectives (use check="always" while debugging).

Overlap: the message is cut into `pipeline` slices; slice k+1 is compressed while slice k is on
the wire (async process-group work; on GPUs NCCL runs on its own stream). Collectives are issued
in the same order on every rank, driven from the calling thread, so concurrent collectives on a
group can never interleave differently across ranks.

Streams, decided: the codec runs on the caller's current stream, not on a side stream. NCCL
already moves slice k on its own stream while the current stream compresses slice k+1 and
reduces slice k-1 (c10d orders the two with events), so that overlap exists without a side
stream. By the compile-time model (bench/aot.py) the codec runs at memory speed: a 16 MiB bf16
compress is a few microseconds of H200 time against tens of microseconds for NVLink to move the
slice, so a side stream could hide at most those few microseconds of compute-stream time, while
costing a cross-stream event pair per slice (host time of the order of the kernels themselves),
`record_stream` bookkeeping for every buffer, and outputs no longer ready in the caller's stream
order, which CUDA graph capture and torch's stream semantics rely on.
"""
from __future__ import annotations

import itertools
import math
import threading
from collections import deque
from collections.abc import Callable

import torch
import torch.distributed as dist

from .. import ops
from ..config import INPUT_DTYPES, SUPERBLOCK_ELEMS, CompressionConfig
from ..env import check_mode, compress_single_rank
from ..kernels import slots
from ..kernels._launch import Prepared, launch_params, target_of
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
#: (group, signature) pairs every rank agreed on (the fingerprint exchange ran and matched).
_agreed: set = set()
_fingerprints: dict = {}


_DEFAULT_CONFIG: list = []


def _default_config() -> CompressionConfig:
    if not _DEFAULT_CONFIG:
        _DEFAULT_CONFIG.append(CompressionConfig())
    return _DEFAULT_CONFIG[0]


def _fingerprint(signature: tuple) -> int:
    fp = _fingerprints.get(signature)
    if fp is None:
        if len(_fingerprints) > 4096:
            _fingerprints.clear()
        fp = _fingerprints[signature] = _pg.fingerprint(signature)
    return fp


class Pending:
    """Handle of an async collective; like torch.distributed's Work.

    Everything that enters the process group was issued when the collective was called (see the
    module docstring), so waiting on handles in any order, or never before the next collective,
    changes nothing. `wait()` finishes what is left on this rank: on the native path the
    process group's work and the copy back into a non-contiguous tensor; on CUDA it makes the
    current stream wait for the collective (no host sync).

    Errors belong to their call: `wait()` raises this call's tag mismatch (see `check_errors`),
    never another call's, and no other call raises this one's. A handle that failed stays failed:
    every later `wait()` raises the same error and `is_completed()` stays False.
    """

    def __init__(self, finish: Callable[[], None], entry=None):
        self._finish = finish
        self._entry = entry  # the call's error record (`_Watched`), on the Triton path
        self._done = False
        self._error: BaseException | None = None

    def wait(self, timeout=None) -> bool:
        """Finish the operation; True once the result is in the output tensor. `timeout` is
        accepted for Work compatibility; the process group's own timeout bounds communication.
        Raises ValueError if this call's tags did not match (its outputs are NaN)."""
        if self._error is not None:
            raise self._error
        if not self._done:
            try:
                self._finish()
            except BaseException as e:
                self._error = e
                raise
            self._done = True
        if self._entry is not None and _own_error(self._entry) is not None:
            self._error, self._done = self._entry.error, False
            _report(self._entry)
        return True

    def is_completed(self) -> bool:
        """True once `wait()` has returned successfully."""
        return self._done

    def exception(self) -> BaseException | None:
        """The error this handle failed with, or None."""
        return self._error


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
        config = _default_config() if config is None else config
        if not isinstance(config, CompressionConfig):
            raise TypeError(f"config must be a CompressionConfig or None, got {type(config).__name__}")
        if op not in ("sum", "avg"):
            raise ValueError(f"op must be 'sum' or 'avg', got {op!r}")
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"taco_triton.{kind} expects tensors, got {type(t).__name__}")
        dtype = self.dtype = tensors[0].dtype
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
        self.fp = _fingerprint(self.signature)
        self.seq = next(_calls)
        self.record = None  # the error record of this call's kernels (Triton path)
        # the group object itself: a default group re-created after destroy_process_group is a new
        # one, whose agreements and plans (which hold P and the rank) start afresh
        self.pg = _pg.group_object(group)
        mode = check_mode(check)
        if mode != "never" and self.p > 1:
            key = (self.pg, self.signature)
            if mode == "always" or key not in _agreed:
                _pg.agree(kind, self.signature, message.device, group)
                _agreed.add(key)

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


class _Slice:
    """One pipeline slice: a piece of every chunk, its wire layouts, 16-byte-aligned slot strides
    (payload, tag, zero padding) and their offsets in the send buffer; `slot` the widest."""

    def __init__(self, piece, config):
        self.piece = piece
        self.lays = [WireLayout.of(b - a, config) for a, b in piece]
        self.strides = [_round_up(lay.nbytes + _TAG, _ALIGN) for lay in self.lays]
        self.offsets = list(itertools.accumulate([0] + self.strides[:-1]))
        self.slot = max(self.strides)


def _tag_int(tag: bytes) -> int:
    return int.from_bytes(tag, "little")


#: Sets of reusable wire buffers a plan keeps (one per calling thread and CUDA stream).
_MAX_BUFFER_SETS = 8


class _Buffers:
    """The wire buffers of one pipeline slice on the Triton path (see `_Plan.buffers` for when
    they are reused): `send` what this rank compresses, `recv` (viewed as `rows`, one per rank)
    what the all_to_all delivers, `own` this rank's reduced slot, `gathered` what the all_gather
    delivers; `dense_of(out)` the part of a reduce_scatter's output this slice writes."""

    __slots__ = ("dense_of", "gathered", "own", "recv", "recv_splits", "rows", "send")

    def __init__(self, plan: "_Plan", sl: "_Slice"):
        p, rank, dev, u8 = plan.p, plan.rank, plan.device, torch.uint8
        self.send = self.recv = self.rows = self.own = self.gathered = None
        if plan.kind == "all_gather":
            self.send = torch.empty(sl.slot, dtype=u8, device=dev)
        else:
            stride = sl.strides[rank]
            self.send = torch.empty(sum(sl.strides), dtype=u8, device=dev)
            self.recv = torch.empty(p * stride, dtype=u8, device=dev)
            self.rows = self.recv.view(p, stride)
            self.recv_splits = [stride] * p
        if plan.kind == "all_reduce":
            self.own = torch.empty(sl.slot, dtype=u8, device=dev)
        if plan.kind != "reduce_scatter":
            self.gathered = torch.empty(p * sl.slot, dtype=u8, device=dev)
        a, b = sl.piece[rank] if plan.kind == "reduce_scatter" else (0, 0)
        lo, hi, m = a - rank * plan.chunk_numel, b - rank * plan.chunk_numel, plan.chunk_numel
        self.dense_of = (lambda out: out) if (lo, hi) == (0, m) else (lambda out: out[lo:hi])


def _schedule(n_slices: int, n_stages: int) -> list[tuple[int, int]]:
    """The (stage, slice) steps `_pipeline` runs for this many slices and stages, in its order."""
    order: list = []

    def stage(i):
        def step(state):
            order.append((i, state[0]))
            return state
        return step

    _pipeline([(k, None) for k in range(n_slices)], [stage(i) for i in range(n_stages)])
    return order


class _Plan:
    """What every compressed call of one signature needs besides the data, built by its first
    call and kept (`_plan`): the slices' geometry and tags, and on the Triton path the slots'
    descriptor tables on the device, launches prepared once (grid, constexprs, tables) and the
    error record the kernels write when a tag does not match.

    Stage 0 (all_to_all) slot j carries tag(0, k, j); stage 1 (all_gather) slot j tag(1, k, j):
    its sender's rank. The receiving kernels check them on the device.
    """

    def __init__(self, call: _Call, chunks, device: torch.device, chunk_numel: int = 0):
        self.chunk_numel = chunk_numel  # all_gather: elements of one rank's shard
        self.kind, self.signature, self.fp = call.kind, call.signature, call.fp
        self.p, self.rank, self.config, self.backend = call.p, call.rank, call.config, call.backend
        self.device = device
        # a zero-size message is one slice of empty pieces: only the tags move, as in the others
        pieces = _pieces(chunks, call.depth)
        self.slices = [_Slice(piece, call.config) for piece in pieces]
        self.scale = 1.0 / self.p if call.op == "avg" else 1.0
        # decoded values beyond this become +-inf (all_gather decodes one rank's values: no sum)
        self.inf_above = math.inf if call.kind == "all_gather" else overflow_threshold(call.config, call.dtype)
        self.launches = self.graph_launches = None  # the Triton path's prepared launches (`_prepare`)
        self._buffers: dict = {}
        if self.backend == "triton":
            self.errors = slots.ErrorRecords(device)  # one record per call in flight
            self._build_tables()

    def tag(self, stage: int, k: int, j: int) -> bytes:
        return _pg.tag(self.fp, stage, k, j)

    def _build_tables(self) -> None:
        """Every slice's descriptor rows in one device table (one copy, at plan time):
        [slice][0] the slots this rank compresses, [slice][1] the slots it decompresses."""
        p, rank = self.p, self.rank
        rows = []
        for k, sl in enumerate(self.slices):
            if self.kind == "all_gather":
                m = self.chunk_numel
                (a, b), = sl.piece
                send = slots.descriptors(sl.piece, sl.lays, [0], [sl.slot], [_tag_int(self.tag(1, k, rank))], [rank])
                recv = slots.descriptors([(j * m + a, j * m + b) for j in range(p)], sl.lays * p,
                                         [j * sl.slot for j in range(p)], [sl.slot] * p,
                                         [_tag_int(self.tag(1, k, j)) for j in range(p)], list(range(p)))
            else:
                send = slots.descriptors(sl.piece, sl.lays, sl.offsets, sl.strides,
                                         [_tag_int(self.tag(0, k, j)) for j in range(p)], list(range(p)))
                recv = slots.descriptors(sl.piece, sl.lays, [j * sl.slot for j in range(p)], [sl.slot] * p,
                                         [_tag_int(self.tag(1, k, j)) for j in range(p)], list(range(p)))
            width = max(len(send), len(recv))
            pad = [[0] * slots.DESC]
            rows.append([send + pad * (width - len(send)), recv + pad * (width - len(recv))])
        width = max(len(r[0]) for r in rows)
        pad = [[0] * slots.DESC]
        rows = [[st + pad * (width - len(st)) for st in r] for r in rows]
        self.desc = slots.table(rows, self.device)

    # ------------------------------------------------------- the reference path's three steps
    def compress(self, call: _Call, flat: torch.Tensor, k: int) -> torch.Tensor:
        """The send buffer of slice k (reference path): every piece compressed into its slot, tags included."""
        sl = self.slices[k]
        stage = 1 if self.kind == "all_gather" else 0
        return _compress_pieces(call, flat, k, sl.piece, [sl.slot] if stage else sl.strides, stage)

    def reduce(self, call: _Call, recv: torch.Tensor, k: int, scale: float, dense_out=None, inf_above=math.inf):
        """Sum the P received copies of this rank's piece of slice k (reference path): compressed
        into a slot (tagged, returned) or, with `dense_out`, decompressed there."""
        sl, p, rank = self.slices[k], self.p, self.rank
        lay = sl.lays[rank]
        rows = recv.view(p, sl.strides[rank])
        call.verify(rows, [lay.nbytes] * p, [self.tag(0, k, rank)] * p, k)
        if dense_out is not None:
            if lay.numel:
                ops.reduce_into(rows, lay.numel, self.config, scale, dense_out=dense_out, backend=self.backend,
                                inf_above=inf_above)
            return dense_out
        seed = slots.salt(self.config.seed, p + rank, call.seq) if self.config.stochastic else self.config.seed
        own = torch.zeros(sl.slot, dtype=torch.uint8, device=recv.device)
        if lay.nbytes:
            ops.reduce_into(rows, lay.numel, self.config.replace(seed=seed), scale, out=own[: lay.nbytes],
                            backend=self.backend)
        _put_tag(own, lay.nbytes, self.tag(1, k, rank))
        return own

    def decompress(self, call: _Call, gathered: torch.Tensor, out_flat: torch.Tensor, k: int, inf_above=math.inf):
        """Decompress the P slots of the gathered buffer of slice k into their places of out_flat
        (reference path)."""
        sl, p = self.slices[k], self.p
        rows = gathered.view(p, sl.slot)
        lays = sl.lays * p if self.kind == "all_gather" else sl.lays
        call.verify(rows, [lay.nbytes for lay in lays], [self.tag(1, k, j) for j in range(p)], k)
        for j, lay in enumerate(lays):
            if lay.nbytes:
                a, b = sl.piece[0] if self.kind == "all_gather" else sl.piece[j]
                base = j * self.chunk_numel if self.kind == "all_gather" else 0
                ops.decompress_into(rows[j, : lay.nbytes], out_flat[base + a : base + b], self.config,
                                    self.backend, inf_above=inf_above)

    # ---------------------------------------------------------------- the Triton path, prepared
    def _prepare(self, flat: torch.Tensor, dense: torch.Tensor) -> None:
        """Everything the Triton path's calls reuse: per slice the process-group split sizes, the
        schedule of stages, and the three prepared launches (built with this call's tensors;
        later calls replace the tensor arguments). Stochastic rounding also gets the launches
        that calls captured in a CUDA graph run (`graph_launches`: seeds salted on the device with
        `slots.seed_counter`), made now so that no kernel compiles during a capture."""
        n_stages = 3 if self.kind == "all_reduce" else 2
        self.schedule = _schedule(len(self.slices), n_stages)
        self.launches = self._launches(flat, dense, None)
        if self.config.stochastic:
            self.graph_launches = self._launches(flat, dense, slots.seed_counter(self.device))

    def _launches(self, flat: torch.Tensor, dense: torch.Tensor, seq_ptr) -> list:
        """Per slice its (compress, reduce, decompress) prepared launches (None where the kind has
        no such stage); `seq_ptr` the device counter stochastic seeds are salted with, or None."""
        p, rank, cfg = self.p, self.rank, self.config
        bufs = self._new_buffers()
        target, device = target_of(self.device), self.device
        err = self.errors.claim()  # the launches' template argument; each call passes its own record
        self.errors.release(err)
        err = err.tensor
        launches = []
        for k, (sl, b) in enumerate(zip(self.slices, bufs)):
            compress = decompress = reduce = None
            if self.kind == "all_gather":
                lays = sl.lays * p
                m, ((a, e),) = self.chunk_numel, sl.piece
                pieces = [(j * m + a, j * m + e) for j in range(p)]
            else:
                lays, pieces = sl.lays, sl.piece
            from ..kernels.compress import compress_slots_launch

            launch = compress_slots_launch(flat, b.send, self.desc[k, 0], len(sl.piece), slots.total_tiles(sl.lays),
                                           cfg, target, launch_params("compress_slots", device, flat.dtype, cfg,
                                                                      max(lay.numel for lay in sl.lays)),
                                           device, elem_align=slots.elem_align(sl.piece), seq_ptr=seq_ptr)
            compress = Prepared(launch, ("x_ptr", "out_ptr", "seed"))
            if self.kind != "all_gather":
                from ..kernels.reduce import reduce_launch

                lay, stride = sl.lays[rank], sl.strides[rank]
                dense_reduce = self.kind == "reduce_scatter"
                own = dense if dense_reduce else b.own
                strides = (stride, stride // 4, stride if cfg.scales == "dual" else stride // 4)
                tags = (err, _tag_int(self.tag(0, k, rank)), _tag_int(self.tag(1, k, rank)), sl.slot)
                launch = reduce_launch(b.rows, b.rows, b.rows, strides, p, own, own, own, own, lay.numel, cfg,
                                       self.scale, dense_reduce, target,
                                       launch_params("reduce", device, torch.uint8, cfg, lay.numel), device,
                                       self.inf_above if dense_reduce else math.inf, tags=tags, seq_ptr=seq_ptr)
                reduce = Prepared(launch, ("in_codes_ptr", "in_a_ptr", "in_b_ptr", "out_codes_ptr", "out_a_ptr", "out_b_ptr",
                                           "out_ptr", "seed", "err_ptr", "k", "seq"))
            if self.kind != "reduce_scatter":
                from ..kernels.decompress import decompress_slots_launch

                launch = decompress_slots_launch(b.gathered, dense, self.desc[k, 1], err, p,
                                                 slots.total_tiles(lays), cfg, target,
                                                 launch_params("decompress", device, dense.dtype, cfg,
                                                               max(lay.numel for lay in lays)),
                                                 device, self.inf_above, elem_align=slots.elem_align(pieces))
                decompress = Prepared(launch, ("data_ptr", "out_ptr", "err_ptr", "k", "seq"))
            launches.append(tuple(x and x.call for x in (compress, reduce, decompress)))  # plain functions
        return launches

    def _new_buffers(self) -> list:
        """One set of wire buffers per slice (`_Buffers`), from torch.empty."""
        return [_Buffers(self, sl) for sl in self.slices]

    def buffers(self) -> list:
        """The wire buffers of this caller, reused across its calls.

        The rule that makes reuse safe: a call waits (in the calling thread, at issue) for every
        process-group work it started, so on CPU all its work is done when it returns and on CUDA
        the caller's current stream is ordered after all of it (c10d's wait() orders the stream);
        the next call's kernels run on that stream after it and its communication is issued after
        them. So buffers are kept per (thread, current CUDA stream): a call from another thread
        or on another stream gets its own set. While a CUDA graph is captured every call gets
        fresh buffers (from the graph's pool), which replays then own.
        """
        if self.device.type == "cuda":
            if torch.cuda.is_current_stream_capturing():
                return self._new_buffers()
            key = (threading.get_ident(), torch.cuda.current_stream(self.device).cuda_stream)
        else:
            key = threading.get_ident()
        bufs = self._buffers.get(key)
        if bufs is None:
            if len(self._buffers) >= _MAX_BUFFER_SETS:
                self._buffers.clear()  # in-flight users keep theirs alive until they finish
            bufs = self._buffers[key] = self._new_buffers()
        return bufs

    def run(self, src: torch.Tensor, dst: torch.Tensor, seq: int, group) -> slots.ErrorRecord:
        """Issue one call on the Triton path: `src` the flat input (all_reduce: also `dst`),
        `dst` the flat output. Runs the precomputed schedule of (stage, slice) steps: slice k+1
        is compressed and its communication issued before slice k is reduced or decoded.
        Returns the error record this call's kernels write (for `_finish_call`)."""
        if self.launches is None:
            self._prepare(src, dst)
        record = self.errors.claim()
        err = record.tensor
        bufs, launches, slices = self.buffers(), self.launches, self.slices
        cfg, rank, kind = self.config, self.rank, self.kind
        stochastic = cfg.stochastic
        if stochastic and _graph_seeds(self.device):  # replays must not repeat the captured seeds
            slots.seed_counter(self.device).add_(1)
            launches = self.graph_launches
        work = [None] * len(slices)
        for stage, k in self.schedule:
            b = bufs[k]
            compress, reduce, decompress = launches[k]
            if stage == 0:
                seed = slots.salt(cfg.seed, rank, seq, k) if stochastic else cfg.seed
                compress(src, b.send, seed)
                if kind == "all_gather":
                    work[k] = _pg.all_gather(b.gathered, b.send, group, True, compressed=True)
                else:
                    work[k] = _pg.all_to_all(b.recv, b.send, b.recv_splits, slices[k].strides, group, True)
            elif stage == 1 and kind != "all_gather":
                work[k].wait()
                if kind == "reduce_scatter":
                    out = b.dense_of(dst)
                    reduce(b.rows, b.rows, b.rows, out, out, out, out, cfg.seed, err, k, seq)
                    continue
                seed = slots.salt(cfg.seed, self.p + rank, seq) if stochastic else cfg.seed
                reduce(b.rows, b.rows, b.rows, b.own, b.own, b.own, b.own, seed, err, k, seq)
                work[k] = _pg.all_gather(b.gathered, b.own, group, True, compressed=True)
            else:
                work[k].wait()
                decompress(b.gathered, dst, err, k, seq)
        return record

    def error(self, record) -> ValueError:
        k, src, got, want, seq = record
        return ValueError(
            f"taco_triton.{self.kind} (call {seq}): slice {k} from rank {src} carries tag {got.to_bytes(4, 'little').hex()}, "
            f"this rank expected {want.to_bytes(4, 'little').hex()} for {self.signature}: the ranks issued different "
            "collectives (config, size, dtype, op, pipeline or order differ); the outputs it fed are NaN"
        )


_plans: dict = {}
_MAX_PLANS = 1024


def _plan(call: _Call, chunks: Callable[[], list], device: torch.device, chunk_numel: int = 0) -> _Plan:
    """The plan of this call's (group, signature, device), built on its first call (`chunks()`
    gives the chunks then)."""
    key = (call.pg, call.signature, device)
    plan = _plans.get(key)
    if plan is None:
        if len(_plans) >= _MAX_PLANS:
            _plans.clear()
        plan = _plans[key] = _Plan(call, chunks(), device, chunk_numel)
    return plan


# Calls on the Triton path whose error records are not read yet, in issue order (`_Watched`;
# entries captured in a CUDA graph stay: every replay writes their record again), and calls
# whose record held an error that has not been raised yet.
_unchecked: list = []
_unreported: list = []
_IN_GRAPH = "captured in a CUDA graph"


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _graph_seeds(device: torch.device) -> bool:
    """Whether a stochastic call on `device` takes its seeds from the device counter
    (`slots.seed_counter`): while a CUDA graph is captured, so that every replay rounds afresh.
    Outside graphs the seeds are the host's, salted with the call number, as before."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _completion(device: torch.device):
    """What tells the host the work queued so far on `device` is done: None on CPU (done at once),
    a recorded CUDA event, or _IN_GRAPH while a CUDA graph is being captured."""
    if device.type != "cuda":
        return None
    if torch.cuda.is_current_stream_capturing():
        return _IN_GRAPH
    event = torch.cuda.Event()
    event.record()
    return event


class _Watched:
    """One call's error record in flight: `owner` (the plan or p2p message; it names the error),
    the `record` only this call's kernels write, `done` (None: the work was complete at issue, as
    on CPU; a CUDA event; _IN_GRAPH), whether an async handle owns the error (`handle`), and the
    error once the record was read."""

    __slots__ = ("done", "error", "handle", "owner", "read", "record", "reported")

    def __init__(self, owner, record, done, handle: bool):
        self.owner, self.record, self.done, self.handle = owner, record, done, handle
        self.error = None
        self.read = self.reported = False


def _read(entries, block: bool) -> None:
    """Read the error records of those `entries` whose work is complete (all of them with
    `block`, waiting for it). A record is cleared and given back to its owner only here, after
    its call's work is complete, so no kernel can still write it; an error read stays with its
    entry until it is raised (`_report`)."""
    capturing = None  # asked once, only for entries with an event: CPU work has none
    for e in entries:
        if e.done is not None:
            if capturing is None:
                capturing = _capturing()
            if capturing:  # no event query or sync while a CUDA graph is captured
                continue
        if e.done is _IN_GRAPH:  # written by every replay: read after a device sync, never given back
            if block:
                torch.cuda.synchronize()
                record = e.record.take()
                if record is not None:
                    replay = _Watched(e.owner, None, None, False)
                    replay.error, replay.read = e.owner.error(record), True
                    _unreported.append(replay)
            continue
        if e.done is not None:
            if block:
                e.done.synchronize()
            elif not e.done.query():  # not done yet: read later
                continue
        _unchecked.remove(e)
        _take(e)


def _take(e: _Watched) -> None:
    """Read a complete call's record, clear it and give it back (its error, if any, kept)."""
    record = e.record.take()
    e.owner.errors.release(e.record)
    e.record, e.read = None, True
    if record is not None:
        e.error = e.owner.error(record)
        _unreported.append(e)


def _watched(owner, record, done, handle: bool) -> _Watched:
    """A call's error record watched from issue: read at once when its work is complete (CPU:
    the interpreter ran it already), else kept in `_unchecked` until it is."""
    entry = _Watched(owner, record, done, handle)
    if done is None:
        _take(entry)
    else:
        _unchecked.append(entry)
    return entry


def _report(entry: _Watched):
    """Raise `entry`'s error, which counts as reported from then on."""
    if not entry.reported:
        entry.reported = True
        _unreported.remove(entry)
    raise entry.error


def _watch(owner, record, device: torch.device, handle: bool) -> _Watched:
    """Register one call's error record (claimed from `owner.errors`), to be read once the call's
    work is complete: at once on CPU (the interpreter ran it already)."""
    return _watched(owner, record, _completion(device), handle)


def _end_of_call(entry: _Watched | None) -> None:
    """The error check at the end of a call without a handle: its own error if its work is
    complete (always on CPU), else the oldest error of an earlier call without a handle whose
    work completed since (on CUDA, without waiting for anything)."""
    if _unchecked:
        _read(list(_unchecked), block=False)  # also gives completed calls' records back
    if entry is not None and entry.error is not None:
        _report(entry)
    for e in _unreported:
        if not e.handle:
            _report(e)


def _own_error(entry: _Watched) -> BaseException | None:
    """The error of `entry`'s call, once its work is complete (read without waiting)."""
    if not entry.read:
        _read([entry], block=False)
    return entry.error


def check_errors() -> None:
    """Raise ValueError if a compressed call found a tag mismatch (ranks that issued different
    collectives, or p2p ends that disagree) that has not been raised yet.

    Each call's tags are checked on the device into an error record of its own (one per call in
    flight), read by the host without a synchronization once that call's work is complete:

    - an async call's error is raised by its handle's `wait()` (by every later `wait()` too),
      never by another call; on CUDA, `wait()` can only see it once the call's work has completed
      (it does not wait for the device), so a `wait()` issued earlier returns True and a later
      one, or this function, raises it;
    - a synchronous call's error is raised at its end on CPU; on CUDA by the first synchronous
      call that ends after the work completed, or by this function;
    - calls captured in a CUDA graph: by this function, for the replays run since its last call.

    This function waits for all compressed work issued so far (on CUDA: a host synchronization
    with it), then raises the oldest error not raised yet (call it again for the next); an async
    call's handle still raises its own error afterwards. The message names the call (its number),
    the slice, the rank the message came from and both tags.

    Example:
        >>> import taco_triton as taco
        >>> taco.check_errors()  # nothing issued, nothing to report
    """
    _read(list(_unchecked), block=True)
    if _unreported:
        _report(_unreported[0])


def _finish_call(plan: _Plan | None, device: torch.device, async_op: bool, record=None):
    """What follows the issue of a compressed call: its error record watched (`record`: the one
    its kernels write, None on the reference path), then the handle (async) or the error check."""
    event = _completion(device)
    entry = None if record is None else _watched(plan, record, event, async_op)
    if not async_op:
        _end_of_call(entry)
        return None
    if _unchecked:
        _read(list(_unchecked), block=False)  # gives completed calls' records back; raises nothing

    def finish():
        if event is not None and event is not _IN_GRAPH:
            torch.cuda.current_stream().wait_event(event)

    return Pending(finish, entry)


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


def _compress_pieces(call: _Call, flat, k, piece, strides, stage):
    """The reference path's send buffer: every piece's wire bytes and tag, each in its
    16-byte-aligned slot, one compression per piece."""
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


# ------------------------------------------------------------------------------- steady state
#: (kind, group, arguments, metadata of the tensors) -> _Steady: what a call with exactly these
#: arguments and tensor metadata decided on its first run (validation, agreement, plan), so a
#: repeated call skips straight to its launches.
_steady_calls: dict = {}
_MAX_STEADY = 1024


class _Steady:
    """A call's decisions on the Triton path, kept for calls with the same arguments and tensor
    metadata (dtype, shape, strides, device: everything the validation and the plan depend on).
    Only contiguous tensors, world sizes above 1 and check modes other than "always" get one."""

    __slots__ = ("agreed", "config", "group", "pg", "plan")

    def __init__(self, call: _Call, plan: _Plan, config):
        self.plan, self.group, self.pg, self.config = plan, call.group, call.pg, config  # config: keeps its id
        self.agreed = (call.pg, call.signature) in _agreed

    def ready(self, check) -> bool:
        """False when this call must take the full path: the default group was re-created, or
        the check mode (None: the environment's, read per call) wants an exchange."""
        if self.group is None and _pg.default_group() is not self.pg:
            return False
        if check is None:
            mode = check_mode(None)
            return mode == "never" or (mode == "first" and self.agreed)
        return True  # "always" never gets a _Steady; "first" got one after agreeing

    def issue(self, src: torch.Tensor, dst: torch.Tensor, async_op: bool):
        plan = self.plan
        if dst.requires_grad:  # invisible to autograd, as native (a view of src when it is dst)
            src, dst = src.detach(), dst.detach()
        record = plan.run(src, dst, next(_calls), self.group)
        return _finish_call(plan, plan.device, async_op, record)


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor as 1-D (itself when it is: a view costs more than asking)."""
    return t if t.dim() == 1 else t.view(-1)


def _steady(args: tuple, tensors: tuple):
    """(key, _Steady or None) of a call with these arguments (kind, group, config, op, min_bytes,
    pipeline, backend, check) and tensors; key None when they cannot be a key (the full path
    validates them)."""
    try:
        key = (*args[:2], id(args[2]), *args[3:],
               *[(t.dtype, t.shape, t.stride(), t.device, t.requires_grad) for t in tensors])
        return key, _steady_calls.get(key)
    except (AttributeError, TypeError):  # not tensors, unhashable arguments
        return None, None


def _remember(key, call: _Call, plan: _Plan, tensors: tuple, config) -> None:
    """Keep what this call decided for its repeats (see `_Steady`)."""
    if (key is None or plan.backend != "triton" or call.p < 2 or check_mode(key[7]) == "always"
            or not all(t.is_contiguous() for t in tensors)):
        return
    if len(_steady_calls) >= _MAX_STEADY:
        _steady_calls.clear()
    _steady_calls[key] = _Steady(call, plan, config)


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
            Zero elements are fine on every path, as in torch (only the 4-byte tags move).
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
            they differ. True: on the first call of each (group, signature), then cached (the
            exchange reads its result on the host); "always": on every call (debugging);
            False: never. None: as env TACO_TRITON_CHECK_COLLECTIVES says (default: True).
            Every slot also carries a 4-byte tag of the call checked by the receiving kernel: a
            mismatch makes the outputs it fed NaN and raises ValueError without a host
            synchronization, in this call and no other: at its end (sync), at its handle's
            `wait()` (async); on CUDA once its work is complete (see `check_errors`).

    Every rank ends with bitwise-identical values. Groups that held NaN/Inf on any rank are NaN;
    a sum that overflows the dtype is +-inf (see `overflow_threshold`). Autograd does not see the
    collective, as with `dist.all_reduce`.
    """
    key, steady = _steady(("all_reduce", group, config, op, min_bytes, pipeline, backend, check), (tensor,))
    if steady is not None and steady.ready(check):
        flat = _flat(tensor)
        return steady.issue(flat, flat, async_op)
    if not _member(group):
        return None
    tensor = tensor.detach() if isinstance(tensor, torch.Tensor) else tensor  # invisible to autograd, as native
    call = _Call("all_reduce", [tensor], group, config, op, min_bytes, pipeline, check, backend)
    if not call.compress or (call.p == 1 and not compress_single_rank()):
        red, divide = _native_op(op, group)
        return _native(lambda t, a: _pg.all_reduce(t, red, group, a), tensor, call.p if divide else None, async_op)
    plan = _all_reduce_compressed(call, tensor)
    _remember(key, call, plan, (tensor,), config)
    return _finish_call(plan, tensor.device, async_op, call.record)


def _all_reduce_compressed(call: _Call, tensor: torch.Tensor) -> _Plan:
    p = call.p
    flat, copy_back = _flat_inplace(tensor)
    n = flat.numel()
    c = _round_up(-(-n // p), SUPERBLOCK_ELEMS)
    plan = _plan(call, lambda: [(min(j * c, n), min((j + 1) * c, n)) for j in range(p)], flat.device)
    if plan.backend == "triton":
        call.record = plan.run(flat, flat, call.seq, call.group)
    else:
        _all_reduce_reference(call, plan, flat)
    if copy_back is not None:
        copy_back.copy_(flat.view_as(copy_back))
    return plan


def _all_reduce_reference(call: _Call, plan: _Plan, flat: torch.Tensor) -> None:
    p, device = call.p, flat.device

    def launch(kp):
        k, _ = kp
        sl = plan.slices[k]
        send = plan.compress(call, flat, k)
        recv = torch.empty(p * sl.strides[call.rank], dtype=torch.uint8, device=device)
        work = _pg.all_to_all(recv, send, [sl.strides[call.rank]] * p, sl.strides, call.group, True)
        return k, recv, work

    def reduce(state):
        k, recv, work = state
        work.wait()
        own = plan.reduce(call, recv, k, plan.scale)
        gathered = torch.empty(p * plan.slices[k].slot, dtype=torch.uint8, device=device)
        return k, gathered, _pg.all_gather(gathered, own, call.group, True, compressed=True)

    def finish(state):
        k, gathered, work = state
        work.wait()
        plan.decompress(call, gathered, flat, k, plan.inf_above)

    _pipeline([sl.piece for sl in plan.slices], [launch, reduce, finish])


@_pg.records_as("reduce_scatter")
def reduce_scatter(
    output: torch.Tensor, input: torch.Tensor, group=None, config: CompressionConfig | None = None,
    op: str = "sum", async_op: bool = False, *, min_bytes: int | None = None, pipeline="auto",
    backend: str = "auto", check: bool | None = None,
):
    """Like `dist.reduce_scatter_tensor`: `input` is P equal slices along dim 0 (flattened),
    rank r's `output` gets the reduction of every rank's slice r. Arguments as in `all_reduce`.

    Overflow: a sum that overflows the output dtype is +-inf, as in `all_reduce`, with one
    exception. The ranks' values are summed in FP32 in the transformed domain, then transformed
    back; a group whose FP32 sum overflows there (only possible for bf16 and FP32 tensors whose
    values in that group approach 2 * 3.4e38 / P in magnitude; never for fp16) comes out NaN in
    all its elements on NVIDIA GPUs, whose FP32 transform splits its operands into bf16 pieces
    (Inf - Inf is NaN). On AMD GPUs and on CPU such a group's elements are +-inf, or NaN where
    infinities of both signs meet in the transform.
    """
    key, steady = _steady(("reduce_scatter", group, config, op, min_bytes, pipeline, backend, check), (output, input))
    if steady is not None and steady.ready(check):
        return steady.issue(_flat(input), _flat(output), async_op)
    if not _member(group):
        return None
    output, input = _detached(output, input)
    p = dist.get_world_size(group)
    _check_pair("reduce_scatter", "input", input, output, p)
    call = _Call("reduce_scatter", [output, input], group, config, op, min_bytes, pipeline, check, backend)
    if not call.compress or (p == 1 and not compress_single_rank()):
        red, divide = _native_op(op, group)
        return _native(lambda t, a: _pg.reduce_scatter(t, input.contiguous(), red, group, a),
                       output, p if divide else None, async_op)
    plan = _reduce_scatter_compressed(call, output, input)
    _remember(key, call, plan, (output, input), config)
    return _finish_call(plan, output.device, async_op, call.record)


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


def _reduce_scatter_compressed(call: _Call, output, input) -> _Plan:
    p, rank = call.p, call.rank
    flat_in = input.contiguous().view(-1)
    out_flat, copy_back = _flat_inplace(output)
    m = out_flat.numel()
    plan = _plan(call, lambda: [(j * m, (j + 1) * m) for j in range(p)], flat_in.device, chunk_numel=m)
    if plan.backend == "triton":
        call.record = plan.run(flat_in, out_flat, call.seq, call.group)
    else:
        def launch(kp):
            k, _ = kp
            sl = plan.slices[k]
            send = plan.compress(call, flat_in, k)
            recv = torch.empty(p * sl.strides[rank], dtype=torch.uint8, device=flat_in.device)
            return k, recv, _pg.all_to_all(recv, send, [sl.strides[rank]] * p, sl.strides, call.group, True)

        def finish(state):
            k, recv, work = state
            work.wait()
            a, b = plan.slices[k].piece[rank]
            plan.reduce(call, recv, k, plan.scale, dense_out=out_flat[a - rank * m : b - rank * m],
                        inf_above=plan.inf_above)

        _pipeline([sl.piece for sl in plan.slices], [launch, finish])
    if copy_back is not None:
        copy_back.copy_(out_flat.view_as(copy_back))
    return plan


@_pg.records_as("all_gather")
def all_gather(
    output: torch.Tensor, input: torch.Tensor, group=None, config: CompressionConfig | None = None,
    async_op: bool = False, *, min_bytes: int | None = None, pipeline="auto", backend: str = "auto",
    check: bool | None = None,
):
    """Like `dist.all_gather_into_tensor`: `output` is P slices along dim 0, slice r from rank r.
    The local shard is compressed once. Arguments as in `all_reduce`."""
    key, steady = _steady(("all_gather", group, config, "sum", min_bytes, pipeline, backend, check), (output, input))
    if steady is not None and steady.ready(check):
        return steady.issue(_flat(input), _flat(output), async_op)
    if not _member(group):
        return None
    output, input = _detached(output, input)
    p = dist.get_world_size(group)
    _check_pair("all_gather", "output", output, input, p)
    call = _Call("all_gather", [output, input], group, config, "sum", min_bytes, pipeline, check, backend)
    if not call.compress or (p == 1 and not compress_single_rank()):
        return _native(lambda t, a: _pg.all_gather(t, input.contiguous(), group, a), output, None, async_op)
    plan = _all_gather_compressed(call, output, input)
    _remember(key, call, plan, (output, input), config)
    return _finish_call(plan, output.device, async_op, call.record)


def _all_gather_compressed(call: _Call, output, input) -> _Plan:
    p = call.p
    flat_in = input.contiguous().view(-1)
    out_flat, copy_back = _flat_inplace(output)
    m = flat_in.numel()
    plan = _plan(call, lambda: [(0, m)], flat_in.device, chunk_numel=m)
    if plan.backend == "triton":
        call.record = plan.run(flat_in, out_flat, call.seq, call.group)
    else:
        def launch(kp):
            k, _ = kp
            own = plan.compress(call, flat_in, k)
            gathered = torch.empty(p * plan.slices[k].slot, dtype=torch.uint8, device=flat_in.device)
            return k, gathered, _pg.all_gather(gathered, own, call.group, True, compressed=True)

        def finish(state):
            k, gathered, work = state
            work.wait()
            plan.decompress(call, gathered, out_flat, k)

        _pipeline([sl.piece for sl in plan.slices], [launch, finish])
    if copy_back is not None:
        copy_back.copy_(out_flat.view_as(copy_back))
    return plan
