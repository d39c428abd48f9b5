"""Route megatron-core's tensor-parallel (TP) communication through taco_triton's collectives,
and its pipeline-parallel (PP) send/recv and data-parallel (DP) gradient reduction too.

Two modes. `enable` (the mappings mode, described below) replaces megatron-core's communication
functions. `enable_groups` (the group mode, at the end of this module) replaces megatron's
process groups in ``parallel_state`` by compressing ones (`taco_triton.compressed_group`) before
the model is built, which also reaches code that talks to the group directly, such as
TransformerEngine's layers; pick it for ``--transformer-impl transformer_engine``.

PP: ``p2p_communication._p2p_ops`` / ``_batched_p2p_ops`` are replaced; each message is decided
by the PP policy at site ``megatron.pp.<direction>.stage<i>_to_stage<j>`` (direction "forward"
for activations, "backward" for activation gradients; i, j pipeline ranks), the sender
compresses it once (`collectives.p2p.encode`), the receiver gets the wire buffer and decodes it
into megatron's tensor when megatron waits on the request (batched: after all of the batch's
requests). DP: in ``distributed.param_and_grad_buffer`` the module
globals ``torch`` (its ``distributed.all_reduce``), ``dist_reduce_scatter_func``,
``dist_all_gather_func`` and ``_coalescing_manager`` are replaced; gradient reductions use the DP
policy at ``megatron.dp.bucket<k>.<collective>`` ("backward"), the parameter all-gather stays
native unless ``compress_param_gather``. See `enable` for per-axis policies and error feedback,
`MegatronHandle.by_axis` for bytes per axis. The TP part follows.

    from taco_triton.integrations import megatron as taco_megatron
    from taco_triton.parallel import CompressionPolicy

    with taco_megatron.enable(CompressionPolicy(exempt=["*.output_layer.*"]), model=gpt):
        loss = gpt(tokens, position_ids, attention_mask, labels=labels)
        loss.mean().backward()

`enable(policy, model=None)` replaces megatron-core's TP communication points (below) so that
every forward all-reduce, backward dgrad all-reduce and sequence-parallel all-gather /
reduce-scatter calls `taco_triton.all_reduce / all_gather / reduce_scatter` with
`policy.config_for(site, direction)`; `None` from the policy, messages below `policy.min_bytes`
and non-float dtypes run the native collective. `handle.disable()` (or leaving the `with`
block) puts back the very objects it replaced. Only one handle may be active at a time.
Every routed tensor that could be compressed is first shown to `policy.observe(site, direction,
tensor)` (the policy keeps samples only while calibrating); call `policy.step()` once per
training step as usual.

Importing this module does not import megatron; `enable` does, and raises ImportError naming
what to install (``pip install 'megatron-core==0.16.1'``, the ``megatron`` extra) when it is missing.

Patch points (megatron-core 0.16.1; `enable` refuses a version that lacks one of them), all in
megatron/core/tensor_parallel/:

- mappings.py ``_reduce``: the all-reduce of reduce_from_tp (forward) and copy_to_tp (backward).
- mappings.py ``_gather_along_first_dim`` / ``_reduce_scatter_along_first_dim``: the SP
  all-gather (gather_from_sp forward; reduce_scatter_to_sp, scatter_to_sp backward) and
  reduce-scatter (reduce_scatter_to_sp forward, gather_from_sp backward; also reached through
  ``_reduce_scatter_along_last_dim``).
- mappings.py ``_gather_along_last_dim``: gather_from_tp / all_gather_last_dim.
- layers.py ``dist_all_gather_func``, ``dist_reduce_scatter_func`` and ``torch`` (see below).
- with `model` only: ``forward`` of each autograd Function named in the site roles below (it
  tags the autograd node with the issuing module's name; nothing else changes).

The autograd Functions of mappings.py look these helpers up as module globals at call time, so
replacing the globals reaches every caller, including modules that imported the public
``*_region`` functions by name. layers.py bypasses them:
``LinearWithGradAccumulationAndAsyncCommunication`` (behind
``linear_with_grad_accumulation_and_async_allreduce``) issues the SP input all-gather (forward,
and again in backward for the weight gradient) through the module global
``dist_all_gather_func``, the SP dgrad reduce-scatter through ``dist_reduce_scatter_func``, and
the non-SP dgrad all-reduce as ``torch.distributed.all_reduce(...)``; ``LinearWithFrozenWeight``
(behind ``linear_with_frozen_weight``) also calls ``torch.distributed.all_reduce``. So in layers
we replace ``dist_all_gather_func``, ``dist_reduce_scatter_func`` and the module global
``torch`` by a shim that forwards every attribute to torch except ``torch.distributed.all_reduce``
(ours; SUM only, other ops go to torch). This keeps megatron's own forward/backward code -
including the overlap of the async dgrad all-reduce with the weight-gradient GEMM - untouched.
``linear_with_frozen_weight``'s SP gather goes through ``gather_from_sequence_parallel_region``
and so through mappings.

Not routed (native, uncounted): all_gather / reduce_scatter with uneven split sizes (these
fall back to megatron's own code), ``_AllToAll`` (MoE; taco has no all_to_all), and
collectives megatron issues with ``torch.distributed`` directly outside layers.py - notably the
three per-token all-reduces of ``vocab_parallel_cross_entropy`` (one is a MAX, which taco does
not offer; all are [sequence, batch] FP32, far below any useful ``min_bytes``).

Site names (what `policy.config_for(site, direction)` and its ``exempt`` patterns see)::

    megatron.[<layer>.]<role>.<collective>      direction: "forward" | "backward"

- <collective>: "all_reduce", "all_gather" or "reduce_scatter".
- <role>: the megatron operation that issues it: "reduce_from_tp", "copy_to_tp",
  "gather_from_tp", "scatter_to_tp", "gather_from_sp", "reduce_scatter_to_sp", "scatter_to_sp",
  "all_gather_last_dim", "reduce_scatter_last_dim" (the mappings.py region functions) or
  "linear" (the linear autograd Functions in layers.py: dgrad all-reduce, SP all-gather and
  reduce-scatter).
- <layer>: only when `model` is passed to `enable`: the qualified name (``named_modules``) of the
  innermost module of `model` whose forward issued the operation (for backward collectives: the
  module whose forward created the autograd node), e.g.
  ``megatron.decoder.layers.0.mlp.linear_fc2.reduce_from_tp.all_reduce`` (forward) or
  ``megatron.decoder.layers.1.self_attention.linear_qkv.linear.all_reduce`` (backward dgrad).
  It is found by walking at most 12 Python frames at each autograd Function's forward, once
  per call.

A GPT step at TP=2 without SP routes 1 + 2L forward all-reduces (word embeddings, then
linear_proj and linear_fc2 of each of the L layers) and 2L + 1 backward dgrad all-reduces
(linear_qkv and linear_fc1 of each layer, output_layer). `handle.stats` counts every routed call.
"""
from __future__ import annotations

