"""Column- and row-parallel linear layers (Megatron-LM's semantics) with policy-compressed communication.

A two-layer MLP split over P ranks, `ColumnParallelLinear(h, f)` -> activation ->
`RowParallelLinear(f, h)`, communicates once per direction:

    no sequence parallelism:   x [t, h] replicated
        fc1: copy (fwd identity, bwd all-reduce)   -> x W1_r^T [t, f/P]   (W1_r: rows r of W1)
        fc2: x_r W2_r^T [t, h] partial             -> reduce (fwd all-reduce, bwd identity) -> + b2
    sequence parallelism:      x [t/P, h], this rank's tokens
        fc1: gather (fwd all-gather dim 0, bwd reduce-scatter) -> [t, f/P]
        fc2: partial [t, h] -> reduce_scatter (fwd reduce-scatter dim 0, bwd all-gather) -> [t/P, h] + b2

Communication sites (the keys a `CompressionPolicy` answers for), with `name` the layer's name:

| site                       | layer / when                          | forward        | backward       |
|----------------------------|---------------------------------------|----------------|----------------|
| f"{name}.copy"             | Column, no sequence parallelism       | -              | all-reduce     |
| f"{name}.gather"           | Column, sequence parallelism          | all-gather d0  | reduce-scatter |
| f"{name}.gather_output"    | Column, gather_output=True            | all-gather d-1 | -              |
| f"{name}.reduce"           | Row, no sequence parallelism          | all-reduce     | -              |
| f"{name}.reduce_scatter"   | Row, sequence parallelism             | reduce-scatter | all-gather d0  |
| f"{name}.scatter"          | Row, input_is_parallel=False          | -              | all-gather d-1 |

(with an empty name the site is just the role, e.g. "copy"). Each layer lists its own in `.sites`;
`parallel_sites(model)` lists a model's. `assign_site_names(model)` names every parallel layer
after its path in the model (e.g. "layers.3.mlp.fc2"), which is what policy patterns match.

Weights: the full matrix is initialised on the CPU from a generator seeded by `seed` (default:
CRC32 of `name`) and this rank's slice is kept, so the model is the same for any P (Megatron's
CPU-initialisation path). Biases start at zero, as in Megatron. `from_dense` / `load_dense_`
shard a dense `nn.Linear`'s weights instead.

Under sequence parallelism a row-parallel layer's bias is replicated but sees only this rank's
tokens, so its grad is partial: it carries `param.sequence_parallel = True`, and
`allreduce_sequence_parallel_grads(model, group)` sums such grads (Megatron does this for its
layer norms and biases after backward).
"""
from __future__ import annotations

import math
import zlib
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from ..collectives import compressed as _coll
from .mappings import (
    NATIVE,
    copy_to_tp_region,
    gather_from_sp_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sp_region,
    scatter_to_tp_region,
    tp_rank,
    tp_world_size,
)

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "allreduce_sequence_parallel_grads",
    "assign_site_names",
    "init_dense_weight",
    "parallel_sites",
]


