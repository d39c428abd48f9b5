"""A process group that compresses what a `CompressionPolicy` asks for and forwards the rest.

(Longer than the project's ~500 lines per module: it is one class with a method for each entry
point torch.distributed calls on a process group, collectives, lists, coalescing, p2p and the
forwarded rest; its Work types, policy decision and byte counts live elsewhere.)

    import taco_triton as taco
    tp = taco.compressed_group(tp_group, policy)          # once, on every rank of tp_group
    dist.all_reduce(x, group=tp)                          # and any other torch.distributed call

    # or as the default group (and every group dist.new_group makes under it):
    dist.init_process_group("taco", pg_options=taco.GroupOptions(inner="gloo", policy=policy))

`compressed_group(inner, policy)` returns a ``torch.distributed.ProcessGroup`` (registered with
torch.distributed under the backend name ``"taco"`` when ``taco_triton`` is imported) that every
torch.distributed API accepts in place of `inner`: ``all_reduce``, ``reduce_scatter_tensor``,
``all_gather_into_tensor``, their list and coalesced forms, the functional collectives (and so
DTensor), DDP, send/recv, ``batch_isend_irecv``, ``all_to_all``, ``broadcast``, ``barrier``,
gather/scatter/reduce. ``dist.init_process_group("taco")`` and ``dist.new_group(ranks,
backend="taco")`` make one over a new inner group (`GroupOptions` names its backend and the
policy); under a ``"taco"`` default group, ``dist.new_group`` makes ``"taco"`` groups too.
``dist.destroy_process_group`` destroys an inner group the library made along with its group,
never one the caller handed in. ``dist.monitored_barrier`` refuses any group whose backend is
not named gloo; call it on ``group.inner`` (or ``group.monitored_barrier(timeout)``).

Compressed: SUM and AVG all_reduce / reduce_scatter and all_gather of bf16, fp16 and fp32
tensors of at least ``policy.min_bytes`` bytes whose site the policy gives a config (see
`taco_triton.integrations.sites` for how sites are named); they run
`taco_triton.all_reduce / reduce_scatter / all_gather` over `inner`. Point-to-point messages
(send/recv, isend/irecv, batch_isend_irecv) of such tensors are compressed once by the sender
and decompressed by the receiver when it waits, with the policy's config at site ``"p2p"``,
direction "forward", at both ends (sender and receiver must decide alike from what both know;
``recv`` from any source is forwarded, so do not mix it with compressed sends). Everything else
(integer dtypes, MAX/MIN/PRODUCT/PREMUL_SUM, small messages, exempt sites, all_to_all,
broadcast, barrier, gather, scatter, reduce) is handed to `inner` unchanged, in its own form
(a list all_gather as inner's list all_gather, a coalesced all_reduce with nothing to compress
as inner's coalesced all_reduce), with the same options, and is bit for bit what `inner` gives.

Work: a compressed collective runs as the collectives' async calls do: on CUDA on the device's
communication stream, off the caller's stream, whose `wait()` (or the future's) orders the
waiting stream after it; on CPU as a job of the inner group's worker thread, whose `wait()`
blocks until it is done. Its errors (a tag mismatch) raise at that Work's `wait()`. A forwarded
call returns `inner`'s own Work, which writes the caller's outputs itself; on CPU, while
compressed calls are queued on `inner`, it is issued behind them, so every rank issues the
group's calls in one order. A coalesced call that mixes compressed and forwarded parts returns a
Work that waits for each part's. Nothing is copied into a caller's output before the
communication that fills it is done.

`WireStats` counts every call on this rank: compressed ones as the collectives count them,
forwarded ones by the collective's standard cost (`WireStats`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..collectives import _pg, _streams, _worker, p2p
from ..state import STATE
from ..collectives import compressed as coll
from ..collectives.work import PendingWork, all_of, as_work, decode_on_wait
from ..estimate import ring_bytes
from ..policy import CompressionPolicy, decide, eligible
from . import sites

__all__ = ["BACKEND", "P2P_SITE", "CompressingProcessGroup", "GroupOptions", "GroupStats", "compressed_group"]

BACKEND = "taco"
"""The name the group's backend is registered under (``import taco_triton`` registers it):
``dist.init_process_group("taco")``, ``dist.new_group(ranks, backend="taco")``."""

P2P_SITE = "p2p"
"""The site of point-to-point messages (the same at both ends; ``exempt=["p2p"]`` forwards them)."""
_COMPRESSIBLE_OPS = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg"}
# torch.distributed does not re-export this one (2.13); the others are dist.*Options
_AllgatherOptions = torch._C._distributed_c10d.AllgatherOptions
_P2P_METHODS = frozenset({"send", "recv", "recv_anysource"})


@dataclass
class GroupStats:
    """Calls of one (site, direction, kind) on a compressing group: how many, how many compressed,
    and their buffer bytes (all_reduce: the tensor; reduce_scatter, all_gather: the larger one)."""

    calls: int = 0
    """Calls made."""
    compressed: int = 0
    """Of those, calls sent compressed."""
    bytes: int = 0
    """Their buffer bytes."""


@dataclass(frozen=True)
class GroupOptions:
    """What a ``"taco"`` group is made of: ``pg_options=`` of ``dist.init_process_group("taco")``
    and ``dist.new_group(..., backend="taco")``.

    Args:
        inner: the group that carries the bytes. A backend string (``"gloo"``, ``"nccl"``,
            ``"cpu:gloo,cuda:nccl"``): a new group of that backend over the same ranks, made with
            the compressing group and destroyed with it. A ``ProcessGroup``: that group (over the
            same ranks; the caller keeps it, destroying the compressing group leaves it alone).
            None: under a compressing default group, its inner backend; under another default
            group, the default group's backend; for the default group itself, the device's own
            (``"cpu:gloo,cuda:nccl"`` where CUDA and NCCL are available, else ``"gloo"``).
        policy: a `taco_triton.CompressionPolicy`. None: the compressing default group's
            policy (groups made under it share it), else a new default ``CompressionPolicy()``.

    Example:
        >>> GroupOptions(inner="gloo").inner
        'gloo'
        >>> GroupOptions(inner="taco")
        Traceback (most recent call last):
        ...
        ValueError: GroupOptions.inner must name the backend that carries the bytes (gloo, nccl, ...), not 'taco' itself
    """

    inner: str | dist.ProcessGroup | None = None
    policy: object | None = None

    def __post_init__(self):
        if isinstance(self.inner, str):
            named = {b for pair in self.inner.lower().split(",") for b in pair.split(":")[-1:]}
            if BACKEND in named:
                raise ValueError("GroupOptions.inner must name the backend that carries the bytes (gloo, nccl, ...), "
                                 f"not {self.inner!r} itself")
        elif isinstance(self.inner, CompressingProcessGroup):
            raise TypeError("inner is already a compressing group; pass its .inner (compressing twice gains nothing)")
        elif self.inner is not None and not isinstance(self.inner, dist.ProcessGroup):
            raise TypeError(f"GroupOptions.inner must be a backend string, a ProcessGroup or None, "
                            f"got {type(self.inner).__name__}")
        if self.policy is not None:
            missing = [a for a in ("config_for", "observe", "min_bytes") if not hasattr(self.policy, a)]
            if missing:
                raise TypeError(f"policy must be a CompressionPolicy (missing {missing}), got {type(self.policy).__name__}")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _op_of(opts):
    op = getattr(opts, "reduceOp", dist.ReduceOp.SUM)
    # ReduceOp instances compare equal to their RedOpType members
    for known, name in _COMPRESSIBLE_OPS.items():
        if op == known:
            return name
    return None


def _first_tensor(args):
    """The first tensor in a call's arguments (lists of tensors, and lists of them, included)."""
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
        if isinstance(a, (list, tuple)):
            t = _first_tensor(a)
            if t is not None:
                return t
    return None


