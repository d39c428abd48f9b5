#!/usr/bin/env python
"""nccl-tests-style benchmark of native vs compressed all_reduce, reduce_scatter and all_gather.

For each cell (collective, message size, emulated link rate) this runs, side by side in the
same process group and interleaved repeat by repeat:

    native_bf16          the torch.distributed collective on the bf16 tensor (the baseline;
                         never fp32)
    compressed           taco.<collective>(..., min_bytes=0, pipeline=D) for every codec in
                         --codecs (default: the default config fp8_e4m3 G=128 Hadamard, and int8)
                         and every depth D in --depths (default 1,4)
    compressed_default   taco.<collective>(t) with every default (DEFAULT_MIN_BYTES,
                         pipeline="auto"), only where that differs from a row above (below
                         DEFAULT_MIN_BYTES it is the native path; above it, an auto depth not in
                         --depths); otherwise it would duplicate a measured row and is left out

Columns as in nccl-tests: `size_bytes` is the whole buffer (all_reduce: the tensor;
reduce_scatter: the input, P shards; all_gather: the output, P shards), algbw = size / time,
busbw = algbw * factor with factor 2(P-1)/P for all_reduce and (P-1)/P for reduce_scatter and
all_gather. GB = 1e9 bytes. `speedup_vs_native` = native median / this median, same cell.

Timing: one warm-up call per implementation (it also records `taco.WireStats` wire bytes per
rank - the native call goes through taco's native path with `enabled=False`, the same
torch.distributed call - and the relative L2 error against the exact fp32-accumulated sum of
the bf16 inputs, computed from an all_gather of the inputs outside any timed region), then
`repeats` rounds; in each round every implementation is timed once, each call between two
barriers, and the round's order is rotated. A repeat's time is the slowest rank's. Reported:
median, p20, p80 over the repeats. The number of repeats adapts to the cell's cost
(--repeats max, --min-repeats min, --cell-target-s).

Link emulation (bench/netns.py): a private network namespace whose loopback egress is a token
bucket (`tc ... tbf rate R`). All ranks run on 127.0.0.1 inside it; rank 0 changes the rate
between cells (`tc -n NAME qdisc replace ...` - only that namespace's loopback is touched).
NOTE: every byte of every rank, both directions, goes through that one bucket: rate R is a
*shared* medium of R bit/s, so with 2 ranks sending at once each gets ~R/2 (a full-duplex NIC of
R per direction would be ~2x faster for these symmetric collectives). Needs root; --no-netns
runs on the host loopback without emulation ("unlimited (no emulation)").

Process layout: the script (outside the namespace) creates the namespace and re-executes itself
as `ip netns exec NAME python bench/collectives.py --worker JOB.json`; the worker spawns the P
ranks with torch.multiprocessing (spawn) and they init gloo on tcp://127.0.0.1. Rank 0 streams
progress and rows to a JSON-lines file the parent reads. The parent kills the whole worker
process group when a cell exceeds --cell-timeout, or the run exceeds --time-budget plus a grace
period; an error in a cell is recorded and the worker is restarted for the remaining cells. The
namespace is always deleted (errors, Ctrl-C, SIGTERM).

Time budget: cells run in size order (small first; within a size: collective, then rate). Before
a cell, rank 0 estimates its duration from the cells already run; a cell that would not finish
within --time-budget (measured from the start) is skipped and recorded as skipped, and the
repeats of a running cell are cut short at the budget.

!! CPU timings with the torch reference codec are NOT GPU performance. On CPU the codec runs on
!! the same 1-2 cores as the ranks at tens of MB/s, so compression is compute-bound, and only a
!! very slow (emulated) link can make it pay. On a GPU the fused Triton kernels run at hundreds
!! of GB/s and the balance is entirely different.

Usage:
    python bench/collectives.py --quick                  # ~3-5 min: all_reduce, 1 & 16 MiB, 1 Gbit/s & unlimited
    python bench/collectives.py                          # full grid, cut by --time-budget (900 s)
    python bench/collectives.py --collectives all_reduce --sizes 1MiB,4MiB,16MiB,64MiB \\
        --rates 0.5,2,10,unlimited --depths 1,4 --time-budget 780
    python bench/collectives.py --no-netns --quick       # no root: host loopback, no emulation

Output: a table per (collective, link), a crossover summary, and a CSV (default
bench/results/collectives_cpu_<UTC date-time>[_tag].csv) with one row per (cell, implementation):
collective, impl, codec, pipeline, size_bytes, link, world_size, median_ms, p20_ms, p80_ms,
algbw_GBps, busbw_GBps, speedup_vs_native, wire_bytes_per_rank, rel_l2_err, machine,
torch_version, git_commit, date, and extras (status, note, repeats, threads, codec_backend,
min_bytes, load_1min = the 1-minute load average at the cell's start, link_emulation = the tc
qdisc used, git_dirty, platform).
Cells not measured have a single row with impl "*" and status skipped / timeout / error.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
for _p in (str(ROOT), str(HERE)):
    if _p not in sys.path:  # run from the source tree without installing
        sys.path.insert(0, _p)

import torch  # noqa: E402

from taco_triton.examples.ranks import free_port  # noqa: E402

import netns  # noqa: E402  (bench/netns.py)

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")
DEFAULT_RATES = "0.5,1,2,5,10,unlimited"
DEFAULT_SIZES = "1MiB,4MiB,16MiB,64MiB,256MiB"
QUICK = {"sizes": "1MiB,16MiB", "rates": "1,unlimited", "collectives": "all_reduce", "time_budget": 300.0}
ELEM = 2  # bf16 bytes

COLUMNS = [
    "collective", "impl", "codec", "pipeline", "size_bytes", "link", "world_size",
    "median_ms", "p20_ms", "p80_ms", "algbw_GBps", "busbw_GBps", "speedup_vs_native",
    "wire_bytes_per_rank", "rel_l2_err", "machine", "torch_version", "git_commit", "date",
    # extras
    "status", "note", "repeats", "threads", "codec_backend", "min_bytes", "load_1min", "link_emulation", "git_dirty", "platform",
]

BANNER = """
##############################################################################################
##  CPU RUN: THESE TIMINGS ARE NOT GPU PERFORMANCE.                                         ##
##  Compression runs the torch REFERENCE codec on the same CPU cores as the ranks, at tens  ##
##  of MB/s: on CPU compressed collectives are COMPUTE-BOUND, and only a slow emulated link ##
##  can make them pay. GPU kernels run orders of magnitude faster. Other work may share     ##
##  this machine: timings are noisy. The emulated link is ONE token bucket shared by all    ##
##  ranks and both directions (rate R ~ R/2 per rank when both send).                       ##
##############################################################################################
"""


def bus_factor(collective: str, p: int) -> float:
    return 2 * (p - 1) / p if collective == "all_reduce" else (p - 1) / p


# -- parsing ------------------------------------------------------------------------------------
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 1 << 10, "m": 1 << 20, "mib": 1 << 20,
          "mb": 1 << 20, "g": 1 << 30, "gib": 1 << 30, "gb": 1 << 30}


def parse_size(s: str) -> int:
    """'1MiB', '16M', '512KiB', '1048576' -> bytes (binary units)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", s)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"bad size {s!r} (e.g. 1MiB, 512KiB, 1048576)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def fmt_size(n: int) -> str:
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k and n % k == 0:
            return f"{n // k} {unit}"
    return f"{n} B"


