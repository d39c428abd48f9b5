"""Compressed communication for PyTorch's own tensor parallelism (DTensor parallel styles).

    from torch.distributed.tensor.parallel import parallelize_module
    from taco_triton.integrations.dtensor import compress_plan, name_sites

    parallelize_module(model, tp_mesh, compress_plan(plan, policy))   # plan: torch's styles
    name_sites(model)                        # sites named after module paths, as our TP layers

`CompressedColwiseParallel`, `CompressedRowwiseParallel`, `CompressedSequenceParallel` and
`CompressedPrepareModuleInput` take the torch style's arguments plus ``policy=`` (a
`taco_triton.CompressionPolicy`) and ``name=``. They shard parameters exactly as the
torch styles do and give outputs the same placements and shapes, so the rest of a plan does not
change; only the redistributions the styles run at their module boundaries go through
`taco_triton.parallel`'s communication (`taco_triton.all_reduce / reduce_scatter / all_gather`
under the policy, in the policy's ``comm_dtype``), forward and backward:

| boundary (torch style)                        | forward          | backward         | site role        |
|-----------------------------------------------|------------------|------------------|------------------|
| Colwise input, Replicate (no SP)              | -                | all-reduce       | "copy"           |
| Colwise / PrepareModuleInput, Shard(d) -> Rep | all-gather d     | reduce-scatter d | "gather"         |
| Colwise output Shard(-1) -> Replicate         | all-gather -1    | split            | "gather_output"  |
| Rowwise output Partial -> Replicate           | all-reduce       | -                | "reduce"         |
| Rowwise output Partial -> Shard(d) (SP)       | reduce-scatter d | all-gather d     | "reduce_scatter" |
| Rowwise input Replicate -> Shard(-1)          | split            | all-gather -1    | "scatter"        |

A site is f"{name}.{role}" (just the role while `name` is empty): the names and roles of
`taco_triton.parallel`'s layers, so the same exempt patterns, overrides, calibrated plans and
``comm_dtype`` apply. Each style's ``name`` defaults to the module's path once `name_sites(model)`
has run (e.g. "layers.0.feed_forward.w2" -> site "layers.0.feed_forward.w2.reduce_scatter").

A redistribution runs in a `DTensor`-to-`DTensor` autograd function whose backward is the
transposed redistribution (as torch's own ``redistribute`` is), so gradients keep the placements
DTensor expects and no native collective is added behind the compressed one. Both directions
require the sharded dim to divide evenly by the mesh size (ValueError naming the shape
otherwise). Left to DTensor (native): a rowwise ``nn.Embedding``'s forward output reduction (its partial
placement carries a mask only DTensor applies), partial placements other than a plain sum,
shard-to-shard moves, and the gradient reduction of replicated parameters (norm weights under
sequence parallelism; small, and kept exact so the replicas stay identical).

Only 1-D meshes: pass the tensor-parallel submesh (``mesh["tp"]``) as torchtitan does.
"""
from __future__ import annotations

import fnmatch
from typing import Any, Mapping

import torch
from torch import nn
from torch.distributed.tensor import DeviceMesh, DTensor, Partial, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)
from torch.distributed.tensor.placement_types import Placement

# The policy-aware communication of our own TP layers (comm_dtype cast, observe, config_for,
# min_bytes): one place for that logic.
from ..parallel import mappings as _comm
from ..policy import CompressionPolicy

__all__ = [
    "CompressedColwiseParallel",
    "CompressedPrepareModuleInput",
    "CompressedRowwiseParallel",
    "CompressedSequenceParallel",
    "compress_plan",
    "name_sites",
]

#: Attribute a compressed style sets on the module it parallelizes: the site-name prefix.
SITE_NAME_ATTR = "_taco_site_name"


# ---------------------------------------------------------------------------- redistribution
def _is_sum_partial(p: Placement) -> bool:
    # exactly Partial("sum"): subclasses (the embedding's masked partial) need DTensor's reduction
    return type(p) is Partial and p.reduce_op == "sum"


def _even(x: DTensor, dim: int, site: str, p: int) -> None:
    if x.shape[dim] % p:
        raise ValueError(
            f"{site}: compressed redistribution needs dim {dim} of the global shape {tuple(x.shape)} "
            f"divisible by the mesh size {p}"
        )


