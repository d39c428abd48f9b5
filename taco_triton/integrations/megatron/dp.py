"""The data-parallel axis of the mappings mode: DDP's gradient reductions and the distributed
optimizer's parameter all-gather, and the DP policy derived from the user's (`gradient_policy`).

In ``distributed.param_and_grad_buffer`` the module globals ``torch`` (its
``distributed.all_reduce``), ``dist_reduce_scatter_func``, ``dist_all_gather_func`` and
``_coalescing_manager`` are replaced (see `patching`); gradient reductions use the DP policy at
``megatron.dp.bucket<k>.<collective>`` ("backward"), the parameter all-gather stays native
unless ``compress_param_gather`` (the codec's error in every weight) or ``weight_deltas`` (the
weights' quantized differences, `integrations.weight_deltas`).
"""
from __future__ import annotations

import torch.distributed as dist

from ...collectives import compressed as coll
from ...collectives.work import completed
from ...config import CompressionConfig
from .common import derived_policy
from .error_feedback import feed_back_error

GRADIENT_CONFIG = CompressionConfig(codec="int8", hadamard=True, rounding="stochastic")
"""What data-parallel gradients are compressed with by default: INT8 after the block Hadamard
transform (which spreads outliers over the group), stochastic rounding so that the reduced
gradient is unbiased."""
#: The reduce ops the DP axis routes; others go to torch.
REDUCE_OPS = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg"}


def gradient_policy(policy=None, *, error_feedback: bool = False):
    """The data-parallel policy `enable` derives when it is not given one.

    `GRADIENT_CONFIG` (INT8, Hadamard, stochastic rounding) as the default of every DP site,
    with `policy`'s other fields meaning what they mean on every axis: `forward` (the parameter
    all-gather, compressed only with `compress_param_gather`) and `backward` (the gradient
    reductions) switch compression per direction, `min_bytes`, `exempt` and `overrides` (site
    patterns such as ``"megatron.dp.*"``) apply as they are, `comm_dtype` is kept (the megatron
    integration communicates in megatron's own dtypes on every axis, see `enable`). Nothing is
    compressed when `policy.default` is None. Calibration fields are not carried: DP gradients
    are not calibrated unless `enable(dp=...)` gets a calibrating policy. With `error_feedback`,
    the default rounds to nearest (the residual this rank carries is then exactly what its
    quantization dropped; see `enable`).

    Args:
        policy: the policy whose fields carry over (None: `GRADIENT_CONFIG` for every DP site).
        error_feedback: round to nearest instead (see above).

    Returns:
        The DP `CompressionPolicy`.
    """
    return derived_policy(policy, GRADIENT_CONFIG.replace(rounding="nearest") if error_feedback else GRADIENT_CONFIG)


def collective(handle, kind, tensor, output, op, group, async_op, frame):
    """One DDP collective (bucket gradient all-reduce / reduce-scatter, or parameter all-gather)
    issued from `frame` (megatron's, whose local ``bucket`` names the site)."""
    bucket = frame.f_locals.get("bucket")
    where = f"bucket{bucket.bucket_id}" if hasattr(bucket, "bucket_id") else frame.f_code.co_name.strip("_")
    direction = "forward" if kind == "all_gather" else "backward"
    site = f"megatron.dp.{where}.{kind}"
    deltas = kind == "all_gather" and handle.weight_deltas is not None
    # parameters stay exact by default
    native = kind == "all_gather" and not (handle.compress_param_gather or deltas)

    def issue(cfg, mb):
        if deltas:  # the policy decides whether the site is compressed, the deltas' own codec how
            wd = handle.weight_deltas
            return wd.all_gather(output, tensor, group, wd.config if cfg.enabled else None, async_op=async_op)
        # megatron's other DP reductions (e.g. across distributed-optimizer instances) keep the policy's config
        if handle.two_level is not None and cfg.enabled and kind != "all_gather" and handle.two_level.serves(group):
            return two_level(handle.two_level, kind, tensor, output, op, async_op)
        if handle.error_feedback and cfg.enabled and kind != "all_gather":
            feed_back_error(handle.residuals, tensor, cfg,
                            dist.get_world_size(group) if kind == "reduce_scatter" else 1, site)
        if kind == "all_reduce":
            return coll.all_reduce(tensor, group, cfg, op, async_op=async_op, min_bytes=mb)
        if kind == "reduce_scatter":
            return coll.reduce_scatter(output, tensor, group, cfg, op, async_op=async_op, min_bytes=mb)
        return coll.all_gather(output, tensor, group, cfg, async_op=async_op, min_bytes=mb)

    work = handle._route("dp", site, direction, kind, tensor, group, issue, native=native)
    if async_op and work is not None and handle._batches:
        handle._batches[-1].works.append(work)
    return work


def two_level(reduction, kind, tensor, output, op, async_op):
    """A gradient reduction by `reduction` (a `TwoLevel` built for the call's group), synchronous:
    with `async_op` the returned Work is already complete."""
    if kind == "all_reduce":
        reduction.all_reduce(tensor, op)
    else:
        reduction.reduce_scatter(output, tensor, op)
    return completed(None, tensor.device) if async_op else None
