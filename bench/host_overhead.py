"""Host overhead around the kernels: launches, host reads and host time per call.

    python bench/host_overhead.py                       # P = 2, 4, 8; pipeline 1, 2; CSV in bench/results/
    python bench/host_overhead.py --worlds 2 --repeats 5 --csv /tmp/h.csv

What a GPU user's host pays per call, measured on CPU: the kernels run under Triton's
interpreter with their launches stubbed out (`taco_triton.host_audit`), so only Python and torch
overhead is timed. Every time is also given as a ratio to a tiny eager torch op
(`torch.add(a, b, out=c)` of 16 elements) timed in the same run, because absolute host times on
a shared machine move with its load.

Rows: `compress` / `decompress` (eager `taco.compress` / `taco.decompress` of `--numel` bf16,
default config) and each compressed collective at each world size P and pipeline depth, issued
async and waited, in its steady state (after a first call that prepares the plan). The
collectives run on torch's fake process group (rank 0 of P; the collectives move no data), so
the host time is ours and c10d's issue cost, not a transfer. Columns: launches per call (Triton
launches plus any other device op), host reads per call (`item`, `tolist`, `cpu`, `numpy`,
`bool`/`int`/`float` of a tensor), host us per call (median over repeats), its ratio to the
tiny op, and us per launch. `host_us_without_pg` times the same call with the process-group
calls stubbed too (what our code costs around its launches, c10d's issue cost left out), and
`launch_ratio_to_tiny_op` is that per launch, as a ratio to the tiny op.
"""
from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402 - after TRITON_INTERPRET is set

KINDS = ("all_reduce", "reduce_scatter", "all_gather")
COLUMNS = ["what", "mode", "world_size", "pipeline", "numel", "launches_per_call", "host_reads_per_call", "host_us",
           "tiny_op_us", "ratio_to_tiny_op", "us_per_launch", "host_us_without_pg", "launch_ratio_to_tiny_op",
           "machine", "torch_version", "git_commit", "date"]


def _per_call_us(fn, calls: int, repeats: int) -> float:
    """Median over `repeats` of the mean time of `calls` calls, in microseconds."""
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(samples)


def tiny_op_us(calls: int, repeats: int) -> float:
    a, b, c = torch.ones(16), torch.ones(16), torch.empty(16)
    return _per_call_us(lambda: torch.add(a, b, out=c), calls * 20, repeats)


def _counted(fn) -> tuple[int, int]:
    """(launches, host reads) of one call of fn (after it ran once)."""
    from taco_triton.host_audit import audit

    with audit(stub_kernels=True):
        fn()
    with audit(stub_kernels=True) as seen:
        fn()
    return seen.launches, seen.host_reads


def _timed(fn, calls: int, repeats: int) -> float:
    from taco_triton.host_audit import audit

    with audit(stub_kernels=True, ops=False):
        fn()
        return _per_call_us(fn, calls, repeats)


def codec_rows(numel: int, calls: int, repeats: int) -> list[dict]:
    import taco_triton as taco

    x = torch.randn(numel).to(torch.bfloat16)
    with _stubbed():
        c = taco.compress(x, backend="triton")
    fns = {"compress": lambda: taco.compress(x, backend="triton"),
           "decompress": lambda: taco.decompress(c, backend="triton")}
    rows = []
    for what, fn in fns.items():
        launches, reads = _counted(fn)
        rows.append({"what": what, "mode": "sync", "world_size": 1, "pipeline": 0, "numel": numel, "launches_per_call": launches,
                     "host_reads_per_call": reads, "host_us": _timed(fn, calls, repeats)})
    return rows


def _stubbed():
    from taco_triton.host_audit import audit

    return audit(stub_kernels=True, ops=False)


def _issue(kind: str, p: int, pipeline: int, per_rank: int, async_op: bool):
    import taco_triton as taco

    n = per_rank * p
    kw = {"min_bytes": 0, "backend": "triton", "pipeline": pipeline, "async_op": async_op, "check": False}
    if kind == "all_reduce":
        x = torch.ones(n, dtype=torch.bfloat16)
        call = lambda: taco.all_reduce(x, **kw)  # noqa: E731
    elif kind == "reduce_scatter":
        out, inp = torch.empty(per_rank, dtype=torch.bfloat16), torch.ones(n, dtype=torch.bfloat16)
        call = lambda: taco.reduce_scatter(out, inp, **kw)  # noqa: E731
    else:
        out, shard = torch.empty(n, dtype=torch.bfloat16), torch.ones(per_rank, dtype=torch.bfloat16)
        call = lambda: taco.all_gather(out, shard, **kw)  # noqa: E731
    if async_op:
        return lambda: call().wait()
    return call


#: How each collective row is issued: synchronous; async and waited (on CPU tensors the group's
#: worker thread runs it); async and waited on the CUDA schedule, its stream and event calls
#: replaced by recording fakes (`host_audit.fake_streams`), so the host cost of that schedule's
#: bookkeeping is timed on CPU (a real CUDA event record or stream wait adds a few us each).
MODES = ("sync", "async", "async-cuda-schedule")