def _along(dim: int, fn, local: torch.Tensor, *args) -> torch.Tensor:
    """fn (which works along dim 0) applied along `dim`; quantization groups stay in the last dim."""
    if dim == 0:
        return fn(local, *args)
    return fn(local.movedim(dim, 0), *args).movedim(0, dim).contiguous()


def _redistribute(x: DTensor, dst: Placement, site: str, direction: str, policy) -> DTensor:
    """`x` (1-D mesh) redistributed to `dst`; communication through taco_triton where it is one of
    the table's collectives, DTensor's own redistribute otherwise (local moves, special placements)."""
    src, mesh = x.placements[0], x.device_mesh
    if src == dst:
        return x
    group, p = mesh.get_group(), mesh.size()
    local = x.to_local()
    if _is_sum_partial(src) and dst.is_replicate():
        y = _comm._all_reduce(local, site, direction, policy, group)
    elif _is_sum_partial(src) and dst.is_shard():
        d = dst.dim % x.ndim
        _even(x, d, site, p)
        y = _along(d, _comm._reduce_scatter_dim0, local, site, direction, policy, group, p)
    elif src.is_shard() and dst.is_replicate():
        d = src.dim % x.ndim
        _even(x, d, site, p)
        if d == x.ndim - 1:  # the hidden dim: gathered in each rank's natural layout
            y = _comm._all_gather_last(local, site, direction, policy, group, p)
        else:
            y = _along(d, _comm._all_gather_dim0, local, site, direction, policy, group, p)
    else:
        return x.redistribute(mesh, (dst,))
    return DTensor.from_local(y, mesh, (dst,), run_check=False)


class _Redistribute(torch.autograd.Function):
    """DTensor -> DTensor with placement `dst`; backward moves the gradient to the input's
    placement (a partial input gets a replicated gradient, as in DTensor's own redistribute)."""

    @staticmethod
    def forward(ctx, x: DTensor, dst: Placement, site: str, policy):
        src = x.placements[0]
        ctx.grad_dst = Replicate() if src.is_partial() else src
        ctx.site, ctx.policy = site, policy
        out = _redistribute(x, dst, site, "forward", policy)
        return out.view_as(out) if out is x else out  # a new tensor object for autograd

    @staticmethod
    def backward(ctx, g):
        if g is None:
            return None, None, None, None
        return _redistribute(g, ctx.grad_dst, ctx.site, "backward", ctx.policy), None, None, None


# torch.compile: the compiled graph breaks here and the redistribution runs eagerly. Tracing into
# the collectives and the codec gains nothing (they are communication and their own kernels) and
# took minutes of compile time for one small block; WireStats also counts every call this way.
@torch.compiler.disable
def _move(x: DTensor, dst: Placement, site: str, policy) -> DTensor:
    return _Redistribute.apply(x, dst, site, policy)


def _role(src: Placement, dst: Placement) -> str:
    """The site role of a move, named as `taco_triton.parallel`'s layers name theirs."""
    if src.is_shard() and dst.is_replicate():
        return "gather"
    if src.is_partial():
        return "reduce_scatter" if dst.is_shard() else "reduce"
    if src.is_replicate() and dst.is_shard():
        return "scatter"
    return "copy"  # Replicate -> Replicate: the backward all-reduce of a replicated input


def _site(mod: nn.Module, role: str) -> str:
    name = getattr(mod, SITE_NAME_ATTR, None) or ""
    return f"{name}.{role}" if name else role


def _prepare(x: Any, mod: nn.Module, mesh: DeviceMesh, layout: Placement | None, desired: Placement | None,
             policy, role_suffix: str = "") -> Any:
    """A module input as the torch styles prepare it: a plain tensor is annotated with `layout`
    (it then always enters a redistribution, so its gradient is moved back to `layout` by ours,
    not by DTensor's `from_local`); a DTensor is redistributed only if it is not already `desired`."""
    if layout is None or not isinstance(x, torch.Tensor):
        return x
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, (layout,), run_check=False)
        src = layout
    else:
        src = x.placements[0]
        if desired is None or src == desired:
            return x
    dst = desired or src
    return _move(x, dst, _site(mod, role_suffix + _role(src, dst)), policy)


