"""Does compression pay off for my collective? A first-order model from quantities you can state.

    >>> import taco_triton as taco
    >>> e = taco.estimate(8 * 4096 * 4096, link_gbps=400, ranks=8, codec_gbytes_s=None)
    >>> round(e.wire_ratio, 3), e.launches, round(e.speedup, 2)   # codec time left out, 3 launches' host time in
    (0.504, 3, 1.98)
    >>> round(taco.estimate(8 * 4096 * 4096, link_gbps=400, ranks=8, host_us_per_launch=0).speedup, 2)
    1.98

Model (per rank, full-duplex links, the nccl-tests cost model that `WireStats` counts):

- link time = bytes each rank sends / `link_gbps` + `latency_us` per communication step.
  Native ring all_reduce sends 2 (P-1)/P of the message; the compressed two-shot all_reduce
  sends 2 (P-1)/P of its wire bytes (an all-to-all, then an all-gather, of the compressed
  chunks). reduce_scatter and all_gather send half as much, each way. Both take 2 (P-1) steps
  (all_reduce) or P-1 steps.
- wire bytes come from `WireLayout` (codes, scales) plus each chunk's 4-byte tag and padding: exactly what each rank
  sends when the message cuts into P equal chunks (all_reduce: super-block-aligned ones), the
  average over ranks otherwise.
- codec time = element-passes x element size / `codec_gbytes_s`: all_reduce compresses the
  message, decodes P chunks and re-encodes one in the fused reduce, and decompresses the result,
  3 + 1/P passes; reduce_scatter 2 (compress, fused decode-sum); all_gather 1 + 1/P.
  `codec_gbytes_s` is the dense (input dtype) bytes a compress or decompress pass processes per
  second: measure it with `bench/kernel_speed.py` on your GPU (its `bytes` column also counts the
  compressed side, so divide its `logical_gbps` by about 1.5 for bf16). None leaves the codec
  out: the result is then the ceiling the wire ratio allows, not a prediction.
- host time = kernel launches x `host_us_per_launch`: the compressed collectives launch at most
  `LAUNCHES_PER_SLICE` kernels per pipeline slice (all_reduce 3: one compress of every chunk,
  the fused reduce, one decompress; reduce_scatter and all_gather 2), `pipeline` slices per
  call. The default per-launch time is `HOST_US_PER_LAUNCH`. The native collective launches no
  codec kernel; the host time of the communication calls themselves is left out on both sides.
- a point-to-point message (`collective="p2p"`, a pipeline stage's send): the sender sends the
  tensor, or its wire buffer (the message's one slot, tag and padding included), in one step;
  the codec compresses on the sender and decompresses on the receiver, 2 passes and 2 launches,
  both on the message's path.
- `overlap=False` adds codec, link and host time (no pipelining); True takes the largest of
  the three, the bound `pipeline` slicing approaches on large messages.
- `break_even_codec_gbytes_s`: the codec throughput below which compression loses. For a large
  all_reduce (host time negligible) it is (3 + 1/P) / (2 (P-1)/P x (1 - wire_ratio)) times the
  link's bytes/s without overlap (3.6x at P = 8), (3 + 1/P) / (2 (P-1)/P) with it (1.8x); where
  link and host time alone reach the native time, no codec is fast enough (inf).

What the model leaves out: contention between codec and communication for memory bandwidth,
algorithms other than ring/two-shot (NCCL's tree and NVLS all-reduce move fewer bytes per rank
at large P), and on the native side any in-network reduction.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from . import wire as contract
from .config import INPUT_DTYPES, CompressionConfig

__all__ = ["COLLECTIVES", "LAUNCHES_PER_SLICE", "HOST_US_PER_LAUNCH", "P2P", "RING_COSTS", "Estimate", "ring_bytes",
           "compressed_bytes_per_rank", "compressed_wire_bytes", "estimate"]

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")
"""The collectives `estimate` models; it also models a point-to-point message ("p2p")."""
P2P = "p2p"
"""`estimate`'s name for a point-to-point message (`taco_triton.collectives.p2p`)."""
LAUNCHES_PER_SLICE = {c: contract.launches(c, 1) for c in COLLECTIVES}
"""Kernel launches per pipeline slice of each compressed collective, one per stage of its wire
contract (`taco_triton.wire.STAGES`): all_reduce compresses every chunk in one launch, reduces in
one and decompresses in one; reduce_scatter compresses and decode-sums; all_gather compresses and
decompresses."""
HOST_US_PER_LAUNCH = 6.0
"""Host time per kernel launch on the collectives' path, in microseconds: the median over every
collective, world size (2, 4, 8) and pipeline depth (1, 2) that bench/host_overhead.py measured
on a 2-core x86-64 CPU host with the kernel launches stubbed and the process-group calls left
out (bench/results/host_overhead.csv: 6.0 us, 3.9x a 16-element torch.add timed in the same
run). A GPU host's faster cores do better; Triton's own launch cost on a GPU is not in it."""


