"""The parameter all-gather of a sharded optimizer as quantized weight differences (SDP4Bit's
scheme, arXiv 2410.15526): what crosses the wire is each shard's change since the last gather.

Every rank holds the full weights (megatron's distributed optimizer keeps the whole parameter
buffer on every rank and gathers it after each step) and each owns one shard, whose FP32 master
copy the optimizer updates. Instead of the owner's new weights, `WeightDeltas.all_gather` sends
their difference from the weights every rank already holds, compressed (default: INT4, G=32,
Hadamard, nearest rounding): every rank, the owner included, decodes the same differences and adds
them to the weights it holds, in the same order and dtype, so all ranks end bit-identical. The
next difference is taken against these applied weights, so the codec's error does not accumulate:
after any number of steps the weights differ from the master (rounded to the buffer's dtype) by
one difference's quantization error plus one rounding, and the master itself stays exact.

State: per gathered buffer, this rank's shard of the applied weights (the owner's optimizer
overwrites that shard of the buffer before the gather; the other shards still hold what was
applied). The first gather of a buffer is exact, which gives every rank the same starting point
whatever it held before.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..collectives import compressed as coll
from ..collectives.work import as_work
from ..config import CompressionConfig

WEIGHT_DELTA_CONFIG = CompressionConfig(codec="int4", group_size=32, hadamard=True)
"""What weight differences are sent with by default: INT4 with G=32 (the sub-byte codes need small
groups), after the block Hadamard transform, nearest rounding (0.53 bytes per element: 0.27x bf16)."""

_EXACT = CompressionConfig(enabled=False)


class WeightDeltas:
    """The state of the weight-difference all-gather: per buffer, this rank's shard of the weights
    every rank holds.

    Args:
        config: the codec of the differences (`WEIGHT_DELTA_CONFIG` by default).
    """

    def __init__(self, config: CompressionConfig = WEIGHT_DELTA_CONFIG):
        if not isinstance(config, CompressionConfig) or not config.enabled:
            raise ValueError(f"WeightDeltas needs an enabled CompressionConfig, got {config!r}")
        self.config = config
        #: {(buffer data_ptr, numel): this rank's shard of the applied weights}
        self.held: dict[tuple[int, int], torch.Tensor] = {}

    def reset(self) -> None:
        """Forget every buffer: the next gather of each is exact again."""
        self.held.clear()

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, group=None, config: CompressionConfig | None = None,
                   async_op: bool = False):
        """Gather the shards' new weights into `output` (contiguous; shard r is rank r's) as
        differences from what every rank holds. `input` is this rank's new shard (it may be a view
        of `output`, as in megatron). `config`: None sends the exact weights (and makes them what
        every rank holds), else the codec of the differences (callers pass `self.config` unless a
        policy says otherwise).

        Returns:
            None, or with `async_op` a Work whose `wait()` completes the gather and applies it.

        Raises:
            ValueError: `output` is not contiguous or not `world` times `input`'s elements.
        """
        p, me = dist.get_world_size(group), dist.get_rank(group)
        m = input.numel()
        if not output.is_contiguous() or output.numel() != p * m or output.dtype != input.dtype:
            raise ValueError(f"weight deltas need a contiguous output of {p} x {m} elements of {input.dtype}, got "
                             f"{output.numel()} elements of {output.dtype} (contiguous={output.is_contiguous()})")
        flat = output.view(-1)
        key = (flat.data_ptr(), flat.numel())
        mine = slice(me * m, (me + 1) * m)
        held = self.held.get(key)
        if held is None or config is None or not config.enabled:
            work = coll.all_gather(output, input, group, _EXACT, async_op=async_op)

            def keep():  # what every rank now holds of this rank's shard
                self.held[key] = flat[mine].clone()

            return _then(work, keep, output, async_op)
        delta = input.reshape(-1).float() - held.float()  # before the buffer's shard is put back
        decoded = torch.empty(p * m, dtype=torch.float32, device=output.device)
        work = coll.all_gather(decoded, delta, group, config, async_op=async_op, min_bytes=0)

        def apply():
            flat[mine].copy_(held)  # the owner's shard as every rank holds it, then every rank adds the same
            flat.copy_(flat.float() + decoded)
            held.copy_(flat[mine])

        return _then(work, apply, output, async_op)


def _then(work, finish, output, async_op):
    """`finish()` once `work` is complete: now (sync), or at the returned Work's `wait()`."""
    if not async_op:
        finish()
        return None
    return as_work(work, output, output.device, then=finish)