def _check_mesh(style: str, mesh: DeviceMesh) -> None:
    if mesh.ndim != 1:
        raise ValueError(
            f"{style}: compressed styles need a 1-D tensor-parallel mesh, got a {mesh.ndim}-D mesh of shape "
            f"{tuple(mesh.shape)}; pass the TP submesh (e.g. mesh['tp'])"
        )


def _check_policy(style: str, policy) -> None:
    if policy is not None and not isinstance(policy, CompressionPolicy):
        raise TypeError(f"{style}: policy must be a CompressionPolicy or None, got {type(policy).__name__}")


def _mark(module: nn.Module, name: str | None) -> None:
    if name is not None or not hasattr(module, SITE_NAME_ATTR):
        setattr(module, SITE_NAME_ATTR, name)


def _single(layouts, what: str, style: str) -> Placement:
    if len(layouts) != 1:
        raise ValueError(f"{style}: one {what} placement expected (1-D mesh), got {layouts}")
    return layouts[0]


# ---------------------------------------------------------------------------- styles
class _LinearStyle:
    """Shared by the column- and row-wise styles: arguments and the module-boundary hooks."""

    def __init__(self, *, input_layouts: Placement | None = None, output_layouts: Placement | None = None,
                 use_local_output: bool = True, policy: CompressionPolicy | None = None, name: str | None = None):
        super().__init__(input_layouts=input_layouts, output_layouts=output_layouts, use_local_output=use_local_output)
        _check_policy(type(self).__name__, policy)
        self.policy, self.name = policy, name

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + f", name={self.name!r})"


    def _linear_apply(self, module: nn.Module, mesh: DeviceMesh, desired_input: Placement) -> nn.Module:
        style = type(self).__name__
        _check_mesh(style, mesh)
        if isinstance(module, nn.Linear):
            partition = self._partition_linear_fn
        elif isinstance(module, nn.Embedding):
            partition = self._partition_embedding_fn
        else:
            raise NotImplementedError(f"{style} supports nn.Linear and nn.Embedding, got {type(module).__name__}")
        _mark(module, self.name)
        layout = _single(self.input_layouts, "input", style)
        out_layout = _single(self.output_layouts, "output", style)

        def input_fn(mod, inputs, device_mesh):
            return _prepare(inputs[0], mod, device_mesh, layout, desired_input, self.policy)

        def output_fn(mod, outputs, device_mesh):
            if outputs.placements[0] != out_layout:
                src = outputs.placements[0]
                role = "gather_output" if src.is_shard() and out_layout.is_replicate() else _role(src, out_layout)
                outputs = _move(outputs, out_layout, _site(mod, role), self.policy)
            return outputs.to_local() if self.use_local_output else outputs

        return distribute_module(module, mesh, partition, input_fn, output_fn)


