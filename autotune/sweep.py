"""Sweep the launch-config space of a kernel over a grid of problems; cache the best per key.

    python -m autotune.sweep --kernel compress,decompress --shapes 8192x4096,16384x8192 \\
        --dtype bf16 --group-size 128 --csv sweep.csv --cache gpu_out/autotune.json

For every kernel x dtype x shape it times each config of the (pruned) space, writes one CSV row
per timed config (long format: kernel, num_warps, num_stages, shape, numel, dtype, codec,
group_size, hadamard, median/p20/p80 ms, logical GB/s, device, versions, git commit, UTC date;
`best` marks each problem's winner) and stores the winner in the cache under the problem's key
(`autotune.cache`). A problem whose key is already cached is not timed again (one `source=cache`
row reports the cached entry) unless --force is given; two shapes in the same size bucket share
a key, so the second is a cache hit of the first. `reduce` is keyed with dtype u8 (what its
launch passes) and timed summing `registry.REDUCE_RANKS` ranks' chunks of the shape.

Timing: on a GPU `triton.testing.do_bench` (L2 flushed before every call; --repeats runs of it,
median of each statistic). On CPU only under TRITON_INTERPRET=1, with perf_counter: those are
interpreter timings, meaningless for a GPU, and the interpreter runs every config alike, so the
space is just the heuristic unless --full-space. Such entries are keyed device=cpu-interpreter
and are never looked up by a GPU launch.

Before timing, the sweep says how many configs it will time; under the interpreter also about
how long, from one call of each kernel on one tile (the interpreter's time grows with the
elements: a GPU-sized shape takes hours there, and the sweep then names a small shape that
exercises the same machinery in seconds). After every config one line on stderr gives the
configs done out of the total, the time spent and the time left.

Exit status: 0; 1 when nothing was timed or looked up, or every config of a problem failed
(the CSV and the cache keep what succeeded); 2 for bad arguments (one line on stderr), an
unusable --device, --cache or --csv (checked before any timing), or a registered kernel
without a builder.
Importing this module makes no CUDA call.
"""
from __future__ import annotations

import argparse
import collections
import math
import os
import sys
import time
from pathlib import Path

import torch

from taco_triton import env
from taco_triton.config import CODECS, GROUP_SIZES, ROUNDINGS, SCALE_MODES, CompressionConfig

from . import cache, meta, registry, space

# The command line is the public interface; the rest of this module is its implementation.
__all__ = ["main"]

COLUMNS = [
    "kernel", "num_warps", "num_stages", "shape", "numel", "dtype", "codec", "group_size", "hadamard",
    "median_ms", "p20_ms", "p80_ms", "logical_gbps", "device", "torch_version", "triton_version", "git_commit",
    "date",
    # extras
    "best", "source", "scales", "rounding", "cc", "logical_bytes", "n_samples", "timer", "interpreter",
    "bucket", "cache_key", "error",
]
DATA_DTYPES = ("bf16", "fp16", "fp32")
INTERPRETER_BANNER = """\
##########################################################################################
##  TRITON_INTERPRET=1: THESE ARE INTERPRETER TIMINGS ON CPU, NOT GPU PERFORMANCE.       ##
##  Every config runs the same Python code here; the cache entries are keyed             ##
##  device=cpu-interpreter and are never used by a GPU launch.                           ##
##########################################################################################"""


