"""The mappings mode: `enable` replaces megatron-core's communication functions (the patch points
in `patching`) by ones that route through taco_triton; `MegatronHandle` decides and counts every
routed message and undoes the patching.

`enable(policy, model=None)` makes every TP forward all-reduce, backward dgrad all-reduce and
sequence-parallel all-gather / reduce-scatter call `taco_triton.all_reduce / all_gather /
reduce_scatter` with `policy.config_for(site, direction)`; `None` from the policy, messages
below `policy.min_bytes` and non-float dtypes run the native collective. Every routed tensor
that could be compressed is first shown to `policy.observe(site, direction, tensor)` (the policy
keeps samples only while calibrating); call `policy.step()` once per training step as usual.
`handle.disable()` (or leaving the `with` block) puts back the very objects it replaced. Only one
handle may be active at a time.

A GPT step at TP=2 without SP routes 1 + 2L forward all-reduces (word embeddings, then
linear_proj and linear_fc2 of each of the L layers) and 2L + 1 backward dgrad all-reduces
(linear_qkv and linear_fc1 of each layer, output_layer). `handle.stats` counts every routed call.
"""
from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist

from ...collectives import WireStats
from ...collectives.work import Counted, WaitAll
from ...config import CompressionConfig
from ...policy import CompressionPolicy, decide
from ..weight_deltas import WeightDeltas
from . import patching
from .common import ACTIVE, AXES, EXTRA, NATIVE, TESTED_VERSION, SiteStats, import_megatron, megatron_version
from .dp import gradient_policy


class MegatronHandle:
    """An active routing of megatron-core's TP, PP and DP communication (see `enable`).

    Attributes:
        policy: the `CompressionPolicy` consulted for every TP call.
        policies: {axis: the policy of that axis} ("tp", "pp", "dp").
        stats: {(site, direction, collective): SiteStats} of every routed call since enable
            (or `reset_stats`).
        patched: "module.attribute" names replaced while active.

    Args:
        policy: the TP policy (see `enable`).
        model: the model whose module paths name the sites (None: megatron's own names).
        pp: the PP policy (None: `policy`).
        dp: the DP policy (None: DP communication is not routed).
        error_feedback: carry each DP bucket's quantization residual into the next step.
        compress_param_gather: compress the distributed optimizer's parameter all-gather.
        weight_deltas: a `WeightDeltas` (the parameter all-gather as quantized weight
            differences), or None.
        two_level: a `TwoLevel` reducing the DP gradients, or None.
    """

    def __init__(self, policy, model=None, *, pp=None, dp=None, error_feedback: bool = False,
                 compress_param_gather: bool = False, weight_deltas=None, two_level=None):
        self.policy = policy
        self.policies = {"tp": policy, "pp": pp if pp is not None else policy, "dp": dp}
        self.error_feedback = error_feedback
        self.compress_param_gather = compress_param_gather
        self.weight_deltas = weight_deltas
        self.two_level = two_level
        self.residuals: dict[tuple[int, int], torch.Tensor] = {}  # DP error feedback, per bucket buffer
        self._batches: list[WaitAll] = []  # the open coalescing blocks' Works (DP)
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
        """True until `disable()`."""
        return self._active

    def disable(self) -> None:
        """Restore every replaced object (the same objects); a second call does nothing. An
        attribute another patch replaced after `enable` keeps that patch, and our replacement it
        may have captured falls through to megatron's original from now on."""
        if not self._active:
            return
        patching.restore(self._saved)
        self._active = False
        if ACTIVE.mappings is self:
            ACTIVE.mappings = None

    def __enter__(self) -> "MegatronHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.disable()

    def reset_stats(self) -> None:
        """Start `stats` afresh."""
        self.stats = {}

    def by_axis(self) -> dict[str, SiteStats]:
        """`stats` summed per axis.

        Returns:
            {axis: SiteStats} for "tp", "pp" and "dp" (every axis present, zeros where unused).
        """
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

    # ------------------------------------------------------------------ routing (every axis)
    def _decide(self, axis, site, direction, kind, tensor, world, native=False) -> tuple[CompressionConfig | None, SiteStats]:
        """The policy's config for one message (None: native), after counting and observing it."""
        nbytes = tensor.numel() * tensor.element_size()
        message = world * nbytes if kind == "all_gather" else nbytes  # the whole buffer, as the collectives count it
        cfg = decide(self.policies[axis], site, direction, tensor, nbytes=message, ranks=world,
                     compressible=not native, observe=kind != "recv")  # a receive buffer holds nothing yet
        st = self.stats.get((site, direction, kind))
        if st is None:
            st = self.stats[(site, direction, kind)] = SiteStats(axis=axis)
        st.calls += 1
        st.bytes += nbytes
        st.compressed += cfg is not None
        return cfg, st

    def _route(self, axis, site, direction, kind, tensor, group, issue, native=False):
        """Decide, then `issue(config, min_bytes)` one collective, counting the bytes it sends."""
        cfg, st = self._decide(axis, site, direction, kind, tensor, dist.get_world_size(group), native)
        with WireStats() as ws:
            work = issue(cfg if cfg is not None else NATIVE, self.policies[axis].min_bytes)
        counted = ws.wire_bytes
        st.wire_bytes += counted
        # its wait() counts what it sends then, and what it sent from a worker thread since (CPU)
        return None if work is None else Counted(work, st, ws, counted)


