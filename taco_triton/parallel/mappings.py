"""Tensor-parallel mappings (Megatron-LM's semantics) whose communication a `CompressionPolicy` compresses.

Each mapping is an autograd function that communicates in one direction and is the identity (or
a local split) in the other:

| function                      | forward                        | backward                        |
|-------------------------------|--------------------------------|---------------------------------|
| `copy_to_tp_region`           | identity                       | all-reduce (sum) of the grad    |
| `reduce_from_tp_region`       | all-reduce (sum)               | identity                        |
| `gather_from_sp_region`       | all-gather along dim 0         | reduce-scatter (sum), dim 0     |
| `reduce_scatter_to_sp_region` | reduce-scatter (sum), dim 0    | all-gather along dim 0          |
| `gather_from_tp_region`       | all-gather along the last dim  | split (this rank's slice)       |
| `scatter_to_tp_region`        | split (this rank's slice)      | all-gather along the last dim   |

Dim 0 is the sequence/token dim of sequence parallelism (Megatron's [s, b, h], or [tokens, h]);
the last dim is the hidden dim that tensor parallelism shards.

Every call names a *site* (for example "layers.3.mlp.fc2.reduce"); each communication is decided
by `taco_triton.policy.decide` ("forward" or "backward"): a message that could be compressed is
shown to `policy.observe(site, direction, tensor)` (calibration samples), then
`policy.config_for(site, direction)` decides it; None (or `policy` None) runs the native
collective, and `min_bytes=policy.min_bytes` is passed on.
With a group of world size 1 (or torch.distributed not initialized) every mapping returns its
input unchanged. Outputs are new tensors: no mapping writes into a tensor autograd handed it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..collectives import compressed as _coll
from ..config import CompressionConfig
from ..policy import decide

#: What a site runs when the policy says None: the collectives' native path.
NATIVE = CompressionConfig(enabled=False)

__all__ = [
    "copy_to_tp_region",
    "gather_from_sp_region",
    "gather_from_tp_region",
    "reduce_from_tp_region",
    "reduce_scatter_to_sp_region",
    "scatter_to_tp_region",
    "tp_rank",
    "tp_world_size",
]


def tp_world_size(group=None) -> int:
    """World size of `group` (1 when torch.distributed is not initialized)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def tp_rank(group=None) -> int:
    """This process's rank in `group` (0 when torch.distributed is not initialized)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(group)


def _plan(policy, site: str, direction: str, tensor: torch.Tensor, ranks: int, nbytes: int | None = None):
    """(config, min_bytes) for one communication of `tensor` (`nbytes`: the whole message, as the
    collectives count it), decided by `decide` (which shows it to the policy first)."""
    if policy is None:
        return NATIVE, None
    cfg = decide(policy, site, direction, tensor, nbytes=nbytes, ranks=ranks)
    return (NATIVE if cfg is None else cfg), policy.min_bytes


def _check_site(site) -> None:
    if not isinstance(site, str):
        raise TypeError(f"site must be a str, got {type(site).__name__}")


# ---------------------------------------------------------------------------- collectives
def _outgoing(x: torch.Tensor, policy) -> torch.Tensor:
    """A detached contiguous copy in the policy's communication dtype (its own storage: the
    collectives work in place and `x` belongs to autograd)."""
    dt = getattr(policy, "comm_dtype", None)
    if dt is None or not x.is_floating_point():
        dt = x.dtype
    return x.detach().to(dt, memory_format=torch.contiguous_format, copy=True)


def _all_reduce(x, site, direction, policy, group):
    buf = _outgoing(x, policy)
    cfg, min_bytes = _plan(policy, site, direction, buf, tp_world_size(group))
    _coll.all_reduce(buf, group, cfg, "sum", min_bytes=min_bytes)
    return buf.to(x.dtype)


def _all_gather_dim0(x, site, direction, policy, group, p):
    src = _outgoing(x, policy)
    out = src.new_empty((p * src.shape[0], *src.shape[1:]))
    cfg, min_bytes = _plan(policy, site, direction, src, p, p * src.numel() * src.element_size())
    _coll.all_gather(out, src, group, cfg, min_bytes=min_bytes)
    return out.to(x.dtype)


def _reduce_scatter_dim0(x, site, direction, policy, group, p):
    if x.dim() == 0 or x.shape[0] % p:
        raise ValueError(
            f"{site}: reduce-scatter along dim 0 needs dim 0 divisible by the group's world size {p}; "
            f"got shape {tuple(x.shape)}"
        )
    src = _outgoing(x, policy)
    out = src.new_empty((src.shape[0] // p, *src.shape[1:]))
    cfg, min_bytes = _plan(policy, site, direction, src, p)
    _coll.reduce_scatter(out, src, group, cfg, "sum", min_bytes=min_bytes)
    return out.to(x.dtype)


def _all_gather_last(x, site, direction, policy, group, p):
    # Gather [P, ..., n] (each rank's slice sent in its natural layout, so quantization groups run
    # along the hidden dim), then interleave to [..., P * n].
    # Flat views: gloo's native all-gather insists on output shape [P * d0, ...] of the input's.
    src = _outgoing(x, policy)
    buf = src.new_empty(p * src.numel())
    cfg, min_bytes = _plan(policy, site, direction, src, p, p * src.numel() * src.element_size())
    _coll.all_gather(buf, src.view(-1), group, cfg, min_bytes=min_bytes)
    return buf.view(p, *src.shape).movedim(0, -2).reshape(*src.shape[:-1], p * src.shape[-1]).to(x.dtype)


def _split_last(x, site, p, r):
    if x.dim() == 0 or x.shape[-1] % p:
        raise ValueError(
            f"{site}: splitting the last dim needs it divisible by the group's world size {p}; "
            f"got shape {tuple(x.shape)}"
        )
    n = x.shape[-1] // p
    return x[..., r * n : (r + 1) * n].contiguous()


# ---------------------------------------------------------------------------- autograd functions
class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, site, policy, group):
        ctx.site, ctx.policy, ctx.group = site, policy, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.site, "backward", ctx.policy, ctx.group), None, None, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, site, policy, group):
        return _all_reduce(x, site, "forward", policy, group)

    @staticmethod
    def backward(ctx, g):
        return g, None, None, None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, site, policy, group):
        ctx.site, ctx.policy, ctx.group = site, policy, group
        ctx.p = tp_world_size(group)
        return _all_gather_dim0(x, site, "forward", policy, group, ctx.p)

    @staticmethod
    def backward(ctx, g):
        return _reduce_scatter_dim0(g, ctx.site, "backward", ctx.policy, ctx.group, ctx.p), None, None, None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, site, policy, group):
        ctx.site, ctx.policy, ctx.group = site, policy, group
        ctx.p = tp_world_size(group)
        return _reduce_scatter_dim0(x, site, "forward", policy, group, ctx.p)

    @staticmethod
    def backward(ctx, g):
        return _all_gather_dim0(g, ctx.site, "backward", ctx.policy, ctx.group, ctx.p), None, None, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, site, policy, group):
        ctx.site, ctx.p, ctx.r = site, tp_world_size(group), tp_rank(group)
        return _all_gather_last(x, site, "forward", policy, group, ctx.p)

    @staticmethod
    def backward(ctx, g):
        return _split_last(g, ctx.site, ctx.p, ctx.r), None, None, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, site, policy, group):
        ctx.site, ctx.policy, ctx.group = site, policy, group
        ctx.p, r = tp_world_size(group), tp_rank(group)
        return _split_last(x, site, ctx.p, r)

    @staticmethod
    def backward(ctx, g):
        return _all_gather_last(g, ctx.site, "backward", ctx.policy, ctx.group, ctx.p), None, None, None


# ---------------------------------------------------------------------------- public functions
def _apply(fn, x, site, policy, group):
    _check_site(site)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{site}: expected a tensor, got {type(x).__name__}")
    if tp_world_size(group) == 1:
        return x
    return fn.apply(x, site, policy, group)


def copy_to_tp_region(x: torch.Tensor, site: str, policy=None, group=None) -> torch.Tensor:
    """Enter a tensor-parallel region: forward identity, backward all-reduce (sum) of the grad.

    Megatron's `copy_to_tensor_model_parallel_region`, used on the input of a column-parallel
    layer: every rank holds the same `x` [..., h]; each rank's grad is a partial sum.

    Args:
        x: any shape, replicated on the ranks of `group`.
        site: the site name (policy key), e.g. "layers.0.mlp.fc1.copy"; direction "backward".
        policy: `CompressionPolicy` (None: native collectives).
        group: process group (None: the default group).

    Returns:
        `x` (a view) in forward; its grad is all-reduced over `group` in backward.

    Example:
        >>> x = torch.ones(2, 3, requires_grad=True)
        >>> copy_to_tp_region(x, "fc1.copy").sum().backward()   # world size 1: identity
        >>> x.grad
        tensor([[1., 1., 1.],
                [1., 1., 1.]])
    """
    return _apply(_CopyToTP, x, site, policy, group)


def reduce_from_tp_region(x: torch.Tensor, site: str, policy=None, group=None) -> torch.Tensor:
    """Leave a tensor-parallel region: forward all-reduce (sum), backward identity.

    Megatron's `reduce_from_tensor_model_parallel_region`, used on the output of a row-parallel
    layer: each rank holds a partial sum [..., h]; every rank gets the (identical) total.

    Args:
        x: any shape, the same shape on every rank.
        site: e.g. "layers.0.mlp.fc2.reduce"; direction "forward".
        policy: as in `copy_to_tp_region`.
        group: as in `copy_to_tp_region`.

    Returns:
        A new tensor, the sum of `x` over `group` (bitwise identical on all ranks).

    Example:
        >>> reduce_from_tp_region(torch.arange(3.0), "fc2.reduce")
        tensor([0., 1., 2.])
    """
    return _apply(_ReduceFromTP, x, site, policy, group)


def gather_from_sp_region(x: torch.Tensor, site: str, policy=None, group=None) -> torch.Tensor:
    """Leave a sequence-parallel region: forward all-gather along dim 0, backward reduce-scatter (sum).

    Megatron's `gather_from_sequence_parallel_region` (with `tensor_parallel_output_grad=True`),
    used on the input of a column-parallel layer under sequence parallelism.

    Args:
        x: [s / P, ...], this rank's slice of the sequence (token) dim.
        site: e.g. "layers.0.mlp.fc1.gather"; all-gather "forward", reduce-scatter "backward".
        policy: as in `copy_to_tp_region`.
        group: as in `copy_to_tp_region`.

    Returns:
        [s, ...]: rank r's slice at rows [r s/P, (r+1) s/P). Backward needs the grad's dim 0
        divisible by P (it is, being s).

    Example:
        >>> gather_from_sp_region(torch.zeros(4, 8), "fc1.gather").shape
        torch.Size([4, 8])
    """
    return _apply(_GatherFromSP, x, site, policy, group)


def reduce_scatter_to_sp_region(x: torch.Tensor, site: str, policy=None, group=None) -> torch.Tensor:
    """Enter a sequence-parallel region: forward reduce-scatter (sum) along dim 0, backward all-gather.

    Megatron's `reduce_scatter_to_sequence_parallel_region`, used on the output of a row-parallel
    layer under sequence parallelism.

    Args:
        x: [s, ...] partial sums, the same shape on every rank; s divisible by P (ValueError
            naming the shape otherwise).
        site: e.g. "layers.0.mlp.fc2.reduce_scatter"; reduce-scatter "forward", all-gather "backward".
        policy: as in `copy_to_tp_region`.
        group: as in `copy_to_tp_region`.

    Returns:
        [s / P, ...]: rows [r s/P, (r+1) s/P) of the sum over `group`.

    Example:
        >>> reduce_scatter_to_sp_region(torch.zeros(4, 8), "fc2.reduce_scatter").shape
        torch.Size([4, 8])
    """
    return _apply(_ReduceScatterToSP, x, site, policy, group)


def gather_from_tp_region(x: torch.Tensor, site: str, policy=None, group=None) -> torch.Tensor:
    """All-gather along the last dim in forward; backward keeps this rank's slice of the grad.

    Megatron's `gather_from_tensor_model_parallel_region` (a column-parallel layer with
    `gather_output=True`).

    Args:
        x: [..., n] this rank's slice of the hidden dim.
        site: e.g. "fc1.gather_output"; direction "forward".
        policy: as in `copy_to_tp_region`.
        group: as in `copy_to_tp_region`.

    Returns:
        [..., P n]: rank r's slice at columns [r n, (r+1) n).

    Example:
        >>> gather_from_tp_region(torch.zeros(2, 3), "fc1.gather_output").shape
        torch.Size([2, 3])
    """
    return _apply(_GatherFromTP, x, site, policy, group)


def scatter_to_tp_region(x: torch.Tensor, site: str, policy=None, group=None) -> torch.Tensor:
    """Keep this rank's slice of the last dim in forward; backward all-gathers the grad along it.

    Megatron's `scatter_to_tensor_model_parallel_region` (a row-parallel layer with
    `input_is_parallel=False`).

    Args:
        x: [..., n], replicated; n divisible by P (ValueError naming the shape otherwise).
        site: e.g. "fc2.scatter"; direction "backward".
        policy: as in `copy_to_tp_region`.
        group: as in `copy_to_tp_region`.

    Returns:
        [..., n / P]: columns [r n/P, (r+1) n/P), a new tensor.

    Example:
        >>> scatter_to_tp_region(torch.zeros(2, 6), "fc2.scatter").shape
        torch.Size([2, 6])
    """
    return _apply(_ScatterToTP, x, site, policy, group)
