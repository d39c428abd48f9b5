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
reused.

No host synchronization in the steady state: the receiving kernels check every slot's tag on
the device; a mismatch makes the outputs it fed NaN and fills a small host-visible error record
(pinned host memory on CUDA), which the host reads once the work is complete, without waiting
for it (`_settle`, `check_errors`). The rank-agreement exchange (a fingerprint all_gather whose
result the host reads) runs on the first call of each (group, signature) and is cached;
check="always" runs it on every call. Limitation of the cache: a rank that changes its signature
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
        self.fp = _fingerprint(self.signature)
        self.seq = next(_calls)
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
        pieces = _pieces(chunks, call.depth)
        if call.kind == "all_gather":
            pieces = [pc for pc in pieces if pc[0][1] > pc[0][0]]
        self.slices = [_Slice(piece, call.config) for piece in pieces]
        self._prepared: dict = {}
        if self.backend == "triton":
            self.errors = slots.ErrorRecord(device)
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
            pad = [[0] * slots.DESC.value]
            rows.append([send + pad * (width - len(send)), recv + pad * (width - len(recv))])
        width = max(len(r[0]) for r in rows)
        pad = [[0] * slots.DESC.value]
        rows = [[st + pad * (width - len(st)) for st in r] for r in rows]
        self.desc = slots.table(rows, self.device)

    # ------------------------------------------------------------------------- the three steps
    def compress(self, call: _Call, flat: torch.Tensor, k: int) -> torch.Tensor:
        """The send buffer of slice k: every piece compressed into its slot, tags included."""
        sl = self.slices[k]
        stage = 1 if self.kind == "all_gather" else 0
        n_send = sl.slot if stage else sum(sl.strides)
        if self.backend != "triton":
            return _compress_pieces(call, flat, k, sl.piece, [sl.slot] if stage else sl.strides, stage)
        send = torch.empty(n_send, dtype=torch.uint8, device=flat.device)
        seed = slots.salt(self.config.seed, self.rank, call.seq, k) if self.config.stochastic else self.config.seed
        prep = self._prepared.get(("compress", k))
        if prep is None:
            from ..kernels.compress import compress_slots_launch

            launch = compress_slots_launch(flat, send, self.desc[k, 0], len(sl.piece), slots.total_tiles(sl.lays),
                                           self.config, target_of(flat.device),
                                           launch_params("compress", flat.device, flat.dtype, self.config,
                                                         max(lay.numel for lay in sl.lays)), flat.device,
                                           elem_align=slots.elem_align(sl.piece))
            prep = self._prepared["compress", k] = Prepared(launch, (0, 1, 6))
        prep(flat, send, seed)
        return send

    def reduce(self, call: _Call, recv: torch.Tensor, k: int, scale: float, dense_out=None, inf_above=math.inf):
        """Sum the P received copies of this rank's piece of slice k: compressed into a slot
        (tagged, returned) or, with `dense_out`, decompressed there."""
        sl, p, rank = self.slices[k], self.p, self.rank
        lay = sl.lays[rank]
        rows = recv.view(p, sl.strides[rank])
        dense = dense_out is not None
        stochastic_seed = (self.config.seed if dense or not self.config.stochastic
                           else slots.salt(self.config.seed, p + rank, call.seq))
        if self.backend != "triton":
            call.verify(rows, [lay.nbytes] * p, [self.tag(0, k, rank)] * p, k)
            if dense:
                if lay.numel:
                    ops.reduce_into(rows, lay.numel, self.config, scale, dense_out=dense_out, backend=self.backend,
                                    inf_above=inf_above)
                return dense_out
            own = torch.zeros(sl.slot, dtype=torch.uint8, device=recv.device)
            if lay.nbytes:
                ops.reduce_into(rows, lay.numel, self.config.replace(seed=stochastic_seed), scale,
                                out=own[: lay.nbytes], backend=self.backend)
            _put_tag(own, lay.nbytes, self.tag(1, k, rank))
            return own
        own = dense_out if dense else torch.empty(sl.slot, dtype=torch.uint8, device=recv.device)
        prep = self._prepared.get(("reduce", k))
        if prep is None:
            from ..kernels.reduce import reduce_launch

            stride = sl.strides[rank]
            strides = (stride, stride // 4, stride if self.config.scales == "dual" else stride // 4)
            tags = (self.errors.tensor, _tag_int(self.tag(0, k, rank)), _tag_int(self.tag(1, k, rank)), sl.slot)
            launch = reduce_launch(rows, rows, rows, strides, p, own, own, own, own, lay.numel, self.config, scale,
                                   dense, target_of(recv.device),
                                   launch_params("reduce", recv.device, torch.uint8, self.config, lay.numel),
                                   recv.device, inf_above, tags=tags)
            prep = self._prepared["reduce", k] = Prepared(launch, (0, 1, 2, 7, 8, 9, 10, 17, 26, 27))
        prep(rows, rows, rows, own, own, own, own, stochastic_seed, k, call.seq)
        return own

    def decompress(self, call: _Call, gathered: torch.Tensor, out_flat: torch.Tensor, k: int, inf_above=math.inf):
        """Decompress the P slots of the gathered buffer of slice k into their places of out_flat."""
        sl, p = self.slices[k], self.p
        rows = gathered.view(p, sl.slot)
        if self.backend != "triton":
            lays = sl.lays * p if self.kind == "all_gather" else sl.lays
            call.verify(rows, [lay.nbytes for lay in lays], [self.tag(1, k, j) for j in range(p)], k)
            for j, lay in enumerate(lays):
                if lay.nbytes:
                    a, b = sl.piece[0] if self.kind == "all_gather" else sl.piece[j]
                    base = j * self.chunk_numel if self.kind == "all_gather" else 0
                    ops.decompress_into(rows[j, : lay.nbytes], out_flat[base + a : base + b], self.config,
                                        self.backend, inf_above=inf_above)
            return
        prep = self._prepared.get(("decompress", k))
        if prep is None:
            from ..kernels.decompress import decompress_slots_launch

            lays = sl.lays * p if self.kind == "all_gather" else sl.lays
            if self.kind == "all_gather":
                m, ((a, b),) = self.chunk_numel, sl.piece
                pieces = [(j * m + a, j * m + b) for j in range(p)]
            else:
                pieces = sl.piece
            launch = decompress_slots_launch(gathered, out_flat, self.desc[k, 1], self.errors.tensor, p,
                                             slots.total_tiles(lays), self.config, target_of(gathered.device),
                                             launch_params("decompress", gathered.device, out_flat.dtype, self.config,
                                                           max(lay.numel for lay in lays)),
                                             gathered.device, inf_above, elem_align=slots.elem_align(pieces))
            prep = self._prepared["decompress", k] = Prepared(launch, (0, 1, 9, 10))
        prep(gathered, out_flat, k, call.seq)

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


# Calls on the Triton path whose tag checks have not been read yet: (plan, CUDA event or None,
# or _IN_GRAPH for work captured in a CUDA graph, which every replay runs again).
_unchecked: list = []
_IN_GRAPH = "captured in a CUDA graph"


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


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


def _settle(entries, block: bool) -> None:
    """Read the error records of those `entries` whose work is complete (all of them with
    `block`, waiting for each) and drop them; raise the first recorded tag mismatch."""
    err = None
    if _capturing():  # no event query while a CUDA graph is captured; check_errors() reads later
        return
    for entry in entries:
        plan, event = entry
        if event is _IN_GRAPH:  # written by graph replays: read by check_errors() after a device sync
            if block:
                torch.cuda.synchronize()
                record = plan.errors.take()
                if record is not None and err is None:
                    err = plan.error(record)
            continue
        if event is not None:
            if block:
                event.synchronize()
            elif not event.query():  # not done yet: a later call or check_errors() reads it
                continue
        if entry in _unchecked:
            _unchecked.remove(entry)
        record = plan.errors.take()
        if record is not None and err is None:
            err = plan.error(record)
    if err is not None:
        raise err


def _watch(owner, device: torch.device):
    """Register work whose error record `owner.errors` is read once the work is done; on CPU
    (the interpreter ran it already) it is read at once."""
    entry = (owner, _completion(device))
    if entry not in _unchecked:
        _unchecked.append(entry)
    if entry[1] is None:
        _settle([entry], block=False)


def check_errors() -> None:
    """Raise ValueError if a compressed collective found a tag mismatch (ranks that issued
    different collectives) in work that has not been reported yet.

    On the Triton path the tags are checked on the device and the error surfaces without a host
    synchronization: at the end of a later call whose earlier work is complete, at `wait()` of an
    async call's handle once its work is done, or here. This function waits for all compressed
    collective work issued so far (on CUDA: a host synchronization with it), then reads.

    Example:
        >>> import taco_triton as taco
        >>> taco.check_errors()  # nothing issued, nothing to report
    """
    _settle(list(_unchecked), block=True)


def _finish_call(plan: _Plan | None, device: torch.device, async_op: bool):
    """What follows the issue of a compressed call: the handle (or None) and the error checks."""
    event = _completion(device)
    if plan is None or plan.backend != "triton":
        entry = None
    else:
        entry = (plan, event)
        if entry not in _unchecked:  # one graph entry per plan, however often it is captured
            _unchecked.append(entry)
    if not async_op:
        _settle(list(_unchecked), block=False)
        return None
    if entry is not None and len(_unchecked) > 1:
        _settle([e for e in _unchecked if e is not entry], block=False)

    def finish():
        if event is not None and event is not _IN_GRAPH:
            torch.cuda.current_stream().wait_event(event)
        if entry is not None:
            _settle([entry], block=False)

    return Pending(finish)


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
            they differ. True: on the first call of each (group, signature), then cached (the
            exchange reads its result on the host); "always": on every call (debugging);
            False: never. None: as env TACO_TRITON_CHECK_COLLECTIVES says (default: True).
            Every slot also carries a 4-byte tag of the call checked by the receiving kernel: a
            mismatch makes the outputs it fed NaN and raises ValueError without a host
            synchronization (see `check_errors`).

    Every rank ends with bitwise-identical values. Groups that held NaN/Inf on any rank are NaN;
    a sum that overflows the dtype is +-inf (see `overflow_threshold`). Autograd does not see the
    collective, as with `dist.all_reduce`.
    """
    if not _member(group):
        return None
    tensor = tensor.detach() if isinstance(tensor, torch.Tensor) else tensor  # invisible to autograd, as native
    call = _Call("all_reduce", [tensor], group, config, op, min_bytes, pipeline, check, backend)
    if not call.compress or (call.p == 1 and not compress_single_rank()):
        red, divide = _native_op(op, group)
        return _native(lambda t, a: _pg.all_reduce(t, red, group, a), tensor, call.p if divide else None, async_op)
    plan = _all_reduce_compressed(call, tensor)
    return _finish_call(plan, tensor.device, async_op)


def _all_reduce_compressed(call: _Call, tensor: torch.Tensor) -> _Plan:
    p = call.p
    flat, copy_back = _flat_inplace(tensor)
    n = flat.numel()
    c = _round_up(-(-n // p), SUPERBLOCK_ELEMS)
    plan = _plan(call, lambda: [(min(j * c, n), min((j + 1) * c, n)) for j in range(p)], flat.device)
    scale = 1.0 / p if call.op == "avg" else 1.0
    inf_above = call.inf_above(flat.dtype)
    device = flat.device

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
        own = plan.reduce(call, recv, k, scale)
        gathered = torch.empty(p * plan.slices[k].slot, dtype=torch.uint8, device=device)
        return k, gathered, _pg.all_gather(gathered, own, call.group, True, compressed=True)

    def finish(state):
        k, gathered, work = state
        work.wait()
        plan.decompress(call, gathered, flat, k, inf_above)

    _pipeline([sl.piece for sl in plan.slices], [launch, reduce, finish])
    if copy_back is not None:
        copy_back.copy_(flat.view_as(copy_back))
    return plan


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
    return _finish_call(plan, output.device, async_op)


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
    plan = _plan(call, lambda: [(j * m, (j + 1) * m) for j in range(p)], flat_in.device)
    scale = 1.0 / p if call.op == "avg" else 1.0
    inf_above = call.inf_above(out_flat.dtype)

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
        plan.reduce(call, recv, k, scale, dense_out=out_flat[a - rank * m : b - rank * m], inf_above=inf_above)

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
    if not _member(group):
        return None
    output, input = _detached(output, input)
    p = dist.get_world_size(group)
    _check_pair("all_gather", "output", output, input, p)
    call = _Call("all_gather", [output, input], group, config, "sum", min_bytes, pipeline, check, backend)
    if not call.compress or (p == 1 and not compress_single_rank()):
        return _native(lambda t, a: _pg.all_gather(t, input.contiguous(), group, a), output, None, async_op)
    plan = _all_gather_compressed(call, output, input)
    return _finish_call(plan, output.device, async_op)


def _all_gather_compressed(call: _Call, output, input) -> _Plan:
    p = call.p
    flat_in = input.contiguous().view(-1)
    out_flat, copy_back = _flat_inplace(output)
    m = flat_in.numel()
    plan = _plan(call, lambda: [(0, m)], flat_in.device, chunk_numel=m)

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
