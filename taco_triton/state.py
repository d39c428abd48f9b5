"""Everything taco_triton keeps between calls, in one object (`STATE`), and its one eviction rule.

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
share forgets that share's oldest entry. Forgetting costs a rebuild, never a result, with one
care: whether a call runs the rank-agreement exchange depends on `agreements`, so every rank must
forget the same agreement at the same call. The ranks of a group make the same calls on it in the
same order whatever else each of them does, so counting per group makes each rank forget the same
entries of that group at the same call (a count over all groups would follow each rank's traffic
on its other groups).

Per process group besides the caches: its worker thread (`workers`: CPU async calls, `_worker`),
the p2p handshakes of its messages (`handshakes`) and the queues of receives posted behind them
(`p2p_queues`, `_handshake`). A group torch.distributed destroys is forgotten everywhere at once
(`State.forget`: its cache shares, its worker, whose thread ends, its handshakes): a compressing
process group when `dist.destroy_process_group` shuts it down; any other group, which tells no one,
when the next group is first seen (`State.sweep`: every group torch.distributed knew and no longer
does).

Per device or process, never forgotten (small, and CUDA graphs hold their addresses): the
communication streams (`comm_streams`), the stochastic seed counters of captured calls
(`seed_counters`), the programs one SM holds per compiled kernel (`resident`), the backend
"auto" resolves to per device type (`backends`), the eager codec's prepared launches (`eager`,
cleared whole past `EAGER_BOUND`), the tuned-parameter lookup the autotune runtime registers
(`tuned_lookup`) and the default configs.

Not caches, so never forgotten: the call numbers (`calls`: they name a call in its errors and salt
its stochastic seeds; `messages_sent`: the same for p2p), the error entries of calls whose records
are not read yet (`unchecked`, in issue order; bounded by the calls in flight), those of calls
captured in CUDA graphs (`captured`: every replay writes them; one per captured call) and the errors not
raised yet (`unreported`; dropping one would lose it). A plan's wire buffers are kept per calling
thread and stream by the same rule in a `Cache` of the plan (`Plan.buffers`).

This module sits below everything else of taco_triton (kernels, ops and collectives keep their
state here) and imports none of it.
"""
from __future__ import annotations

import itertools
import threading
import types
import weakref

import torch.distributed as dist


class Cache:
    """A bounded map with the eviction rule (see the module docstring): at most `bound` entries
    per share (a process group, or None for entries of no group); `put` to a full share forgets
    its oldest entry. `get` and `has` are the map's own (no Python call in between: the steady
    state looks up on every call). `on_new_share(share)` is called when a share is first made
    (`State.seen`: the sweep of destroyed groups)."""

    BOUND = 1024

    def __init__(self, bound: int = BOUND, on_new_share=None):
        self.bound = bound
        self._map: dict = {}
        self._shares: dict = {}  # share -> {key: None}, oldest first
        self._on_new_share = on_new_share
        self._mu = threading.Lock()  # puts come from callers and from groups' worker threads
        self.get = self._map.get
        self.has = self._map.__contains__

    def put(self, key, value, share=None) -> None:
        """Keep `value` under `key`, counted in `share` (the key's process group, or None)."""
        if share not in self._shares and self._on_new_share is not None:
            self._on_new_share(share)  # outside the lock: a sweep forgets shares of this cache too
        with self._mu:
            self._put(key, value, share)

    def forget(self, share) -> None:
        """Drop `share`'s entries (its group is being destroyed)."""
        with self._mu:
            for key in self._shares.pop(share, {}):
                del self._map[key]

    def _put(self, key, value, share) -> None:
        if key in self._map:
            self._map[key] = value
            return
        keys = self._shares.get(share)
        if keys is None:
            keys = self._shares[share] = {}
        if len(keys) >= self.bound:
            oldest = next(iter(keys))
            del keys[oldest]
            del self._map[oldest]
        keys[key] = None
        self._map[key] = value

    def __len__(self) -> int:
        return len(self._map)

    def items(self):
        return self._map.items()

    def values(self):
        return self._map.values()

    def clear(self) -> None:
        self._map.clear()
        self._shares.clear()


