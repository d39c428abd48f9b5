"""How the mappings mode patches megatron-core: the module globals it replaces (the patch points of
megatron-core 0.16.1), the replacements, the `torch` shims, and the gate that makes a replacement
fall through to megatron's original once its handle is disabled.

Patch points (`enable` refuses a megatron-core that lacks one of them):

- tensor_parallel/mappings.py ``_reduce``: the all-reduce of reduce_from_tp (forward) and
  copy_to_tp (backward).
- mappings.py ``_gather_along_first_dim`` / ``_reduce_scatter_along_first_dim``: the SP
  all-gather (gather_from_sp forward; reduce_scatter_to_sp, scatter_to_sp backward) and
  reduce-scatter (reduce_scatter_to_sp forward, gather_from_sp backward; also reached through
  ``_reduce_scatter_along_last_dim``).
- mappings.py ``_gather_along_last_dim``: gather_from_tp / all_gather_last_dim.
- tensor_parallel/layers.py ``dist_all_gather_func``, ``dist_reduce_scatter_func`` and ``torch``
  (see below).
- with `model` only: ``forward`` of each autograd Function named in `tp.ROLES` (it tags the
  autograd node with the issuing module's name; nothing else changes).
- pipeline_parallel/p2p_communication.py ``_p2p_ops``, ``_batched_p2p_ops`` (the PP axis, `pp`).
- distributed/param_and_grad_buffer.py ``torch``, ``dist_reduce_scatter_func``,
  ``dist_all_gather_func``, ``_coalescing_manager`` (the DP axis, `dp`).

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
(ours; SUM only, other ops go to torch). Megatron's own forward/backward code stays untouched.
Its overlaps are kept because our async collectives leave the caller's stream free until
`wait()`: the async dgrad all-reduce (and the SP all-gather / reduce-scatter) runs on the
device's communication stream (on CPU, the group's worker thread) while megatron computes the
weight-gradient GEMM, and its Work's `wait()` orders the waiting stream after it, as NCCL's does.
``linear_with_frozen_weight``'s SP gather goes through ``gather_from_sequence_parallel_region``
and so through mappings.
"""
from __future__ import annotations

import contextlib
import functools
import sys
from typing import Any, Callable

import torch
import torch.distributed as dist

from ...collectives.work import WaitAll
from . import dp, pp, tp

MAPPINGS_GLOBALS = (
    "_reduce", "_gather_along_first_dim", "_reduce_scatter_along_first_dim", "_gather_along_last_dim",
)
LAYERS_GLOBALS = ("torch", "dist_all_gather_func", "dist_reduce_scatter_func")
P2P_GLOBALS = ("_p2p_ops", "_batched_p2p_ops")
DDP_GLOBALS = ("torch", "dist_all_gather_func", "dist_reduce_scatter_func", "_coalescing_manager")
#: The module globals replaced in each of `common.import_megatron()`'s modules, in its order.
GLOBALS = (MAPPINGS_GLOBALS, LAYERS_GLOBALS, P2P_GLOBALS, DDP_GLOBALS)


def missing(modules) -> list[str]:
    """"module.attribute" of every patch point the given megatron modules lack."""
    return [f"{mod.__name__.rsplit('.', 1)[-1]}.{n}" for mod, names in zip(modules, GLOBALS)
            for n in names if not hasattr(mod, n)]


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


def _gated(handle, orig: Any, ours: Any) -> Any:
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


def install(handle, modules) -> None:
    """Replace every patch point of `modules` (`common.import_megatron()`) by `handle`'s gated
    replacement, recording each in `handle._saved` and `handle.patched`; on failure put back what
    was replaced and raise."""
    try:
        for obj, attr, new in replacements(handle, *modules):
            orig = obj.__dict__[attr] if isinstance(obj, type) else getattr(obj, attr)
            new = _gated(handle, orig, new)
            handle._saved.append((obj, attr, orig, new))
            setattr(obj, attr, new)
            owner = obj.__name__ if isinstance(obj, type) else obj.__name__.rsplit(".", 1)[-1]
            handle.patched.append(f"{owner}.{attr}")
    except BaseException:
        handle.disable()  # put back whatever was already replaced
        raise


def restore(saved: list) -> None:
    """Put back each original of `saved` ((obj, attr, orig, ours), newest first) where `ours` is
    still in place; an attribute another patch replaced since keeps that patch."""
    for obj, attr, orig, ours in reversed(saved):
        current = obj.__dict__.get(attr) if isinstance(obj, type) else getattr(obj, attr, None)
        if current is ours:  # a patch applied on top of ours since enable() stays
            setattr(obj, attr, orig)
    saved.clear()


def replacements(h, mappings, layers, p2p_communication, param_and_grad_buffer) -> list[tuple[Any, str, Any]]:
    """(object, attribute, replacement) of every patch point, routing through handle `h`."""
    reps = _tp_replacements(h, mappings, layers)
    reps += _pp_dp_replacements(h, p2p_communication, param_and_grad_buffer)
    if h._names:  # layer names: tag each autograd node with the module that created it
        for mod in (mappings, layers):
            for cls_name in tp.ROLES:
                cls = getattr(mod, cls_name, None)
                if cls is not None and "forward" in cls.__dict__:
                    fn = cls.__dict__["forward"]
                    reps.append((cls, "forward", staticmethod(tp.tagging_forward(h._names, fn.__func__))))
    return reps


