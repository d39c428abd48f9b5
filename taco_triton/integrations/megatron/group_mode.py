"""The group mode: `enable_groups` replaces megatron's process groups in ``parallel_state`` by
compressing ones (`taco_triton.compressed_group`) before the model is built, which also reaches
code that talks to the group directly, such as TransformerEngine's layers; `GroupsHandle` undoes it."""
from __future__ import annotations

from typing import Any

import torch

from ...policy import CompressionPolicy
from .. import sites
from .common import ACTIVE, import_parallel_state
from .dp import gradient_policy

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


class GroupsHandle:
    """What `enable_groups` did: `groups` ({axis: compressing group}), `disable()` to restore the
    original groups in megatron's ``parallel_state``, `track(model)` to name sites after modules.

    Args:
        parallel_state: megatron-core's ``parallel_state`` module, whose groups were replaced.
        policies: {axis: the `CompressionPolicy` of that axis}.
    """

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
        """True until `disable()`."""
        return self._active

    def track(self, model: torch.nn.Module, **kwargs):
        """`taco_triton.integrations.sites.track_sites(model)`, removed again by `disable()`;
        the policies' patterns are checked against the model's sites (unmatched ones warn).

        Args:
            model: the model whose modules name the sites.
            **kwargs: go to `track_sites` (e.g. `prefix`).

        Returns:
            The `SiteTracker`.
        """
        tracker = sites.track_sites(model, policies=list(self.policies.values()), **kwargs)
        self._trackers.append(tracker)
        return tracker

    def disable(self) -> None:
        """Put megatron's original groups back (a second call does nothing). Models built while
        enabled keep the compressing groups they captured; build new ones after disabling."""
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
        if ACTIVE.groups is self:
            ACTIVE.groups = None

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

    Returns:
        A `GroupsHandle`; `disable()` (or leaving a ``with`` block) restores the groups.

    Raises:
        RuntimeError: megatron's model parallelism is not initialized, a group mode is already
            enabled, or the mappings mode (`enable`) is active (use one mode at a time).
        TypeError: a policy lacks config_for/observe/min_bytes.
        ImportError: megatron-core is not installed (names the extra to install).
    """
    ps = import_parallel_state()
    # here, not at module level: importing process_group registers its torch.distributed backend
    from ..process_group import compressed_group

    if ACTIVE.groups is not None:
        raise RuntimeError(f"the megatron group mode is already enabled ({ACTIVE.groups!r}); call its disable() first")
    if ACTIVE.mappings is not None:
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
    ACTIVE.groups = handle
    return handle
