"""The pipeline-parallel axis of the mappings mode: megatron's stage-boundary send/recv on wire buffers.

``p2p_communication._p2p_ops`` / ``_batched_p2p_ops`` are replaced (see `patching`); each message
is decided by the PP policy at site ``megatron.pp.<direction>.stage<i>_to_stage<j>`` (direction
"forward" for activations, "backward" for activation gradients; i, j pipeline ranks), the sender
compresses it once (`collectives.p2p.encode`), the receiver gets the wire buffer and decodes it
into megatron's tensor when megatron waits on the request (batched: after all of the batch's
requests).
"""
from __future__ import annotations

from ...collectives import WireStats, _pg, p2p
from ...collectives.work import Pending, decode_on_wait
from ...config import CompressionConfig
from .common import derived_policy

PIPELINE_CONFIG = CompressionConfig(codec="int6", group_size=32, hadamard=True)
"""The 6-bit pipeline codec: INT6 with G=32 after the block Hadamard transform, nearest rounding
(0.78 bytes per element: 0.39x bf16), for activations and activation gradients alike."""


def pipeline_policy(policy=None):
    """A PP policy sending every pipeline message with `PIPELINE_CONFIG` (INT6, G=32, Hadamard),
    with `policy`'s other fields as they are (`forward` / `backward` switch a direction, `exempt`
    and `overrides` name sites ``megatron.pp.<direction>.stage<i>_to_stage<j>``, `min_bytes`);
    nothing compressed when `policy.default` is None. For a codec chosen per site under an error
    budget, give `enable(pp=...)` a calibrating `CompressionPolicy` instead.

    Args:
        policy: the `CompressionPolicy` whose other fields are kept (None: `PIPELINE_CONFIG` everywhere).

    Returns:
        The PP `CompressionPolicy`.
    """
    return derived_policy(policy, PIPELINE_CONFIG)


def _decode_after_all(reqs: list, decodes: list) -> Pending:
    """A pipeline receive's request: waits for the wire buffers' requests, then decompresses each
    buffer into the tensor megatron allocated, once (a gloo p2p Work waited twice blocks until the
    timeout); a failure is raised again by every later wait(). On CUDA the decode runs on the
    waiting stream after the issuing stream's earlier work, each wire buffer recorded there, and
    every later wait() orders its stream after the decode."""
    def decode():
        for wire, tensor, cfg in decodes:
            p2p.decode_into(wire, tensor, cfg)

    return decode_on_wait(reqs, [wire for wire, _, _ in decodes], decode, decodes[0][0].device)


def send_recv(handle, orig, tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next, group,
              prev_pipeline_rank, next_pipeline_rank):
    """megatron's p2p helper (`orig`) on wire buffers: sends compressed once, receives decoded
    into megatron's tensors when the returned requests are waited on."""
    me, n = group.rank(), group.size()
    prev, nxt = (me - 1) % n, (me + 1) % n

    def send(t, direction, dst):
        if t is None:
            return None
        cfg, st = handle._decide("pp", f"megatron.pp.{direction}.stage{me}_to_stage{dst}", direction, "send", t, n)
        wire = p2p.encode(t, cfg) if cfg is not None else t
        with WireStats() as ws:
            _pg.record_send(wire, cfg is not None)
        st.wire_bytes += ws.wire_bytes
        return wire

    decodes = {}

    def recv(t, direction, src, key):
        if t is None:
            return None
        cfg, _ = handle._decide("pp", f"megatron.pp.{direction}.stage{src}_to_stage{me}", direction, "recv", t, n)
        if cfg is None:
            return t
        wire = p2p.wire_like(t, cfg)
        decodes[key] = (wire, t, cfg)
        return wire

    reqs = orig(tensor_send_prev=send(tensor_send_prev, "backward", prev),
                tensor_recv_prev=recv(tensor_recv_prev, "forward", prev, "recv_prev"),
                tensor_send_next=send(tensor_send_next, "forward", nxt),
                tensor_recv_next=recv(tensor_recv_next, "backward", nxt, "recv_next"),
                group=group, prev_pipeline_rank=prev_pipeline_rank, next_pipeline_rank=next_pipeline_rank)
    if isinstance(reqs, dict):  # _p2p_ops: one request per message, maybe waited later (overlapped p2p)
        return {k: _decode_after_all([r], [decodes[k]]) if k in decodes else r for k, r in reqs.items()}
    # _batched_p2p_ops: megatron waits every request of the list, so ours is one request that
    # waits the batch's (one per message on gloo, maybe one in all on NCCL) and then decodes.
    # Never hand megatron a request it would wait twice: a second wait of a gloo p2p Work
    # blocks until the process-group timeout.
    return [_decode_after_all(list(reqs), list(decodes.values()))] if decodes else reqs