def _on_cuda(args) -> bool:
    """Whether a forwarded call moves CUDA tensors (its first tensor's device)."""
    t = _first_tensor(args)
    return t is not None and t.device.type == "cuda"


def _receive_work(work, wire: torch.Tensor, tensor: torch.Tensor, cfg) -> PendingWork:
    """A compressed receive's Work: `wait()` waits for the wire buffer, then decompresses it into
    the caller's tensor (once); a failed receive keeps raising its error. It has no future
    (receives are waited on, as torch's gloo receives are)."""

    def decode():
        if tensor.is_contiguous():
            p2p.decode_into(wire, tensor, cfg)
        else:
            dense = torch.empty_like(tensor, memory_format=torch.contiguous_format)
            p2p.decode_into(wire, dense, cfg)
            tensor.copy_(dense)

    return decode_on_wait([work], [wire], decode, wire.device, PendingWork)


class CompressingProcessGroup(dist.ProcessGroup):
    """A ``torch.distributed.ProcessGroup`` over `inner` that compresses what `policy` selects.

    Made by `compressed_group`; see the module docstring. Attributes: `inner` (the process group
    that carries every byte), `policy`, `stats` ({(site, direction, kind): GroupStats}).

    Args:
        rank: this process's rank in the group.
        size: ranks in the group.
        inner: the process group that carries every byte.
        policy: the `CompressionPolicy` deciding each message.
        global_ranks: the group's ranks in the world, in group order.
        group_name: the name torch.distributed knows the group by ("": the one it assigns).
        inner_backend: the backend of an inner group this group made and destroys with itself;
            None for a group the caller made.
    """

    def __init__(self, rank: int, size: int, inner, policy, global_ranks: list[int], group_name: str = "",
                 inner_backend: str | None = None):
        super().__init__(rank, size)
        self._inner = inner
        self._global_ranks = list(global_ranks)
        self._group_name = group_name
        #: the backend string of an inner group this group made (and destroys); None: the caller's
        self.inner_backend = inner_backend
        self.policy = policy
        self.stats: dict[tuple[str, str, str], GroupStats] = {}
        self._checked_devices: set[str] = set()
        self._patterns_checked = False
        self._coalescing: list | None = None  # the Works issued inside a coalescing block

    # ------------------------------------------------------------------ identity
    @property
    def inner(self):
        """The process group that carries the bytes."""
        return self._inner

    @property
    def taco_carrier(self):
        """The group that carries this group's bytes (`inner`): the collectives issue and order on it."""
        return self._inner

    @property
    def group_name(self) -> str:
        # kept here: destroy_process_group reads it after dropping the group from torch's tables
        return self._group_name or dist.distributed_c10d._world.pg_names[self]

    @property
    def pg_name(self) -> str:
        """The group's name (as `group_name`; the name torch's newer API reads)."""
        return self.group_name

    def shutdown(self) -> None:
        """Called by ``dist.destroy_process_group``: forgets what the collectives kept for this group
        (and for the inner group it made, which it destroys too: its worker thread ends)."""
        c10d = dist.distributed_c10d
        STATE.forget(self)
        if self.inner_backend is not None:
            STATE.forget(self._inner)
            if c10d._world.pg_map.get(self._inner) is not None:
                dist.destroy_process_group(self._inner)

    def getBackendName(self) -> str:
        """The backend name, `BACKEND`.

        Returns:
            "taco".
        """
        return BACKEND

    def name(self) -> str:
        return BACKEND

    def __repr__(self) -> str:
        return f"CompressingProcessGroup(rank={self.rank()}, size={self.size()}, ranks={self._global_ranks})"

    # ------------------------------------------------------------------ deciding
    def _inner_for(self, tensor: torch.Tensor):
        """`inner`, after checking once per device type that it can carry `tensor`."""
        inner = self.inner
        dev = tensor.device.type
        if dev not in self._checked_devices:
            try:
                inner._get_backend(tensor.device)
            except RuntimeError as e:
                raise ValueError(
                    f"compressed group: its inner group (backend {dist.get_backend(inner)!r}) has no backend for "
                    f"{dev} tensors; make the inner group with a backend for {dev} (gloo for cpu, nccl for cuda)"
                ) from e
            self._checked_devices.add(dev)
        return inner

    def _decide(self, kind: str, tensor: torch.Tensor, nbytes: int, op: str | None):
        """The policy's config for one message, or None to forward it."""
        site, direction = sites.current_site(kind)
        st = self.stats.get((site, direction, kind))
        if st is None:
            st = self.stats[(site, direction, kind)] = GroupStats()
        st.calls += 1
        st.bytes += nbytes
        if not self._patterns_checked and sites.tracking():
            self._patterns_checked = True
            sites.check_patterns(self.policy)
        cfg = decide(self.policy, site, direction, tensor, nbytes=nbytes, ranks=self.size(), compressible=op is not None)
        if cfg is not None:
            st.compressed += 1
        return cfg

    def _check_pair(self, kind: str, big_name: str, big: torch.Tensor, small_name: str, small: torch.Tensor) -> None:
        """ValueError, before anything is sent, unless `big` holds world_size times `small`'s
        elements in its dtype (some backends abort the process on a mismatch instead)."""
        if big.numel() != self.size() * small.numel() or big.dtype != small.dtype:
            raise ValueError(
                f"{kind}: the {big_name} must hold world_size ({self.size()}) times the {small_name}'s elements, in "
                f"its dtype; got {big_name} {tuple(big.shape)} {big.dtype}, {small_name} {tuple(small.shape)} {small.dtype}")

    def _forward(self, kind: str, nbytes: float, wire: float, method: str, *args):
        """Hand a call to `inner`'s method of the same name, unchanged, counting its bytes. A
        collective on CPU tensors goes behind the compressed calls still queued on inner (in the same
        order on every rank, `_worker`); point-to-point messages and CUDA calls are issued at once,
        on the caller's thread and stream, as the compressed ones are."""
        _pg._record(kind, int(nbytes), float(wire), False)
        inner = self.inner
        fn = getattr(inner, method)
        try:
            if method in _P2P_METHODS or _on_cuda(args):
                return self._track(fn(*args))
            return self._track(_worker.in_order(inner, lambda: fn(*args), True))
        except RuntimeError as e:
            if type(e) is not RuntimeError:  # keep torch's own error types (DistBackendError, ...)
                raise
            raise RuntimeError(f"compressed group: the inner group (backend {dist.get_backend(inner)!r}) "
                               f"cannot run {method} (forwarded unchanged): {e}") from e

    # ------------------------------------------------------------------ all_reduce
    def allreduce(self, tensors, opts=None):
        opts = dist.AllreduceOptions() if opts is None else opts
        if len(tensors) != 1:
            return self._forward_all_reduce("allreduce", tensors, opts)
        (t,) = tensors
        self._inner_for(t)
        return self._all_reduce_one(t, self._decide("all_reduce", t, _nbytes(t), _op_of(opts)), opts)

    def _all_reduce_one(self, t: torch.Tensor, cfg, opts):
        if cfg is None:
            return self._forward_all_reduce("allreduce", [t], opts)
        work = coll.all_reduce(t, self._inner_for(t), cfg, op=_op_of(opts), async_op=True,
                               min_bytes=self.policy.min_bytes)
        return self._track(as_work(work, [t], t.device))

    def _forward_all_reduce(self, method: str, tensors, opts):
        n = sum(_nbytes(t) for t in tensors)
        return self._forward("all_reduce", n, ring_bytes("all_reduce", n, self.size()), method, tensors, opts)

    def allreduce_coalesced(self, tensors, opts=None):
        opts = dist.AllreduceCoalescedOptions() if opts is None else opts
        cfgs = [self._decide("all_reduce", t, _nbytes(t), _op_of(opts)) for t in tensors]
        if all(cfg is None for cfg in cfgs):  # nothing to compress: the inner group's own coalesced call
            return self._forward_all_reduce("allreduce_coalesced", tensors, opts)
        one = dist.AllreduceOptions()
        one.reduceOp = opts.reduceOp
        works = [self._all_reduce_one(t, cfg, one) for t, cfg in zip(tensors, cfgs)]
        return all_of(works, list(tensors), tensors[0].device)

    # ------------------------------------------------------------------ reduce_scatter
    def reduce_scatter_single(self, output, input, opts=None):
        opts = dist.ReduceScatterOptions() if opts is None else opts
        inner = self._inner_for(input)
        self._check_pair("reduce_scatter", "input", input, "output", output)
        op = _op_of(opts)
        cfg = self._decide("reduce_scatter", input, _nbytes(input), op)
        if cfg is None:
            n = _nbytes(input)
            method = "reduce_scatter_single" if hasattr(inner, "reduce_scatter_single") else "_reduce_scatter_base"
            return self._forward("reduce_scatter", n, ring_bytes("reduce_scatter", n, self.size()), method, output, input,
                                 opts)
        work = coll.reduce_scatter(output, input, inner, cfg, op=op, async_op=True, min_bytes=self.policy.min_bytes)
        return self._track(as_work(work, [output], output.device))

    _reduce_scatter_base = reduce_scatter_single  # the name torch < 2.13 calls

    def reduce_scatter(self, outputs, input_lists, opts=None):
        opts = dist.ReduceScatterOptions() if opts is None else opts
        op = _op_of(opts)
        if len(outputs) == 1 and len(input_lists) == 1 and len(input_lists[0]) == self.size() and all(
                t.shape == outputs[0].shape and t.dtype == outputs[0].dtype for t in input_lists[0]) and \
                self._decide_peek(outputs[0], _nbytes(outputs[0]) * self.size(), op):
            (out,), inner = outputs, self._inner_for(outputs[0])
            flat = torch.cat([t.reshape(-1) for t in input_lists[0]])
            cfg = self._decide("reduce_scatter", flat, _nbytes(flat), op)
            if cfg is not None:
                work = coll.reduce_scatter(out, flat, inner, cfg, op=op, async_op=True, min_bytes=self.policy.min_bytes)
                return self._track(as_work(work, list(outputs), out.device))
        n = sum(_nbytes(t) for ts in input_lists for t in ts)
        return self._forward("reduce_scatter", n, ring_bytes("reduce_scatter", n, self.size()), "reduce_scatter",
                             outputs, input_lists, opts)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        opts = dist.ReduceScatterOptions() if opts is None else opts
        works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return all_of(works, list(outputs), outputs[0].device)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced  # torch < 2.13

    # ------------------------------------------------------------------ all_gather
    def all_gather_single(self, output, input, opts=None):
        opts = _AllgatherOptions() if opts is None else opts
        inner = self._inner_for(input)
        self._check_pair("all_gather", "output", output, "input", input)
        cfg = self._decide("all_gather", input, _nbytes(output), "sum")
        if cfg is None:
            method = "all_gather_single" if hasattr(inner, "all_gather_single") else "_allgather_base"
            return self._forward("all_gather", _nbytes(input), ring_bytes("all_gather", _nbytes(input), self.size()), method,
                                 output, input, opts)
        work = coll.all_gather(output, input, inner, cfg, async_op=True, min_bytes=self.policy.min_bytes)
        return self._track(as_work(work, [output], output.device))

    _allgather_base = all_gather_single  # the name torch < 2.13 calls

    def allgather(self, output_lists, inputs, opts=None):
        opts = _AllgatherOptions() if opts is None else opts
        if len(inputs) == 1 and len(output_lists) == 1 and len(output_lists[0]) == self.size() and all(
                t.shape == inputs[0].shape and t.dtype == inputs[0].dtype for t in output_lists[0]) and \
                self._decide_peek(inputs[0], _nbytes(inputs[0]) * self.size(), "sum"):
            (inp,), outs = inputs, output_lists[0]
            inner = self._inner_for(inp)
            cfg = self._decide("all_gather", inp, _nbytes(inp) * self.size(), "sum")
            if cfg is not None:  # compressed: the copies into the outputs run at wait(), after the gather
                flat = torch.empty(self.size() * inp.numel(), dtype=inp.dtype, device=inp.device)
                allocated_on = _streams.allocation_stream(flat.device)
                work = coll.all_gather(flat, inp.reshape(-1), inner, cfg, async_op=True, min_bytes=self.policy.min_bytes)

                def copy_out():
                    _streams.used_here(flat, allocated_on)  # read on the waiting stream
                    for o, part in zip(outs, flat.view(self.size(), -1)):
                        o.copy_(part.view(o.shape))

                return self._track(as_work(work, output_lists, inp.device, then=copy_out))
        # forwarded in its own form: inner's Work writes the caller's outputs itself
        n = sum(_nbytes(t) for t in inputs)
        return self._forward("all_gather", n, ring_bytes("all_gather", n, self.size()), "allgather", output_lists, inputs,
                             opts)

    def _decide_peek(self, tensor: torch.Tensor, nbytes: int, op: str | None) -> bool:
        """Whether a list-form call could be compressed (op, dtype, size), before it is counted;
        if not, it is forwarded in its own form."""
        return eligible(self.policy, tensor, nbytes, self.size(), op is not None)

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        opts = _AllgatherOptions() if opts is None else opts
        works = [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return all_of(works, list(outputs), outputs[0].device)

    allgather_into_tensor_coalesced = all_gather_single_coalesced  # torch < 2.13

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        opts = _AllgatherOptions() if opts is None else opts
        n = sum(_nbytes(t) for t in inputs)
        return self._forward("all_gather", n, ring_bytes("all_gather", n, self.size()), "allgather_coalesced",
                             output_lists, inputs, opts)

    # ------------------------------------------------------------------ forwarded unchanged
    def broadcast(self, tensors, opts=None):
        opts = dist.BroadcastOptions() if opts is None else opts
        n = sum(_nbytes(t) for t in tensors)
        return self._forward("broadcast", n, n if self.rank() == opts.rootRank else 0, "broadcast", tensors, opts)

    # ------------------------------------------------------------------ point-to-point
    def _p2p_config(self, tensors, sending: bool):
        """The config of a message, decided alike by sender and receiver from what both know: the
        policy at site "p2p", direction "forward", the dtype and size (never the module or the
        direction, which differ between the two ends). The sender's tensor is observed (a
        receive buffer holds nothing yet)."""
        if len(tensors) != 1:
            return None
        return decide(self.policy, P2P_SITE, "forward", tensors[0], ranks=self.size(), observe=sending)

    def _count_p2p(self, kind: str, t: torch.Tensor, compressed: bool) -> None:
        st = self.stats.setdefault((P2P_SITE, "forward", kind), GroupStats())
        st.calls += 1
        st.compressed += compressed
        st.bytes += _nbytes(t)

    def send(self, tensors, dst, tag=0):
        cfg = self._p2p_config(tensors, sending=True)
        if cfg is None:
            n = sum(_nbytes(t) for t in tensors)
            return self._forward("send", n, n, "send", tensors, dst, tag)
        (t,) = tensors
        inner = self._inner_for(t)
        self._count_p2p("send", t, True)
        wire = p2p.encode(t, cfg)
        _pg.record_send(wire, True)
        return self._track(inner.send([wire], dst, tag))  # the Work keeps `wire` alive until it is sent

    def recv(self, tensors, src, tag=0):
        cfg = self._p2p_config(tensors, sending=False)
        if cfg is None:
            return self._forward("recv", sum(_nbytes(t) for t in tensors), 0, "recv", tensors, src, tag)
        (t,) = tensors
        inner = self._inner_for(t)
        self._count_p2p("recv", t, True)
        wire = p2p.wire_like(t, cfg)
        return self._track(_receive_work(inner.recv([wire], src, tag), wire, t, cfg))

    def recv_anysource(self, tensors, tag=0):
        return self._forward("recv", sum(_nbytes(t) for t in tensors), 0, "recv_anysource", tensors, tag)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        opts = dist.AllToAllOptions() if opts is None else opts
        n = _nbytes(input)
        if input_split_sizes:
            row = n // max(1, input.shape[0]) if input.dim() else n
            sent = sum(s for j, s in enumerate(input_split_sizes) if j != self.rank()) * row
        else:
            sent = ring_bytes("all_to_all", n, self.size())
        inner = self.inner
        method = "all_to_all_single" if hasattr(inner, "all_to_all_single") else "alltoall_base"
        return self._forward("all_to_all", n, sent, method, output, input, output_split_sizes, input_split_sizes, opts)

    alltoall_base = all_to_all_single  # torch < 2.13

    def alltoall(self, outputs, inputs, opts=None):
        opts = dist.AllToAllOptions() if opts is None else opts
        sent = sum(_nbytes(t) for j, t in enumerate(inputs) if j != self.rank())
        return self._forward("all_to_all", sum(_nbytes(t) for t in inputs), sent, "alltoall", outputs, inputs, opts)

    def barrier(self, opts=None):
        opts = dist.BarrierOptions() if opts is None else opts
        return self._forward("barrier", 0, 0, "barrier", opts)

    def monitored_barrier(self, *args, **kwargs):
        return self._forward("barrier", 0, 0, "monitored_barrier", *args, **kwargs)

    def gather(self, outputs, inputs, opts=None):
        opts = dist.GatherOptions() if opts is None else opts
        n = sum(_nbytes(t) for t in inputs)
        return self._forward("gather", n, 0 if self.rank() == opts.rootRank else n, "gather", outputs, inputs, opts)

    def scatter(self, outputs, inputs, opts=None):
        opts = dist.ScatterOptions() if opts is None else opts
        n = sum(_nbytes(t) for ts in inputs for t in ts)
        return self._forward("scatter", n, ring_bytes("scatter", n, self.size()), "scatter",
                             outputs, inputs, opts)

    def reduce(self, tensors, opts=None):
        opts = dist.ReduceOptions() if opts is None else opts
        n = sum(_nbytes(t) for t in tensors)
        return self._forward("reduce", n, n, "reduce", tensors, opts)

    # ------------------------------------------------------------------ coalescing contexts
    def _track(self, work):
        """`work`, also kept for the end of an open coalescing block."""
        if self._coalescing is not None and work is not None:
            self._coalescing.append(work)
        return work

    def _start_coalescing(self, device):
        """`torch.distributed._coalescing_manager` opens a block: torch records the collectives
        inside and hands them to the *_coalesced methods at its end, then takes the block's Work
        from `_end_coalescing`, which therefore covers every Work issued in between."""
        self._coalescing = []

    def _end_coalescing(self, device):
        works, self._coalescing = self._coalescing or [], None
        return all_of(works, None, torch.device(device) if device is not None else torch.device("cpu"))


def _inner_and_policy(options: GroupOptions | None, is_default: bool) -> tuple[object, object]:
    """(inner, policy) of a new group: `options`, else what a compressing default group uses,
    else the default group's backend (or, for the default group itself, the device's)."""
    options = GroupOptions() if options is None else options
    default = None if is_default else dist.distributed_c10d._get_default_group()
    inner, policy = options.inner, options.policy
    if isinstance(default, CompressingProcessGroup):
        inner = inner if inner is not None else (default.inner_backend or dist.get_backend(default.inner))
        policy = policy if policy is not None else default.policy
    elif inner is None:
        if default is not None:
            inner = dist.get_backend(default)
        elif torch.cuda.is_available() and dist.is_nccl_available():
            inner = "cpu:gloo,cuda:nccl"
        else:
            inner = "gloo"
    if policy is None:
        policy = CompressionPolicy()
    return inner, policy


def _make_inner(backend: str, dist_opts, ranks: list[int], is_default: bool):
    """A new group of `backend` over the ranks of the group being made, registered with
    torch.distributed (so every dist.* call takes it). Made inside the backend creator, where
    ``dist.new_group`` cannot run (no default group yet, or a group name counter the ranks outside
    this group would not advance): the name derives from the new group's, its store is the new
    group's, and a tag of its own keeps look-ups by ranks on the compressing group."""
    c10d = dist.distributed_c10d
    name = f"{dist_opts.group_id}:{BACKEND}-inner"
    pg, _ = c10d._new_process_group_helper(
        dist_opts.group_size, dist_opts.group_rank, [] if is_default else ranks, dist.Backend(backend),
        dist_opts.store, name, timeout=dist_opts.timeout, pg_tag=name, group_desc=f"inner group of {BACKEND} group")
    c10d._world.pg_group_ranks[pg] = {g: r for r, g in enumerate(ranks)}
    return pg


def _create(dist_opts, backend_opts):
    """The registered backend's creator, for ``dist.init_process_group("taco")``,
    ``dist.new_group(backend="taco")`` (or under a "taco" default group) and `compressed_group`."""
    if backend_opts is not None and not isinstance(backend_opts, GroupOptions):
        raise TypeError(f"pg_options of a {BACKEND!r} group must be a taco_triton GroupOptions, "
                        f"got {type(backend_opts).__name__}")
    is_default = not dist_opts.global_ranks_in_group  # torch passes [] for the default group
    ranks = list(range(dist_opts.group_size)) if is_default else list(dist_opts.global_ranks_in_group)
    inner, policy = _inner_and_policy(backend_opts, is_default)
    inner_backend = None
    if isinstance(inner, str):
        inner_backend, inner = inner, _make_inner(inner, dist_opts, ranks, is_default)
    elif dist.get_process_group_ranks(inner) != ranks:
        raise ValueError(f"the inner group's ranks {dist.get_process_group_ranks(inner)} are not the new group's {ranks}")
    return CompressingProcessGroup(dist_opts.group_rank, dist_opts.group_size, inner, policy, ranks,
                                   group_name=dist_opts.group_id, inner_backend=inner_backend)


def _register() -> None:
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])


