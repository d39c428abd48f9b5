"""Compressed all_reduce, reduce_scatter and all_gather with torch.distributed semantics: the
public API of the collectives.

all_reduce is two-shot, as in TACO: every rank compresses P chunks of its tensor, an
all-to-all delivers chunk r of every rank to rank r, one fused kernel dequantizes, sums and
requantizes them (in the transformed domain: no inverse/forward Hadamard between sum and
requantization), an all-gather delivers the compressed sums to everyone and each rank
decompresses all of them - its own too, so every rank ends with bitwise-identical results.
reduce_scatter is the first half (the fused kernel writes the dense sum); all_gather compresses
the local shard once.

Launches: on the Triton path a pipeline slice costs one launch per stage whatever P is. One
compress launch writes all P chunks into their 16-byte-aligned slots of the send buffer, each
with its tag and zero padding; one fused reduce; one decompress launch for all P received
slots: 3 per slice for all_reduce, 2 for reduce_scatter and all_gather. What a call needs besides
the data (slice geometry, tags, the slots' descriptor tables on the device, launch parameters,
grids, constexprs) is a plan built by the first call of a (group, signature, device) and
reused, with its wire buffers. A call repeated with the same arguments and tensor metadata goes
straight to its plan's launches (the steady state).

No host synchronization in the steady state: the receiving kernels check every slot's tag on
the device; a mismatch makes the outputs it fed NaN and fills the call's own small host-visible
error record, which the host reads once that call's work is complete, without waiting for it,
and raises in that call (`check_errors`). The rank-agreement exchange (a fingerprint all_gather
whose result the host reads) runs on the first call of each (group, signature) and is kept;
check="always" runs it on every call.

Async calls leave the caller free until `wait()` (`_driver`): on CUDA they run on the device's
communication stream, forked from the caller's stream by one event and joined at `wait()` by
one; on CPU (gloo) as jobs of the group's worker thread, in issue order.

Where each part lives: `_call` (validation, path, signature, agreement, the front half of the
three functions below), `_shapes` (each collective's stages, slots and native fallback), `_plan`
(geometry, tables, prepared launches, buffers, per codec path), `_driver` (the schedule of stages
over slices and its streams and waits), `_errors` (error records), `_steady` (the steady state),
`taco_triton.state` (what is kept between calls, and its eviction rule), `_streams` (CUDA streams and
events), `work` (the Work types), `_pg` (the process-group calls and `WireStats`).
"""
from __future__ import annotations

import torch

from ..config import CompressionConfig
from . import _pg
from ._call import AUTO_SLICE_BYTES, DEFAULT_MIN_BYTES, MAX_PIPELINE, collective
from ._errors import check_errors
from ._shapes import ALL_GATHER_SHAPE, ALL_REDUCE_SHAPE, REDUCE_SCATTER_SHAPE, overflow_threshold
from .work import Pending

__all__ = ["AUTO_SLICE_BYTES", "DEFAULT_MIN_BYTES", "MAX_PIPELINE", "Pending", "all_gather", "all_reduce",
           "check_errors", "overflow_threshold", "reduce_scatter"]

@_pg.records_as("all_reduce")
def all_reduce(
    tensor: torch.Tensor, group=None, config: CompressionConfig | None = None, op: str = "sum",
    async_op: bool = False, *, min_bytes: int | None = None, pipeline="auto", backend: str = "auto",
    check: bool | None = None,
):
    """In-place all-reduce like `dist.all_reduce`, with about half the bytes on the wire.

    Args:
        tensor: any shape, any strides; bf16/fp16/fp32 are compressed, other dtypes run natively.
            Zero elements are fine on every path, as in torch (only the 4-byte tags move).
        group: process group (None: the default group). On a rank outside it: nothing, None.
        config: `CompressionConfig` (None: the default). `enabled=False`, or a message smaller
            than `min_bytes`, runs the native collective. The message is the whole buffer
            (all_reduce: the tensor; reduce_scatter: the input; all_gather: the output).
        min_bytes: None means `DEFAULT_MIN_BYTES` where the codec runs on a GPU, and native
            collectives where it would be the torch reference on CPU (measured slower than
            the link at every size for links >= 0.25 Gbit/s); pass an int to compress anyway.
        op: "sum" or "avg" ("avg" needs a floating dtype).
        async_op: return a `Pending` handle whose `wait()` completes the operation. The call
            returns before its communication completes: on CUDA its work runs on the device's
            communication stream and `wait()` orders the waiting stream after it; on CPU it
            runs on the group's worker thread and `wait()` blocks for it, and raises its errors
            (a disagreement found by `check` included). See the collectives guide.
        pipeline: slices in flight ("auto" or 1..16): compression of one overlaps the
            communication of the previous.
        backend: codec backend, as in `taco_triton.compress`.
        check: exchange an 8-byte fingerprint of (kind, sizes, dtype, op, path, config, slices,
            backend) first and raise ValueError on every rank, naming each rank's values, if
            they differ. True: on the first call of each (group, signature), then cached (the
            exchange reads its result on the host); "always": on every call (debugging);
            False: never. None: as env TACO_TRITON_CHECK_COLLECTIVES says (default: True).
            Every slot also carries a 4-byte tag of the call checked by the receiving kernel: a
            mismatch makes the outputs it fed NaN and raises ValueError without a host
            synchronization, in this call and no other: at its end (sync), at its handle's
            `wait()` (async); on CUDA once its work is complete (see `check_errors`).

    Returns:
        None; with `async_op`, a `Pending` handle whose `wait()` completes the operation. On a
        rank outside `group`: None, nothing done.

    Raises:
        TypeError: a tensor or `config` of the wrong type.
        ValueError: bad arguments (`op`, `min_bytes`, `pipeline`, sizes or dtypes that do not
            fit, an output with overlapping elements), ranks that disagree (`check`), or a tag
            mismatch (the ranks issued different collectives; the outputs it fed are NaN).

    Every rank ends with bitwise-identical values. Groups that held NaN/Inf on any rank are NaN;
    a sum that overflows the dtype is +-inf (see `overflow_threshold`). Autograd does not see the
    collective, as with `dist.all_reduce`.
    """
    return collective(ALL_REDUCE_SHAPE, (tensor,), group, config, op, min_bytes, pipeline, backend, check, async_op)


