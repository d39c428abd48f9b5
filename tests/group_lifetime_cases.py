"""Per-rank body of the group-lifetime test (module-level so spawned processes can import it)."""
from __future__ import annotations

import gc
import threading
import time

import torch
import torch.distributed as dist

import taco_triton as taco
from taco_triton.collectives import p2p
from taco_triton.state import STATE

CFG = taco.CompressionConfig()


def _taco_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("taco_triton"))


def fifty_groups(rank: int, world: int) -> dict:
    """Make 50 groups; on each an async compressed all_reduce (its worker thread, plan, agreement)
    and a compressed p2p message (its handshake); destroy it. Then one call of a new signature on
    the world group; report what is left: taco_triton's threads, the entries of the destroyed
    groups, the groups still held."""
    used, held = 0, []
    destroyed = []
    for i in range(50):
        g = dist.new_group([0, 1])
        x = torch.full((256,), float(rank + i))
        taco.collectives.all_reduce(x, group=g, config=CFG, min_bytes=0, async_op=True).wait()
        msg = torch.full((128,), float(i))
        if rank == 0:
            p2p.isend(msg, 1, group=g, config=CFG, min_bytes=0).wait()
        else:
            p2p.irecv(msg, 0, group=g, config=CFG, min_bytes=0).wait()
        used += bool(STATE.holds(g))
        dist.destroy_process_group(g)
        destroyed.append(g)
    taco.collectives.all_reduce(torch.ones(96), config=CFG, min_bytes=0)  # a new signature: the next share
    held = sorted({name for g in destroyed for name in STATE.holds(g)})
    del destroyed, g
    gc.collect()
    deadline = time.monotonic() + 10
    while _taco_threads() and time.monotonic() < deadline:  # closed workers finish their last job
        time.sleep(0.05)
    return {"used": used, "threads": _taco_threads(), "held": held, "groups": len(STATE._groups)}
