"""Everything the collectives keep between calls, in one object (`STATE`), and its one eviction rule.

Caches (each a `Cache`): what a call decided that later calls reuse.

| cache | key | holds |
|---|---|---|
| `fingerprints` | signature | its 32-bit fingerprint (`_pg.fingerprint`) |
| `agreements` | (group, signature) | nothing: every rank of the group agreed on it (the exchange ran, matched) |
| `plans` | (group, signature, device) | its `Plan` (geometry, tables, prepared launches, buffers) |
| `steady` | (kind, arguments, tensor metadata) | its `Steady` (what a repeat skips) |
| `messages` | p2p (numel, dtype, config, device, backend) | the message's geometry and launches |

The rule, the same for each: a cache holds at most `Cache.BOUND` entries per process group (an
entry of no group, such as a fingerprint, counts in one share of its own), and adding to a full
share forgets that share's oldest entry; the share of a group torch.distributed no longer knows
(destroyed) is dropped when a new share is made, and a compressing process group's share (with its
inner group's, when it made it) when torch.distributed destroys it (`State.forget`). Forgetting costs a rebuild, never a result,
with one care: whether a call runs the rank-agreement exchange depends on `agreements`, so every
rank must forget the same agreement at the same call. The ranks of a group make the same calls
on it in the same order whatever else each of them does, so counting per group makes each rank
forget the same entries of that group at the same call (a count over all groups would follow
each rank's traffic on its other groups).

Not caches, so never forgotten: the call numbers (`calls`: they name a call in its errors and salt
its stochastic seeds; `messages_sent`: the same for p2p), the error entries of calls whose records
are not read yet (`unchecked`, in issue order; bounded by the calls in flight), those of calls
captured in CUDA graphs (`captured`: every replay writes them; one per captured call) and the errors not
raised yet (`unreported`; dropping one would lose it). The p2p handshake's state is the
handshake's (`_handshake`). A plan's wire buffers are kept per calling thread and stream by the
same rule in a `Cache` of the plan (`Plan.buffers`).
"""
from __future__ import annotations

import itertools
import threading

import torch.distributed as dist


class Cache:
    """A bounded map with the collectives' eviction rule (see the module docstring): at most
    `bound` entries per share (a process group, or None for entries of no group); `put` to a full
    share forgets its oldest entry. `get` and `has` are the map's own (no Python call in between:
    the steady state looks up on every call)."""

    BOUND = 1024

    def __init__(self, bound: int = BOUND):
        self.bound = bound
        self._map: dict = {}
        self._shares: dict = {}  # share -> {key: None}, oldest first
        self._registered: set = set()  # shares whose group torch.distributed knew when they were made
        self._mu = threading.Lock()  # puts come from callers and from groups' worker threads
        self.get = self._map.get
        self.has = self._map.__contains__

    def put(self, key, value, share=None) -> None:
        """Keep `value` under `key`, counted in `share` (the key's process group, or None)."""
        with self._mu:
            self._put(key, value, share)

    def forget(self, share) -> None:
        """Drop `share`'s entries (its group is being destroyed)."""
        with self._mu:
            self._registered.discard(share)
            for key in self._shares.pop(share, {}):
                del self._map[key]

    def _put(self, key, value, share) -> None:
        if key in self._map:
            self._map[key] = value
            return
        keys = self._shares.get(share)
        if keys is None:
            if share in self._drop_destroyed():
                self._registered.add(share)
            keys = self._shares[share] = {}
        if len(keys) >= self.bound:
            oldest = next(iter(keys))
            del keys[oldest]
            del self._map[oldest]
        keys[key] = None
        self._map[key] = value

    def _drop_destroyed(self):
        """Forget the shares of groups torch.distributed knew and no longer does (destroyed);
        returns the groups it knows now."""
        known = dist.distributed_c10d._world.pg_map if dist.is_available() else {}
        for share in [s for s in self._registered if s not in known]:
            self._registered.discard(share)
            for key in self._shares.pop(share):
                del self._map[key]
        return known

    def __len__(self) -> int:
        return len(self._map)

    def items(self):
        return self._map.items()

    def values(self):
        return self._map.values()

    def clear(self) -> None:
        self._map.clear()
        self._shares.clear()
        self._registered.clear()


class State:
    """The collectives' state between calls (one instance, `STATE`; see the module docstring)."""

    def __init__(self):
        self.calls = itertools.count()          # call numbers of the collectives
        self.messages_sent = itertools.count()  # message numbers of p2p (salt stochastic rounding)
        self.default_config = None              # made on first use (`_call.default_config`)
        self.fingerprints = Cache()
        self.agreements = Cache()
        self.plans = Cache()
        self.steady = Cache()
        self.messages = Cache()
        self.unchecked: list = []   # `_errors.Watched` of calls whose error records are not read yet
        self.unreported: list = []  # those whose record held an error not raised yet
        self.captured: list = []    # those of calls captured in CUDA graphs (read by check_errors)

    def forget(self, group) -> None:
        """Drop every cache's entries of `group` (torch.distributed is destroying it)."""
        for cache in (self.fingerprints, self.agreements, self.plans, self.steady, self.messages):
            cache.forget(group)


STATE = State()