import contextlib
import functools
import sys
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..collectives import WireStats, p2p
from ..config import INPUT_DTYPES, CompressionConfig

__all__ = ["AXES", "GRADIENT_CONFIG", "GroupsHandle", "MegatronHandle", "SiteStats", "active_handle", "cpu_compat",
           "enable", "enable_groups", "gradient_policy"]

#: The pip extra that installs the supported megatron-core.
EXTRA = "pip install 'megatron-core==0.16.1' (taco-triton's `megatron` extra: pip install -e '.[megatron]' in a clone)"
#: The megatron-core release these patch points were read from.
TESTED_VERSION = "0.16.1"

_NATIVE = CompressionConfig(enabled=False)
_MAX_CTX_FRAMES = 6
_MAX_MODULE_FRAMES = 12

#: autograd Function (class name) -> <role> in site names.
_ROLES = {
    "_CopyToModelParallelRegion": "copy_to_tp",
    "_ReduceFromModelParallelRegion": "reduce_from_tp",
    "_ScatterToModelParallelRegion": "scatter_to_tp",
    "_GatherFromModelParallelRegion": "gather_from_tp",
    "_ScatterToSequenceParallelRegion": "scatter_to_sp",
    "_GatherFromSequenceParallelRegion": "gather_from_sp",
    "_ReduceScatterToSequenceParallelRegion": "reduce_scatter_to_sp",
    "_AllGatherFromTensorParallelRegion": "all_gather_last_dim",
    "_ReduceScatterToTensorParallelRegion": "reduce_scatter_last_dim",
    "LinearWithGradAccumulationAndAsyncCommunication": "linear",
    "LinearWithFrozenWeight": "linear",
}
_MAPPINGS_GLOBALS = (
    "_reduce", "_gather_along_first_dim", "_reduce_scatter_along_first_dim", "_gather_along_last_dim",
)
_LAYERS_GLOBALS = ("torch", "dist_all_gather_func", "dist_reduce_scatter_func")
_P2P_GLOBALS = ("_p2p_ops", "_batched_p2p_ops")
_DDP_GLOBALS = ("torch", "dist_all_gather_func", "dist_reduce_scatter_func", "_coalescing_manager")

#: The parallel axes a handle routes: tensor (TP collectives), pipeline (stage-boundary
#: send/recv), data (DDP gradient reduction and the distributed optimizer's parameter all-gather).
AXES = ("tp", "pp", "dp")
#: What data-parallel gradients are compressed with by default: INT8 after the block Hadamard
#: transform (which spreads outliers over the group), stochastic rounding so that the reduced
#: gradient is unbiased.
GRADIENT_CONFIG = CompressionConfig(codec="int8", hadamard=True, rounding="stochastic")
_REDUCE_OPS = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg"}

_active: "MegatronHandle | None" = None


@dataclass
class SiteStats:
    """Routed calls of one (site, direction, collective): how many, how many compressed, input bytes,
    wire bytes, and the axis ("tp", "pp" or "dp") the site belongs to."""

    calls: int = 0
    compressed: int = 0
    bytes: int = 0
    #: bytes this rank handed to the process group for these calls (as `WireStats` counts them)
    wire_bytes: float = 0.0
    axis: str = "tp"


def _import_megatron():
    """megatron-core's modules holding the patch points: (mappings, layers, p2p_communication,
    param_and_grad_buffer)."""
    try:
        from megatron.core.distributed import param_and_grad_buffer
        from megatron.core.pipeline_parallel import p2p_communication
        from megatron.core.tensor_parallel import layers, mappings
    except ImportError as e:
        raise ImportError(
            f"taco_triton.integrations.megatron needs megatron-core (tested with {TESTED_VERSION}): {EXTRA}"
            f" ({type(e).__name__}: {e})"
        ) from e
    return mappings, layers, p2p_communication, param_and_grad_buffer


def _megatron_version() -> str:
    try:
        from megatron.core import package_info

        return str(package_info.__version__)
    except Exception:  # noqa: BLE001 - informational only
        return "unknown"


def _in_backward() -> bool:
    fn = getattr(torch._C, "_current_graph_task_id", None)
    return fn is not None and fn() != -1


def _caller(depth: int):
    """(role, direction, ctx) of the megatron code that called our replacement `depth` frames up.

    The nearest frame that is an autograd Function's forward/backward (first argument `ctx`, a
    node whose type knows its Function) names the role and direction; otherwise the calling
    function's name is the role and the autograd engine tells the direction.
    """
    first = f = sys._getframe(depth + 1)
    for _ in range(_MAX_CTX_FRAMES):
        if f is None:
            break
        code = f.f_code
        if code.co_argcount and code.co_varnames[0] == "ctx" and code.co_name in ("forward", "backward"):
            ctx = f.f_locals.get("ctx")
            cls = getattr(type(ctx), "_forward_cls", None)
            if cls is not None:
                direction = "backward" if code.co_name == "backward" else "forward"
                return _ROLES.get(cls.__name__, cls.__name__.strip("_")), direction, ctx
        f = f.f_back
    return first.f_code.co_name.strip("_"), ("backward" if _in_backward() else "forward"), None