def init_dense_weight(
    out_features: int, in_features: int, seed: int = 0, init_method: Callable | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The full [out_features, in_features] weight the parallel layers slice, on the CPU.

    Args:
        out_features: rows of the weight.
        in_features: columns of the weight.
        seed: seeds the generator, so every rank (and every world size) builds the same matrix.
        init_method: Megatron-style `init_method(tensor)` filling an FP32 tensor in place, run
            under `torch.random.fork_rng` with `torch.manual_seed(seed)` (the global RNG is left as
            it was). None: nn.Linear's default, U(-1/sqrt(in), 1/sqrt(in)).
        dtype: result dtype (default: torch's default dtype); the values are drawn in FP32.

    Returns:
        The weight, the same on every rank for the same arguments.

    Example:
        >>> w = init_dense_weight(4, 16, seed=1)
        >>> w.shape, bool(w.abs().max() <= 0.25), torch.equal(w, init_dense_weight(4, 16, seed=1))
        (torch.Size([4, 16]), True, True)
    """
    w = torch.empty(out_features, in_features, dtype=torch.float32)
    if init_method is None:
        bound = 1.0 / math.sqrt(in_features) if in_features else 0.0
        w.uniform_(-bound, bound, generator=torch.Generator().manual_seed(seed))
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            init_method(w)
    return w.to(dtype or torch.get_default_dtype())


def _site(name: str, role: str) -> str:
    return f"{name}.{role}" if name else role


def _divisible(cls: str, what: str, n: int, p: int) -> None:
    if n % p:
        raise ValueError(
            f"{cls}: {what}={n} is not divisible by the tensor-parallel world size {p}; "
            f"pick {what} a multiple of {p}"
        )


class _ParallelLinear(nn.Module):
    """Shared parts: group, rank, world size, parameters, loading from a dense layer."""

    _kind = ""

    def __init__(self, in_features, out_features, group, policy, sequence_parallel, bias, name,
                 init_method, dtype, device, seed, skip_init):
        super().__init__()
        if not isinstance(name, str):
            raise TypeError(f"{type(self).__name__}: name must be a str, got {type(name).__name__}")
        for what, n in (("in_features", in_features), ("out_features", out_features)):
            if not isinstance(n, int) or n <= 0:
                raise ValueError(f"{type(self).__name__}: {what} must be a positive int, got {n!r}")
        self.in_features, self.out_features = in_features, out_features
        self.group, self.policy, self.name = group, policy, name
        self.sequence_parallel = bool(sequence_parallel)
        self.tp_size, self.tp_rank = tp_world_size(group), tp_rank(group)
        self.seed = zlib.crc32(name.encode()) if seed is None else seed
        dtype = dtype or torch.get_default_dtype()
        shape = self._shard_shape()
        self.weight = nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(self._bias_len(), dtype=dtype, device=device)) if bias else None
        if self.bias is not None and self._kind == "row" and self.sequence_parallel:
            self.bias.sequence_parallel = True  # grad covers this rank's tokens only
        if not skip_init:
            full = init_dense_weight(out_features, in_features, self.seed, init_method, torch.float32)
            with torch.no_grad():
                self.weight.copy_(self._shard(full))

    # subclasses: which slice of the full weight / bias this rank holds
    def _shard_shape(self):  # pragma: no cover - abstract
        raise NotImplementedError

    def _bias_len(self):  # pragma: no cover - abstract
        raise NotImplementedError

    def _shard(self, full_weight: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def _shard_bias(self, full_bias: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    @torch.no_grad()
    def load_dense_(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        """Copy this rank's slice of a full [out_features, in_features] weight (and [out_features]
        bias) into the layer.

        Args:
            weight: the full dense weight.
            bias: the full dense bias; given exactly when the layer has one.

        Returns:
            The layer itself.

        Raises:
            ValueError: a shape that does not match (naming both), or a bias given to a layer
                without one or missing for a layer with one.
        """
        want = (self.out_features, self.in_features)
        if tuple(weight.shape) != want:
            raise ValueError(f"{type(self).__name__}.load_dense_: weight shape {tuple(weight.shape)}, expected {want}")
        self.weight.copy_(self._shard(weight))
        if (bias is None) != (self.bias is None):
            raise ValueError(
                f"{type(self).__name__}.load_dense_: bias given={bias is not None} but the layer "
                f"has bias={self.bias is not None}"
            )
        if bias is not None:
            if tuple(bias.shape) != (self.out_features,):
                raise ValueError(
                    f"{type(self).__name__}.load_dense_: bias shape {tuple(bias.shape)}, expected ({self.out_features},)"
                )
            self.bias.copy_(self._shard_bias(bias))
        return self

    @classmethod
    def from_dense(cls, linear: nn.Linear, group=None, policy=None, **kwargs):
        """A parallel layer holding this rank's slice of `linear`'s weight and bias.

        Args:
            linear: the dense layer.
            group: the tensor-parallel process group (None: the default group).
            policy: the `CompressionPolicy` of the layer's sites.
            **kwargs: go to the constructor (sequence_parallel, name, ...); dtype and device
                default to the dense layer's.

        Returns:
            The new layer.
        """
        kwargs.setdefault("dtype", linear.weight.dtype)
        kwargs.setdefault("device", linear.weight.device)
        layer = cls(linear.in_features, linear.out_features, group=group, policy=policy,
                    bias=linear.bias is not None, skip_init=True, **kwargs)
        return layer.load_dense_(linear.weight.detach(), None if linear.bias is None else linear.bias.detach())

    def _extra(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, tp={self.tp_rank}/{self.tp_size}, "
                f"bias={self.bias is not None}, sequence_parallel={self.sequence_parallel}, name={self.name!r}")


class ColumnParallelLinear(_ParallelLinear):
    """Y = X W^T + b with W's rows (output features) split over the ranks of `group`.

    Rank r holds W[r o/P : (r+1) o/P, :] (o = out_features) and the same slice of b.

    Args:
        in_features: the full layer's input size.
        out_features: the full layer's output size; it must be divisible by P (ValueError naming
            both sizes otherwise).
        group: tensor-parallel process group (None: the default group; world size 1 when
            torch.distributed is not initialized).
        policy: `CompressionPolicy` deciding each site's compression (None: all native).
        sequence_parallel: the input is [t/P, ..., in], this rank's tokens; it is all-gathered
            along dim 0 (site f"{name}.gather"). Otherwise the input is replicated [..., in] and
            its grad all-reduced (site f"{name}.copy").
        gather_output: all-gather the output along the last dim (site f"{name}.gather_output")
            so every rank gets [..., out]; not with sequence_parallel.
        bias: learnable bias (zero-initialised).
        name: prefix of the site names (see the module docstring).
        init_method: Megatron-style `init_method(full_fp32_weight)`; see `init_dense_weight`.
        dtype: of the parameters.
        device: of the parameters.
        seed: seeds the full weight's initialisation (None: CRC32 of `name`).
        skip_init: leave the weight uninitialised (for `load_dense_`).

    Shapes: input [..., in] ([t/P, ..., in] with sequence_parallel), output [..., out/P]
    ([t, ..., out/P] with sequence_parallel; [..., out] with gather_output).

    Example:
        >>> fc1 = ColumnParallelLinear(16, 32, name="mlp.fc1")
        >>> fc1(torch.randn(5, 16)).shape, fc1.sites
        (torch.Size([5, 32]), ('mlp.fc1.copy',))
    """

    _kind = "column"

    def __init__(self, in_features: int, out_features: int, group=None, policy=None,
                 sequence_parallel: bool = False, gather_output: bool = False, bias: bool = True,
                 name: str = "", init_method: Callable | None = None, dtype: torch.dtype | None = None,
                 *, device=None, seed: int | None = None, skip_init: bool = False):
        if sequence_parallel and gather_output:
            raise ValueError("ColumnParallelLinear: gather_output=True is not supported with sequence_parallel=True")
        _divisible("ColumnParallelLinear", "out_features", out_features, tp_world_size(group))
        super().__init__(in_features, out_features, group, policy, sequence_parallel, bias, name,
                         init_method, dtype, device, seed, skip_init)
        self.gather_output = bool(gather_output)

    def _shard_shape(self):
        return (self.out_features // self.tp_size, self.in_features)

    def _bias_len(self):
        return self.out_features // self.tp_size

    def _shard(self, w):
        n = self.out_features // self.tp_size
        return w[self.tp_rank * n : (self.tp_rank + 1) * n, :]

    def _shard_bias(self, b):
        n = self.out_features // self.tp_size
        return b[self.tp_rank * n : (self.tp_rank + 1) * n]

    @property
    def sites(self) -> tuple[str, ...]:
        """The site names this layer communicates at."""
        first = _site(self.name, "gather" if self.sequence_parallel else "copy")
        return (first, _site(self.name, "gather_output")) if self.gather_output else (first,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"ColumnParallelLinear {self.name!r}: input's last dim {x.shape[-1]}, expected {self.in_features}")
        if self.sequence_parallel:
            x = gather_from_sp_region(x, _site(self.name, "gather"), self.policy, self.group)
        else:
            x = copy_to_tp_region(x, _site(self.name, "copy"), self.policy, self.group)
        y = F.linear(x, self.weight, self.bias)
        if self.gather_output:
            y = gather_from_tp_region(y, _site(self.name, "gather_output"), self.policy, self.group)
        return y

    def extra_repr(self) -> str:
        return self._extra() + f", gather_output={self.gather_output}"


class RowParallelLinear(_ParallelLinear):
    """Y = X W^T + b with W's columns (input features) split over the ranks of `group`.

    Rank r holds W[:, r i/P : (r+1) i/P] (i = in_features) and the whole bias, which is added
    once, after the reduction. `group`, `policy`, `bias`, `name`, `init_method`, `dtype`, `device`,
    `seed` and `skip_init` are as in `ColumnParallelLinear`.

    Args:
        in_features: the full layer's input size; it must be divisible by P (ValueError naming
            both sizes otherwise).
        out_features: the full layer's output size.
        group: as in `ColumnParallelLinear`.
        policy: as in `ColumnParallelLinear`.
        sequence_parallel: reduce-scatter the output along dim 0 (site f"{name}.reduce_scatter"),
            giving this rank's tokens [t/P, ..., out]; otherwise all-reduce it (site
            f"{name}.reduce"), giving [..., out] on every rank.
        input_is_parallel: the input is already split [..., in/P] (a column-parallel layer's
            output). False: the input is replicated [..., in] and this rank takes its slice (site
            f"{name}.scatter", whose backward all-gathers the grad); not with sequence_parallel.
        bias: as in `ColumnParallelLinear`.
        name: as in `ColumnParallelLinear`.
        init_method: as in `ColumnParallelLinear`.
        dtype: as in `ColumnParallelLinear`.
        device: as in `ColumnParallelLinear`.
        seed: as in `ColumnParallelLinear`.
        skip_init: as in `ColumnParallelLinear`.

    Example:
        >>> fc2 = RowParallelLinear(32, 16, name="mlp.fc2")
        >>> fc2(torch.randn(5, 32)).shape, fc2.sites
        (torch.Size([5, 16]), ('mlp.fc2.reduce',))
    """

    _kind = "row"

    def __init__(self, in_features: int, out_features: int, group=None, policy=None,
                 sequence_parallel: bool = False, input_is_parallel: bool = True, bias: bool = True,
                 name: str = "", init_method: Callable | None = None, dtype: torch.dtype | None = None,
                 *, device=None, seed: int | None = None, skip_init: bool = False):
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel=True needs input_is_parallel=True")
        _divisible("RowParallelLinear", "in_features", in_features, tp_world_size(group))
        super().__init__(in_features, out_features, group, policy, sequence_parallel, bias, name,
                         init_method, dtype, device, seed, skip_init)
        self.input_is_parallel = bool(input_is_parallel)

    def _shard_shape(self):
        return (self.out_features, self.in_features // self.tp_size)

    def _bias_len(self):
        return self.out_features

    def _shard(self, w):
        n = self.in_features // self.tp_size
        return w[:, self.tp_rank * n : (self.tp_rank + 1) * n]

    def _shard_bias(self, b):
        return b

    @property
    def sites(self) -> tuple[str, ...]:
        """The site names this layer communicates at."""
        out = _site(self.name, "reduce_scatter" if self.sequence_parallel else "reduce")
        return (out,) if self.input_is_parallel else (_site(self.name, "scatter"), out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            if x.shape[-1] != self.in_features:
                raise ValueError(f"RowParallelLinear {self.name!r}: input's last dim {x.shape[-1]}, expected {self.in_features}")
            x = scatter_to_tp_region(x, _site(self.name, "scatter"), self.policy, self.group)
        elif x.shape[-1] != self.weight.shape[1]:
            raise ValueError(
                f"RowParallelLinear {self.name!r}: input's last dim {x.shape[-1]}, expected in_features/P = "
                f"{self.in_features}/{self.tp_size} = {self.weight.shape[1]}"
            )
        y = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sp_region(y, _site(self.name, "reduce_scatter"), self.policy, self.group)
        else:
            y = reduce_from_tp_region(y, _site(self.name, "reduce"), self.policy, self.group)
        # Bias after the reduction: added once, not P times.
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return self._extra() + f", input_is_parallel={self.input_is_parallel}"


def _parallel_layers(model: nn.Module) -> Iterator[tuple[str, _ParallelLinear]]:
    for path, m in model.named_modules():
        if isinstance(m, _ParallelLinear):
            yield path, m


def assign_site_names(model: nn.Module, overwrite: bool = False) -> nn.Module:
    """Name every parallel layer of `model` after its module path (e.g. "layers.3.mlp.fc2").

    Args:
        model: the model holding the parallel layers.
        overwrite: rename layers that already have a name too.

    Returns:
        `model`.

    Example:
        >>> m = nn.Sequential(ColumnParallelLinear(8, 16), nn.GELU(), RowParallelLinear(16, 8))
        >>> parallel_sites(assign_site_names(m))
        ['0.copy', '2.reduce']
    """
    for path, m in _parallel_layers(model):
        if overwrite or not m.name:
            m.name = path
    return model


def parallel_sites(model: nn.Module) -> list[str]:
    """Every site the parallel layers of `model` communicate at.

    Args:
        model: the model holding the parallel layers.

    Returns:
        The site names, in module order.
    """
    return [s for _, m in _parallel_layers(model) for s in m.sites]


@torch.no_grad()
def allreduce_sequence_parallel_grads(model: nn.Module, group=None) -> int:
    """Sum over `group` the grads of parameters marked `sequence_parallel` (replicated
    parameters that saw only this rank's tokens); returns how many grads were reduced.

    One native all-reduce of the flattened grads (they are small, and exact sums keep the
    replicas identical). Call after backward, before the optimizer step.

    Args:
        model: the model whose parameters are marked.
        group: the tensor-parallel process group (None: the default group).

    Returns:
        How many grads were reduced.
    """
    grads = [p.grad for p in model.parameters() if getattr(p, "sequence_parallel", False) and p.grad is not None]
    if not grads or tp_world_size(group) == 1:
        return len(grads)
    flat = torch.cat([g.reshape(-1) for g in grads])
    _coll.all_reduce(flat, group, NATIVE, "sum")
    off = 0
    for g in grads:
        g.copy_(flat[off : off + g.numel()].view_as(g))
        off += g.numel()
    return len(grads)