def compressed_group(inner=None, policy=None) -> CompressingProcessGroup:
    """A process group over `inner` that compresses what `policy` selects and forwards the rest.

    Call it on every rank of `inner`, in the same order relative to other group creations (it
    makes a new torch.distributed group over `inner`'s ranks, synchronizing only those ranks).

    Args:
        inner: the process group that carries the bytes (None: the default group, or the inner
            group of a compressing default group). Its backend must serve the tensors' device
            (gloo: CPU, nccl: CUDA). Destroying the compressing group leaves it alone.
        policy: a `taco_triton.CompressionPolicy` (None: a compressing default group's
            policy, else the default: FP8 E4M3 for every site, messages from `policy.min_bytes` =
            1 MiB up). Sites are named by
            `taco_triton.integrations.sites.track_sites`. Tensors travel in their own dtype
            (`comm_dtype` is not used).

    Returns:
        A `CompressingProcessGroup`, usable wherever torch.distributed takes a group.

    Raises:
        RuntimeError: torch.distributed is not initialized.
        TypeError: `inner` is not a process group or is already a compressing group, or `policy`
            lacks config_for/observe/min_bytes.
        ValueError: this rank is not in `inner`, or its ranks are not in increasing order.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("compressed_group needs torch.distributed initialized (dist.init_process_group)")
    if inner is None:
        inner = dist.distributed_c10d._get_default_group()
        if isinstance(inner, CompressingProcessGroup):
            inner = inner.inner
    if not isinstance(inner, dist.ProcessGroup):
        raise TypeError(f"inner must be a torch.distributed ProcessGroup or None, got {type(inner).__name__}")
    options = GroupOptions(inner=inner, policy=policy)
    ranks = dist.get_process_group_ranks(inner)
    if dist.get_rank() not in ranks:
        raise ValueError(f"rank {dist.get_rank()} is not in the inner group (ranks {ranks})")
    if ranks != sorted(ranks):
        raise ValueError(f"the inner group's ranks must be in increasing order (as new_group makes them), got {ranks}")
    return dist.new_group(ranks, backend=BACKEND, pg_options=options, use_local_synchronization=True)


_register()