def parse_shape(text: str) -> tuple[int, ...]:
    """"8192x4096" -> (8192, 4096); "65536" -> (65536,)."""
    try:
        dims = tuple(int(d) for d in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape {text!r} is not like 8192x4096") from None
    if not dims or any(d <= 0 for d in dims):
        raise argparse.ArgumentTypeError(f"shape {text!r} must have positive dimensions")
    if math.prod(dims) >= 2**63:
        raise argparse.ArgumentTypeError(f"shape {text!r} has {math.prod(dims)} elements, more than a tensor can hold")
    return dims


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m autotune.sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--kernel", default="compress",
                   help=f"comma-separated kernels, or 'all' (registered: {','.join(registry.KERNELS)})")
    p.add_argument("--shapes", default="8192x4096", help="comma-separated shapes, e.g. 8192x4096,16384x8192")
    p.add_argument("--dtype", default="bf16", help=f"comma-separated data dtypes ({','.join(DATA_DTYPES)}); "
                   "compress: the input's, decompress: the output's")
    p.add_argument("--group-size", type=int, default=128, choices=GROUP_SIZES,
                   help="elements per group G (default: %(default)s)")
    p.add_argument("--codec", default="fp8_e4m3", choices=CODECS, help="code format (default: %(default)s)")
    p.add_argument("--no-hadamard", action="store_true", help="tune the kernels without the Hadamard transform")
    p.add_argument("--scales", default="dual", choices=SCALE_MODES, help="scale layout (default: %(default)s)")
    p.add_argument("--rounding", default="nearest", choices=ROUNDINGS, help="code rounding (default: %(default)s)")
    p.add_argument("--csv", default=None,
                   help="CSV file, or a folder (ending in /) for autotune_<device>_<date>.csv; default: none")
    p.add_argument("--cache", default=None, help="cache file to read and update (default: the user's cache, "
                   "TACO_AUTOTUNE_CACHE or ~/.cache/taco_triton/autotune.json)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per config (GPU: do_bench runs; CPU: calls)")
    p.add_argument("--rep-ms", type=int, default=50, help="do_bench's timed window per run, ms (GPU)")
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu (needs TRITON_INTERPRET=1)")
    p.add_argument("--configs", default=None, help="time only these num_warps:num_stages configs, e.g. 4:1,8:1")
    p.add_argument("--max-configs", type=int, default=None, help="time at most this many configs per problem")
    p.add_argument("--no-prune", action="store_true", help="time the full 20-config space (checks the pruning)")
    p.add_argument("--full-space", action="store_true",
                   help="under the interpreter, time the GPU space anyway (exercises the machinery only)")
    p.add_argument("--force", action="store_true", help="time problems whose key is already cached")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds; stop starting new problems after this (finished ones are kept)")
    args = p.parse_args(argv)
    names = list(registry.KERNELS) if args.kernel == "all" else [k.strip() for k in args.kernel.split(",") if k.strip()]
    if not names:
        p.error(f"--kernel {args.kernel!r} names no kernel; registered: {', '.join(registry.KERNELS)}")
    for k in names:
        if k not in registry.KERNELS:
            p.error(f"unknown kernel {k!r}; registered: {', '.join(registry.KERNELS)}")
    args.kernels = names
    try:
        args.shape_list = [parse_shape(s) for s in args.shapes.split(",") if s.strip()]
    except argparse.ArgumentTypeError as exc:
        p.error(str(exc))
    if not args.shape_list:
        p.error(f"--shapes {args.shapes!r} names no shape; use e.g. 8192x4096")
    args.dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()]
    if not args.dtypes:
        p.error(f"--dtype {args.dtype!r} names no dtype; allowed: {', '.join(DATA_DTYPES)}")
    for d in args.dtypes:
        if d not in DATA_DTYPES:
            p.error(f"dtype {d!r} is not supported; allowed: {', '.join(DATA_DTYPES)}")
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.rep_ms < 1:
        p.error(f"--rep-ms must be >= 1, got {args.rep_ms}")
    if args.max_configs is not None and args.max_configs < 1:
        p.error(f"--max-configs must be >= 1, got {args.max_configs}")
    if args.time_budget is not None and not (math.isfinite(args.time_budget) and args.time_budget > 0):
        p.error(f"--time-budget must be a positive number of seconds, got {args.time_budget}")
    if args.device is not None:
        try:
            torch.device(args.device)
        except RuntimeError:
            p.error(f"--device {args.device!r} is not a device; use cuda or cpu")
    if args.configs:
        try:
            args.config_list = space.parse_configs(args.configs)
        except ValueError as exc:
            p.error(str(exc))
    else:
        args.config_list = None
    return args


def _ms(v) -> str:
    return f"{v:.4g} ms" if isinstance(v, (int, float)) else "time unknown"


def csv_path(arg: str | None, device_name: str, date: str) -> Path | None:
    if not arg:
        return None
    path = Path(arg)
    if arg.endswith(os.sep) or path.is_dir():
        stamp = date.replace("-", "").replace(":", "")
        return path / f"autotune_{cache.normalise_gpu_name(device_name)}_{stamp}.csv"
    return path


def write_csv(path: Path | None, rows: list[dict]) -> bool:
    """(Re)write the long-format CSV; False when no --csv was given."""
    if path is None:
        return False
    import pandas as pd

    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).reindex(columns=COLUMNS).to_csv(path, index=False)
    return True


