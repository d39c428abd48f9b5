"""Name the communication site of a process-group call from the module that is running.

A compressing process group (`taco_triton.compressed_group`) receives plain
``torch.distributed`` calls: it does not know which layer issued them. `track_sites(model)`
installs module hooks that keep the qualified name (``model.named_modules()``) of the module
whose forward or backward is running, so that an ``all_reduce`` issued inside
``layers.3.mlp.fc2`` is decided by the policy at site ``layers.3.mlp.fc2.all_reduce``.

- Forward: a forward pre-hook pushes the module's name, a forward hook pops it; the innermost
  tracked module wins.
- Backward: in each tracked module's forward hook, a pre-hook is put on the autograd nodes that
  produced its outputs; when the backward pass reaches them, that module becomes the backward
  site until the next tracked module's nodes are reached (backward runs the modules in reverse),
  for that backward pass only. Calls a backward pass makes before it reaches any tracked
  module, or outside one (e.g. DDP's gradient buckets after the last module), may carry the
  name of the module whose backward ran last.
  The graph is not changed (no identity Functions around inputs or outputs), so in-place
  operations on module outputs keep working.
- The direction is "backward" while the autograd engine runs a backward pass, else "forward".
- Outside every tracked module the site is the bare collective name (``all_reduce``,
  ``reduce_scatter``, ``all_gather``, ...), so the policy's `default` applies unless a pattern
  names it.

By default the modules that own parameters are tracked (the layers that communicate: linear
layers, embeddings); `include` chooses others. The state is process-wide, not per thread: CUDA
backward passes run in the autograd engine's device threads, and the call made there must see
the module that thread is running.
"""
from __future__ import annotations

import fnmatch
import warnings
from collections.abc import Callable, Iterable

import torch

from ..state import STATE

__all__ = ["KINDS", "SiteTracker", "check_patterns", "current_site", "track_sites", "tracking"]

KINDS = ("all_reduce", "reduce_scatter", "all_gather", "send")
"""The collective names that end a site (what the compressing process group decides for)."""

# What this module tracks lives in `STATE.sites`: the forward stack of module names, the backward
# site ([module name, the backward pass (graph task id) that set it]), the trackers, the warnings given.