def csv_list(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


# -- provenance ---------------------------------------------------------------------------------
def git_info() -> tuple[str, str]:
    """(short commit, dirty 'yes'/'no'); TACO_GIT_COMMIT overrides; 'unknown' outside a checkout."""
    env_commit = os.environ.get("TACO_GIT_COMMIT")
    try:
        c = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        if c.returncode != 0:
            return env_commit or "unknown", "unknown"
        d = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], cwd=ROOT, capture_output=True, timeout=10)
        return env_commit or c.stdout.strip(), {0: "no", 1: "yes"}.get(d.returncode, "unknown")
    except (OSError, subprocess.SubprocessError):
        return env_commit or "unknown", "unknown"


def machine() -> str:
    model = platform.processor() or platform.machine() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"cpu {platform.machine()} {model}, {os.cpu_count()} cores"


# == ranks ======================================================================================
def _variants(collective: str, size: int, job: dict) -> tuple[list[dict], str]:
    """The implementations measured in a cell (identical on every rank), and a note."""
    from taco_triton.collectives import _call

    p = job["world"]
    out = [{"impl": "native_bf16", "codec": "-", "pipeline": "-", "pipeline_arg": None, "min_bytes": None}]
    for codec in job["codecs"]:
        for d in job["depths"]:
            out.append({"impl": "compressed", "codec": codec, "pipeline": str(d), "pipeline_arg": d, "min_bytes": 0})
    note = ""
    if job["default_row"]:
        # what taco.<collective>(t) does with every default: the size test is on the *input*
        # tensor (the shard, for all_gather), the auto depth on the whole buffer.
        tested = size // p if collective == "all_gather" else size
        compresses = tested >= _call.DEFAULT_MIN_BYTES
        depth = _call.depth(size, "auto")
        default_codec = job["codecs"][0] if job["codecs"] else None
        if compresses and depth in job["depths"] and default_codec == "fp8_e4m3":
            note = f"compressed_default = fp8_e4m3 pipeline {depth} row (auto depth {depth}, size >= DEFAULT_MIN_BYTES)"
        else:
            out.append({"impl": "compressed_default", "codec": "fp8_e4m3" if compresses else "- (native path)",
                        "pipeline": f"auto={depth}" if compresses else "auto", "pipeline_arg": "auto",
                        "min_bytes": None})
    return out, note


