"""The steady state: a call repeated with the same arguments and tensor metadata goes straight to
its plan's launches.

`STATE.steady` maps (kind, group, config identity, op, min_bytes, pipeline, backend, check, and
per tensor its dtype, shape, strides, device and requires_grad: everything the validation and the
plan depend on) to what the first such call decided (`Steady`). Only the Triton path, contiguous
tensors, world sizes above 1 and check modes other than "always" get one.
"""
from __future__ import annotations

import torch

from ..env import check_mode
from . import _driver, _pg
from ..state import STATE


class Steady:
    """A call's decisions on the Triton path, kept for calls with the same arguments and tensor
    metadata (see the module docstring)."""

    __slots__ = ("agreement", "config", "default", "group", "pg", "plan")

    def __init__(self, call, plan, config, on_default: bool):
        # group and pg: the group that carries the bytes; default: the default group of a call that
        # passed None, when it was kept
        self.plan, self.group, self.pg, self.config = plan, call.group, call.pg, config  # config: keeps its id
        self.default = _pg.default_group() if on_default else None
        self.agreement = (call.pg, call.signature)

    def ready(self, check) -> bool:
        """False when this call must take the full path: the default group was re-created, or
        the check mode (None: the environment's, read per call) wants an exchange (the agreement
        is looked up on every call: a forgotten one is forgotten on every rank alike)."""
        if self.default is not None and _pg.default_group() is not self.default:
            return False
        if check is None:
            mode = check_mode(None)
            return mode == "never" or (mode == "first" and STATE.agreements.has(self.agreement))
        return True  # "always" never gets a Steady; "first" got one after agreeing

    def repeat(self, src: torch.Tensor, dst: torch.Tensor, async_op: bool):
        """Issue the call on its plan (see `_driver.issue`); the handle (async) or None."""
        plan = self.plan
        if dst.requires_grad:  # invisible to autograd, as native (a view of src when it is dst)
            src, dst = src.detach(), dst.detach()
        return _driver.issue(plan, src, dst, next(STATE.calls), self.group, self.pg, async_op)


def lookup(kind: str, tensors: tuple, group, config, op, min_bytes, pipeline, backend, check):
    """(key, Steady or None) of a call with these arguments and tensors; key None when they
    cannot be a key (the full path validates them)."""
    try:
        key = (kind, group, id(config), op, min_bytes, pipeline, backend, check,
               *[(t.dtype, t.shape, t.stride(), t.device, t.requires_grad) for t in tensors])
        return key, STATE.steady.get(key)
    except (AttributeError, TypeError):  # not tensors, unhashable arguments
        return None, None


def remember(key, call, plan, tensors: tuple, config) -> None:
    """Keep what this call decided for its repeats (see `Steady`), once the ranks agreed on it. The
    entry counts in the share of the group the call named (a compressing group's own, so that it
    goes with that group), or of the group that carries the bytes for the default group."""
    if (key is None or plan.backend != "triton" or call.p < 2 or check_mode(key[7]) == "always"
            or not all(t.is_contiguous() for t in tensors)):
        return
    named = key[1]
    STATE.steady.put(key, Steady(call, plan, config, named is None), call.pg if named is None else named)