def _schedule(mode: str):
    """The context a row of `mode` runs in (None: not available in this checkout)."""
    import contextlib

    if mode != "async-cuda-schedule":
        return contextlib.nullcontext()
    from taco_triton import host_audit

    try:  # without the allocator model: its dispatch mode is the tests' instrumentation, not the schedule's cost
        return host_audit.fake_streams(check_memory=False)
    except TypeError:  # a checkout from before the model
        return host_audit.fake_streams()


class _Done:
    def wait(self, timeout=None):
        return True


class _no_process_group:
    """Process-group calls of the collectives return a completed work at once."""

    NAMES = ("all_to_all", "all_gather")

    def __enter__(self):
        from taco_triton.collectives import _pg

        self.saved = {n: getattr(_pg, n) for n in self.NAMES}
        for n in self.NAMES:
            setattr(_pg, n, lambda *a, **k: _Done())

    def __exit__(self, *exc):
        from taco_triton.collectives import _pg

        for n, f in self.saved.items():
            setattr(_pg, n, f)


def collective_rows(worlds, pipelines, per_rank: int, calls: int, repeats: int) -> list[dict]:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from taco_triton import host_audit

    modes = [m for m in MODES if m != "async-cuda-schedule" or hasattr(host_audit, "fake_streams")]
    rows = []
    for p in worlds:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=p)
        try:
            for kind, pipeline, mode in itertools.product(KINDS, pipelines, modes):
                fn = _issue(kind, p, pipeline, per_rank, mode != "sync")
                with _schedule(mode):
                    launches, reads = _counted(fn)
                    rows.append({"what": kind, "mode": mode, "world_size": p, "pipeline": pipeline,
                                 "numel": per_rank * p,
                                 "launches_per_call": launches, "host_reads_per_call": reads,
                                 "host_us": _timed(fn, calls, repeats)})
                    with _no_process_group():
                        rows[-1]["host_us_without_pg"] = _timed(fn, calls, repeats)
        finally:
            dist.destroy_process_group()
    return rows


def measure(worlds=(2, 4, 8), pipelines=(1, 2), numel: int = 1 << 20, per_rank: int = 2 * 4096, calls: int = 20,
            repeats: int = 15):
    """The table (a pandas DataFrame, COLUMNS): codec rows, then collective rows."""
    import pandas as pd

    from autotune import meta

    tiny = tiny_op_us(calls, repeats)
    rows = codec_rows(numel, calls, repeats) + collective_rows(worlds, pipelines, per_rank, calls, repeats)
    tiny = min(tiny, tiny_op_us(calls, repeats))  # again after: the lower of two, as load shifts
    stamp = {"machine": meta.device_identity(torch.device("cpu"))[0], "torch_version": torch.__version__,
             "git_commit": meta.git_commit(), "date": meta.utc_now()}
    for r in rows:
        launches = r["launches_per_call"] or float("nan")
        own = r.get("host_us_without_pg", r["host_us"])
        r.update(tiny_op_us=tiny, ratio_to_tiny_op=r["host_us"] / tiny, us_per_launch=r["host_us"] / launches,
                 host_us_without_pg=own, launch_ratio_to_tiny_op=own / launches / tiny, **stamp)
    return pd.DataFrame(rows, columns=COLUMNS)


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", type=_ints, default=[2, 4, 8], help="world sizes (default 2,4,8)")
    ap.add_argument("--pipelines", type=_ints, default=[1, 2], help="pipeline depths (default 1,2)")
    ap.add_argument("--numel", type=int, default=1 << 20, help="elements of the compress/decompress rows")
    ap.add_argument("--calls", type=int, default=20, help="calls per timed repeat")
    ap.add_argument("--repeats", type=int, default=15, help="timed repeats (the median is reported)")
    ap.add_argument("--csv", default=str(ROOT / "bench" / "results" / "host_overhead.csv"))
    args = ap.parse_args(argv)
    if args.numel < 1 or args.calls < 1 or args.repeats < 1:
        ap.error("--numel, --calls and --repeats must be >= 1")
    df = measure(args.worlds, args.pipelines, args.numel, calls=args.calls, repeats=args.repeats)
    try:
        Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
        df.to_csv(args.csv, index=False)
    except OSError as e:
        print(f"host_overhead: cannot write {args.csv}: {e}", file=sys.stderr)
        return 2
    cols = ["what", "mode", "world_size", "pipeline", "launches_per_call", "host_reads_per_call", "host_us",
            "ratio_to_tiny_op", "us_per_launch", "host_us_without_pg", "launch_ratio_to_tiny_op"]
    print(df[cols].to_string(index=False, float_format=lambda v: f"{v:.1f}"))
    print(f"tiny op: {df['tiny_op_us'].iloc[0]:.2f} us; written {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