class _Cell:
    """Buffers and calls of one (collective, size) on this rank."""

    def __init__(self, collective: str, size: int, rank: int, p: int, seed: int):
        import torch.distributed as dist

        self.collective, self.rank, self.p = collective, rank, p
        n = size // ELEM
        g = torch.Generator().manual_seed(seed * 1000 + rank)
        if collective == "all_reduce":
            self.inp = torch.randn(n, generator=g).to(torch.bfloat16)
            self.out = torch.empty_like(self.inp)
        elif collective == "reduce_scatter":
            self.inp = torch.randn(n, generator=g).to(torch.bfloat16)
            self.out = torch.empty(n // p, dtype=torch.bfloat16)
        else:
            self.inp = torch.randn(n // p, generator=g).to(torch.bfloat16)
            self.out = torch.empty(n, dtype=torch.bfloat16)
        # exact reference: fp32 sum of the bf16 inputs (exact for P=2), outside any timed region
        gathered = [torch.empty_like(self.inp) for _ in range(p)]
        dist.all_gather(gathered, self.inp)
        if collective == "all_reduce":
            self.exact = sum(t.float() for t in gathered)
        elif collective == "reduce_scatter":
            m = n // p
            self.exact = sum(t[rank * m:(rank + 1) * m].float() for t in gathered)
        else:
            self.exact = torch.cat(gathered).float()
        del gathered
        self.exact_norm = torch.linalg.vector_norm(self.exact, dtype=torch.float64).item()

    def reset(self) -> None:
        if self.collective == "all_reduce":
            self.out.copy_(self.inp)  # in place: restore the input

    def poison(self) -> None:
        if self.collective == "all_reduce":
            self.out.copy_(self.inp)
        else:
            self.out.fill_(float("nan"))

    def rel_err(self) -> float:
        diff = torch.linalg.vector_norm(self.out.float() - self.exact, dtype=torch.float64).item()
        return diff / self.exact_norm if self.exact_norm else float("nan")

    def call(self, v: dict, *, warm: bool = False):
        """The collective of variant v. warm=True: the native variant goes through taco's
        native path (enabled=False) so WireStats records it; compressed ones check ranks agree."""
        import torch.distributed as dist

        import taco_triton as taco
        from taco_triton.config import CompressionConfig

        c = self.collective
        if v["impl"] == "native_bf16" and not warm:
            if c == "all_reduce":
                return dist.all_reduce(self.out)
            if c == "reduce_scatter":
                return _REDUCE_SCATTER(self.out, self.inp)
            return _ALL_GATHER(self.out, self.inp)
        if v["impl"] == "native_bf16":
            kw = {"config": CompressionConfig(enabled=False)}
        else:
            cfg = CompressionConfig() if v["codec"] in ("fp8_e4m3", "- (native path)") else CompressionConfig(codec=v["codec"])
            kw = {"config": cfg, "pipeline": v["pipeline_arg"], "check": warm}
            if v["min_bytes"] is not None:
                kw["min_bytes"] = v["min_bytes"]
        if c == "all_reduce":
            return taco.all_reduce(self.out, **kw)
        if c == "reduce_scatter":
            return taco.reduce_scatter(self.out, self.inp, **kw)
        return taco.all_gather(self.out, self.inp, **kw)


def _dist_shims():
    import torch.distributed as dist

    # torch 2.13 renamed the *_tensor collectives (the old names warn); older torch has only the old
    ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return ag, rs


_ALL_GATHER = _REDUCE_SCATTER = None


class _Events:
    """Rank 0's JSON-lines stream to the parent (other ranks only report errors)."""

    def __init__(self, path: str, rank: int):
        self.path, self.rank = path, rank

    def put(self, **ev) -> None:
        ev.setdefault("rank", self.rank)
        ev.setdefault("t", time.time())
        with open(self.path, "a") as f:
            f.write(json.dumps(ev) + "\n")
            f.flush()


def _quantiles(xs: list[float]) -> tuple[float, float, float]:
    t = torch.tensor(xs, dtype=torch.float64)
    q = torch.quantile(t, torch.tensor([0.2, 0.5, 0.8], dtype=torch.float64))
    return q[1].item(), q[0].item(), q[2].item()


def _estimate(history: list[dict], collective: str, rate: str, size: int, job: dict) -> float | None:
    """Seconds a cell will take, from the cells already run (None: nothing to go by)."""
    same = [h for h in history if h["collective"] == collective and h["rate"] == rate]
    pool = same or [h for h in history if h["collective"] == collective] or history
    if not pool:
        return None
    # per-byte cost of one round (all implementations once), worst of the pool; fixed part 1 s
    per_byte = max(h["round_s"] / h["size"] for h in pool)
    round_s = per_byte * size
    reps = min(job["repeats"], max(job["min_repeats"], math.floor(job["cell_target_s"] / max(round_s, 1e-9))))
    return round_s * (1 + reps) * 1.1 + 1.0


def rank_main(rank: int, job: dict, port: int) -> None:
    import datetime as _dt

    import torch.distributed as dist

    import taco_triton as taco
    from taco_triton.ops import resolve_backend

    global _ALL_GATHER, _REDUCE_SCATTER
    _ALL_GATHER, _REDUCE_SCATTER = _dist_shims()
    torch.set_num_threads(job["threads"])
    p = job["world"]
    ev = _Events(job["events"], rank)
    cell_id = None
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=p,
                                timeout=_dt.timedelta(seconds=job["pg_timeout_s"]))
        link = netns.LinkEmulation.attach(job["netns"])
        backend = resolve_backend("auto", torch.device("cpu"))
        current_rate, history = None, []
        for cell in job["cells"]:
            cell_id = cell["id"]
            collective, size, rate = cell["collective"], cell["size"], cell["rate"]
            # -- budget: rank 0 decides, everyone follows ------------------------------------
            flag = torch.zeros(1, dtype=torch.int64)
            if rank == 0:
                est = _estimate(history, collective, rate, size, job)
                left = job["deadline"] - time.time()
                if left <= 0 or (est is not None and est > left):
                    flag[0] = 1
                    why = f"time budget: {left:.0f} s left" + (f", cell estimated {est:.0f} s" if est else "")
            dist.broadcast(flag, 0)
            if flag.item():
                if rank == 0:
                    ev.put(event="skip", cell=cell_id, why=why)
                    print(f"[skip] {collective} {fmt_size(size)} link {rate}: {why}", flush=True)
                continue
            if rank == 0:
                ev.put(event="start", cell=cell_id)
            t_cell = time.time()
            load = os.getloadavg()[0]  # other work on the machine makes timings noisy: record it
            # -- link rate -------------------------------------------------------------------
            if rate != current_rate:
                dist.barrier()
                if rank == 0:
                    link.set_rate(rate)
                dist.barrier()
                current_rate = rate
            label = link.label if link.disabled else rate
            emulation = ("none (host loopback)" if link.disabled else "none (namespace loopback)"
                         if rate == netns.UNLIMITED else "tc " + " ".join(netns.tbf_args(rate)))
            # -- buffers, variants, warm-up (+ wire bytes and error) ----------------------------
            bufs = _Cell(collective, size, rank, p, job["seed"])
            variants, note = _variants(collective, size, job)
            wire, err = [], []
            t0 = time.perf_counter()
            for v in variants:
                bufs.poison()
                dist.barrier()
                with taco.WireStats() as ws:
                    bufs.call(v, warm=True)
                wire.append(ws.wire_bytes)
                err.append(bufs.rel_err())
            round_s = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(round_s, op=dist.ReduceOp.MAX)
            round_s = round_s.item()
            reps = min(job["repeats"], max(job["min_repeats"], math.floor(job["cell_target_s"] / max(round_s, 1e-9))))
            # -- timed rounds ----------------------------------------------------------------
            times = [[] for _ in variants]
            cut = False
            for r in range(reps):
                k = len(variants)
                for j in range(k):
                    i = (j + r) % k  # rotate the order round by round
                    bufs.reset()
                    dist.barrier()
                    t = time.perf_counter()
                    bufs.call(variants[i])
                    times[i].append(time.perf_counter() - t)
                    dist.barrier()
                stop = torch.tensor([1 if rank == 0 and time.time() > job["deadline"] else 0], dtype=torch.int64)
                dist.all_reduce(stop, op=dist.ReduceOp.MAX)
                if stop.item() and r + 1 < reps:
                    cut = True
                    break
            # the slowest rank's time per repeat; the worst rank's error
            T = torch.tensor(times, dtype=torch.float64)
            dist.all_reduce(T, op=dist.ReduceOp.MAX)
            E = torch.tensor(err, dtype=torch.float64)
            dist.all_reduce(E, op=dist.ReduceOp.MAX)
            W = torch.tensor(wire, dtype=torch.float64)
            dist.all_reduce(W, op=dist.ReduceOp.MAX)
            del bufs
            if rank == 0:
                nrep = T.shape[1]
                stats = [_quantiles(T[i].tolist()) for i in range(len(variants))]
                native_med = stats[0][0]
                for i, v in enumerate(variants):
                    med, p20, p80 = stats[i]
                    algbw = size / med / 1e9
                    ev.put(event="row", cell=cell_id, row={
                        "collective": collective, "impl": v["impl"], "codec": v["codec"], "pipeline": v["pipeline"],
                        "size_bytes": size, "link": label, "world_size": p,
                        "median_ms": med * 1e3, "p20_ms": p20 * 1e3, "p80_ms": p80 * 1e3,
                        "algbw_GBps": algbw, "busbw_GBps": algbw * bus_factor(collective, p),
                        "speedup_vs_native": native_med / med,
                        "wire_bytes_per_rank": W[i].item(), "rel_l2_err": E[i].item(),
                        "status": "ok", "repeats": nrep, "threads": job["threads"], "codec_backend": backend,
                        "min_bytes": "default" if v["min_bytes"] is None and v["impl"] != "native_bf16"
                        else ("-" if v["min_bytes"] is None else v["min_bytes"]),
                        "load_1min": load,
                        "link_emulation": emulation,
                        "note": "; ".join(x for x in (note, "repeats cut at the time budget" if cut else "") if x),
                    })
                history.append({"collective": collective, "rate": rate, "size": size, "round_s": round_s})
                ev.put(event="done", cell=cell_id, seconds=time.time() - t_cell)
                fast = min(range(1, len(variants)), key=lambda i: stats[i][0]) if len(variants) > 1 else 0
                print(f"[done {time.time() - t_cell:5.0f} s] {collective} {fmt_size(size)} link {label}: "
                      f"native {native_med * 1e3:.1f} ms, best compressed {stats[fast][0] * 1e3:.1f} ms "
                      f"({variants[fast]['codec']} d={variants[fast]['pipeline']}), {nrep} repeats", flush=True)
        dist.barrier()
    except BaseException as e:  # noqa: BLE001 - tell the parent which cell failed, then die
        ev.put(event="error", cell=cell_id, msg=f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        raise SystemExit(1)
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


def worker_main(job_path: str) -> int:
    """Inside the namespace: spawn the ranks, wait, and kill the rest if one fails."""
    import torch.multiprocessing as mp

    with open(job_path) as f:
        job = json.load(f)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, job, port), daemon=True) for r in range(job["world"])]

    def _term(signum, frame):
        for pr in procs:
            if pr.is_alive():
                pr.kill()
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, _term)
    for pr in procs:
        pr.start()
    failed_at = None
    while any(pr.is_alive() for pr in procs):
        time.sleep(0.5)
        if failed_at is None and any(pr.exitcode not in (None, 0) for pr in procs):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > 10:  # peers stuck in a collective
            for pr in procs:
                if pr.is_alive():
                    pr.kill()
    for pr in procs:
        pr.join(5)
    return 0 if all(pr.exitcode == 0 for pr in procs) else 1