class _DistShim:
    """`torch.distributed` as megatron's layers.py sees it: all_reduce is ours, the rest is torch's."""

    def __init__(self, all_reduce: Callable):
        self.all_reduce = all_reduce

    def __getattr__(self, name: str) -> Any:
        return getattr(dist, name)


class _TorchShim:
    """`torch` as megatron's layers.py sees it: only `.distributed` differs (a `_DistShim`), and
    only while `on()` holds; otherwise every attribute is the replaced object's (`orig`)."""

    def __init__(self, distributed: _DistShim, orig: Any = torch, on: Callable[[], bool] = lambda: True):
        self._distributed, self._orig, self._on = distributed, orig, on

    def __getattr__(self, name: str) -> Any:
        if name == "distributed" and self._on():
            return self._distributed
        return getattr(self._orig, name)


def _gated(handle: "MegatronHandle", orig: Any, ours: Any) -> Any:
    """`ours`, which acts only while `handle` is active and is `orig` afterwards: a wrapper that
    captured it after `enable` reaches megatron's original once `disable` ran."""
    if isinstance(ours, staticmethod):
        return staticmethod(_gated(handle, orig.__func__, ours.__func__))
    if isinstance(ours, _TorchShim):
        ours._orig, ours._on = orig, lambda: handle._active
        return ours

    @functools.wraps(ours)
    def gated(*args, **kwargs):
        return (ours if handle._active else orig)(*args, **kwargs)

    return gated


class _CountedWork:
    """A routed async collective's Work: `wait()` also counts the bytes sent while finishing it."""

    def __init__(self, work, st: SiteStats):
        self._work, self._st = work, st

    def wait(self, timeout=None):
        with WireStats() as ws:
            out = self._work.wait()
        self._st.wire_bytes += ws.wire_bytes
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class _WorkList:
    """What our `_coalescing_manager` yields: the async Works issued inside it; `wait()` waits all."""

    def __init__(self):
        self.works: list = []

    def wait(self, timeout=None) -> None:
        for w in self.works:
            w.wait()


class _DecodeAfterAll:
    """A pipeline receive's request: waits for the wire buffers' requests, then decompresses each
    buffer into the tensor megatron allocated (once)."""

    def __init__(self, reqs: list, decodes: list):
        self._reqs, self._decodes = reqs, decodes

    def wait(self, timeout=None) -> bool:
        for r in self._reqs:
            r.wait()
        for wire, tensor, cfg in self._decodes:
            p2p.decode_into(wire, tensor, cfg)
        self._reqs, self._decodes = [], []  # once: a gloo p2p Work waited twice blocks until the timeout
        return True


def gradient_policy(policy=None, *, error_feedback: bool = False):
    """The data-parallel policy `enable` derives when it is not given one.

    `GRADIENT_CONFIG` (INT8, Hadamard, stochastic rounding) as the default of every DP site,
    with `policy`'s other fields meaning what they mean on every axis: `forward` (the parameter
    all-gather, compressed only with `compress_param_gather`) and `backward` (the gradient
    reductions) switch compression per direction, `min_bytes`, `exempt` and `overrides` (site
    patterns such as ``"megatron.dp.*"``) apply as they are, `comm_dtype` is kept (the megatron
    integration communicates in megatron's own dtypes on every axis, see `enable`). Nothing is
    compressed when `policy.default` is None. Calibration fields are not carried: DP gradients
    are not calibrated unless `enable(dp=...)` gets a calibrating policy. With `error_feedback`,
    the default rounds to nearest (the residual this rank carries is then exactly what its
    quantization dropped; see `enable`).
    """
    from ..parallel import CompressionPolicy

    cfg = GRADIENT_CONFIG.replace(rounding="nearest") if error_feedback else GRADIENT_CONFIG
    if policy is None:
        return CompressionPolicy(default=cfg)
    return CompressionPolicy(default=cfg if policy.default is not None else None, min_bytes=policy.min_bytes,
                             exempt=list(getattr(policy, "exempt", ())), forward=getattr(policy, "forward", True),
                             backward=getattr(policy, "backward", True), overrides=dict(getattr(policy, "overrides", {})),
                             comm_dtype=getattr(policy, "comm_dtype", None))


