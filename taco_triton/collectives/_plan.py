"""Plans: what every compressed call of one (group, signature, device) needs besides the data.

A plan is built by the first call and kept (`plan_for`, in `STATE.plans`): the slices of the
message and their slot geometry, the slots each codec step writes and reads (from the shape),
and per codec path:

- `TritonPlan`: the slots' descriptor tables on the device (one copy, at plan time), the three
  launches per slice prepared once (grid, constexprs, tables; a call replaces the tensors), the
  pool of error records (one per call in flight) and the wire buffers, reused per calling thread
  and stream (`buffers` says when that is safe);
- `ReferencePlan`: the torch reference of the same steps, one piece at a time, on fresh buffers,
  checking each received tag on the host.

`begin` binds a plan's codec steps to one call's tensors; the driver runs them (`_driver`).
"""
from __future__ import annotations

import itertools
import threading

import torch

from .. import ops
from ..kernels import slots
from ..layout import WireLayout
from ..wire import pieces
from . import _streams
from ._shapes import ALL_TO_ALL, COMPRESS, DECOMPRESS, REDUCE
from ..state import STATE, Cache

#: Sets of reusable wire buffers a Triton plan keeps (one per calling thread and CUDA stream).
MAX_BUFFER_SETS = 8


class Slice:
    """One pipeline slice: a piece of every chunk, its wire layouts, slot strides (payload, tag,
    zero padding: `slots.slot_bytes`) and their offsets in the send buffer; `slot` the widest."""

    def __init__(self, piece, config):
        self.piece = piece
        self.lays = [WireLayout.of(b - a, config) for a, b in piece]
        self.strides = [slots.slot_bytes(lay.nbytes) for lay in self.lays]
        self.offsets = list(itertools.accumulate([0] + self.strides[:-1]))
        self.slot = max(self.strides)


class Buffers:
    """The wire buffers of one pipeline slice: `send` what this rank compresses, `recv` (viewed as
    `rows`, one per rank) what an all_to_all delivers, `own` this rank's requantized slot, and
    `gathered` what an all_gather delivers, each where the shape's stages need it;
    `dense_of(out)` the part of the output a dense reduce writes. `zeroed`: send and own start
    zero (the reference path writes only the wire bytes and tags; the kernels write the padding
    too)."""

    __slots__ = ("dense_of", "gathered", "own", "recv", "recv_splits", "rows", "send")

    def __init__(self, plan: "Plan", k: int, zeroed: bool = False):
        sl, p, rank, dev, u8 = plan.slices[k], plan.p, plan.rank, plan.device, torch.uint8
        new = torch.zeros if zeroed else torch.empty
        shape = plan.shape
        comms = {st.comm for st in shape.stages}
        self.send = new(sum(plan.sends[k].ends), dtype=u8, device=dev)
        self.recv = self.rows = self.own = self.gathered = self.recv_splits = None
        if ALL_TO_ALL in comms:
            stride = sl.strides[rank]
            self.recv = torch.empty(p * stride, dtype=u8, device=dev)
            self.rows = self.recv.view(p, stride)
            self.recv_splits = [stride] * p
        if any(st.op == REDUCE for st in shape.stages) and not shape.dense_reduce:
            self.own = new(sl.slot, dtype=u8, device=dev)
        if any(st.op == DECOMPRESS for st in shape.stages):  # an all_gather's (or a message's) slots
            self.gathered = torch.empty(p * sl.slot, dtype=u8, device=dev)
        a, b = sl.piece[rank] if shape.dense_reduce else (0, 0)
        lo, hi, m = a - rank * plan.chunk_numel, b - rank * plan.chunk_numel, plan.chunk_numel
        self.dense_of = (lambda out: out) if (lo, hi) == (0, m) else (lambda out: out[lo:hi])