# == parent =====================================================================================
def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
    except ProcessLookupError:
        pass


def _read_events(path: str, pos: int) -> tuple[list[dict], int]:
    if not os.path.exists(path):
        return [], pos
    with open(path) as f:
        f.seek(pos)
        data = f.read()
    # only whole lines
    end = data.rfind("\n") + 1
    out = []
    for line in data[:end].splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out, pos + len(data[:end].encode())


def build_plan(args) -> list[dict]:
    cells = []
    for size in args.sizes:
        for coll in args.collectives:
            for rate in args.rates:
                cells.append({"id": len(cells), "collective": coll, "size": size, "rate": rate})
    return cells


def run_plan(args, plan: list[dict], link, meta: dict, rows: list, status: dict) -> None:
    """Run every cell (restarting the worker after a failed cell), filling `rows` and
    `status[cell id] = (status, note)` as it goes (so an interrupt keeps what was measured)."""
    tmp = tempfile.mkdtemp(prefix="taco-collectives-")
    events = os.path.join(tmp, "events.jsonl")
    start = meta["t_start"]
    deadline = start + args.time_budget
    pos, attempt = 0, 0
    remaining = list(plan)
    while remaining:
        if time.time() >= deadline:
            for c in remaining:
                status[c["id"]] = ("skipped", "time budget: not reached")
            break
        attempt += 1
        if attempt > args.max_restarts + 1:
            for c in remaining:
                status[c["id"]] = ("skipped", f"not run: worker failed {args.max_restarts + 1} times")
            break
        job = {
            "cells": remaining, "world": args.world_size, "threads": args.threads, "seed": args.seed,
            "codecs": args.codecs, "depths": args.depths, "default_row": args.default_row,
            "repeats": args.repeats, "min_repeats": args.min_repeats, "cell_target_s": args.cell_target_s,
            "deadline": deadline, "pg_timeout_s": args.pg_timeout, "events": events,
            "netns": None if args.no_netns else link.name,
        }
        job_path = os.path.join(tmp, f"job{attempt}.json")
        with open(job_path, "w") as f:
            json.dump(job, f)
        env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1")
        proc = subprocess.Popen(link.wrap([sys.executable, str(Path(__file__).resolve()), "--worker", job_path]),
                                start_new_session=True, env=env)
        cur, cur_t, killed = None, None, None
        try:
            while True:
                rc = proc.poll()
                evs, pos = _read_events(events, pos)
                for e in evs:
                    cid = e.get("cell")
                    if e["event"] == "start":
                        cur, cur_t = cid, time.time()
                    elif e["event"] == "row":
                        rows.append(e["row"] | {"_cell": cid})
                    elif e["event"] == "done":
                        status[cid] = ("ok", "")
                        cur = None
                    elif e["event"] == "skip":
                        status[cid] = ("skipped", e["why"])
                    elif e["event"] == "error" and cid is not None and cid not in status:
                        msg = e["msg"].strip().splitlines()
                        status[cid] = ("error", f"rank {e['rank']}: {msg[0]}")
                        print(f"[error] cell {cid} rank {e['rank']}:\n{e['msg']}", file=sys.stderr, flush=True)
                if rc is not None:
                    break
                if cur is not None and time.time() - cur_t > args.cell_timeout:
                    killed = ("timeout", f"cell ran over --cell-timeout {args.cell_timeout:.0f} s; ranks killed")
                elif time.time() > deadline + args.grace:
                    killed = ("timeout", f"run exceeded --time-budget + {args.grace:.0f} s grace; ranks killed")
                if killed:
                    print(f"[kill] {killed[1]}", file=sys.stderr, flush=True)
                    _kill_group(proc)
                    break
                time.sleep(0.5)
        finally:
            _kill_group(proc)
        evs, pos = _read_events(events, pos)
        for e in evs:
            if e["event"] == "row":
                rows.append(e["row"] | {"_cell": e.get("cell")})
            elif e["event"] in ("done", "skip"):
                status.setdefault(e["cell"], ("ok", "") if e["event"] == "done" else ("skipped", e["why"]))
        if cur is not None and cur not in status:
            status[cur] = killed or ("error", f"worker exited with {proc.returncode} during this cell")
        remaining = [c for c in remaining if c["id"] not in status]
        if remaining and proc.returncode == 0 and not killed:
            for c in remaining:  # should not happen: the worker ends after its last cell
                status[c["id"]] = ("error", "worker finished without running this cell")
            remaining = []
    shutil.rmtree(tmp, ignore_errors=True)  # job files and the event stream (kept if we crashed)


