"""A compressed collective's call: its validation, the path it takes (compressed or native), its
signature and fingerprint, the rank agreement, and the one front half every public collective runs
(`collective`).

The rank-agreement exchange (a fingerprint all_gather whose result the host reads, `_pg.agree`)
runs on the first call of each (group, signature) and is kept (`STATE.agreements`);
check="always" runs it on every call. Limitation of keeping it: a rank that changes its signature
alone after the first call is caught by the tags if the message sizes still match; if they do
not, the process group sees mismatched collectives (use check="always" while debugging).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import ops
from ..config import INPUT_DTYPES, CompressionConfig
from ..env import check_mode, compress_single_rank
from . import _driver, _pg, _plan, _steady, _streams, _worker
from ..state import STATE
from ..wire import AUTO_SLICE_BYTES, MAX_PIPELINE, depth  # noqa: F401 - re-exported by compressed

DEFAULT_MIN_BYTES = 1 << 20
"""Messages below this many bytes go through the native collective when the codec runs on a GPU.
Not yet measured on GPUs (TACO's authors use 10 MiB); see docs/speed/index.md. On CPU tensors the codec is the
torch reference (~14 MB/s per core measured, bench/collectives.py), slower than the link at
every size for links >= 0.25 Gbit/s, so there the default is native unless min_bytes is given."""
def default_config() -> CompressionConfig:
    """The config of calls that pass None (made once)."""
    if STATE.default_config is None:
        STATE.default_config = CompressionConfig()
    return STATE.default_config


def fingerprint(signature: tuple) -> int:
    """`_pg.fingerprint(signature)`, kept (`STATE.fingerprints`)."""
    fp = STATE.fingerprints.get(signature)
    if fp is None:
        fp = _pg.fingerprint(signature)
        STATE.fingerprints.put(signature, fp)
    return fp


class Call:
    """What one collective call decided before touching any byte: path, slices, fingerprint."""

    def __init__(self, kind, tensors, group, config, op, min_bytes, pipeline, backend, check):
        """tensors[0] is the one written (all_reduce's tensor, the others' output)."""
        # the group that carries the bytes (a compressing group's inner): calls issue, agree and order
        # on it, and it keys their state; a default group re-created after destroy_process_group is a
        # new object, whose agreements and plans (which hold P and the rank) start afresh
        self.kind, self.op = kind, op
        self.group = self.pg = _pg.carrier(group)
        STATE.sweep()  # a call that is no repeat: groups destroyed since are forgotten (`State.sweep`)
        config = default_config() if config is None else config
        if not isinstance(config, CompressionConfig):
            raise TypeError(f"config must be a CompressionConfig or None, got {type(config).__name__}")
        if op not in ("sum", "avg"):
            raise ValueError(f"op must be 'sum' or 'avg', got {op!r}")
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"taco_triton.{kind} expects tensors, got {type(t).__name__}")
        dtype = self.dtype = tensors[0].dtype
        if any(st == 0 and n > 1 for st, n in zip(tensors[0].stride(), tensors[0].shape)):  # expand(): shared elements
            raise ValueError(f"taco_triton.{kind}: the output tensor has overlapping elements (strides "
                             f"{tensors[0].stride()} for shape {tuple(tensors[0].shape)}); pass a tensor that owns each element")
        if op == "avg" and not (dtype.is_floating_point or dtype.is_complex):
            raise ValueError(f"taco_triton.{kind}: op='avg' needs a floating dtype, got {dtype}")
        if min_bytes is not None and (isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0):
            raise ValueError(f"min_bytes must be None or an int >= 0, got {min_bytes!r}")
        message = max(tensors, key=lambda t: t.numel())  # the whole buffer: comparable across collectives
        nbytes = message.numel() * message.element_size()
        self.backend = ops.resolve_backend(backend, message.device)
        n_slices = depth(nbytes, pipeline)  # validates `pipeline` on every path
        if min_bytes is None:
            # the CPU reference codec is slower than any link we measured: native there
            min_bytes = None if self.backend == "torch" else DEFAULT_MIN_BYTES
        self.compress = (min_bytes is not None and config.enabled and dtype in INPUT_DTYPES and nbytes >= min_bytes)
        self.config = config if self.compress else None
        self.depth = n_slices if self.compress else None
        self.p = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.signature = (kind, tuple(t.numel() for t in tensors), str(dtype), op, self.compress, self.config,
                          self.depth, self.backend if self.compress else None)
        self.fp = fingerprint(self.signature)
        self.seq = next(STATE.calls)
        self.device = message.device
        mode = check_mode(check)
        self.mode = mode if self.p > 1 else "never"

    def agree(self) -> None:
        """Run the rank-agreement exchange if this call needs one (see the module docstring). A
        process-group call, so it runs in the group's order with the call's own (`_driver`), and
        so does the decision: whether an earlier call of the signature agreed is asked when this
        one runs, which on CPU may be on the group's worker after earlier async calls, in the
        same order on every rank."""
        if self.mode == "never":
            return
        key = (self.pg, self.signature)
        if self.mode == "always" or not STATE.agreements.has(key):
            _pg.agree(self.kind, self.signature, self.device, self.group)
            STATE.agreements.put(key, None, self.pg)


def member(group) -> bool:
    """False on a rank outside `group` (torch.distributed's collectives are no-ops there)."""
    return group is None or dist.get_rank(group) >= 0


def _detached(tensors: tuple) -> tuple:
    return tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in tensors)


def collective(shape, tensors: tuple, group, config, op: str, min_bytes, pipeline, backend, check, async_op: bool):
    """The front half of every public collective, then its issue: `shape` says which collective,
    `tensors` are its (output, input) or all_reduce's (tensor,). A repeat goes straight to its
    plan (`_steady`); otherwise the arguments are checked, the ranks agree, and the call runs
    natively or on its plan (`_driver.run`). Returns the handle (async) or None."""
    key, steady = _steady.lookup(shape.kind, tensors, group, config, op, min_bytes, pipeline, backend, check)
    if steady is not None and steady.ready(check):
        dst = tensors[0] if tensors[0].dim() == 1 else tensors[0].view(-1)  # contiguous (see _steady)
        if shape.in_place:
            return steady.repeat(dst, dst, async_op)
        src = tensors[1] if tensors[1].dim() == 1 else tensors[1].view(-1)
        return steady.repeat(src, dst, async_op)
    if not member(group):
        return None
    tensors = _detached(tensors)  # invisible to autograd, as native
    shape.check(tensors, group)
    call = Call(shape.kind, tensors, group, config, op, min_bytes, pipeline, backend, check)
    if not call.compress or (call.p == 1 and not compress_single_rank()):
        return _native_path(shape, call, tensors, op, async_op)
    src, dst, copy_back = shape.flats(tensors)
    plan = _plan.plan_for(call, shape, src, dst)

    def keep():  # only once the ranks agreed on the call: a repeat skips the agreement
        _steady.remember(key, call, plan, tensors, config)

    before = None
    if call.mode == "never":
        keep()
    else:
        def before():  # in the group's order, on CPU possibly on its worker
            call.agree()
            keep()
    return _driver.issue(plan, src, dst, call.seq, call.group, call.pg, async_op, before, copy_back)


def _native_path(shape, call: Call, tensors: tuple, op: str, async_op: bool):
    """The native collective (and the agreement before it), in the group's order: on CPU behind
    the group's queued async calls (`_worker`), if any."""

    def issue():
        call.agree()
        return shape.native(tensors, call.group, op, call.p, async_op)

    if _streams.on_streams(call.device):
        return issue()
    return _worker.in_order(call.pg, issue, async_op)