class MegatronHandle:
    """An active routing of megatron-core's TP communication; see the module docstring.

    Attributes:
        policy: the `CompressionPolicy` consulted for every call.
        stats: {(site, direction, collective): SiteStats} of every routed call since enable
            (or `reset_stats`).
        patched: "module.attribute" names replaced while active.
    """

    def __init__(self, policy, model=None, *, pp=None, dp=None, error_feedback: bool = False,
                 compress_param_gather: bool = False):
        self.policy = policy
        self.policies = {"tp": policy, "pp": pp if pp is not None else policy, "dp": dp}
        self.error_feedback = error_feedback
        self.compress_param_gather = compress_param_gather
        self.residuals: dict[tuple[int, int], torch.Tensor] = {}  # DP error feedback, per bucket buffer
        self._batches: list[_WorkList] = []
        self.stats: dict[tuple[str, str, str], SiteStats] = {}
        self.patched: list[str] = []
        self._saved: list[tuple[Any, str, Any, Any]] = []
        self._names: dict[int, tuple[weakref.ref, str]] = {}
        if model is not None:
            for name, mod in model.named_modules():
                if name:
                    self._names[id(mod)] = (weakref.ref(mod), name)
        self._active = False

    # ------------------------------------------------------------------ lifecycle
    @property
    def active(self) -> bool:
        return self._active

    def disable(self) -> None:
        """Restore every replaced object (the same objects); a second call does nothing. An
        attribute another patch replaced after `enable` keeps that patch, and our replacement it
        may have captured falls through to megatron's original from now on."""
        global _active
        if not self._active:
            return
        for obj, attr, orig, ours in reversed(self._saved):
            current = obj.__dict__.get(attr) if isinstance(obj, type) else getattr(obj, attr, None)
            if current is ours:  # a patch applied on top of ours since enable() stays
                setattr(obj, attr, orig)
        self._saved.clear()
        self._active = False
        if _active is self:
            _active = None

    def __enter__(self) -> "MegatronHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.disable()

    def reset_stats(self) -> None:
        self.stats = {}

    def by_axis(self) -> dict[str, SiteStats]:
        """`stats` summed per axis ("tp", "pp", "dp"; every axis present, zeros where unused)."""
        out = {a: SiteStats(axis=a) for a in AXES}
        for st in self.stats.values():
            o = out[st.axis]
            o.calls += st.calls
            o.compressed += st.compressed
            o.bytes += st.bytes
            o.wire_bytes += st.wire_bytes
        return out

    def __repr__(self) -> str:
        calls = sum(s.calls for s in self.stats.values())
        return f"MegatronHandle(active={self._active}, sites={len(self.stats)}, calls={calls})"

    # ------------------------------------------------------------------ naming
    def _module_name(self) -> str | None:
        """Qualified name of the innermost module of `model` on the Python stack (or None)."""
        if not self._names:
            return None
        f = sys._getframe(2)
        for _ in range(_MAX_MODULE_FRAMES):
            if f is None:
                return None
            code = f.f_code
            if code.co_argcount and code.co_varnames[0] == "self":
                obj = f.f_locals.get("self")
                hit = self._names.get(id(obj))
                if hit is not None and hit[0]() is obj:
                    return hit[1]
            f = f.f_back
        return None

    def _tagging_forward(self, fn: Callable) -> Callable:
        def forward(ctx, *args, **kwargs):
            ctx._taco_layer = self._module_name()
            return fn(ctx, *args, **kwargs)

        forward.__wrapped__ = fn
        forward.__name__ = getattr(fn, "__name__", "forward")
        forward.__qualname__ = getattr(fn, "__qualname__", "forward")
        return forward

    # ------------------------------------------------------------------ routing
    def _decide(self, axis, site, direction, kind, tensor, world, native=False) -> tuple[CompressionConfig | None, SiteStats]:
        """The policy's config for one message (None: native), after counting and observing it."""
        policy = self.policies[axis]
        nbytes = tensor.numel() * tensor.element_size()
        eligible = tensor.dtype in INPUT_DTYPES and nbytes >= policy.min_bytes
        if eligible and kind != "recv":  # a receive buffer holds nothing yet
            policy.observe(site, direction, tensor)
        cfg = policy.config_for(site, direction)
        st = self.stats.get((site, direction, kind))
        if st is None:
            st = self.stats[(site, direction, kind)] = SiteStats(axis=axis)
        st.calls += 1
        st.bytes += nbytes
        compress = eligible and cfg is not None and world > 1 and not native
        st.compressed += compress
        return (cfg if compress else None), st

    def _route(self, axis, site, direction, kind, tensor, group, issue, native=False):
        """Decide, then `issue(config, min_bytes)` one collective, counting the bytes it sends."""
        cfg, st = self._decide(axis, site, direction, kind, tensor, dist.get_world_size(group), native)
        with WireStats() as ws:
            work = issue(cfg if cfg is not None else _NATIVE, self.policies[axis].min_bytes)
        st.wire_bytes += ws.wire_bytes
        return None if work is None else _CountedWork(work, st)

    def _tp_site(self, kind: str, caller) -> tuple[str, str]:
        role, direction, ctx = caller
        layer = getattr(ctx, "_taco_layer", None) if ctx is not None else None
        return (f"megatron.{layer}.{role}.{kind}" if layer else f"megatron.{role}.{kind}"), direction

    def _all_reduce(self, tensor, group, async_op, caller):
        from ..collectives import compressed as coll

        site, direction = self._tp_site("all_reduce", caller)
        return self._route("tp", site, direction, "all_reduce", tensor, group, lambda cfg, mb: coll.all_reduce(
            tensor, group, cfg, async_op=async_op, min_bytes=mb))

    def _all_gather(self, output, input_, group, async_op, caller):
        from ..collectives import compressed as coll

        site, direction = self._tp_site("all_gather", caller)
        return self._route("tp", site, direction, "all_gather", input_, group, lambda cfg, mb: coll.all_gather(
            output, input_, group, cfg, async_op=async_op, min_bytes=mb))

    def _reduce_scatter(self, output, input_, group, async_op, caller):
        from ..collectives import compressed as coll

        site, direction = self._tp_site("reduce_scatter", caller)
        return self._route("tp", site, direction, "reduce_scatter", input_, group, lambda cfg, mb: coll.reduce_scatter(
            output, input_, group, cfg, async_op=async_op, min_bytes=mb))

    # ------------------------------------------------------------------ pipeline parallel
    def _p2p(self, orig, tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next, group,
             prev_pipeline_rank, next_pipeline_rank):
        """megatron's p2p helper (`orig`) on wire buffers: sends compressed once, receives decoded
        into megatron's tensors when the returned requests are waited on."""
        me, n = group.rank(), group.size()
        prev, nxt = (me - 1) % n, (me + 1) % n

        def send(t, direction, dst):
            if t is None:
                return None
            cfg, st = self._decide("pp", f"megatron.pp.{direction}.stage{me}_to_stage{dst}", direction, "send", t, n)
            wire = p2p.encode(t, cfg) if cfg is not None else t
            with WireStats() as ws:
                p2p.record_send(wire, cfg is not None)
            st.wire_bytes += ws.wire_bytes
            return wire

        decodes = {}

        def recv(t, direction, src, key):
            if t is None:
                return None
            cfg, _ = self._decide("pp", f"megatron.pp.{direction}.stage{src}_to_stage{me}", direction, "recv", t, n)
            if cfg is None:
                return t
            wire = p2p.wire_like(t, cfg)
            decodes[key] = (wire, t, cfg)
            return wire

        reqs = orig(tensor_send_prev=send(tensor_send_prev, "backward", prev),
                    tensor_recv_prev=recv(tensor_recv_prev, "forward", prev, "recv_prev"),
                    tensor_send_next=send(tensor_send_next, "forward", nxt),
                    tensor_recv_next=recv(tensor_recv_next, "backward", nxt, "recv_next"),
                    group=group, prev_pipeline_rank=prev_pipeline_rank, next_pipeline_rank=next_pipeline_rank)
        if isinstance(reqs, dict):  # _p2p_ops: one request per message, maybe waited later (overlapped p2p)
            return {k: _DecodeAfterAll([r], [decodes[k]]) if k in decodes else r for k, r in reqs.items()}
        # _batched_p2p_ops: megatron waits every request of the list, so ours is one request that
        # waits the batch's (one per message on gloo, maybe one in all on NCCL) and then decodes.
        # Never hand megatron a request it would wait twice: a second wait of a gloo p2p Work
        # blocks until the process-group timeout.
        return [_DecodeAfterAll(list(reqs), list(decodes.values()))] if decodes else reqs

    # ------------------------------------------------------------------ data parallel
    def _dp(self, kind, tensor, output, op, group, async_op, frame):
        """One DDP collective (bucket gradient all-reduce / reduce-scatter, or parameter all-gather)."""
        from ..collectives import compressed as coll

        bucket = frame.f_locals.get("bucket")
        where = f"bucket{bucket.bucket_id}" if hasattr(bucket, "bucket_id") else frame.f_code.co_name.strip("_")
        direction = "forward" if kind == "all_gather" else "backward"
        site = f"megatron.dp.{where}.{kind}"
        native = kind == "all_gather" and not self.compress_param_gather  # parameters stay exact by default

        def issue(cfg, mb):
            if self.error_feedback and cfg.enabled and kind != "all_gather":
                self._feed_back_error(tensor, cfg, dist.get_world_size(group) if kind == "reduce_scatter" else 1, site)
            if kind == "all_reduce":
                return coll.all_reduce(tensor, group, cfg, op, async_op=async_op, min_bytes=mb)
            if kind == "reduce_scatter":
                return coll.reduce_scatter(output, tensor, group, cfg, op, async_op=async_op, min_bytes=mb)
            return coll.all_gather(output, tensor, group, cfg, async_op=async_op, min_bytes=mb)

        work = self._route("dp", site, direction, kind, tensor, group, issue, native=native)
        if async_op and work is not None and self._batches:
            self._batches[-1].works.append(work)
        return work

    def _feed_back_error(self, tensor, cfg, chunks, site) -> None:
        """Error feedback: add this bucket's residual to its gradient, and keep as the new residual
        what quantizing the result loses (the compressed collective's first quantization, computed
        here the same way: nearest rounding is deterministic; per slice for reduce_scatter)."""
        from .. import codec

        if cfg.stochastic:
            raise ValueError(
                f"error feedback needs rounding='nearest' (the residual must be exactly what this rank's "
                f"quantization drops), but {site} got {cfg}"
            )
        if not tensor.is_contiguous():
            raise ValueError(f"error feedback needs a contiguous gradient buffer at {site}, got strides {tensor.stride()}")
        flat = tensor.view(-1)
        key = (flat.data_ptr(), flat.numel())
        res = self.residuals.get(key)
        if res is None:
            res = self.residuals[key] = torch.zeros(flat.numel(), dtype=torch.float32, device=flat.device)
        y = flat.float() + res
        flat.copy_(y)
        sent = torch.cat([codec.decompress(codec.compress(part, cfg)).float().view(-1)
                          for part in flat.chunk(chunks)])
        res.copy_(y - sent)

    # ------------------------------------------------------------------ replacements
    def _replacements(self, mappings, layers, p2p_communication, param_and_grad_buffer) -> list[tuple[Any, str, Any]]:
        h = self
        orig_gather_first = mappings._gather_along_first_dim
        orig_rs_first = mappings._reduce_scatter_along_first_dim

        def _reduce(input_, group):
            """taco_triton replacement of megatron's mappings._reduce (all-reduce)."""
            assert group is not None, "group should not be None"
            if group.size() == 1:
                return input_
            h._all_reduce(input_, group, False, _caller(1))
            return input_

        def _gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
            """taco_triton replacement of megatron's mappings._gather_along_first_dim."""
            assert group is not None, "group should not be None"
            world_size = group.size()
            if world_size == 1 or output_split_sizes is not None:
                return orig_gather_first(input_, group, output_split_sizes, use_global_buffer)
            dim_size = list(input_.size())
            dim_size[0] *= world_size
            if use_global_buffer:
                output = mappings.get_global_memory_buffer().get_tensor(dim_size, input_.dtype, "mpu")
            else:
                output = torch.empty(dim_size, dtype=input_.dtype, device=input_.device)
            h._all_gather(output, input_, group, False, _caller(1))
            return output

        def _reduce_scatter_along_first_dim(input_, group, input_split_sizes=None, use_global_buffer=False):
            """taco_triton replacement of megatron's mappings._reduce_scatter_along_first_dim."""
            assert group is not None, "group should not be None"
            world_size = group.size()
            if world_size == 1 or input_split_sizes is not None:
                return orig_rs_first(input_, group, input_split_sizes, use_global_buffer)
            dim_size = list(input_.size())
            assert dim_size[0] % world_size == 0, (
                "First dimension of the tensor should be divisible by tensor parallel size"
            )
            dim_size[0] //= world_size
            if use_global_buffer:
                output = mappings.get_global_memory_buffer().get_tensor(dim_size, input_.dtype, "mpu")
            else:
                output = torch.empty(dim_size, dtype=input_.dtype, device=input_.device)
            h._reduce_scatter(output, input_, group, False, _caller(1))
            return output

        def _gather_along_last_dim(input_, group):
            """taco_triton replacement of megatron's mappings._gather_along_last_dim."""
            world_size = group.size()
            if world_size == 1:
                return input_
            dim_size = list(input_.size())
            dim_size[0] *= world_size
            output = torch.empty(dim_size, dtype=input_.dtype, device=input_.device)
            h._all_gather(output, input_, group, False, _caller(1))
            return torch.cat(output.chunk(world_size, dim=0), dim=-1).contiguous()

        def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
            """taco_triton replacement of torch.distributed.all_reduce inside megatron's layers.py."""
            if op != dist.ReduceOp.SUM:
                return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
            return h._all_reduce(tensor, group, async_op, _caller(1))

        def dist_all_gather_func(output, input, group=None, async_op=False):
            """taco_triton replacement of layers.dist_all_gather_func (SP all-gather)."""
            return h._all_gather(output, input, group, async_op, _caller(1))

        def dist_reduce_scatter_func(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
            """taco_triton replacement of layers.dist_reduce_scatter_func (SP reduce-scatter)."""
            if op != dist.ReduceOp.SUM:
                return layers_orig_rs(output, input, op=op, group=group, async_op=async_op)
            return h._reduce_scatter(output, input, group, async_op, _caller(1))

        layers_orig_rs = layers.dist_reduce_scatter_func
        reps = [
            (mappings, "_reduce", _reduce),
            (mappings, "_gather_along_first_dim", _gather_along_first_dim),
            (mappings, "_reduce_scatter_along_first_dim", _reduce_scatter_along_first_dim),
            (mappings, "_gather_along_last_dim", _gather_along_last_dim),
            (layers, "torch", _TorchShim(_DistShim(all_reduce))),
            (layers, "dist_all_gather_func", dist_all_gather_func),
            (layers, "dist_reduce_scatter_func", dist_reduce_scatter_func),
        ]
        reps += self._pp_dp_replacements(p2p_communication, param_and_grad_buffer)
        if self._names:  # layer names: tag each autograd node with the module that created it
            for mod in (mappings, layers):
                for cls_name in _ROLES:
                    cls = getattr(mod, cls_name, None)
                    if cls is not None and "forward" in cls.__dict__:
                        fn = cls.__dict__["forward"]
                        reps.append((cls, "forward", staticmethod(self._tagging_forward(fn.__func__))))
        return reps


    def _pp_dp_replacements(self, p2pc, pgb) -> list[tuple[Any, str, Any]]:
        h = self
        orig_p2p, orig_batched = p2pc._p2p_ops, p2pc._batched_p2p_ops
        orig_rs = pgb.dist_reduce_scatter_func

        def _p2p_ops(*, tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next, group,
                     prev_pipeline_rank, next_pipeline_rank):
            """taco_triton replacement of megatron's p2p_communication._p2p_ops."""
            return h._p2p(orig_p2p, tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next, group,
                          prev_pipeline_rank, next_pipeline_rank)

        def _batched_p2p_ops(*, tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next, group,
                             prev_pipeline_rank, next_pipeline_rank):
            """taco_triton replacement of megatron's p2p_communication._batched_p2p_ops (megatron's
            own batch_isend_irecv, on the wire buffers)."""
            return h._p2p(orig_batched, tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next,
                          group, prev_pipeline_rank, next_pipeline_rank)

        def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
            """taco_triton replacement of torch.distributed.all_reduce inside param_and_grad_buffer.py."""
            if op not in _REDUCE_OPS:
                return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
            return h._dp("all_reduce", tensor, None, _REDUCE_OPS[op], group, async_op, sys._getframe(1))

        def dist_reduce_scatter_func(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
            """taco_triton replacement of param_and_grad_buffer.dist_reduce_scatter_func."""
            if op not in _REDUCE_OPS:
                return orig_rs(output, input, op=op, group=group, async_op=async_op)
            return h._dp("reduce_scatter", input, output, _REDUCE_OPS[op], group, async_op, sys._getframe(1))

        def dist_all_gather_func(output, input, group=None, async_op=False):
            """taco_triton replacement of param_and_grad_buffer.dist_all_gather_func."""
            return h._dp("all_gather", input, output, "sum", group, async_op, sys._getframe(1))

        @contextlib.contextmanager
        def _coalescing_manager(group=None, device=None, async_ops=False):
            """Our collectives are issued one by one; the handle megatron keeps waits for all of them."""
            batch = _WorkList()
            h._batches.append(batch)
            try:
                yield batch
            finally:
                h._batches.remove(batch)

        return [
            (p2pc, "_p2p_ops", _p2p_ops),
            (p2pc, "_batched_p2p_ops", _batched_p2p_ops),
            (pgb, "torch", _TorchShim(_DistShim(all_reduce))),
            (pgb, "dist_reduce_scatter_func", dist_reduce_scatter_func),
            (pgb, "dist_all_gather_func", dist_all_gather_func),
            (pgb, "_coalescing_manager", _coalescing_manager),
        ]


def enable(policy=None, model=None, *, tp=None, pp=None, dp=None, error_feedback: bool = False,
           compress_param_gather: bool = False) -> MegatronHandle:
    """Route megatron-core's TP, PP and DP communication through taco_triton.

    Args:
        policy: a `taco_triton.parallel.CompressionPolicy` (anything with `config_for(site,
            direction)`, `observe(site, direction, tensor)` and `min_bytes`) for TP collectives
            and pipeline send/recv; DP gradients get `gradient_policy(policy)` (INT8, Hadamard,
            stochastic rounding; the policy's `forward`, `backward`, `exempt`, `overrides` and
            `min_bytes` apply) unless `dp` is given. On every axis "forward" is what flows
            forward (TP activations, PP activations, the DP parameter all-gather) and
            "backward" the gradients (TP dgrads, PP activation gradients, DP gradient
            reductions): `backward=False` compresses forward communication only. The policy's
            `comm_dtype` is not applied on any axis: megatron communicates in its own dtypes
            (its ``bf16``/``fp16`` and ``grad_reduce_in_fp32`` settings).
        model: optional; when given, TP site names carry the qualified name of the issuing module
            (see the module docstring).
        tp: the TP axis's policy, replacing what `policy` would give it. An axis that gets no
            policy at all is routed natively (counted, never compressed).
        pp: the PP axis's policy, likewise.
        dp: the DP axis's policy, likewise (instead of `gradient_policy(policy)`).
        error_feedback: DP only: carry each gradient bucket's quantization residual to the next
            step (the derived DP policy then rounds to nearest; a DP config with stochastic
            rounding raises ValueError at the first compressed reduction).
        compress_param_gather: also compress the distributed optimizer's parameter all-gather
            with the DP policy's "forward" config (default: exact; compressed, every rank's model
            weights carry that codec's error in every forward, while the optimizer's FP32 shard
            stays exact).

    Returns a `MegatronHandle`; `handle.disable()` or `with enable(...):` undoes it.

    Raises:
        TypeError: a policy argument is not a policy, or none is given.
        RuntimeError: already enabled (call the active handle's `disable()` first), the group
            mode (`enable_groups`) is active, or this megatron-core lacks a patch point.
        ImportError: megatron-core is not installed (names the extra to install).
    """
    global _active
    if policy is None and tp is None and pp is None and dp is None:
        raise TypeError("enable needs a policy: enable(policy) or per-axis enable(tp=..., pp=..., dp=...)")
    for name, pol in (("policy", policy), ("tp", tp), ("pp", pp), ("dp", dp)):
        for attr in ("config_for", "observe", "min_bytes"):
            if pol is not None and not hasattr(pol, attr):
                raise TypeError(
                    f"{name} must be a CompressionPolicy (missing {attr!r}), got {type(pol).__name__}"
                )
    if _active is not None:
        raise RuntimeError(
            f"taco_triton.integrations.megatron is already enabled ({_active!r}); call its disable() first"
        )
    if _active_groups is not None:
        raise RuntimeError("the group mode (enable_groups) is active: use one mode at a time; call its disable() first")
    modules = _import_megatron()
    missing = [f"{mod.__name__.rsplit('.', 1)[-1]}.{n}" for mod, names in
               zip(modules, (_MAPPINGS_GLOBALS, _LAYERS_GLOBALS, _P2P_GLOBALS, _DDP_GLOBALS))
               for n in names if not hasattr(mod, n)]
    if missing:
        raise RuntimeError(
            f"megatron-core {_megatron_version()} lacks {missing}; taco_triton's integration was written "
            f"against megatron-core {TESTED_VERSION} ({EXTRA})"
        )
    from ..parallel import CompressionPolicy

    native = CompressionPolicy(default=None)
    tp = tp if tp is not None else policy if policy is not None else native
    pp = pp if pp is not None else policy if policy is not None else native
    if dp is None:
        dp = gradient_policy(policy, error_feedback=error_feedback) if policy is not None else native
    handle = MegatronHandle(tp, model, pp=pp, dp=dp, error_feedback=error_feedback,
                            compress_param_gather=compress_param_gather)
    handle._active = True
    try:
        for obj, attr, new in handle._replacements(*modules):
            orig = obj.__dict__[attr] if isinstance(obj, type) else getattr(obj, attr)
            new = _gated(handle, orig, new)
            handle._saved.append((obj, attr, orig, new))
            setattr(obj, attr, new)
            owner = obj.__name__ if isinstance(obj, type) else obj.__name__.rsplit(".", 1)[-1]
            handle.patched.append(f"{owner}.{attr}")
    except BaseException:
        handle.disable()  # put back whatever was already replaced
        raise
    _active = handle
    return handle


def active_handle() -> MegatronHandle | None:
    """The handle currently enabled, or None."""
    return _active


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


def _no_op(*args, **kwargs) -> None:
    return None


class _CpuDeviceTorch:
    """`torch` as megatron's pipeline schedules see it in `cpu_compat`: tensors they create with
    ``device="cuda"`` (token counters) land on the CPU; everything else is torch's."""

    _FACTORIES = frozenset({"zeros", "ones", "empty", "full", "tensor"})

    def __getattr__(self, name: str) -> Any:
        fn = getattr(torch, name)
        if name not in self._FACTORIES:
            return fn

        def on_cpu(*args, **kwargs):
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            return fn(*args, **kwargs)

        return on_cpu


@contextlib.contextmanager
def cpu_compat():
    """Let megatron-core run on a CPU-only torch build (gloo process groups): tests, CPU examples.

    megatron-core allocates buffers with ``device=torch.cuda.current_device()``, which raises on a
    CPU-only build. Inside this context ``torch.cuda.current_device`` returns
    ``torch.device("cpu")`` and ``torch.cuda.synchronize`` does nothing (the pipeline's p2p code
    calls it), and megatron's pipeline schedules (``pipeline_parallel/schedules.py``, which
    create tensors with ``device="cuda"``) see a ``torch`` that puts those on the CPU. On exit
    the originals are put back. When CUDA is available it changes nothing.

    The other things megatron-core needs on CPU are arguments, not patches:
    ``TransformerConfig(use_cpu_initialization=True, gradient_accumulation_fusion=False, ...)``;
    ``model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)`` (the default tracker
    saves CUDA RNG states); an explicit ``attention_mask`` for GPTModel (the default causal mask
    is built with ``device="cuda"``); and no sequence parallelism in models with megatron's
    torch LayerNorm wrapper ("sequence parallel not supported by torch LayerNorm"). Set
    ``CUDA_DEVICE_MAX_CONNECTIONS=1`` to silence megatron's overlap warning.
    """
    if torch.cuda.is_available():
        yield
        return
    saved = [(torch.cuda, "current_device", _cpu_current_device), (torch.cuda, "synchronize", _no_op)]
    try:
        from megatron.core.pipeline_parallel import schedules

        saved.append((schedules, "torch", _CpuDeviceTorch()))
    except ImportError:  # without megatron-core there is nothing else to adapt
        pass
    saved = [(obj, attr, getattr(obj, attr), new) for obj, attr, new in saved]
    for obj, attr, _, new in saved:
        setattr(obj, attr, new)
    try:
        yield
    finally:
        for obj, attr, orig, _ in reversed(saved):
            setattr(obj, attr, orig)


# ---------------------------------------------------------------------------------------- group mode
#: parallel_state globals each axis of the group mode replaces (objects that are the same group,
#: e.g. the data-parallel group with and without context parallelism at CP = 1, get one
#: compressing group).
GROUP_GLOBALS = {
    "tp": ("_TENSOR_MODEL_PARALLEL_GROUP",),
    # megatron's DDP reduces gradients over the intra-partial group (the same object as the one
    # with CP when there is one distributed-optimizer instance)
    "dp": ("_DATA_PARALLEL_GROUP", "_DATA_PARALLEL_GROUP_WITH_CP", "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP",
           "_DATA_PARALLEL_GROUP_WITH_CP_AG"),
    "pp": ("_PIPELINE_MODEL_PARALLEL_GROUP",),
}

_active_groups: GroupsHandle | None = None


class GroupsHandle:
    """What `enable_groups` did: `groups` ({axis: compressing group}), `disable()` to restore the
    original groups in megatron's ``parallel_state``, `track(model)` to name sites after modules."""

    def __init__(self, parallel_state, policies: dict):
        self._ps = parallel_state
        self.policies = policies
        #: {axis: the CompressingProcessGroup that replaced the axis's first group in GROUP_GLOBALS}
        self.groups: dict = {}
        #: {parallel_state global name: the CompressingProcessGroup now there}
        self.replaced: dict = {}
        self._saved: list[tuple[str, Any, Any]] = []
        self._trackers: list = []
        self._active = False

    @property
    def active(self) -> bool:
        return self._active

    def track(self, model: torch.nn.Module, **kwargs):
        """`taco_triton.integrations.sites.track_sites(model)`, removed again by `disable()`;
        the policies' patterns are checked against the model's sites (unmatched ones warn)."""
        from .sites import track_sites

        tracker = track_sites(model, policies=list(self.policies.values()), **kwargs)
        self._trackers.append(tracker)
        return tracker

    def disable(self) -> None:
        """Put megatron's original groups back (a second call does nothing). Models built while
        enabled keep the compressing groups they captured; build new ones after disabling."""
        global _active_groups
        if not self._active:
            return
        for name, orig, ours in reversed(self._saved):
            if getattr(self._ps, name, None) is ours:
                setattr(self._ps, name, orig)
        for tracker in self._trackers:
            tracker.remove()
        self._saved.clear()
        self._trackers.clear()
        self._active = False
        if _active_groups is self:
            _active_groups = None

    def __enter__(self) -> GroupsHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.disable()

    def __repr__(self) -> str:
        return f"GroupsHandle(active={self._active}, axes={sorted(self.groups)})"


def enable_groups(policy=None, *, tp=None, dp=None, pp=None) -> GroupsHandle:
    """Group mode: replace megatron's process groups by compressing ones (`compressed_group`).

    Call it after ``parallel_state.initialize_model_parallel`` and before building the model:
    megatron's layers, TransformerEngine's layers, megatron's DDP and its pipeline p2p code take
    their groups from ``parallel_state`` when they are built, and then send every collective
    through the compressing group, which compresses what the policy selects and forwards the
    rest unchanged. Unlike `enable` (the mappings mode, which replaces megatron-core's
    communication functions), this reaches code that talks to the group directly - notably
    TransformerEngine (``--transformer-impl transformer_engine``). Sites are named by module
    (`GroupsHandle.track`), not by megatron role.

    Args:
        policy: the tensor-parallel policy (a `CompressionPolicy`); None with `tp` None: the default.
        tp: the TP policy, overriding `policy`.
        dp: None leaves the data-parallel group alone; True uses `gradient_policy(policy)`
            (INT8, Hadamard, stochastic rounding); or a policy.
        pp: None leaves the pipeline group alone; True uses the TP policy; or a policy.
            Point-to-point messages are decided at site "p2p" (see `compressed_group`).

    Returns a `GroupsHandle`; `disable()` (or leaving a ``with`` block) restores the groups.

    Raises:
        RuntimeError: megatron's model parallelism is not initialized, a group mode is already
            enabled, or the mappings mode (`enable`) is active (use one mode at a time).
        TypeError: a policy lacks config_for/observe/min_bytes.
        ImportError: megatron-core is not installed (names the extra to install).
    """
    global _active_groups
    try:
        from megatron.core import parallel_state as ps
    except ImportError as e:
        raise ImportError(f"taco_triton.integrations.megatron needs megatron-core (tested with {TESTED_VERSION}): "
                          f"{EXTRA} ({type(e).__name__}: {e})") from e
    from ..parallel import CompressionPolicy
    from .process_group import compressed_group

    if _active_groups is not None:
        raise RuntimeError(f"the megatron group mode is already enabled ({_active_groups!r}); call its disable() first")
    if _active is not None:
        raise RuntimeError("the mappings mode (enable) is active: use one mode at a time; call its disable() first")
    if not ps.model_parallel_is_initialized():
        raise RuntimeError("enable_groups needs megatron's model parallelism initialized "
                           "(parallel_state.initialize_model_parallel) and must run before the model is built")
    tp = tp if tp is not None else policy if policy is not None else CompressionPolicy()
    policies = {"tp": tp}
    if dp is not None:
        policies["dp"] = gradient_policy(policy) if dp is True else dp
    if pp is not None:
        policies["pp"] = tp if pp is True else pp
    for axis, pol in policies.items():
        missing = [a for a in ("config_for", "observe", "min_bytes") if not hasattr(pol, a)]
        if missing:
            raise TypeError(f"the {axis} policy must be a CompressionPolicy (missing {missing}), got {type(pol).__name__}")
    handle = GroupsHandle(ps, policies)
    try:
        for axis, pol in policies.items():
            made: dict[int, Any] = {}
            for name in GROUP_GLOBALS[axis]:
                orig = getattr(ps, name, None)
                if orig is None:
                    continue
                if id(orig) not in made:
                    made[id(orig)] = compressed_group(orig, pol)
                ours = made[id(orig)]
                handle._saved.append((name, orig, ours))
                handle.replaced[name] = ours
                setattr(ps, name, ours)
                handle.groups.setdefault(axis, ours)
    except BaseException:
        handle._active = True
        handle.disable()
        raise
    handle._active = True
    _active_groups = handle
    return handle