class Plan:
    """What every compressed call of one signature needs besides the data (see the module
    docstring): the slices' geometry, tags, and per slice the slots the compress step writes
    (`sends`) and the decompress step reads (`gathers`, None without one)."""

    def __init__(self, call, shape, chunks, device: torch.device, chunk_numel: int = 0):
        self.shape = shape
        self.chunk_numel = chunk_numel  # reduce_scatter, all_gather: elements of one rank's shard
        self.kind, self.signature, self.fp = call.kind, call.signature, call.fp
        self.p, self.rank, self.config, self.backend = call.p, call.rank, call.config, call.backend
        self.device = device
        # a zero-size message is one slice of empty pieces: only the tags move, as in the others
        self.slices = [Slice(piece, call.config) for piece in pieces(chunks, call.depth)]
        self.scale = 1.0 / self.p if call.op == "avg" else 1.0
        self.inf_above = shape.inf_above(call.config, call.dtype)  # decoded values beyond become +-inf
        self.sends = [shape.send_slots(self, k, sl) for k, sl in enumerate(self.slices)]
        self.gathers = [shape.gathered_slots(self, k, sl) for k, sl in enumerate(self.slices)]
        self.ops = tuple(st.op for st in shape.stages)
        self.comms = tuple(st.comm for st in shape.stages)
        self.schedule = None  # the (stage, slice) order the driver runs (`_driver.order`)

    def tag(self, stage: int, k: int, j: int) -> int:
        """The tag of slot j of slice k in the process-group call of `stage` (`slots.tag`)."""
        return slots.tag(self.fp, stage, k, j)

    def table_rows(self) -> list:
        """Every slice's descriptor rows (host ints), [slice][0] the slots this rank compresses,
        [slice][1] the slots it decompresses, padded with zero rows to one width."""
        rows = []
        for send, gathered in zip(self.sends, self.gathers):
            send = slots.descriptors(*send)
            recv = [] if gathered is None else slots.descriptors(*gathered)
            width = max(len(send), len(recv))
            pad = [[0] * slots.DESC]
            rows.append([send + pad * (width - len(send)), recv + pad * (width - len(recv))])
        width = max(len(r[0]) for r in rows)
        pad = [[0] * slots.DESC]
        return [[st + pad * (width - len(st)) for st in r] for r in rows]

    def slice_launches(self, k: int, flat, dense, b: "Buffers", desc, err, target=None, params=None,
                       graph_seeds: bool = False) -> tuple:
        """The (compress, reduce, decompress) `Launch`es of slice k (None where the shape has no
        such stage), built by each fused op (`CompressOp`, `ReduceOp`, `DecompressOp`), with
        `flat`, `dense`, the slice's buffers `b`, its descriptor tables `desc` ([0] compress, [1]
        decompress) and the error record `err` as arguments (tensors, or stand-ins when a launch
        is only compiled: bench/aot.py builds its launches here, passing the compile `target` and
        `params(kernel, dtype, numel)`); `graph_seeds`: the variant CUDA graph replays salt."""
        from ..kernels.compress import CompressOp

        p, rank, cfg, sl, device = self.p, self.rank, self.config, self.slices[k], self.device
        steps = {st.op for st in self.shape.stages}
        compress = CompressOp(cfg, device, target, params).slots_launch(flat, b.send, desc[0], sl.piece, sl.lays,
                                                                         graph_seeds)
        reduce = decompress = None
        if REDUCE in steps:
            from ..kernels.reduce import ReduceOp

            dense_reduce = self.shape.dense_reduce
            reduce = ReduceOp(cfg, device, target, params).slots_launch(
                b.rows, sl.strides[rank], p, dense if dense_reduce else b.own, sl.lays[rank].numel, self.scale,
                dense_reduce, err, self.tag(0, k, rank), self.tag(1, k, rank), sl.slot,
                self.inf_above, graph_seeds)
        if DECOMPRESS in steps:
            from ..kernels.decompress import DecompressOp

            got = self.gathers[k]
            decompress = DecompressOp(cfg, device, target, params).slots_launch(
                b.gathered, dense, desc[1], err, got.pieces, got.layouts, self.inf_above)
        return compress, reduce, decompress

    @staticmethod
    def prepare(launches: tuple) -> tuple:
        """Slice launches (`slice_launches`) as their fused ops' prepared calls: compress
        `(x, wire, seed)`, reduce `(rows, out, seed, err, k, seq)`, decompress
        `(wire, out, err, k, seq)`; None where there is no such stage."""
        from ..kernels.compress import CompressOp
        from ..kernels.decompress import DecompressOp
        from ..kernels.reduce import ReduceOp

        return tuple(ln and op.prepare_slots(ln) for ln, op in zip(launches, (CompressOp, ReduceOp, DecompressOp)))