def _tp_replacements(h, mappings, layers) -> list[tuple[Any, str, Any]]:
    orig_gather_first = mappings._gather_along_first_dim
    orig_rs_first = mappings._reduce_scatter_along_first_dim

    def _output(dim_size, input_, use_global_buffer):
        """The output buffer megatron's helpers allocate (its global buffer when asked)."""
        if use_global_buffer:
            return mappings.get_global_memory_buffer().get_tensor(dim_size, input_.dtype, "mpu")
        return torch.empty(dim_size, dtype=input_.dtype, device=input_.device)

    def _reduce(input_, group):
        """taco_triton replacement of megatron's mappings._reduce (all-reduce)."""
        assert group is not None, "group should not be None"
        if group.size() == 1:
            return input_
        tp.all_reduce(h, input_, group, False, tp.caller(1))
        return input_

    def _gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        """taco_triton replacement of megatron's mappings._gather_along_first_dim."""
        assert group is not None, "group should not be None"
        world_size = group.size()
        if world_size == 1 or output_split_sizes is not None:
            return orig_gather_first(input_, group, output_split_sizes, use_global_buffer)
        dim_size = list(input_.size())
        dim_size[0] *= world_size
        output = _output(dim_size, input_, use_global_buffer)
        tp.all_gather(h, output, input_, group, False, tp.caller(1))
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
        output = _output(dim_size, input_, use_global_buffer)
        tp.reduce_scatter(h, output, input_, group, False, tp.caller(1))
        return output

    def _gather_along_last_dim(input_, group):
        """taco_triton replacement of megatron's mappings._gather_along_last_dim."""
        world_size = group.size()
        if world_size == 1:
            return input_
        dim_size = list(input_.size())
        dim_size[0] *= world_size
        output = torch.empty(dim_size, dtype=input_.dtype, device=input_.device)
        tp.all_gather(h, output, input_, group, False, tp.caller(1))
        return torch.cat(output.chunk(world_size, dim=0), dim=-1).contiguous()

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        """taco_triton replacement of torch.distributed.all_reduce inside megatron's layers.py."""
        if op != dist.ReduceOp.SUM:
            return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
        return tp.all_reduce(h, tensor, group, async_op, tp.caller(1))

    def dist_all_gather_func(output, input, group=None, async_op=False):
        """taco_triton replacement of layers.dist_all_gather_func (SP all-gather)."""
        return tp.all_gather(h, output, input, group, async_op, tp.caller(1))

    def dist_reduce_scatter_func(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        """taco_triton replacement of layers.dist_reduce_scatter_func (SP reduce-scatter)."""
        if op != dist.ReduceOp.SUM:
            return layers_orig_rs(output, input, op=op, group=group, async_op=async_op)
        return tp.reduce_scatter(h, output, input, group, async_op, tp.caller(1))

    layers_orig_rs = layers.dist_reduce_scatter_func
    return [
        (mappings, "_reduce", _reduce),
        (mappings, "_gather_along_first_dim", _gather_along_first_dim),
        (mappings, "_reduce_scatter_along_first_dim", _reduce_scatter_along_first_dim),
        (mappings, "_gather_along_last_dim", _gather_along_last_dim),
        (layers, "torch", _TorchShim(_DistShim(all_reduce))),
        (layers, "dist_all_gather_func", dist_all_gather_func),
        (layers, "dist_reduce_scatter_func", dist_reduce_scatter_func),
    ]


def _pp_dp_replacements(h, p2pc, pgb) -> list[tuple[Any, str, Any]]:
    orig_p2p, orig_batched = p2pc._p2p_ops, p2pc._batched_p2p_ops
    orig_rs = pgb.dist_reduce_scatter_func

    def _p2p_ops(*, tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next, group,
                 prev_pipeline_rank, next_pipeline_rank):
        """taco_triton replacement of megatron's p2p_communication._p2p_ops."""
        return pp.send_recv(h, orig_p2p, tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next,
                            group, prev_pipeline_rank, next_pipeline_rank)

    def _batched_p2p_ops(*, tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next, group,
                         prev_pipeline_rank, next_pipeline_rank):
        """taco_triton replacement of megatron's p2p_communication._batched_p2p_ops (megatron's
        own batch_isend_irecv, on the wire buffers)."""
        return pp.send_recv(h, orig_batched, tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next,
                            group, prev_pipeline_rank, next_pipeline_rank)

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        """taco_triton replacement of torch.distributed.all_reduce inside param_and_grad_buffer.py."""
        if op not in dp.REDUCE_OPS:
            return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
        return dp.collective(h, "all_reduce", tensor, None, dp.REDUCE_OPS[op], group, async_op, sys._getframe(1))

    def dist_reduce_scatter_func(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        """taco_triton replacement of param_and_grad_buffer.dist_reduce_scatter_func."""
        if op not in dp.REDUCE_OPS:
            return orig_rs(output, input, op=op, group=group, async_op=async_op)
        return dp.collective(h, "reduce_scatter", input, output, dp.REDUCE_OPS[op], group, async_op, sys._getframe(1))

    def dist_all_gather_func(output, input, group=None, async_op=False):
        """taco_triton replacement of param_and_grad_buffer.dist_all_gather_func."""
        return dp.collective(h, "all_gather", input, output, "sum", group, async_op, sys._getframe(1))

    @contextlib.contextmanager
    def _coalescing_manager(group=None, device=None, async_ops=False):
        """Our collectives are issued one by one; the handle megatron keeps waits for all of them."""
        batch = WaitAll()
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