def finish_rows(args, plan, link_label, rows: list, status: dict, missing=("skipped", "not reached")) -> list:
    """Measured rows of finished cells, plus one '*' row per cell that was not measured."""
    out = [r for r in rows if status.get(r["_cell"], ("",))[0] == "ok"]
    for c in plan:
        st, note = status.get(c["id"], missing)
        if st != "ok":
            out.append({"collective": c["collective"], "impl": "*", "codec": "-", "pipeline": "-",
                        "size_bytes": c["size"], "link": link_label or c["rate"],
                        "world_size": args.world_size, "status": st, "note": note, "_cell": c["id"]})
    return out


def print_tables(df) -> None:
    import pandas as pd

    show = df[df["status"] == "ok"].copy()
    if show.empty:
        print("(no measured cells)")
    for (coll, link), g in show.groupby(["collective", "link"], sort=False):
        print(f"\n=== {coll} | link {link}{' Gbit/s (shared token bucket)' if link[0].isdigit() else ''} "
              f"| P={int(g['world_size'].iloc[0])} | busbw factor {bus_factor(coll, int(g['world_size'].iloc[0])):.2f}")
        t = pd.DataFrame({
            "size": g["size_bytes"].map(fmt_size),
            "impl": g["impl"], "codec": g["codec"], "pipe": g["pipeline"],
            "median_ms": g["median_ms"].map("{:.1f}".format),
            "p20-p80_ms": [f"{a:.1f}-{b:.1f}" for a, b in zip(g["p20_ms"], g["p80_ms"])],
            "algbw_GB/s": g["algbw_GBps"].map("{:.4f}".format),
            "busbw_GB/s": g["busbw_GBps"].map("{:.4f}".format),
            "vs_native": g["speedup_vs_native"].map("{:.2f}x".format),
            "wire_MB/rank": (g["wire_bytes_per_rank"] / 1e6).map("{:.2f}".format),
            "rel_l2_err": g["rel_l2_err"].map("{:.2e}".format),
            "reps": g["repeats"],
        })
        print(t.to_string(index=False))
    bad = df[df["status"] != "ok"]
    if not bad.empty:
        print("\nCells not measured:")
        for _, r in bad.iterrows():
            print(f"  {r['collective']} {fmt_size(int(r['size_bytes']))} link {r['link']}: {r['status']} ({r['note']})")


