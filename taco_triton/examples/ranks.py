"""Run one function on several local processes (one per rank) and collect what each returns.

The examples, the demo and the benchmarks start their gloo (or NCCL) ranks this way on one machine:
`spawn` processes, a free TCP port for `init_process_group`, results through a queue, and a rank
that dies without reporting turns into an error instead of a hang.
"""
from __future__ import annotations

import queue as queue_mod
import socket
from typing import Any, Callable


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for `init_method=tcp://127.0.0.1:PORT`)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(target: Callable[..., None], world: int, *args: Any, poll_s: float = 5.0) -> dict[int, Any]:
    """Call `target(rank, world, port, *args, queue)` in `world` spawned processes; each rank puts
    `(rank, result)` on `queue`. Returns the results by rank. Raises RuntimeError naming the
    ranks that exited without a result (checked every `poll_s` seconds while waiting)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results_q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, results_q)) for r in range(world)]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    try:
        while len(got) < world:
            try:
                r, result = results_q.get(timeout=poll_s)
                got[r] = result
            except queue_mod.Empty:
                dead = [i for i, p in enumerate(procs) if not p.is_alive() and i not in got]
                if dead:
                    raise RuntimeError(f"rank(s) {dead} of {world} exited without a result") from None
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return got