class CompressedColwiseParallel(_LinearStyle, ColwiseParallel):
    """`ColwiseParallel` whose input/output redistributions are compressed under `policy`.

    Args: those of `ColwiseParallel` (input_layouts, output_layouts, use_local_output), plus
        policy: `CompressionPolicy` (None: native collectives, through the same code path).
        name: site-name prefix (None: set by `name_sites`, else the bare role).

    Sites: f"{name}.copy" (replicated input, backward all-reduce), f"{name}.gather" (sharded
    input, e.g. Shard(1) with sequence parallelism), f"{name}.gather_output" (Replicate output).
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return self._linear_apply(module, device_mesh, Replicate())


class CompressedRowwiseParallel(_LinearStyle, RowwiseParallel):
    """`RowwiseParallel` whose output reduction (and input split's backward) is compressed.

    Args: those of `RowwiseParallel` plus `policy` and `name` (as `CompressedColwiseParallel`).

    Sites: f"{name}.reduce" (Replicate output: all-reduce), f"{name}.reduce_scatter" (Shard(d)
    output: reduce-scatter, backward all-gather), f"{name}.scatter" (replicated input of a
    linear: backward all-gather). An `nn.Embedding`'s output reduction stays DTensor's.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # as torch: a linear computes on Shard(-1) inputs, an embedding looks up replicated indices
        desired = Shard(-1) if isinstance(module, nn.Linear) else Replicate()
        self.desired_input_layouts = (desired,)
        return self._linear_apply(module, device_mesh, desired)


class CompressedSequenceParallel(SequenceParallel):
    """`SequenceParallel` (parameters replicated, input and output sharded on `sequence_dim`).

    A plain tensor input is taken as this rank's sequence shard (no communication, as in torch);
    a DTensor input with another placement is redistributed to Shard(sequence_dim) under
    `policy` (e.g. a Partial input: reduce-scatter, site f"{name}.reduce_scatter").

    Args:
        sequence_dim: the dimension the input and output are sharded on, as in torch.
        use_local_output: return a local tensor instead of a DTensor, as in torch.
        policy: `CompressionPolicy` (None: native collectives, through the same code path).
        name: site-name prefix (None: set by `name_sites`, else the bare role).
    """

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = False,
                 policy: CompressionPolicy | None = None, name: str | None = None):
        super().__init__(sequence_dim=sequence_dim, use_local_output=use_local_output)
        _check_policy(type(self).__name__, policy)
        self.policy, self.name = policy, name

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _check_mesh(type(self).__name__, device_mesh)
        _mark(module, self.name)
        shard = self.sequence_sharding[0]

        def input_fn(mod, inputs, mesh):
            x = inputs[0]
            if not isinstance(x, torch.Tensor):
                raise ValueError(f"expecting input of {mod} to be a torch.Tensor or DTensor, but got {x!r}")
            return _prepare(x, mod, mesh, shard, shard, self.policy)

        def output_fn(mod, outputs, mesh):
            return outputs.to_local() if self.use_local_output else outputs

        return distribute_module(module, device_mesh, self._replicate_module_fn, input_fn, output_fn)

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + f", name={self.name!r})"


class CompressedPrepareModuleInput(PrepareModuleInput):
    """`PrepareModuleInput` whose redistributions are compressed under `policy`.

    With sequence parallelism this is where a block's input is all-gathered (Shard(1) ->
    Replicate; backward reduce-scatter of the summed gradients of every consumer): site
    f"{name}.gather" for the first positional input, f"{name}.in{i}.gather" for input i > 0 and
    f"{name}.{key}.gather" for a keyword input.

    Args:
        input_layouts: as in torch's `PrepareModuleInput`.
        desired_input_layouts: as in torch's `PrepareModuleInput`.
        input_kwarg_layouts: as in torch's `PrepareModuleInput`.
        desired_input_kwarg_layouts: as in torch's `PrepareModuleInput`.
        use_local_output: as in torch's `PrepareModuleInput`.
        policy: `CompressionPolicy` (None: native collectives, through the same code path).
        name: site-name prefix (None: set by `name_sites`, else the bare role).
    """

    def __init__(self, *, input_layouts=None, desired_input_layouts=None, input_kwarg_layouts=None,
                 desired_input_kwarg_layouts=None, use_local_output: bool = False,
                 policy: CompressionPolicy | None = None, name: str | None = None):
        super().__init__(input_layouts=input_layouts, desired_input_layouts=desired_input_layouts,
                         input_kwarg_layouts=input_kwarg_layouts, desired_input_kwarg_layouts=desired_input_kwarg_layouts,
                         use_local_output=use_local_output)
        _check_policy(type(self).__name__, policy)
        self.policy, self.name = policy, name

    def _one(self, x, mod, mesh, layout, desired, suffix):
        if layout is None:  # not to be prepared: passed through untouched, as torch does
            return x
        out = _prepare(x, mod, mesh, layout, desired, self.policy, suffix)
        return out.to_local() if self.use_local_output and isinstance(out, DTensor) else out

    def _inputs(self, mod, args, kwargs, mesh):
        if self.input_layouts is not None:
            if len(args) != len(self.input_layouts):
                raise ValueError(
                    f"{type(self).__name__}: module got {len(args)} positional inputs, input_layouts has "
                    f"{len(self.input_layouts)}"
                )
            args = tuple(self._one(x, mod, mesh, lay, want, f"in{i}." if i else "")
                         for i, (x, lay, want) in enumerate(zip(args, self.input_layouts, self.desired_input_layouts)))
        kwargs = {k: self._one(v, mod, mesh, self.input_kwarg_layouts.get(k),
                               self.desired_input_kwarg_layouts.get(k), f"{k}.")
                  for k, v in kwargs.items()}
        return args, kwargs

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _check_mesh(type(self).__name__, device_mesh)
        _mark(module, self.name)
        module.register_forward_pre_hook(
            lambda mod, args, kwargs: self._inputs(mod, args, kwargs, device_mesh), with_kwargs=True)
        return module

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + f", name={self.name!r})"