def print_crossover(df) -> None:
    """Smallest measured size from which a compressed row beats native at every larger size."""
    ok = df[(df["status"] == "ok") & (df["impl"] == "compressed")]
    if ok.empty:
        return
    print("\nCrossover (smallest measured size from which compressed beats native at every larger measured size):")
    for (coll, link, codec, pipe), g in ok.groupby(["collective", "link", "codec", "pipeline"], sort=False):
        g = g.sort_values("size_bytes")
        sizes, wins = list(g["size_bytes"]), list(g["speedup_vs_native"] > 1.0)
        cross = None
        for i in range(len(sizes)):
            if all(wins[i:]):
                cross = sizes[i]
                break
        best = g["speedup_vs_native"].max()
        where = fmt_size(int(cross)) if cross is not None else f"none up to {fmt_size(int(sizes[-1]))}"
        print(f"  {coll:15s} link {str(link):24s} {codec:9s} pipe {pipe:>3s}: {where:22s} "
              f"(speedups {', '.join(f'{s:.2f}' for s in g['speedup_vs_native'])}; best {best:.2f}x)")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help=f"preset: sizes {QUICK['sizes']}, rates {QUICK['rates']}, {QUICK['collectives']} only, "
                         f"budget {QUICK['time_budget']:.0f} s (explicit options still win)")
    ap.add_argument("--collectives", default=None, help=f"comma list of {','.join(COLLECTIVES)} (default: all)")
    ap.add_argument("--sizes", default=None, help=f"comma list of buffer sizes in bf16 bytes (default {DEFAULT_SIZES})")
    ap.add_argument("--rates", default=None,
                    help=f"link rates in Gbit/s and/or 'unlimited' (default {DEFAULT_RATES})")
    ap.add_argument("--depths", default="1,4", help="pipeline depths of the compressed rows (default 1,4)")
    ap.add_argument("--codecs", default="fp8_e4m3,int8", help="codecs of the compressed rows (default fp8_e4m3,int8)")
    ap.add_argument("--no-default-row", dest="default_row", action="store_false",
                    help="leave out the compressed_default row (all library defaults)")
    ap.add_argument("--time-budget", type=float, default=None, help="seconds for the whole run (default 900)")
    ap.add_argument("--cell-timeout", type=float, default=600, help="kill the ranks if one cell runs longer (s)")
    ap.add_argument("--grace", type=float, default=60, help="hard kill this long after the time budget (s)")
    ap.add_argument("--pg-timeout", type=float, default=300, help="process-group timeout (s)")
    ap.add_argument("--max-restarts", type=int, default=2, help="restart the ranks after a failed cell at most N times")
    ap.add_argument("--repeats", type=int, default=7, help="timed rounds per cell, at most (default 7)")
    ap.add_argument("--min-repeats", type=int, default=3, help="timed rounds per cell, at least (default 3)")
    ap.add_argument("--cell-target-s", type=float, default=45,
                    help="aim for about this many seconds of timed rounds per cell (default 45)")
    ap.add_argument("--world-size", type=int, default=2, help="ranks (default 2: one per core here)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads per rank (default: cores // world_size, at least 1)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default: %(default)s)")
    ap.add_argument("--no-netns", action="store_true",
                    help="no namespace, no emulation: host loopback, link 'unlimited (no emulation)'")
    ap.add_argument("--csv", default=None, help="output CSV (default bench/results/collectives_cpu_<UTC date>[_tag].csv)")
    ap.add_argument("--tag", default="", help="suffix of the default CSV name")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return args
    q = QUICK if args.quick else {}
    args.collectives = csv_list(args.collectives or q.get("collectives") or ",".join(COLLECTIVES))
    for c in args.collectives:
        if c not in COLLECTIVES:
            ap.error(f"unknown collective {c!r}; choose from {', '.join(COLLECTIVES)}")
    try:
        args.sizes = [parse_size(s) for s in csv_list(args.sizes or q.get("sizes") or DEFAULT_SIZES)]
        args.rates = [netns.normalize_rate(r) for r in csv_list(args.rates or q.get("rates") or DEFAULT_RATES)]
    except (ValueError, argparse.ArgumentTypeError) as e:
        ap.error(str(e))
    args.depths = [int(d) for d in csv_list(args.depths)]
    if any(not 1 <= d <= 16 for d in args.depths):
        ap.error("--depths must be in 1..16")
    args.codecs = csv_list(args.codecs)
    from taco_triton.config import CODECS

    for c in args.codecs:
        if c not in CODECS:
            ap.error(f"unknown codec {c!r}; choose from {', '.join(CODECS)}")
    for s in args.sizes:
        if s % (ELEM * args.world_size):
            ap.error(f"size {s} is not a multiple of {ELEM * args.world_size} bytes (bf16 x world size)")
    if args.time_budget is None:
        args.time_budget = q.get("time_budget", 900.0)
    if args.threads is None:
        args.threads = max(1, (os.cpu_count() or 1) // args.world_size)
    if args.no_netns:
        if any(r != netns.UNLIMITED for r in args.rates):
            dropped = [r for r in args.rates if r != netns.UNLIMITED]
            print(f"--no-netns: no link emulation; dropping rates {', '.join(dropped)} (Gbit/s)", file=sys.stderr)
        args.rates = [netns.UNLIMITED]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args.worker)
    import pandas as pd

    import taco_triton as taco

    # Ctrl-C must work even when started from a shell that ignores SIGINT for background jobs
    signal.signal(signal.SIGINT, signal.default_int_handler)
    commit, dirty = git_info()
    now = datetime.datetime.now(datetime.timezone.utc)
    meta = {"machine": machine(), "torch_version": torch.__version__, "git_commit": commit, "git_dirty": dirty,
            "date": now.isoformat(timespec="seconds"), "t_start": time.time(),
            "platform": "cpu-gloo, torch reference codec (NOT GPU performance)"}
    csv_path = Path(args.csv) if args.csv else (
        ROOT / "bench" / "results" / f"collectives_cpu_{now.strftime('%Y%m%dT%H%M%SZ')}{'_' + args.tag if args.tag else ''}.csv")
    plan = build_plan(args)
    print(BANNER)
    print(f"{meta['machine']} | torch {meta['torch_version']} | git {commit} (dirty: {dirty}) | {meta['date']}")
    print(f"P={args.world_size} gloo ranks on 127.0.0.1, {args.threads} torch thread(s) each | "
          f"DEFAULT_MIN_BYTES={taco.collectives.DEFAULT_MIN_BYTES}")
    print(f"collectives: {', '.join(args.collectives)} | sizes: {', '.join(fmt_size(s) for s in args.sizes)} | "
          f"links: {', '.join(args.rates)} | codecs: {', '.join(args.codecs)} | depths: {args.depths} | "
          f"{len(plan)} cells | budget {args.time_budget:.0f} s | CSV {csv_path}", flush=True)
    try:
        link_cm = netns.LinkEmulation(args.rates[0], disabled=args.no_netns)
        with link_cm as link:
            if not args.no_netns:
                print(f"network namespace {link.name}: {link.qdisc()}", flush=True)
            interrupted = False
            rows, status = [], {}
            try:
                run_plan(args, plan, link, meta, rows, status)
            except (KeyboardInterrupt, SystemExit) as e:  # Ctrl-C; SIGTERM/SIGHUP (netns.py's handler)
                interrupted = True
                print(f"interrupted ({type(e).__name__}): ranks killed, writing what was measured", file=sys.stderr)
    except netns.NetnsError as e:
        print(f"ERROR: {e}", file=sys.stderr)
        return 2
    rows = finish_rows(args, plan, netns.NO_EMULATION if args.no_netns else None, rows, status,
                       ("interrupted", "Ctrl-C") if interrupted else ("skipped", "not reached"))
    df = pd.DataFrame(rows)
    for k in ("machine", "torch_version", "git_commit", "date", "git_dirty", "platform"):
        df[k] = meta[k]
    for c in COLUMNS:
        if c not in df.columns:
            df[c] = None
    df = df.sort_values(["_cell"], kind="stable")  # plan order; rows of a cell as measured
    df = df[COLUMNS]
    df["repeats"] = df["repeats"].astype("Int64")
    print_tables(df)
    print_crossover(df)
    csv_path.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(csv_path, index=False)
    print(BANNER)
    print(f"wrote {csv_path} ({(df['status'] == 'ok').sum()} measured rows, {(df['status'] != 'ok').sum()} cells not measured; "
          f"{time.time() - meta['t_start']:.0f} s)")
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
