"""Compressed point-to-point messages (pipeline-parallel stage boundaries).

The sender compresses once into one uint8 wire buffer; the receiver knows the tensor's shape,
dtype and config (both ends derive the wire layout from them, as in the collectives), receives
the buffer and decompresses it into its own tensor. Nothing but the wire buffer travels.

    work = isend(activations, dst=next_rank, config=cfg, min_bytes=0)      # stage s
    work = irecv(buffer, src=prev_rank, config=cfg, min_bytes=0); work.wait()  # stage s + 1

`encode` / `wire_like` / `decode_into` are the three steps on their own, for code that issues the
send and receive itself (the megatron integration hands the wire buffers to megatron's own p2p
helpers, so that its ordering of sends and receives is kept).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import ops
from ..config import INPUT_DTYPES, CompressionConfig
from ..layout import WireLayout
from . import _pg
from .compressed import DEFAULT_MIN_BYTES

__all__ = ["decode_into", "encode", "irecv", "isend", "should_compress", "wire_like"]


def should_compress(tensor: torch.Tensor, config: CompressionConfig | None, min_bytes: int | None,
                    backend: str = "auto") -> bool:
    """Whether a message goes compressed; sender and receiver decide alike from what both know
    (config, dtype, size). `min_bytes=None` follows the collectives: `DEFAULT_MIN_BYTES` where the
    codec runs on a GPU, never where it would be the torch reference on CPU."""
    if config is None or not config.enabled or tensor.dtype not in INPUT_DTYPES:
        return False
    if min_bytes is None:
        if ops.resolve_backend(backend, tensor.device) == "torch":
            return False
        min_bytes = DEFAULT_MIN_BYTES
    return tensor.numel() * tensor.element_size() >= min_bytes


def encode(tensor: torch.Tensor, config: CompressionConfig, backend: str = "auto") -> torch.Tensor:
    """The wire buffer of `tensor` (1-D uint8; compressed once)."""
    wire = wire_like(tensor, config)
    ops.compress_into(tensor.detach().contiguous().view(-1), config, wire, backend)
    return wire


def wire_like(tensor: torch.Tensor, config: CompressionConfig) -> torch.Tensor:
    """An empty wire buffer for a message shaped like `tensor`."""
    return torch.empty(WireLayout.of(tensor.numel(), config).nbytes, dtype=torch.uint8, device=tensor.device)


def decode_into(wire: torch.Tensor, tensor: torch.Tensor, config: CompressionConfig, backend: str = "auto") -> None:
    """Decompress a received wire buffer into `tensor` (contiguous; autograd leaves allowed)."""
    if not tensor.is_contiguous():
        raise ValueError(f"decode_into needs a contiguous tensor, got shape {tuple(tensor.shape)} "
                         f"with strides {tensor.stride()}")
    ops.decompress_into(wire, tensor.detach(), config, backend)


def record_send(buffer: torch.Tensor, compressed: bool) -> None:
    """Count a message this rank sends in the active `WireStats` (its bytes, once)."""
    n = buffer.numel() * buffer.element_size()
    _pg._record("send", n, float(n), compressed)
    _pg.guard_exit(buffer)


class _DecodeOnWait:
    """A receive's Work: `wait()` waits for the wire buffer, then decompresses it (once)."""

    def __init__(self, work, wire, tensor, config, backend):
        self._work, self._wire, self._tensor, self._config, self._backend = work, wire, tensor, config, backend

    def wait(self, timeout=None) -> bool:
        if self._wire is not None:
            self._work.wait()
            decode_into(self._wire, self._tensor, self._config, self._backend)
            self._wire = None
        return True

    def is_completed(self) -> bool:
        return self._wire is None


def isend(tensor: torch.Tensor, dst: int, group=None, config: CompressionConfig | None = None, *,
          min_bytes: int | None = None, backend: str = "auto"):
    """Like `dist.isend` (dst is a global rank); compressed when `should_compress`."""
    if should_compress(tensor, config, min_bytes, backend):
        wire = encode(tensor, config, backend)
        record_send(wire, True)
        return dist.isend(wire, dst, group=group)
    record_send(tensor, False)
    return dist.isend(tensor.contiguous(), dst, group=group)


def irecv(tensor: torch.Tensor, src: int, group=None, config: CompressionConfig | None = None, *,
          min_bytes: int | None = None, backend: str = "auto"):
    """Like `dist.irecv` into `tensor`; the sender must pass the same config and min_bytes.
    The returned Work's `wait()` leaves the decompressed message in `tensor`."""
    _pg.guard_exit(tensor)
    if should_compress(tensor, config, min_bytes, backend):
        wire = wire_like(tensor, config)
        return _DecodeOnWait(dist.irecv(wire, src, group=group), wire, tensor, config, backend)
    return dist.irecv(tensor, src, group=group)
