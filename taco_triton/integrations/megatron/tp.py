"""The tensor-parallel axis of the mappings mode: how a call is named (role, direction, layer) and the
three TP collectives it routes.

Site names (what `policy.config_for(site, direction)` and its ``exempt`` patterns see)::

    megatron.[<layer>.]<role>.<collective>      direction: "forward" | "backward"

- <collective>: "all_reduce", "all_gather" or "reduce_scatter".
- <role>: the megatron operation that issues it (`ROLES`): "reduce_from_tp", "copy_to_tp",
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

Not routed (native, uncounted): all_gather / reduce_scatter with uneven split sizes (these
fall back to megatron's own code), ``_AllToAll`` (MoE; taco has no all_to_all), and
collectives megatron issues with ``torch.distributed`` directly outside layers.py - notably the
three per-token all-reduces of ``vocab_parallel_cross_entropy`` (one is a MAX, which taco does
not offer; all are [sequence, batch] FP32, far below any useful ``min_bytes``).
"""
from __future__ import annotations

import sys
from typing import Callable

import torch

from ...collectives import compressed as coll

_MAX_CTX_FRAMES = 6
_MAX_MODULE_FRAMES = 12

#: autograd Function (class name) -> <role> in site names.
ROLES = {
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


def _in_backward() -> bool:
    fn = getattr(torch._C, "_current_graph_task_id", None)
    return fn is not None and fn() != -1


def caller(depth: int):
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
                return ROLES.get(cls.__name__, cls.__name__.strip("_")), direction, ctx
        f = f.f_back
    return first.f_code.co_name.strip("_"), ("backward" if _in_backward() else "forward"), None


def module_name(names: dict) -> str | None:
    """Qualified name of the innermost module of `names` ({id(module): (weakref, name)}) on the
    Python stack above the caller's caller (or None)."""
    if not names:
        return None
    f = sys._getframe(2)
    for _ in range(_MAX_MODULE_FRAMES):
        if f is None:
            return None
        code = f.f_code
        if code.co_argcount and code.co_varnames[0] == "self":
            obj = f.f_locals.get("self")
            hit = names.get(id(obj))
            if hit is not None and hit[0]() is obj:
                return hit[1]
        f = f.f_back
    return None


def tagging_forward(names: dict, fn: Callable) -> Callable:
    """An autograd Function's `forward` that first tags its node with the issuing module's name."""
    def forward(ctx, *args, **kwargs):
        ctx._taco_layer = module_name(names)
        return fn(ctx, *args, **kwargs)

    forward.__wrapped__ = fn
    forward.__name__ = getattr(fn, "__name__", "forward")
    forward.__qualname__ = getattr(fn, "__qualname__", "forward")
    return forward


def site(kind: str, called_by) -> tuple[str, str]:
    """(site, direction) of a TP collective `kind` issued by `called_by` (what `caller` returned)."""
    role, direction, ctx = called_by
    layer = getattr(ctx, "_taco_layer", None) if ctx is not None else None
    return (f"megatron.{layer}.{role}.{kind}" if layer else f"megatron.{role}.{kind}"), direction


def all_reduce(handle, tensor, group, async_op, called_by):
    where, direction = site("all_reduce", called_by)
    return handle._route("tp", where, direction, "all_reduce", tensor, group, lambda cfg, mb: coll.all_reduce(
        tensor, group, cfg, async_op=async_op, min_bytes=mb))


def all_gather(handle, output, input_, group, async_op, called_by):
    where, direction = site("all_gather", called_by)
    return handle._route("tp", where, direction, "all_gather", input_, group, lambda cfg, mb: coll.all_gather(
        output, input_, group, cfg, async_op=async_op, min_bytes=mb))


def reduce_scatter(handle, output, input_, group, async_op, called_by):
    where, direction = site("reduce_scatter", called_by)
    return handle._route("tp", where, direction, "reduce_scatter", input_, group, lambda cfg, mb: coll.reduce_scatter(
        output, input_, group, cfg, async_op=async_op, min_bytes=mb))