def enable(policy=None, model=None, *, tp=None, pp=None, dp=None, error_feedback: bool = False,
           compress_param_gather: bool = False, weight_deltas=False, two_level=None) -> MegatronHandle:
    """Route megatron-core's TP, PP and DP communication through taco_triton.

    Args:
        policy: a `taco_triton.CompressionPolicy` (anything with `config_for(site,
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
            (see the site names in `taco_triton.integrations.megatron.tp`).
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
        weight_deltas: send the parameter all-gather as quantized weight differences
            (`integrations.weight_deltas`: every rank applies the same decoded differences, so
            all ranks' weights stay bit-identical and the error does not accumulate): True for
            `WEIGHT_DELTA_CONFIG` (INT4, G=32, Hadamard), a `CompressionConfig`, or a
            `WeightDeltas` to keep the state across `enable` calls. Sites the DP policy does not
            compress in the forward direction are gathered exactly.
        two_level: a `integrations.two_level.TwoLevel` built for megatron's data-parallel group
            (every rank creates it, after ``initialize_model_parallel``): the DP gradient
            reductions the DP policy compresses run in two levels with its codecs (default INT8
            inside a node, INT4 with error feedback between nodes) instead of the policy's
            config; synchronous (an async request is complete when returned). Reductions over
            other groups (megatron's all-reduce across distributed-optimizer instances) keep
            the policy's config. It carries its own error feedback: do not combine it with
            `error_feedback`.

    Returns:
        A `MegatronHandle`; `handle.disable()` or `with enable(...):` undoes it.

    Raises:
        TypeError: a policy argument is not a policy, or none is given.
        RuntimeError: already enabled (call the active handle's `disable()` first), the group
            mode (`enable_groups`) is active, or this megatron-core lacks a patch point.
        ValueError: two ways of one axis at once (`compress_param_gather` with `weight_deltas`,
            `two_level` with `error_feedback`).
        ImportError: megatron-core is not installed (names the extra to install).
    """
    if policy is None and tp is None and pp is None and dp is None:
        raise TypeError("enable needs a policy: enable(policy) or per-axis enable(tp=..., pp=..., dp=...)")
    for name, pol in (("policy", policy), ("tp", tp), ("pp", pp), ("dp", dp)):
        for attr in ("config_for", "observe", "min_bytes"):
            if pol is not None and not hasattr(pol, attr):
                raise TypeError(
                    f"{name} must be a CompressionPolicy (missing {attr!r}), got {type(pol).__name__}"
                )
    if weight_deltas is not False and weight_deltas is not None and compress_param_gather:
        raise ValueError("compress_param_gather and weight_deltas are two ways to send the parameter all-gather: "
                         "choose one")
    if two_level is not None and error_feedback:
        raise ValueError("two_level carries its own error feedback (TwoLevel(error_feedback=...)): "
                         "do not also pass error_feedback=True")
    if ACTIVE.mappings is not None:
        raise RuntimeError(
            f"taco_triton.integrations.megatron is already enabled ({ACTIVE.mappings!r}); call its disable() first"
        )
    if ACTIVE.groups is not None:
        raise RuntimeError("the group mode (enable_groups) is active: use one mode at a time; call its disable() first")
    modules = import_megatron()
    missing = patching.missing(modules)
    if missing:
        raise RuntimeError(
            f"megatron-core {megatron_version()} lacks {missing}; taco_triton's integration was written "
            f"against megatron-core {TESTED_VERSION} ({EXTRA})"
        )
    native = CompressionPolicy(default=None)
    tp = tp if tp is not None else policy if policy is not None else native
    pp = pp if pp is not None else policy if policy is not None else native
    if dp is None:
        dp = gradient_policy(policy, error_feedback=error_feedback) if policy is not None else native
    if weight_deltas is True:
        weight_deltas = WeightDeltas()
    elif isinstance(weight_deltas, CompressionConfig):
        weight_deltas = WeightDeltas(weight_deltas)
    elif weight_deltas is False:
        weight_deltas = None
    handle = MegatronHandle(tp, model, pp=pp, dp=dp, error_feedback=error_feedback,
                            compress_param_gather=compress_param_gather, weight_deltas=weight_deltas,
                            two_level=two_level)
    handle._active = True
    patching.install(handle, modules)
    ACTIVE.mappings = handle
    return handle


def active_handle() -> MegatronHandle | None:
    """The handle `enable` returned, while it is active.

    Returns:
        The `MegatronHandle`, or None.
    """
    return ACTIVE.mappings