def _writable_cache(path: str) -> str | None:
    """Why the cache file `path` cannot be written, or None. Checked before any timing: the cache
    is written after every problem (`cache.update` replaces the file through a temporary one
    in its folder, which it creates)."""
    import tempfile

    if os.path.isdir(path):
        return "it is a folder; name a file, e.g. autotune.json in it"
    try:
        folder = os.path.dirname(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".autotune.", suffix=".check", dir=folder)
        os.close(fd)
        os.unlink(tmp)
    except OSError as exc:
        return f"{type(exc).__name__}: {exc.strerror or exc}"
    return None


def _fail(message: str, code: int = 2) -> int:
    print(f"autotune.sweep: error: {message}", file=sys.stderr)
    return code


SMOKE_SHAPE = (4, 4096)
"""What the sweep suggests under the interpreter when the shapes asked for take long: four
tiles, enough for every kernel to loop, timed in seconds."""
LONG_S = 600.0
"""An interpreter sweep estimated longer than this (seconds) is told about SMOKE_SHAPE."""


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _candidates(args, kernel: str, base: CompressionConfig, dtype, interp: bool) -> list[dict]:
    if args.config_list is not None:
        cands = args.config_list
    else:
        cands = space.candidates(kernel, base, dtype, interpreter=interp and not args.full_space,
                                 prune=not args.no_prune)
    return cands[: args.max_configs] if args.max_configs is not None else cands


def _calibrate(first: dict, base: CompressionConfig, device: torch.device) -> dict:
    """Seconds per element of each kernel under the interpreter: (building a problem, one call).

    Args:
        first: kernel -> (dtype, params) of its first problem to time.

    Returns:
        kernel -> (build s/element, call s/element), from one tile (after one untimed call); a
        kernel whose tile fails is left out.
    """
    rates = {}
    for kernel, (dtype, params) in first.items():
        ks = registry.spec(kernel)
        try:
            t0 = time.perf_counter()
            fn, _ = ks.build(ks.tile_elems, dtype, base, device, params)
            t1 = time.perf_counter()
            fn()
            t2 = time.perf_counter()
            fn()
            rates[kernel] = ((t1 - t0) / ks.tile_elems, (time.perf_counter() - t2) / ks.tile_elems)
        except Exception:  # the sweep itself reports the failure, config by config
            pass
        finally:
            registry.release()
    return rates


def _problem_s(rate: tuple[float, float], numel: int, configs: int, repeats: int) -> list[float]:
    """Predicted seconds of each config of one problem under the interpreter: every config makes
    1 + `repeats` calls (time_host), the first also builds the problem's inputs."""
    build, call = rate
    per = (1 + repeats) * call * numel
    return [per + (build * numel if i == 0 else 0.0) for i in range(configs)]


class _Progress:
    """After each config, one line on stderr: configs done of the total, time spent, time left.

    Each config has a weight (its predicted seconds under the interpreter, 1 elsewhere); time
    left is the time spent per unit of weight done times the weight left, so the prediction's
    scale error cancels once the first config is done.
    """

    def __init__(self, weights: list[float], predicted: bool):
        self.left, self.done_w, self.n, self.total = sum(weights), 0.0, 0, len(weights)
        self.predicted = predicted
        self.t0 = time.perf_counter()

    def add(self, weights: list[float]) -> None:
        """Configs found to need timing after the plan (a problem planned as a cache hit of an
        earlier one that failed)."""
        self.left += sum(weights)
        self.total += len(weights)

    def step(self, weight: float) -> None:
        self.n += 1
        self.done_w += weight
        self.left = max(self.left - weight, 0.0)
        spent = time.perf_counter() - self.t0
        sys.stdout.flush()  # the config's own line first, where both streams go to one file
        left = spent / self.done_w * self.left if self.done_w > 0 else (self.left if self.predicted else 0.0)
        print(f"autotune.sweep: {self.n}/{self.total} configs, {_duration(spent)} spent, "
              f"about {_duration(left)} left", file=sys.stderr, flush=True)