@dataclass(frozen=True)
class Estimate:
    """Times in seconds, per call, for one rank. `speedup` = native_s / compressed_s."""

    collective: str
    """The collective modelled."""
    native_s: float
    """The native collective's time."""
    compressed_s: float
    """The compressed collective's time: link, codec and host time, added or overlapped."""
    link_s: float
    """The compressed collective's communication time."""
    codec_s: float
    """Its compress/reduce/decompress time (0 when codec_gbytes_s is None)."""
    launches: int
    """Its kernel launches per call (0 for a disabled config)."""
    host_s: float
    """The host time of those launches."""
    speedup: float
    """native_s / compressed_s."""
    wire_ratio: float
    """Compressed bytes on the wire / native bytes on the wire."""
    native_bytes_per_rank: float
    """Bytes each rank sends natively (`ring_bytes`)."""
    compressed_bytes_per_rank: float
    """Bytes each rank sends compressed."""
    codec_counted: bool
    """Whether codec time is in `compressed_s` (False: `codec_gbytes_s` was None, a ceiling)."""
    break_even_codec_gbytes_s: float
    """The codec_gbytes_s at which speedup would be exactly 1 (inf: no codec is fast enough)."""


RING_COSTS = {
    "all_reduce": "2 (P-1)/P of the tensor",
    "reduce_scatter": "(P-1)/P of the input",
    "scatter": "(P-1)/P of the root's inputs (on the root)",
    "all_gather": "P-1 times the shard (nbytes: this rank's input)",
    "all_to_all": "(P-1)/P of the input, in whole bytes (equal splits)",
    "send": "the message (point to point: P plays no part)",
}
"""The collectives `ring_bytes` knows, and the share of `nbytes` each rank sends in them."""


def ring_bytes(collective: str, nbytes: float, ranks: int) -> float:
    """Bytes one rank sends in `collective` over `ranks` ranks by the standard ring cost model,
    the bus bytes nccl-tests counts: the one home of these formulas (`WireStats` records them for
    every call handed to a process group; `estimate` models with them).

    Args:
        collective: a key of `RING_COSTS`.
        nbytes: the bytes of the buffer the call is given: all_reduce the tensor, reduce_scatter,
            scatter and all_to_all the input, all_gather this rank's shard.
        ranks: processes in the group, P >= 1.

    Returns:
        The bytes this rank sends (`RING_COSTS`); an int for all_to_all.

    Raises:
        ValueError: an unknown collective.

    Example:
        >>> ring_bytes("all_reduce", 1000, 4), ring_bytes("all_gather", 1000, 4)
        (1500.0, 3000)
    """
    p = ranks
    if collective == "all_reduce":
        return 2 * (p - 1) / p * nbytes
    if collective in ("reduce_scatter", "scatter"):
        return (p - 1) / p * nbytes
    if collective == "all_gather":
        return (p - 1) * nbytes
    if collective == "all_to_all":
        return nbytes * (p - 1) // p
    if collective == "send":
        return nbytes
    raise ValueError(f"collective must be one of {list(RING_COSTS)}, got {collective!r}")


