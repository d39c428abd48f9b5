"""Route megatron-core's tensor-parallel (TP) communication through taco_triton's collectives.

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
the extra (``pip install 'taco-triton[megatron]'``) when megatron-core is missing.

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
import sys
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..config import INPUT_DTYPES, CompressionConfig

__all__ = ["MegatronHandle", "SiteStats", "cpu_compat", "enable", "active_handle"]

#: The pip extra that installs the supported megatron-core.
EXTRA = "pip install 'taco-triton[megatron]'"
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

_active: "MegatronHandle | None" = None


@dataclass
class SiteStats:
    """Routed calls of one (site, direction, collective): how many, how many compressed, input bytes."""

    calls: int = 0
    compressed: int = 0
    bytes: int = 0


def _import_megatron():
    try:
        from megatron.core.tensor_parallel import layers, mappings
    except ImportError as e:
        raise ImportError(
            f"taco_triton.integrations.megatron needs megatron-core (tested with {TESTED_VERSION}): {EXTRA}"
            f" ({type(e).__name__}: {e})"
        ) from e
    return mappings, layers


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
    """`torch` as megatron's layers.py sees it: only `.distributed` differs (a `_DistShim`)."""

    def __init__(self, distributed: _DistShim):
        self.distributed = distributed

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


class MegatronHandle:
    """An active routing of megatron-core's TP communication; see the module docstring.

    Attributes:
        policy: the `CompressionPolicy` consulted for every call.
        stats: {(site, direction, collective): SiteStats} of every routed call since enable
            (or `reset_stats`).
        patched: "module.attribute" names replaced while active.
    """

    def __init__(self, policy, model=None):
        self.policy = policy
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
        attribute another patch replaced after `enable` keeps that patch."""
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
    def _config(self, kind: str, caller, group, tensor: torch.Tensor) -> CompressionConfig:
        role, direction, ctx = caller
        layer = getattr(ctx, "_taco_layer", None) if ctx is not None else None
        site = f"megatron.{layer}.{role}.{kind}" if layer else f"megatron.{role}.{kind}"
        nbytes = tensor.numel() * tensor.element_size()
        eligible = tensor.dtype in INPUT_DTYPES and nbytes >= self.policy.min_bytes
        if eligible:
            self.policy.observe(site, direction, tensor)
        cfg = self.policy.config_for(site, direction)
        st = self.stats.get((site, direction, kind))
        if st is None:
            st = self.stats[(site, direction, kind)] = SiteStats()
        st.calls += 1
        st.bytes += nbytes
        if eligible and cfg is not None and dist.get_world_size(group) > 1:
            st.compressed += 1
        return cfg if cfg is not None else _NATIVE

    def _all_reduce(self, tensor, group, async_op, caller):
        from ..collectives import compressed as coll

        cfg = self._config("all_reduce", caller, group, tensor)
        return coll.all_reduce(tensor, group, cfg, async_op=async_op, min_bytes=self.policy.min_bytes)

    def _all_gather(self, output, input_, group, async_op, caller):
        from ..collectives import compressed as coll

        cfg = self._config("all_gather", caller, group, input_)
        return coll.all_gather(output, input_, group, cfg, async_op=async_op, min_bytes=self.policy.min_bytes)

    def _reduce_scatter(self, output, input_, group, async_op, caller):
        from ..collectives import compressed as coll

        cfg = self._config("reduce_scatter", caller, group, input_)
        return coll.reduce_scatter(output, input_, group, cfg, async_op=async_op,
                                   min_bytes=self.policy.min_bytes)

    # ------------------------------------------------------------------ replacements
    def _replacements(self, mappings, layers) -> list[tuple[Any, str, Any]]:
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
        if self._names:  # layer names: tag each autograd node with the module that created it
            for mod in (mappings, layers):
                for cls_name in _ROLES:
                    cls = getattr(mod, cls_name, None)
                    if cls is not None and "forward" in cls.__dict__:
                        fn = cls.__dict__["forward"]
                        reps.append((cls, "forward", staticmethod(self._tagging_forward(fn.__func__))))
        return reps


def enable(policy, model=None) -> MegatronHandle:
    """Route megatron-core's TP communication through taco_triton under `policy`.

    Args:
        policy: a `taco_triton.parallel.CompressionPolicy` (anything with `config_for(site,
            direction)`, `observe(site, direction, tensor)` and `min_bytes`).
        model: optional; when given, site names carry the qualified name of the issuing module
            (see the module docstring).

    Returns a `MegatronHandle`; `handle.disable()` or `with enable(...):` undoes it.

    Raises:
        RuntimeError: already enabled (call the active handle's `disable()` first), or this
            megatron-core lacks a patch point.
        ImportError: megatron-core is not installed (names the extra to install).
    """
    global _active
    for attr in ("config_for", "observe", "min_bytes"):
        if not hasattr(policy, attr):
            raise TypeError(
                f"policy must be a CompressionPolicy (missing {attr!r}), got {type(policy).__name__}"
            )
    if _active is not None:
        raise RuntimeError(
            f"taco_triton.integrations.megatron is already enabled ({_active!r}); call its disable() first"
        )
    mappings, layers = _import_megatron()
    missing = [f"mappings.{n}" for n in _MAPPINGS_GLOBALS if not hasattr(mappings, n)]
    missing += [f"layers.{n}" for n in _LAYERS_GLOBALS if not hasattr(layers, n)]
    if missing:
        raise RuntimeError(
            f"megatron-core {_megatron_version()} lacks {missing}; taco_triton's integration was written "
            f"against megatron-core {TESTED_VERSION} ({EXTRA})"
        )
    handle = MegatronHandle(policy, model)
    handle._active = True
    try:
        for obj, attr, new in handle._replacements(mappings, layers):
            orig = obj.__dict__[attr] if isinstance(obj, type) else getattr(obj, attr)
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


@contextlib.contextmanager
def cpu_compat():
    """Let megatron-core run on a CPU-only torch build (gloo process groups): tests, CPU examples.

    megatron-core allocates buffers with ``device=torch.cuda.current_device()``, which raises on a
    CPU-only build. Inside this context ``torch.cuda.current_device`` returns
    ``torch.device("cpu")``; on exit the original function is put back. When CUDA is available
    it changes nothing.

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
    orig = torch.cuda.current_device
    torch.cuda.current_device = _cpu_current_device
    try:
        yield
    finally:
        torch.cuda.current_device = orig
