"""The p2p handshake: the first message of a signature between two ranks, and the order in which
the receives waiting for it are posted (used by `p2p.isend` / `p2p.irecv`).

The sender posts its fingerprint and payload size (tag `TAG`), a receive of the receiver's
answer (`TAG + 1`) and the payload, all at once, and compares the answer at `wait()`. The
receiver cannot post the payload's receive before it knows the sender's size (gloo aborts the
process when a message is larger than the receive posted for it), and must not block the host
either: both ends may post their receives before their sends, as pipeline schedules do. So it
posts its half of the handshake at once and the payload's receive becomes a `Deferred`: one
thread per peer posts it as soon as the sender's fingerprint has arrived and matched (when it
does not, the thread takes the sender's payload off the wire into a scratch buffer and the
receive fails with ValueError), and posts every later receive from that peer behind it, so
receives still meet the peer's sends in issue order, as if posted at issue. On NCCL, which runs a
pair's operations in the order they were issued in either direction, the sends to that peer
queue behind it too. Outside a handshake, with no receive waiting, everything is posted at issue.

A message issued while its (peer, signature)'s handshake is still open follows that handshake's
outcome instead of shaking hands again, on both ends alike, so both make the same decision
whenever either one waits. After a failed handshake's error was raised on an end, that end's
next message of the signature shakes hands again.
"""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

import torch

from ..env import check_mode
from ..state import STATE
from . import _pg
from .work import Deferred

TAG = 0x7AC0  # the handshake's messages never match a payload's (tag 0)



def key(peer: int, group, sig: tuple, sending: bool) -> tuple:
    """A message's (peer, group object, signature, sending): `[:2]` names its queue (`submit`)."""
    return peer, _pg.group_object(group), sig, sending


def needs_handshake(key: tuple, check) -> bool:
    mode = check_mode(check)
    return mode == "always" or (mode == "first" and key not in STATE.handshakes)


def follows(key: tuple):
    """The handshake a message without one of its own must wait for: its key's, unless that matched."""
    hs = STATE.handshakes.get(key)
    return None if hs is None or hs.matched else hs


def _error(role: str, peer: int, sig: tuple, theirs: int, mine: int) -> ValueError:
    other = "receiver" if role == "sender" else "sender"
    return ValueError(
        f"taco_triton.p2p: the {other} (rank {peer}) expects a different message than this {role}'s {sig} "
        f"(fingerprints {theirs:#x} vs {mine:#x}): both ends must pass the same size, dtype, config and min_bytes"
    )


class Handshake:
    """One end of a first message's handshake: this end's (fingerprint, payload bytes) out, the
    other end's in. `post()` posts both (the receiver its receive first: the order NCCL needs on
    both ends), `outcome()` waits for them once and compares."""

    def __init__(self, key: tuple, group, device, nbytes: int):
        STATE.seen(key[1])
        self.key, self.group = key, group
        self.peer, _, self.sig, self.sending = key
        # (fingerprint, payload bytes): on a mismatch the receiver drains the payload by its size
        self.mine = torch.tensor([_pg.fingerprint(self.sig), nbytes], dtype=torch.int64, device=device)
        self.theirs = torch.empty(2, dtype=torch.int64, device=device)
        self.their_bytes = 0
        self.matched = False
        self.error: ValueError | None = None
        self._works = None
        self._checked = False
        self._stats = _pg.stats_context()  # post() may run on the queue's thread: count where it was issued
        _pg.guard_exit(self.mine)
        STATE.handshakes[self.key] = self

    def post(self) -> None:
        """Post this end's two messages (once)."""
        if self._works is not None:
            return
        out = _pg.send_fingerprint(self.mine, self.peer, self.group, TAG + (0 if self.sending else 1), self._stats)
        into = _pg.irecv(self.theirs, self.peer, self.group, TAG + (1 if self.sending else 0))
        self._works = [out, into] if self.sending else [into, out]

    def outcome(self) -> ValueError | None:
        """Wait for both messages (once; a host read of 16 bytes, first message only) and compare:
        None when both ends expect the same message, else the ValueError naming both."""
        if not self._checked:
            for w in self._works:
                w.wait()
            (theirs, self.their_bytes), (mine, _) = self.theirs.tolist(), self.mine.tolist()
            if theirs != mine:
                self.error = _error("sender" if self.sending else "receiver", self.peer, self.sig, theirs, mine)
            self.matched, self._checked = theirs == mine, True
        return self.error

    def raised(self) -> None:
        """Its error reached the user on this end: this end's next message of the key shakes hands
        again."""
        if STATE.handshakes.get(self.key) is self:
            del STATE.handshakes[self.key]


def submit(key: tuple, post: Callable[[], tuple], device: torch.device, defer: bool,
           now: Callable[[], None] | None = None) -> Deferred | None:
    """Queue `post` (see `Deferred`) behind the operations with the peer that wait (`key`: the
    message's, or (peer, group object)), or, with `defer`, start a queue with it: a Deferred.
    None when nothing waits and not `defer`: the caller posts at once. `now` runs at once when
    this starts a queue (what of a deferred operation can be posted before it)."""
    key = key[:2]
    with STATE.lock:
        q = STATE.p2p_queues.get(key)
        if q is None and not defer:
            return None
        d = Deferred(post, device)
        if q is not None:
            q.append(d)
            return d
        if now is not None:
            now()
        STATE.p2p_queues[key] = q = deque([d])  # a thread drains it (`_drain`)
    threading.Thread(target=_drain, args=(key, q), name=f"taco_triton p2p {key[0]}", daemon=True).start()
    return d


def waiting(key: tuple) -> bool:
    """Whether operations with the peer of `key` wait in a queue (a new one must queue behind them)."""
    return key[:2] in STATE.p2p_queues


def _drain(key, q: deque) -> None:
    """Post the queue's operations in order, each once the one before it is posted."""
    broken = None
    while True:
        with STATE.lock:
            if not q:
                del STATE.p2p_queues[key]
                return
            d = q[0]
        if broken is None:
            d.run()
            broken = d._error  # a receive that could not be posted: the later ones would meet the wrong messages
        else:
            d.fail(RuntimeError(f"taco_triton.p2p: not posted, an earlier operation with rank {key[0]} failed: "
                                f"{broken}"))
        with STATE.lock:
            q.popleft()