# ---------------------------------------------------------------------------- plans
def _convert(style: ParallelStyle, policy) -> ParallelStyle:
    kind = type(style)  # exact types only: a subclass may prepare its inputs its own way (float8...)
    if kind is ColwiseParallel:
        return CompressedColwiseParallel(input_layouts=style.input_layouts[0], output_layouts=style.output_layouts[0],
                                         use_local_output=style.use_local_output, policy=policy)
    if kind is RowwiseParallel:
        return CompressedRowwiseParallel(input_layouts=style.input_layouts[0], output_layouts=style.output_layouts[0],
                                         use_local_output=style.use_local_output, policy=policy)
    if kind is SequenceParallel:
        return CompressedSequenceParallel(sequence_dim=style.sequence_sharding[0].dim,
                                          use_local_output=style.use_local_output, policy=policy)
    if kind is PrepareModuleInput:
        return CompressedPrepareModuleInput(
            input_layouts=style.input_layouts, desired_input_layouts=style.desired_input_layouts,
            input_kwarg_layouts=style.input_kwarg_layouts or None,
            desired_input_kwarg_layouts=style.desired_input_kwarg_layouts or None,
            use_local_output=style.use_local_output, policy=policy)
    return style


def compress_plan(plan: ParallelStyle | Mapping[str, ParallelStyle], policy: CompressionPolicy | None):
    """The same plan with every torch `ColwiseParallel`, `RowwiseParallel`, `SequenceParallel` and
    `PrepareModuleInput` replaced by its compressed counterpart (same arguments) under `policy`.

    Other styles, and subclasses of these (which may prepare inputs their own way), are kept
    as they are.

    Args:
        plan: what `parallelize_module` accepts: one style or {module path: style}.
        policy: the `CompressionPolicy` of the compressed styles (None: native collectives).

    Returns:
        The converted style, or a new {module path: style} dict.

    Raises:
        TypeError: `plan` is neither a ParallelStyle nor a mapping; `policy` is not a
            CompressionPolicy or None.

    Example:
        >>> from torch.distributed.tensor import Shard
        >>> plan = compress_plan({"w1": ColwiseParallel(), "w2": RowwiseParallel(output_layouts=Shard(1))},
        ...                      CompressionPolicy(min_bytes=0))
        >>> sorted((k, type(s).__name__) for k, s in plan.items())
        [('w1', 'CompressedColwiseParallel'), ('w2', 'CompressedRowwiseParallel')]
        >>> plan["w2"].output_layouts
        (Shard(dim=1),)
    """
    _check_policy("compress_plan", policy)
    if isinstance(plan, ParallelStyle):
        return _convert(plan, policy)
    if not isinstance(plan, Mapping):
        raise TypeError(f"compress_plan: plan must be a ParallelStyle or a dict of them, got {type(plan).__name__}")
    return {k: _convert(s, policy) for k, s in plan.items()}


def name_sites(model: nn.Module, overwrite: bool = False, exclude: tuple[str, ...] = ()) -> list[str]:
    """Name every module a compressed style parallelized after its path in `model` (for example
    "layers.1.attention.wo"), keeping names given explicitly unless `overwrite`; modules whose
    path matches an fnmatch pattern of `exclude` are left alone.

    Call after `parallelize_module` (per-block plans included): site names then match those of
    `taco_triton.parallel`'s layers at the same paths.

    Args:
        model: the parallelized model.
        overwrite: rename modules named explicitly too.
        exclude: fnmatch patterns of module paths to leave alone.

    Returns:
        The paths named.
    """
    named = []
    for path, m in model.named_modules():
        if not hasattr(m, SITE_NAME_ATTR) or any(fnmatch.fnmatchcase(path, pat) for pat in exclude):
            continue
        if overwrite or not getattr(m, SITE_NAME_ATTR):
            setattr(m, SITE_NAME_ATTR, path)
            named.append(path)
    return named