@_pg.records_as("reduce_scatter")
def reduce_scatter(
    output: torch.Tensor, input: torch.Tensor, group=None, config: CompressionConfig | None = None,
    op: str = "sum", async_op: bool = False, *, min_bytes: int | None = None, pipeline="auto",
    backend: str = "auto", check: bool | None = None,
):
    """Like `dist.reduce_scatter_tensor`: `input` is P equal slices along dim 0 (flattened),
    rank r's `output` gets the reduction of every rank's slice r.

    Args:
        output: this rank's slice of the result, any shape and strides with 1/P of `input`'s
            elements, in its dtype.
        input: the whole message (contiguous or not).
        group: as in `all_reduce`.
        config: as in `all_reduce`.
        op: as in `all_reduce`.
        async_op: as in `all_reduce`.
        min_bytes: as in `all_reduce`.
        pipeline: as in `all_reduce`.
        backend: as in `all_reduce`.
        check: as in `all_reduce`.

    Returns:
        None; with `async_op`, a `Pending` handle whose `wait()` completes the operation. On a
        rank outside `group`: None, nothing done.

    Raises:
        TypeError: a tensor or `config` of the wrong type.
        ValueError: bad arguments (`op`, `min_bytes`, `pipeline`, sizes or dtypes that do not
            fit, an output with overlapping elements), ranks that disagree (`check`), or a tag
            mismatch (the ranks issued different collectives; the outputs it fed are NaN).

    Overflow: a sum that overflows the output dtype is +-inf, as in `all_reduce`, with one
    exception. The ranks' values are summed in FP32 in the transformed domain, then transformed
    back; a group whose FP32 sum overflows there (only possible for bf16 and FP32 tensors whose
    values in that group approach 2 * 3.4e38 / P in magnitude; never for fp16) comes out NaN in
    all its elements on NVIDIA GPUs, whose FP32 transform splits its operands into bf16 pieces
    (Inf - Inf is NaN). On AMD GPUs and on CPU such a group's elements are +-inf, or NaN where
    infinities of both signs meet in the transform.
    """
    return collective(REDUCE_SCATTER_SHAPE, (output, input), group, config, op, min_bytes, pipeline, backend, check,
                      async_op)


@_pg.records_as("all_gather")
def all_gather(
    output: torch.Tensor, input: torch.Tensor, group=None, config: CompressionConfig | None = None,
    async_op: bool = False, *, min_bytes: int | None = None, pipeline="auto", backend: str = "auto",
    check: bool | None = None,
):
    """Like `dist.all_gather_into_tensor`: `output` is P slices along dim 0, slice r from rank r.
    The local shard is compressed once.

    Args:
        output: the gathered result, P times `input`'s elements in its dtype, any strides.
        input: this rank's shard (contiguous or not).
        group: as in `all_reduce`.
        config: as in `all_reduce`.
        async_op: as in `all_reduce`.
        min_bytes: as in `all_reduce`.
        pipeline: as in `all_reduce`.
        backend: as in `all_reduce`.
        check: as in `all_reduce`.

    Returns:
        None; with `async_op`, a `Pending` handle whose `wait()` completes the operation. On a
        rank outside `group`: None, nothing done.

    Raises:
        TypeError: a tensor or `config` of the wrong type.
        ValueError: bad arguments (`op`, `min_bytes`, `pipeline`, sizes or dtypes that do not
            fit, an output with overlapping elements), ranks that disagree (`check`), or a tag
            mismatch (the ranks issued different collectives; the outputs it fed are NaN).
    """
    return collective(ALL_GATHER_SHAPE, (output, input), group, config, "sum", min_bytes, pipeline, backend, check,
                      async_op)

