"""Where a measurement ran: device identity, versions, git commit, date; and how it is timed.

Nothing here touches CUDA at import. `device_identity` queries the device the first time it is
asked about it (then remembers the answer), so it costs nothing on the launch path afterwards.
"""
from __future__ import annotations

import datetime
import functools
import platform
import statistics
import subprocess
import time
from pathlib import Path
from collections.abc import Callable

import torch

from taco_triton.env import interpreting

ROOT = Path(__file__).resolve().parents[1]


@functools.cache
def _cuda_identity(index: int) -> tuple[str, str]:
    major, minor = torch.cuda.get_device_capability(index)
    return torch.cuda.get_device_name(index), f"{major}.{minor}"


def device_identity(device: torch.device) -> tuple[str, str]:
    """(device name, compute capability) as they appear in cache keys.

    CUDA: ("NVIDIA H200", "9.0"). Anything else (the interpreter on CPU) gets a name that says
    so, so interpreter "timings" can never be mistaken for a GPU's or looked up by one.
    """
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return _cuda_identity(index)
    name = f"{device.type}-interpreter" if interpreting() else device.type
    return name, platform.machine() or "unknown"


@functools.cache
def triton_version() -> str:
    import triton  # the kernels import it anyway; no GPU is touched

    return triton.__version__


def torch_version() -> str:
    return torch.__version__


@functools.cache
def git_commit() -> str:
    """Short commit of the source tree ("+dirty" when it has local changes), "unknown" outside git."""
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True,
            timeout=10,
        ).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if len(xs) == 1:
        return xs[0]
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def time_cuda(fn: Callable[[], None], repeats: int = 1, rep_ms: int = 50, warmup_ms: int = 10) -> dict:
    """Median / p20 / p80 ms of `fn` on a GPU with `triton.testing.do_bench` (L2 flushed before
    every call). The first call (compilation) is outside the timing; with repeats > 1, do_bench
    runs that many times and each statistic is the median over runs."""
    from triton.testing import do_bench

    fn()
    torch.cuda.synchronize()
    runs = [do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.5, 0.2, 0.8]) for _ in range(max(repeats, 1))]
    med, p20, p80 = (statistics.median(r[i] for r in runs) for i in range(3))
    return {"median_ms": med, "p20_ms": p20, "p80_ms": p80, "n_samples": len(runs), "timer": "do_bench"}


def time_host(fn: Callable[[], None], repeats: int = 3) -> dict:
    """Median / p20 / p80 ms of `fn` by `time.perf_counter` after one untimed call (CPU, the
    interpreter). Under TRITON_INTERPRET=1 this measures Python interpretation, not a GPU."""
    fn()
    samples = []
    for _ in range(max(repeats, 1)):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    timer = "perf_counter (TRITON_INTERPRET=1: interpreter timings)" if interpreting() else "perf_counter"
    return {
        "median_ms": statistics.median(samples), "p20_ms": _quantile(samples, 0.2), "p80_ms": _quantile(samples, 0.8),
        "n_samples": len(samples), "timer": timer,
    }


def measure(fn: Callable[[], None], device: torch.device, repeats: int, rep_ms: int = 50) -> dict:
    """Time `fn` the way this device allows (compiled GPU kernels: do_bench; else perf_counter)."""
    if device.type == "cuda" and not interpreting():
        return time_cuda(fn, repeats=repeats, rep_ms=rep_ms)
    return time_host(fn, repeats=repeats)