class TritonPlan(Plan):
    """A plan on the Triton path: descriptor tables, prepared launches, error records, reused
    buffers (see the module docstring)."""

    def __init__(self, call, shape, chunks, device: torch.device, chunk_numel: int = 0):
        super().__init__(call, shape, chunks, device, chunk_numel)
        self.launches = self.graph_launches = None  # prepared by the first call (`_prepare`)
        self._buffers = Cache(MAX_BUFFER_SETS)
        self.errors = slots.ErrorRecords(device)  # one record per call in flight
        self._build_tables()

    def _build_tables(self) -> None:
        """Every slice's descriptor rows in one device table (one copy, at plan time)."""
        self.desc = slots.table(self.table_rows(), self.device)

    def _prepare(self, flat: torch.Tensor, dense: torch.Tensor) -> None:
        """Everything the Triton path's calls reuse: per slice the prepared launches (built with
        this call's tensors; later calls replace the tensor arguments). Stochastic rounding also
        gets the launches that calls captured in a CUDA graph run (`graph_launches`: seeds salted
        on the device with `slots.seed_counter`), made now so that no kernel compiles during a
        capture."""
        self.launches = self._launches(flat, dense, False)
        if self.config.stochastic:
            self.graph_launches = self._launches(flat, dense, True)

    def _launches(self, flat: torch.Tensor, dense: torch.Tensor, graph_seeds: bool) -> list:
        """Per slice its (compress, reduce, decompress) prepared launches (None where the shape
        has no such stage); `graph_seeds`: the variant CUDA graph replays salt on the device."""
        err = self.errors.claim()  # the launches' template argument; each call passes its own record
        self.errors.release(err)
        return [self.prepare(self.slice_launches(k, flat, dense, b, self.desc[k], err.tensor, graph_seeds=graph_seeds))
                for k, b in enumerate(self._new_buffers())]

    def _new_buffers(self) -> list:
        """One set of wire buffers per slice (`Buffers`), from torch.empty."""
        return [Buffers(self, k) for k in range(len(self.slices))]

    def buffers(self) -> list:
        """The wire buffers of this caller, reused across its calls.

        The rule that makes reuse safe: buffers are kept per (thread, current CUDA stream)
        (`_streams.buffer_key`), and every call that uses a set runs all its steps in order on
        that one stream, waiting there for its own process-group work before the next step
        (c10d's wait() orders the current stream after the communication), so the next call on
        the stream runs its kernels and issues its communication after all of it. A synchronous
        CUDA call runs on the caller's stream and uses that stream's set; an async one runs on
        the device's communication stream (`_driver`), which is current when its buffers are
        taken, so they are allocated there and only async calls on that stream reuse them. On
        CPU a call's work is done when its steps end, and a group's async calls run one at a
        time on its worker thread (a set of their own: the worker is their thread). A call from
        another thread or on another stream gets its own set; the oldest set is forgotten
        beyond `MAX_BUFFER_SETS` (a call in flight keeps its own alive until it finishes: the
        process group holds what it sends and receives, the steps what they read). While a
        CUDA graph is captured every call gets fresh buffers (from the graph's pool), which
        replays then own.
        """
        # CPU: no stream, no capture (the common case, asked without a call)
        key = threading.get_ident() if not _streams.on_streams(self.device) else _streams.buffer_key(self.device)
        if key is None:
            return self._new_buffers()
        bufs = self._buffers.get(key)
        if bufs is None:
            bufs = self._new_buffers()
            self._buffers.put(key, bufs)
        return bufs

    def begin(self, src: torch.Tensor, dst: torch.Tensor, seq: int, checks: bool = True):
        """(the error record this call's kernels write, `step`): `step(stage, k, b)` runs the codec
        step of `stage` on slice k with its buffers `b`, bound to this call's tensors, and returns
        the buffer the stage's communication sends (None for the last stage). `checks` False: the
        steps run check no tag (a message's sender only compresses), no record is claimed (None)."""
        if self.launches is None:
            self._prepare(src, dst)
        record = self.errors.claim() if checks else None
        err = record and record.tensor
        launches, cfg, rank, ops, dense = self.launches, self.config, self.rank, self.ops, self.shape.dense_reduce
        slice_salt = self.shape.slice_salt
        stochastic, seed = cfg.stochastic, cfg.seed
        if stochastic and _streams.graph_seeds(self.device):  # replays must not repeat the captured seeds
            slots.seed_counter(self.device).add_(1)
            launches = self.graph_launches
        # the requantizing reduce's seed: salted per rank (p + rank: apart from the compress's), call
        # and slice, so that two slices' elements at the same offset never round with the same bits
        reduce_seed = slots.salt(seed, self.p + rank, seq) if stochastic else seed

        def step(stage, k, b):
            op = ops[stage]
            if op is COMPRESS:
                launches[k][0](src, b.send, (slots.salt(seed, rank, seq, k) if slice_salt else slots.salt(seed, rank, seq))
                               if stochastic else seed)
                return b.send
            if op is REDUCE:
                if dense:
                    out = b.dense_of(dst)
                    launches[k][1](b.rows, out, seed, err, k, seq)
                    return None
                launches[k][1](b.rows, b.own, slots.salt(reduce_seed, k) if stochastic else seed, err, k, seq)
                return b.own
            launches[k][2](b.gathered, dst, err, k, seq)
            return None

        return record, step

    def error(self, record) -> ValueError:
        """The error of a recorded tag mismatch (`slots.ErrorRecord.take`'s fields), as the shape says it."""
        k, src, got, want, seq = record
        return self.shape.mismatch(self, k, src, got, want, seq)