def main(argv=None) -> int:
    """Run the sweep: `python -m autotune.sweep --help` lists the options.

    Args:
        argv: the command-line arguments (default: `sys.argv[1:]`).

    Returns:
        The exit status (module docstring): 0, 1 when nothing was timed or looked up, 2 for bad
        arguments or an unusable device, cache or CSV path.
    """
    args = parse_args(argv)
    for k in args.kernels:
        try:
            registry.spec(k)
        except registry.KernelUnavailable as exc:
            print(f"autotune.sweep: {exc}", file=sys.stderr)
            return 2
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        return _fail(f"--device {args.device} but this torch sees no CUDA device (torch {torch.__version__})")
    try:
        interp = env.use_interpreter_on_cpu(device.type)  # CPU: Triton's interpreter (a smoke run, not GPU timings)
    except RuntimeError as exc:  # taco_triton's kernels already built for a GPU in this process
        return _fail(str(exc))
    dev_name, cc = meta.device_identity(device)
    triton_v, torch_v, commit, date = meta.triton_version(), meta.torch_version(), meta.git_commit(), meta.utc_now()
    cache_path = args.cache or env.autotune_cache_path()
    problem = _writable_cache(cache_path)
    if problem is not None:
        return _fail(f"cannot write the cache {cache_path}: {problem}")
    base = CompressionConfig(codec=args.codec, group_size=args.group_size, hadamard=not args.no_hadamard,
                             scales=args.scales, rounding=args.rounding)
    stored = cache.load(cache_path, triton_v)
    if interp:
        print(INTERPRETER_BANNER)
    print(f"device {dev_name} (cc {cc}) | torch {torch_v} | triton {triton_v} | git {commit} | {date}")
    print(f"cache {cache_path} ({len(stored)} entries) | config {base} | repeats {args.repeats}\n")

    rows, n_timed, n_hits, n_keys, stopped, failed = [], 0, 0, 0, False, []
    out = csv_path(args.csv, dev_name, date)
    try:
        write_csv(out, [])  # a header now: an unwritable --csv fails before the timing, not after
    except OSError as exc:
        return _fail(f"cannot write --csv {out}: {type(exc).__name__}: {exc.strerror or exc}")
    # The plan: the problems that will be timed (the others are cache hits), with their configs.
    plan, planned, first_params = [], collections.Counter(), {}
    for kernel in args.kernels:
        ks = registry.spec(kernel)
        dnames = [cache.dtype_name(ks.launch_dtype)] if ks.launch_dtype is not None else args.dtypes
        for dname in dnames:
            dtype = cache.DTYPES[dname]
            for shape in args.shape_list:
                name = str(cache.Key.of(kernel, dev_name, cc, triton_v, dtype, base, math.prod(shape)))
                if (name in stored or planned[name]) and not args.force:
                    continue
                planned[name] += 1
                cands = _candidates(args, kernel, base, dtype, interp)
                plan.append((kernel, dtype, math.prod(shape), len(cands)))
                first_params.setdefault(kernel, (dtype, cands[0]))
    rates = _calibrate(first_params, base, device) if interp and plan else {}
    estimated = bool(plan) and interp and all(k in rates for k in first_params)

    def weights(kernel: str, numel: int, configs: int) -> list[float]:
        return _problem_s(rates[kernel], numel, configs, args.repeats) if estimated else [1.0] * configs

    progress = _Progress([w for k, _, numel, n in plan for w in weights(k, numel, n)], predicted=estimated)
    if plan:
        line = f"to time: {progress.total} config(s) of {len(plan)} problem(s)"
        if estimated:
            line += f", about {_duration(progress.left)} here under the interpreter"
        print(line + "; progress on stderr")
        if estimated and progress.left > LONG_S:
            per_kind = {(k, d): n for k, d, _, n in plan}  # the smoke run: one problem per kernel and dtype
            smoke = sum(sum(weights(k, math.prod(SMOKE_SHAPE), n)) for (k, _), n in per_kind.items())
            print(f"   the interpreter runs each GPU program in Python, and its timings say nothing about a GPU: "
                  f"--shapes {'x'.join(map(str, SMOKE_SHAPE))} exercises the same machinery in about "
                  f"{_duration(smoke)}; --time-budget stops starting new problems")
    t_start = time.perf_counter()
    common = dict(dtype=None, codec=base.codec, group_size=base.group_size, hadamard=base.hadamard,
                  scales=base.scales, rounding=base.rounding, device=dev_name, cc=cc, torch_version=torch_v,
                  triton_version=triton_v, git_commit=commit, date=date, interpreter=interp)
    for kernel in args.kernels:
        ks = registry.spec(kernel)
        dnames = [cache.dtype_name(ks.launch_dtype)] if ks.launch_dtype is not None else args.dtypes
        if dnames != args.dtypes:
            print(f"{kernel}: its launch is keyed by dtype {dnames[0]}, whatever --dtype says")
        for dname in dnames:
            dtype = cache.DTYPES[dname]
            for shape in args.shape_list:
                if args.time_budget is not None and time.perf_counter() - t_start > args.time_budget:
                    if not stopped:
                        print(f"time budget of {args.time_budget:.0f} s spent: not starting {kernel} {shape} "
                              "or anything after it")
                    stopped = True
                    break
                numel = math.prod(shape)
                key = cache.Key.of(kernel, dev_name, cc, triton_v, dtype, base, numel)
                name = str(key)
                shape_s = "x".join(map(str, shape))
                head = dict(common, kernel=kernel, shape=shape_s, numel=numel, dtype=dname, bucket=key.bucket,
                            cache_key=name)
                if name in stored and not args.force:
                    e = stored[name]
                    n_hits += 1
                    print(f"{kernel} {shape_s} {dname}: cache hit {e['config']} ({_ms(e.get('median_ms'))}, "
                          f"{e.get('source', '?')} {e.get('date', '')}): not timed")
                    rows.append(dict(head, **e["config"], median_ms=e.get("median_ms"), p20_ms=e.get("p20_ms"),
                                     p80_ms=e.get("p80_ms"), best=True, source="cache", timer="",
                                     logical_bytes=None, logical_gbps=None, n_samples=None, error=""))
                    continue
                cands = _candidates(args, kernel, base, dtype, interp)
                print(f"{kernel} {shape_s} {dname}: timing {len(cands)} config(s) for {name}")
                config_s = weights(kernel, numel, len(cands))
                if planned[name]:
                    planned[name] -= 1
                else:  # planned as a cache hit of an earlier problem, which failed
                    progress.add(config_s)
                timed = []
                try:
                    for params, weight in zip(cands, config_s):
                        row = dict(head, **params, source="timed", best=False, error="")
                        try:
                            fn, nbytes = ks.build(numel, dtype, base, device, params)
                            t = meta.measure(fn, device, args.repeats, args.rep_ms)
                            row.update(t, logical_bytes=nbytes, logical_gbps=nbytes / (t["median_ms"] * 1e-3) / 1e9)
                            timed.append(row)
                            n_timed += 1
                            print(f"    warps={params['num_warps']:<2} stages={params['num_stages']}  "
                                  f"median {t['median_ms']:.4g} ms  [p20 {t['p20_ms']:.4g}, p80 {t['p80_ms']:.4g}]  "
                                  f"{row['logical_gbps']:.3g} GB/s")
                        except Exception as exc:  # one config failing (e.g. out of resources) is a result
                            row.update(error=f"{type(exc).__name__}: {exc}"[:300])
                            first = row["error"].splitlines()[0] if row["error"] else ""
                            print(f"    warps={params['num_warps']:<2} stages={params['num_stages']}  FAILED {first}")
                        rows.append(row)
                        progress.step(weight)
                finally:
                    registry.release()
                if not timed:
                    failed.append(f"{kernel} {shape_s} {dname}")
                    continue
                best = min(timed, key=lambda r: r["median_ms"])
                best["best"] = True
                n_keys += 1
                entry = cache.make_entry(
                    key, best, median_ms=best["median_ms"], p20_ms=best["p20_ms"], p80_ms=best["p80_ms"],
                    source="sweep", numel=numel, shape=shape_s, candidates=len(cands), timer=best["timer"],
                    torch=torch_v, git_commit=commit, date=date,
                )
                # Saved after every problem, so a run cut short by its time limit keeps what it finished.
                stored = cache.update(cache_path, triton_v, {name: entry})
                write_csv(out, rows)
                print(f"    best: warps={best['num_warps']} stages={best['num_stages']} -> {cache_path}")

    if write_csv(out, rows):
        print(f"\nCSV: {out} ({len(rows)} rows)")
    print(f"timed {n_timed} config(s), cached {n_keys} new key(s), {n_hits} cache hit(s) "
          f"in {time.perf_counter() - t_start:.1f} s" + (" (interpreter timings)" if interp else ""))
    if failed:
        return _fail(f"every config failed for {len(failed)} problem(s): {'; '.join(failed)} (see the FAILED "
                     "lines above and the CSV's error column)", 1)
    if n_timed == 0 and n_hits == 0:
        return _fail("nothing was timed or found in the cache" + (" (--time-budget spent)" if stopped else ""), 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