def _graph_task() -> int:
    """The id of the backward pass the autograd engine runs in this thread; -1 outside one."""
    fn = getattr(torch._C, "_current_graph_task_id", None)
    return fn() if fn is not None else -1


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass (in this thread)."""
    return _graph_task() != -1


def current_site(kind: str) -> tuple[str, str]:
    """The site of a collective issued now.

    Args:
        kind: one of `KINDS`.

    Returns:
        (site, direction): ``"<module>.<kind>"`` inside a tracked module, the bare `kind` outside
        every one; "backward" inside a backward pass, else "forward".
    """
    task = _graph_task()
    if task != -1:  # a site set by an earlier backward pass is stale
        module, direction = (STATE.sites.backward[0] if STATE.sites.backward[1] == task else None), "backward"
    else:
        module, direction = (STATE.sites.forward[-1] if STATE.sites.forward else None), "forward"
    return (f"{module}.{kind}" if module else kind), direction


def tracking() -> bool:
    """Whether sites are being tracked.

    Returns:
        True while some `track_sites` tracker is installed.
    """
    return bool(STATE.sites.trackers)


def _owns_parameters(name: str, module: torch.nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False))


class SiteTracker:
    """The hooks of one `track_sites` call; `remove()` (or leaving a ``with`` block) takes them off.

    Args:
        names: qualified names of the tracked modules (the `names` attribute).
    """

    def __init__(self, names: list[str]):
        self.names = names
        self._handles: list = []

    def sites(self) -> list[str]:
        """Every site name a tracked call can have.

        Returns:
            ``"<module>.<kind>"`` for every tracked module and kind, then the bare kinds.
        """
        return [f"{n}.{k}" for n in self.names for k in KINDS] + list(KINDS)

    def remove(self) -> None:
        """Take the hooks off (a second call does nothing)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        if self in STATE.sites.trackers:
            STATE.sites.trackers.remove(self)

    def __enter__(self) -> SiteTracker:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def track_sites(model: torch.nn.Module, *, include: Callable[[str, torch.nn.Module], bool] | None = None,
                policies: Iterable = ()) -> SiteTracker:
    """Name process-group calls after the module of `model` that issues them.

    Args:
        model: the model whose ``named_modules()`` give the site names (the root itself, name "",
            is never a site).
        include: ``include(name, module) -> bool`` chooses the tracked modules; default: those
            that own parameters.
        policies: policies whose ``exempt`` and ``overrides`` patterns are checked against the
            tracked sites now; each pattern that matches none warns once (a typo would otherwise
            silently leave the site at the default).

    Returns:
        A `SiteTracker` (``remove()``, or use it as a context manager).

    Raises:
        TypeError: `model` is not a torch.nn.Module.

    Example:
        >>> import torch
        >>> from taco_triton.integrations.sites import current_site, track_sites
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4))
        >>> seen = []
        >>> _ = model[0].register_forward_hook(lambda m, a, o: seen.append(current_site("all_reduce")))
        >>> with track_sites(model):
        ...     _ = model(torch.ones(1, 4))
        >>> seen
        [('0.all_reduce', 'forward')]
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"track_sites needs a torch.nn.Module, got {type(model).__name__}")
    include = include or _owns_parameters
    chosen = [(n, m) for n, m in model.named_modules() if n and include(n, m)]
    tracker = SiteTracker([n for n, _ in chosen])
    hooked: set[int] = set()  # autograd nodes already tagged in this forward (the innermost module wins)

    def pre(name):
        def hook(module, args):
            if not STATE.sites.forward:
                hooked.clear()
            STATE.sites.forward.append(name)
        return hook

    def post(name):
        def set_backward_site(*_):
            STATE.sites.backward[:] = [name, _graph_task()]

        def hook(module, args, out):
            if STATE.sites.forward and STATE.sites.forward[-1] == name:
                STATE.sites.forward.pop()
            elif name in STATE.sites.forward:  # drop what an inner module left (e.g. hooks removed mid-forward)
                del STATE.sites.forward[len(STATE.sites.forward) - 1 - STATE.sites.forward[::-1].index(name):]
            if torch.is_grad_enabled():
                for t in _tensors(out):
                    node = t.grad_fn
                    if node is not None and id(node) not in hooked:
                        hooked.add(id(node))
                        node.register_prehook(set_backward_site)
        return hook

    for name, module in chosen:
        tracker._handles.append(module.register_forward_pre_hook(pre(name)))
        # always_call: a forward that raises still leaves the stack as it found it
        tracker._handles.append(module.register_forward_hook(post(name), always_call=True))
    STATE.sites.trackers.append(tracker)
    for policy in policies:
        check_patterns(policy, tracker.sites())
    return tracker


def _tensors(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in _tensors(o)]
    return []


def check_patterns(policy, sites: list[str] | None = None) -> list[str]:
    """The `exempt` and `overrides` patterns of `policy` that match none of `sites` (default:
    the sites of every active tracker, or only the bare kinds when none is active) nor the
    point-to-point site "p2p"; warns once per policy and pattern.

    Args:
        policy: a `CompressionPolicy` (anything with `exempt` and `overrides`).
        sites: the site names to check against (default: as above).

    Returns:
        The unmatched patterns.
    """
    if sites is None:
        sites = sorted({s for t in STATE.sites.trackers for s in t.sites()}) or list(KINDS)
    sites = [*sites, "p2p"]
    patterns = list(getattr(policy, "exempt", ())) + list(dict(getattr(policy, "overrides", {}) or {}))
    unmatched = [p for p in patterns if not any(fnmatch.fnmatchcase(s, p) for s in sites)]
    for p in unmatched:
        if (id(policy), p) not in STATE.sites.warned:
            STATE.sites.warned.add((id(policy), p))
            tracked = "no module is tracked (taco_triton.integrations.sites.track_sites)" if not STATE.sites.trackers else \
                f"{len(sites)} sites are known, e.g. {sites[0]!r}"
            warnings.warn(f"CompressionPolicy pattern {p!r} matches no communication site ({tracked}); "
                          "it has no effect", stacklevel=3)
    return unmatched
