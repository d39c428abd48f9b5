"""Compressed point-to-point messages (pipeline-parallel stage boundaries).

The sender compresses once into one uint8 wire buffer; the receiver knows the tensor's shape,
dtype and config (both ends derive the wire layout from them, as in the collectives), receives
the buffer and decompresses it into its own tensor. The buffer is the codec's bytes, a 4-byte tag
of (size, dtype, config) and zero padding to 16 bytes; the receiving kernel checks the tag on the
device before its output is used (a mismatch: NaN and ValueError, no host synchronization). One
launch on each side. The first message of each (peer, signature) is preceded by a handshake of
fingerprints, so ends that disagree raise ValueError instead of posting receives of the wrong
size (gloo aborts the process on one). Neither `isend` nor `irecv` ever blocks: a receive behind a
handshake is posted as soon as the sender's fingerprint arrives, in issue order (`_handshake`), so
both ends may post their receives first. Stochastic rounding gets a fresh seed per message, also
in CUDA graph replays (`slots.seed_counter`).

    work = isend(activations, dst=next_rank, config=cfg, min_bytes=0)      # stage s
    work = irecv(buffer, src=prev_rank, config=cfg, min_bytes=0); work.wait()  # stage s + 1

`encode` / `wire_like` / `decode_into` are the three steps on their own, for code that issues the
send and receive itself (the megatron integration hands the wire buffers to megatron's own p2p
helpers, so that its ordering of sends and receives is kept).
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist

from .. import ops
from ..config import INPUT_DTYPES, CompressionConfig
from ..kernels import slots
from ..layout import WireLayout
from . import _errors, _handshake, _pg
from ._call import DEFAULT_MIN_BYTES
from ._plan import ReferencePlan, TritonPlan
from ._shapes import MESSAGE_SHAPE
from ..state import STATE
from .work import Pending, decode_on_wait

__all__ = ["decode_into", "encode", "irecv", "isend", "should_compress", "wire_like"]


def should_compress(tensor: torch.Tensor, config: CompressionConfig | None, min_bytes: int | None,
                    backend: str = "auto") -> bool:
    """Whether a message goes compressed; sender and receiver decide alike from what both know
    (config, dtype, size). `min_bytes=None` follows the collectives: `DEFAULT_MIN_BYTES` where the
    codec runs on a GPU, never where it would be the torch reference on CPU.

    Args:
        tensor: the message (the sender's tensor, or the receiver's buffer).
        config: the `CompressionConfig`, or None (native).
        min_bytes: messages smaller than this go natively; None as described above.
        backend: codec backend, as in `taco_triton.compress`.

    Returns:
        True when the message is compressed.
    """
    if config is None or not config.enabled or tensor.dtype not in INPUT_DTYPES:
        return False
    if min_bytes is None:
        if ops.resolve_backend(backend, tensor.device) == "torch":
            return False
        min_bytes = DEFAULT_MIN_BYTES
    return tensor.numel() * tensor.element_size() >= min_bytes


def signature(tensor: torch.Tensor, config: CompressionConfig | None) -> tuple:
    """What both ends of a message must agree on: size, dtype and config (None: sent natively)."""
    return ("p2p", tensor.numel(), str(tensor.dtype), config)


class _MessageCall:
    """What a plan reads of a call (`_plan.Plan`), for a message: one slice, P = 1, this process's
    global rank (it salts stochastic rounding)."""

    kind, p, depth, op = "p2p", 1, 1, "sum"

    def __init__(self, tensor: torch.Tensor, config: CompressionConfig, backend: str):
        self.signature = signature(tensor, config)
        self.fp = _pg.fingerprint(self.signature)
        self.config, self.backend, self.dtype, self.rank = config, backend, tensor.dtype, _rank()


def _message(tensor: torch.Tensor, config: CompressionConfig, backend: str):
    """The plan of a message like `tensor` (`_shapes.Message` under `_plan`: its slot's geometry, tag,
    descriptor table, prepared launches and error records, as the collectives'), kept in
    `STATE.messages`: a repeat goes straight to it."""
    key = (tensor.numel(), tensor.dtype, config, tensor.device, backend)
    plan = STATE.messages.get(key)
    if plan is None:
        call = _MessageCall(tensor, config, ops.resolve_backend(backend, tensor.device))
        chunks, n = MESSAGE_SHAPE.chunks(tensor, tensor, 1)
        plan = (TritonPlan if call.backend == "triton" else ReferencePlan)(call, MESSAGE_SHAPE, chunks, tensor.device, n)
        STATE.messages.put(key, plan)
    return plan


def _wire(plan) -> torch.Tensor:
    """A fresh wire buffer of the message (each message in flight holds its own): zeroed on the
    reference path, which writes only the wire bytes and the tag (the kernels write the padding)."""
    new = torch.empty if isinstance(plan, TritonPlan) else torch.zeros
    return new(plan.slices[0].slot, dtype=torch.uint8, device=plan.device)


def encode(tensor: torch.Tensor, config: CompressionConfig, backend: str = "auto") -> torch.Tensor:
    """The wire buffer of `tensor` (1-D uint8; compressed once): the codec's bytes, then a 4-byte
    tag of (size, dtype, config) the receiver checks before using them, zero-padded to 16 bytes.
    Stochastic rounding gets a fresh seed per message, so errors average out across messages.

    Args:
        tensor: the message (bf16, fp16 or fp32; any strides).
        config: the `CompressionConfig` both ends use.
        backend: codec backend, as in `taco_triton.compress`.

    Returns:
        The wire buffer, `wire_like(tensor, config)`'s size.

    Raises:
        ValueError: a backend that is not supported.
    """
    plan = _message(tensor, config, backend)
    flat = tensor.detach().contiguous().view(-1)
    seq = next(STATE.messages_sent) if config.stochastic else 0  # numbers the messages that salt their rounding
    _, step = plan.begin(flat, flat, seq, checks=False)
    return step(0, 0, SimpleNamespace(send=_wire(plan)))


def wire_like(tensor: torch.Tensor, config: CompressionConfig) -> torch.Tensor:
    """An empty wire buffer for a message shaped like `tensor`.

    Args:
        tensor: a tensor of the message's size (its dtype and device are the message's).
        config: the `CompressionConfig` both ends use.

    Returns:
        A 1-D uint8 tensor on `tensor`'s device: the message's wire bytes, its tag and padding to
        16 bytes (`slots.slot_bytes`).
    """
    return torch.empty(slots.slot_bytes(WireLayout.of(tensor.numel(), config).nbytes), dtype=torch.uint8,
                       device=tensor.device)


def decode_into(wire: torch.Tensor, tensor: torch.Tensor, config: CompressionConfig, backend: str = "auto") -> None:
    """Check a received wire buffer's tag and decompress it into `tensor` (contiguous; autograd
    leaves allowed). A tag that does not match this end's (size, dtype, config) raises
    ValueError and leaves NaN in `tensor`: on the Triton path without a host synchronization,
    when the work is done (at once on CPU; on CUDA at a later collective or
    `taco_triton.check_errors()`; see there).

    Args:
        wire: the received wire buffer (`wire_like`'s size).
        tensor: where the message goes, contiguous, of the message's size and dtype.
        config: the `CompressionConfig` both ends use.
        backend: codec backend, as in `taco_triton.compress`.

    Returns:
        None; `tensor` holds the message.

    Raises:
        ValueError: a non-contiguous `tensor`, a wire buffer of the wrong size or dtype, or a tag
            that does not match (see above).
    """
    if not tensor.is_contiguous():
        raise ValueError(f"decode_into needs a contiguous tensor, got shape {tuple(tensor.shape)} "
                         f"with strides {tensor.stride()}")
    plan = _message(tensor, config, backend)
    _check_wire(wire, plan)
    _errors.end_of_call(_decode(plan, wire, tensor.detach().view(-1), handle=False))


def _check_wire(wire: torch.Tensor, plan) -> None:
    nbytes = plan.slices[0].slot
    if wire.dtype != torch.uint8 or wire.dim() != 1 or wire.numel() != nbytes:
        raise ValueError(f"decode_into: the wire buffer must be 1-D uint8 with {nbytes} bytes for {plan.signature}, "
                         f"got {wire.dtype} {tuple(wire.shape)}")


def _decode(plan, wire: torch.Tensor, flat: torch.Tensor, handle: bool):
    """Check the tag and decompress (the plan's step 1): on the Triton path returns the message's
    error record as watched (`handle`: a receive's Work owns its error); the reference path checks
    the tag on the host, fills `flat` with NaN and raises at once on a mismatch."""
    record, step = plan.begin(flat, flat, 0)
    try:
        step(1, 0, SimpleNamespace(gathered=wire))
    except ValueError:
        flat.fill_(float("nan"))  # as the Triton path: the tensor never holds a garbage decode
        raise
    return None if record is None else _errors.watch(plan, record, flat.device, handle)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _received_then_decoded(work, wire: torch.Tensor, tensor: torch.Tensor, plan) -> Pending:
    """A receive's Work: `wait()` waits for the wire buffer (once: a gloo p2p Work waited twice
    blocks), then checks and decompresses it into `tensor`; the message's error record belongs to
    this Work. A failure (a handshake the sender failed, a tag that did not match) makes this and
    every later `wait()` raise."""

    # a handshake the sender failed raises at the receive's wait(); the reference path's tag check in decode
    return decode_on_wait([work], [wire], lambda: _decode(plan, wire, tensor.detach().view(-1), handle=True),
                          wire.device)


def _decided_send(payload, handshake: _handshake.Handshake) -> Pending:
    """A send's Work when a handshake decides it (its own or the open one of its signature's first
    message): `wait()` waits for the send, then raises if the receiver refused (it drained the
    payload), at this and every later call."""

    def finish():
        payload.wait()
        if handshake.outcome() is not None:
            error = handshake.error
            handshake.raised()
            raise error

    return Pending(finish)


def isend(tensor: torch.Tensor, dst: int, group=None, config: CompressionConfig | None = None, *,
          min_bytes: int | None = None, backend: str = "auto", check=None):
    """Like `dist.isend` (dst is a global rank); compressed when `should_compress`. Never blocks.

    The first message of each (peer, size, dtype, config), compressed or sent natively, is
    preceded by a handshake that checks the receiver expects the same: ValueError at the
    receiver's `wait()` and at this Work's `wait()` otherwise (both ends' messages of that
    signature issued before then fail alike). Both ends must therefore use this module's `isend`
    / `irecv` (a plain `dist.irecv` would never answer the handshake). `check` as in the
    collectives (False: no handshake, "always": before every message); after the first message
    only the message's tag is checked, on the device.

    Args:
        tensor: the message.
        dst: the receiving rank (global).
        group: process group (None: the default group).
        config: the `CompressionConfig` both ends use (None: sent natively).
        min_bytes: as in `should_compress`; both ends must pass the same.
        backend: codec backend, as in `taco_triton.compress`.
        check: the handshake mode, as the collectives' `check`.

    Returns:
        A Work: torch's own send Work, or (when a handshake decides the message) one whose
        `wait()` raises ValueError if the receiver refused it, at every later wait() too.
    """
    compress = should_compress(tensor, config, min_bytes, backend)
    sig = signature(tensor, config if compress else None)
    key, hs = _handshake.key(dst, group, sig, True), None
    if _handshake.needs_handshake(key, check):
        nbytes = wire_like(tensor, config).numel() if compress else tensor.numel() * tensor.element_size()
        hs = _handshake.Handshake(key, group, tensor.device, nbytes)
    decides = hs or _handshake.follows(key)
    if compress:
        buf = encode(tensor, config, backend)
    else:
        buf = tensor.contiguous()
    _pg.record_send(buf, compress)

    def post():
        if hs is not None:
            hs.post()
        return [_pg.isend(buf, dst, group)], None

    work = None
    if _handshake.waiting(key) and dist.get_backend(group) == "nccl":  # NCCL keeps a pair's order
        work = _handshake.submit(key, post, tensor.device, defer=False)
    if work is None:
        if hs is not None:
            hs.post()
        work = _pg.isend(buf, dst, group)
    return work if decides is None else _decided_send(work, decides)


def irecv(tensor: torch.Tensor, src: int, group=None, config: CompressionConfig | None = None, *,
          min_bytes: int | None = None, backend: str = "auto", check=None):
    """Like `dist.irecv` into `tensor`; the sender must pass the same config and min_bytes.
    The returned Work's `wait()` leaves the decompressed message in `tensor`. Never blocks: the
    receive is posted at once, or, behind a handshake, as soon as the sender's fingerprint has
    arrived (see `isend`), so both ends may post their receives before their sends.

    Raises ValueError at call time, before any message is consumed, for a compressed message into
    a non-contiguous tensor. At `wait()` (this and every later one): ValueError when the
    handshake finds the sender disagrees (its payload is taken off the wire; `tensor` is left as
    it was), or when the message's tag does not match (a later mismatch; `tensor` is NaN) - on
    CUDA the latter once the decode has run (see `taco_triton.check_errors`).

    Args:
        tensor: where the message goes (contiguous when it is compressed).
        src: the sending rank (global).
        group: process group (None: the default group).
        config: the sender's `CompressionConfig` (None: received natively).
        min_bytes: as the sender's.
        backend: codec backend, as in `taco_triton.compress`.
        check: the handshake mode, as the sender's.

    Returns:
        A Work whose `wait()` leaves the message in `tensor` (a compressed one: a `Pending`).

    Raises:
        ValueError: at call time, a compressed message into a non-contiguous tensor; at
            `wait()`, a sender that disagrees or a tag that does not match (see above).
    """
    _pg.guard_exit(tensor)
    compress = should_compress(tensor, config, min_bytes, backend)
    if compress and not tensor.is_contiguous():
        raise ValueError(f"taco_triton.p2p.irecv: a compressed message needs a contiguous tensor to decode into, got "
                         f"shape {tuple(tensor.shape)} with strides {tensor.stride()}; nothing was received")
    m = _message(tensor, config, backend) if compress else None
    sig = m.signature if compress else signature(tensor, None)
    into = torch.empty(m.slices[0].slot, dtype=torch.uint8, device=tensor.device) if compress else tensor
    key, hs = _handshake.key(src, group, sig, False), None
    if _handshake.needs_handshake(key, check):
        nbytes = into.numel() * into.element_size()
        hs = _handshake.Handshake(key, group, tensor.device, nbytes)
    decides = hs or _handshake.follows(key)

    def post():
        if decides is not None:
            if hs is not None:
                hs.post()
            if decides.outcome() is not None:  # take the sender's payload off the wire, by its size
                scratch = torch.empty(decides.their_bytes, dtype=torch.uint8, device=tensor.device)
                return [_pg.irecv(scratch, src, group)], decides
        return [_pg.irecv(into, src, group)], None

    work = _handshake.submit(key, post, tensor.device, defer=decides is not None,
                             now=hs.post if hs is not None else None)
    if work is None:
        work = _pg.irecv(into, src, group)
    return _received_then_decoded(work, into, tensor, m) if compress else work
