"""Run a function on P gloo ranks (CPU processes) and collect per-rank results or errors."""
from __future__ import annotations

import datetime
import os
import queue as queue_mod
import time
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp

from taco_triton.examples.ranks import free_port


def _worker(rank, world, port, fn, args, queue, pg_timeout_s):
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        queue.put((rank, "ok", fn(rank, world, *args)))
    except BaseException as e:  # noqa: BLE001 - report everything to the parent
        queue.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world: int, *args, timeout_s: float = 300, pg_timeout_s: float = 60, allow_errors: bool = False):
    """fn(rank, world, *args) on `world` processes; returns the results by rank, raises on errors.

    fn must be a module-level function. The environment (TRITON_INTERPRET, ...) is inherited. A
    process that exits without reporting counts as an error, and the parent kills stragglers
    after `timeout_s`, so no bug can hang the suite. With allow_errors, returns (results, errors)
    dicts instead of raising.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, queue, pg_timeout_s)) for r in range(world)]
    for p in procs:
        p.start()
    results, errors = {}, {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) + len(errors) < world and time.monotonic() < deadline:
            try:
                rank, status, value = queue.get(timeout=0.5)
                (results if status == "ok" else errors)[rank] = value
            except queue_mod.Empty:
                for r, p in enumerate(procs):  # died without a word (and its report is not queued)
                    if not p.is_alive() and r not in results and r not in errors and queue.empty():
                        errors[r] = f"exited with code {p.exitcode} without reporting"
        for r in range(world):
            if r not in results and r not in errors:
                errors[r] = f"no report within {timeout_s} s"
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    if allow_errors:
        return results, errors
    if errors:
        raise AssertionError("\n".join(f"rank {r}: {e}" for r, e in sorted(errors.items())))
    return [results[r] for r in range(world)]


os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