def _put_tag(buf: torch.Tensor, at: int, tag: int) -> None:
    buf[at : at + slots.TAG_BYTES] = torch.frombuffer(bytearray(slots.tag_bytes(tag)), dtype=torch.uint8).to(buf.device)


class ReferencePlan(Plan):
    """A plan on the torch reference path: the same steps one piece at a time, each received tag
    checked on the host before its slot is used (ValueError at once)."""

    def buffers(self) -> list:
        """Fresh buffers for every call (send and own zeroed)."""
        return [Buffers(self, k, zeroed=True) for k in range(len(self.slices))]

    def verify(self, rows: torch.Tensor, nbytes: list[int], expected: list[int], k: int) -> None:
        """Check the tag after each received slot: a message from another call, slice or
        signature raises ValueError instead of being decoded."""
        for r, (n, want) in enumerate(zip(nbytes, expected)):
            got = slots.tag_of(rows[r, n : n + slots.TAG_BYTES])
            if got != want:
                raise self.shape.mismatch(self, k, r, got, want, -1, reference=True)

    def begin(self, src: torch.Tensor, dst: torch.Tensor, seq: int, checks: bool = True):
        """(None, `step`), as `TritonPlan.begin`: no error record, the tags are checked here."""
        steps = {COMPRESS: self._compress, REDUCE: self._reduce, DECOMPRESS: self._decompress}
        ops = self.ops

        def step(stage, k, b):
            return steps[ops[stage]](src, dst, seq, k, b)

        return None, step

    def _compress(self, src, dst, seq, k, b):
        """Every piece of slice k into its slot, salted per rank, call, slice and piece; tags."""
        cfg, send = self.config, self.sends[k]
        where = (self.rank, seq, k) if self.shape.slice_salt else (self.rank, seq)
        for j, ((a, e), lay, off, tag) in enumerate(zip(send.pieces, send.layouts, send.offsets, send.tags)):
            if lay.nbytes:
                ops.compress_into(src[a:e], slots.salted(cfg, *where, j), b.send[off : off + lay.nbytes],
                                  self.backend)
            _put_tag(b.send, off + lay.nbytes, tag)
        return b.send

    def _reduce(self, src, dst, seq, k, b):
        """The P received copies of this rank's piece of slice k summed: into the dense output
        (reduce_scatter) or requantized into this rank's slot, tagged (all_reduce)."""
        cfg, p, rank = self.config, self.p, self.rank
        lay = self.slices[k].lays[rank]
        self.verify(b.rows, [lay.nbytes] * p, [self.tag(0, k, rank)] * p, k)
        if self.shape.dense_reduce:
            if lay.numel:
                ops.reduce_into(b.rows, lay.numel, cfg, self.scale, dense_out=b.dense_of(dst), backend=self.backend,
                                inf_above=self.inf_above)
            return None
        if lay.nbytes:
            ops.reduce_into(b.rows, lay.numel, slots.salted(cfg, p + rank, seq, k), self.scale, out=b.own[: lay.nbytes],
                            backend=self.backend)
        _put_tag(b.own, lay.nbytes, self.tag(1, k, rank))
        return b.own

    def _decompress(self, src, dst, seq, k, b):
        """Every gathered slot of slice k into its place of the output."""
        got = self.gathers[k]
        rows = b.gathered.view(self.p, self.slices[k].slot)
        self.verify(rows, [lay.nbytes for lay in got.layouts], got.tags, k)
        for j, ((a, e), lay) in enumerate(zip(got.pieces, got.layouts)):
            if lay.nbytes:
                ops.decompress_into(rows[j, : lay.nbytes], dst[a:e], self.config, self.backend, inf_above=self.inf_above)
        return None


def plan_for(call, shape, src: torch.Tensor, dst: torch.Tensor) -> Plan:
    """The plan of this call's (group, signature, device), built on its first call (from the
    shape's chunks of `src` and `dst`), on its codec path."""
    key = (call.pg, call.signature, src.device)
    plan = STATE.plans.get(key)
    if plan is None:
        chunks, chunk_numel = shape.chunks(src, dst, call.p)
        kind = TritonPlan if call.backend == "triton" else ReferencePlan
        plan = kind(call, shape, chunks, src.device, chunk_numel)
        STATE.plans.put(key, plan, call.pg)
    return plan


__all__ = ["Buffers", "Plan", "ReferencePlan", "Slice", "TritonPlan", "plan_for"]