def _positive(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


def _non_negative(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def _integer(name: str, value, low: int) -> int:
    """`value` as an int (Python or numpy integers) if it is >= `low`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return int(value)


def compressed_wire_bytes(numel: int, config: CompressionConfig, ranks: int, collective: str = "all_reduce",
                          pipeline: int = 1) -> int:
    """Bytes of the compressed message as the collectives cut it into `ranks` chunks and `pipeline`
    slices (`taco_triton.wire`), each piece its own WireLayout in a slot with its 4-byte tag, padded
    to 16 bytes (`slots.slot_bytes`): all_reduce cuts super-block-aligned chunks, reduce_scatter
    and all_gather the equal first-dim shards.

    Args:
        numel: elements of the message (all_gather: of the gathered output).
        config: the compression config.
        ranks: processes in the group, P >= 1.
        collective: one of `COLLECTIVES`; all_reduce cuts super-block-aligned chunks.
        pipeline: the pipeline slices of the call (each adds its own tags and padding).

    Returns:
        The bytes of every slot of every slice together, tags and padding included.

    Example (1 Mi elements at P = 4, FP8: four slots of 264,464 bytes):
        >>> compressed_wire_bytes(1 << 20, CompressionConfig(), 4)
        1057856
    """
    parts, _ = contract.chunks(collective if collective == "all_reduce" else "reduce_scatter", numel, ranks)
    return sum(sum(contract.slot_strides(piece, config)) for piece in contract.pieces(parts, pipeline))


def compressed_bytes_per_rank(numel: int, config: CompressionConfig, ranks: int, collective: str = "all_reduce",
                              pipeline: int = 1) -> float:
    """Bytes one rank sends in a compressed call, as `WireStats` counts them: per pipeline slice,
    `ring_bytes` of each buffer the call hands the process group (`taco_triton.wire.buffers`;
    all_reduce's all_gather carries slots padded to the slice's widest, so uneven chunks cost more
    than their wire bytes' ring share).

    Args:
        numel: elements of the message (all_gather: of the gathered output).
        config: the compression config.
        ranks: processes in the group, P >= 1.
        collective: one of `COLLECTIVES`.
        pipeline: the pipeline slices of the call.

    Returns:
        The bytes (unrounded; `WireStats` rounds each call to a whole byte).
    """
    return sum(ring_bytes(comm, n, ranks) for sl in contract.buffers(collective, numel, config, ranks, pipeline)
               for comm, n in sl.items())


def estimate(
    numel: int,
    dtype: torch.dtype = torch.bfloat16,
    config: CompressionConfig | None = None,
    link_gbps: float = 400.0,
    ranks: int = 8,
    *,
    codec_gbytes_s: float | None = None,
    collective: str = "all_reduce",
    latency_us: float = 0.0,
    overlap: bool = False,
    pipeline: int = 1,
    host_us_per_launch: float = HOST_US_PER_LAUNCH,
) -> Estimate:
    """Native vs compressed time of one collective on a `numel`-element `dtype` message.

    Args:
        numel: elements of the whole message (all_reduce / reduce_scatter input, all_gather output);
            a Python or numpy integer.
        dtype: the message's dtype (bf16, fp16 or fp32).
        config: the CompressionConfig (default: the default config). A disabled config
            (`enabled=False`) is estimated as what the collectives run for it: the native
            collective (speedup 1).
        link_gbps: link bandwidth per rank and direction, in Gbit/s (e.g. 400 for NDR InfiniBand).
        ranks: processes in the group (the TP degree), >= 2.
        codec_gbytes_s: dense GB/s (1e9 bytes) of one compress or decompress pass, measured or
            modelled by you; None leaves codec time out (a ceiling, flagged by `codec_counted`).
        collective: "all_reduce", "reduce_scatter", "all_gather", or "p2p" for a point-to-point
            message (ranks: 2, the sender and the receiver).
        latency_us: per communication step (both paths take the same number of steps), finite.
        overlap: True when codec, link and host overlap perfectly (pipelined large messages).
        pipeline: pipeline slices per call (the collectives' `pipeline` depth), >= 1: each slice
            makes `LAUNCHES_PER_SLICE[collective]` kernel launches.
        host_us_per_launch: host time per kernel launch in microseconds, finite and >= 0
            (default `HOST_US_PER_LAUNCH`; 0 leaves host time out).

    Rates must be positive and finite (an infinitely fast link or codec is not a model input: leave
    the codec out with None).

    Returns:
        The `Estimate` of one call on one rank.

    Raises:
        ValueError: an argument out of its range (naming it and its value): a non-integer or
            too small `numel`, `ranks` or `pipeline`, an unsupported dtype or collective, a config
            that is not a CompressionConfig, a rate that is not positive and finite.
    """
    numel = _integer("numel", numel, 1)
    if dtype not in INPUT_DTYPES:
        raise ValueError(f"dtype must be one of {list(INPUT_DTYPES)}, got {dtype!r}")
    config = CompressionConfig() if config is None else config
    if not isinstance(config, CompressionConfig):
        raise ValueError(f"config must be a CompressionConfig or None, got {type(config).__name__}")
    link_bytes_s = _positive("link_gbps", link_gbps) * 1e9 / 8
    ranks = _integer("ranks", ranks, 2)
    codec_bytes_s = None if codec_gbytes_s is None else _positive("codec_gbytes_s", codec_gbytes_s) * 1e9
    if collective not in COLLECTIVES + (P2P,):
        raise ValueError(f"collective must be one of {list(COLLECTIVES + (P2P,))}, got {collective!r}")
    latency_us = _non_negative("latency_us", latency_us)
    pipeline = _integer("pipeline", pipeline, 1)
    if collective == P2P and (pipeline != 1 or ranks != 2):
        raise ValueError(f"a p2p message has one slice between 2 ranks, got pipeline={pipeline}, ranks={ranks}")
    host_us_per_launch = _non_negative("host_us_per_launch", host_us_per_launch)

    p = ranks
    dense = numel * dtype.itemsize
    # a disabled config runs the native collective: same bytes, no codec
    two_phase = collective == "all_reduce"
    steps = 1 if collective == P2P else (2 if two_phase else 1) * (p - 1)
    # every rank sends its shard in an all_gather, 1/P of the message
    native_bytes = ring_bytes("send" if collective == P2P else collective,
                              dense / p if collective == "all_gather" else dense, p)
    compressed_bytes = (compressed_bytes_per_rank(numel, config, p, collective, pipeline) if config.enabled
                        else native_bytes)
    latency = steps * latency_us * 1e-6
    native_s = native_bytes / link_bytes_s + latency
    link_s = compressed_bytes / link_bytes_s + latency
    passes = {"all_reduce": 3 + 1 / p, "reduce_scatter": 2.0, "all_gather": 1 + 1 / p, P2P: 2.0}[collective]
    codec_s = 0.0 if codec_bytes_s is None or not config.enabled else passes * dense / codec_bytes_s
    n_slices = 1 if collective == P2P else len(contract.pieces(contract.chunks(collective, numel, p)[0], pipeline))
    launches = contract.launches(collective, n_slices) if config.enabled else 0
    host_s = launches * host_us_per_launch * 1e-6
    compressed_s = max(link_s, codec_s, host_s) if overlap else link_s + codec_s + host_s
    # speedup 1 when codec_s reaches native_s (overlapped) or native_s - link_s - host_s (serial)
    if overlap:
        codec_budget_s = native_s if max(link_s, host_s) < native_s else 0.0
    else:
        codec_budget_s = native_s - link_s - host_s
    if not config.enabled:
        break_even = 0.0  # no codec runs: speedup 1 at any codec throughput
    else:
        break_even = passes * dense / codec_budget_s / 1e9 if codec_budget_s > 0 else float("inf")
    return Estimate(
        collective=collective, native_s=native_s, compressed_s=compressed_s, link_s=link_s,
        codec_s=codec_s, launches=launches, host_s=host_s, speedup=native_s / compressed_s, wire_ratio=compressed_bytes / native_bytes,
        native_bytes_per_rank=native_bytes, compressed_bytes_per_rank=compressed_bytes,
        codec_counted=codec_bytes_s is not None, break_even_codec_gbytes_s=break_even,
    )
