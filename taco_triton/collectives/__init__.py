"""Compressed collectives over torch.distributed (gloo for CPU tensors, NCCL for CUDA tensors)."""
from ._pg import WireCall, WireStats
from .compressed import DEFAULT_MIN_BYTES, all_gather, all_reduce, reduce_scatter
from .work import Pending
from . import p2p  # compressed point-to-point messages: p2p.isend / p2p.irecv

__all__ = ["DEFAULT_MIN_BYTES", "Pending", "WireCall", "WireStats", "all_gather", "all_reduce", "p2p", "reduce_scatter"]