class State:
    """taco_triton's state between calls (one instance, `STATE`; see the module docstring)."""

    #: Prepared eager codec calls kept before `eager` is cleared.
    EAGER_BOUND = 4096

    def __init__(self):
        self.calls = itertools.count()          # call numbers of the collectives
        self.messages_sent = itertools.count()  # message numbers of p2p (salt stochastic rounding)
        self.default_config = None              # made on first use (`_call.default_config`)
        self.codec_default = None               # `taco_triton.compress`'s config=None
        self.fingerprints = Cache(on_new_share=self.seen)
        self.agreements = Cache(on_new_share=self.seen)
        self.plans = Cache(on_new_share=self.seen)
        self.steady = Cache(on_new_share=self.seen)
        self.messages = Cache(on_new_share=self.seen)
        self.unchecked: list = []   # `_errors.Watched` of calls whose error records are not read yet
        self.unreported: list = []  # those whose record held an error not raised yet
        self.captured: list = []    # those of calls captured in CUDA graphs (read by check_errors)
        # per process group (forgotten with it)
        self.lock = threading.RLock()  # guards the per-group maps below (callers and worker threads)
        self.workers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # group -> `_worker.Worker`
        self.handshakes: dict = {}  # (peer, group, signature, sending) -> its open or failed `Handshake`
        self.p2p_queues: dict = {}  # (peer, group) -> deque of receives posted behind a handshake
        self._groups: set = set()   # groups seen while torch.distributed knew them (`sweep`)
        # per device or process (see the module docstring)
        self.comm_streams: dict = {}   # CUDA device index -> the communication stream of async calls
        self.seed_counters: dict = {}  # (device type, index) -> int64 counter captured calls salt with
        self.resident: dict = {}       # (kernel, meta, device index) -> programs one SM holds
        self.backends: dict = {}       # (backend asked, device type) -> the one that runs ("auto" only)
        self.eager: dict = {}          # prepared eager codec calls (`ops`)
        self.tuned_lookup = None       # (kernel, device, dtype, config, numel) -> params or None
        # the sites of the integrations (`integrations.sites`): per process, what names a collective
        self.sites = types.SimpleNamespace(forward=[], backward=[None, -1], trackers=[], warned=set())
        self.exit_grace = False        # the exit handler gloo's worker threads need is registered (`_pg`)

    def _caches(self):
        return (self.fingerprints, self.agreements, self.plans, self.steady, self.messages)

    def seen(self, group) -> None:
        """Note a process group that keeps something here; the first time, forget the groups
        torch.distributed destroyed since (`sweep`)."""
        if group in self._groups:
            return
        self.sweep()
        if group is not None and group in _known_groups():
            with self.lock:
                self._groups.add(group)

    def sweep(self) -> None:
        """Forget every group torch.distributed knew and no longer does (destroyed)."""
        known = _known_groups()
        for group in [g for g in list(self._groups) if g not in known]:
            self.forget(group)

    def forget(self, group) -> None:
        """Drop everything kept for `group` (torch.distributed is destroying it): its share of every
        cache, its worker (whose thread ends after the jobs queued so far), its p2p handshakes and
        queues (a queue's thread ends once it has posted what was queued)."""
        for cache in self._caches():
            cache.forget(group)
        with self.lock:
            self._groups.discard(group)
            worker = self.workers.pop(group, None)
            for key in [k for k in self.handshakes if k[1] is group]:
                del self.handshakes[key]
        if worker is not None:
            worker.close()

    def holds(self, group) -> list[str]:
        """What is still kept for `group` (names of the maps with an entry of it): for tests."""
        out = [name for name, cache in zip(("fingerprints", "agreements", "plans", "steady", "messages"), self._caches())
               if group in cache._shares]
        if group in self.workers:
            out.append("workers")
        if any(k[1] is group for k in self.handshakes):
            out.append("handshakes")
        if any(k[1] is group for k in self.p2p_queues):
            out.append("p2p_queues")
        if group in self._groups:
            out.append("groups")
        return out


def _known_groups():
    """The process groups torch.distributed knows now."""
    return dist.distributed_c10d._world.pg_map if dist.is_available() else {}


STATE = State()
