"""Print what an autotune cache holds, as a table.

    python -m autotune.show                        # the user's cache (TACO_AUTOTUNE_CACHE or ~/.cache/...)
    python -m autotune.show --cache PATH           # one file (repeat --cache for several)
    python -m autotune.show --shipped              # every file in autotune/tuned/

One row per entry: kernel, device, compute capability, triton/torch versions, the key's fields,
the config and its measured time. A file that the runtime would ignore (bad JSON, another schema,
another triton version) is reported with the reason; a stale file's entries are still listed so
you can see what it held. Without --cache, a user cache that does not exist yet is the normal
state of a fresh machine (nothing tuned; the runtime uses the shipped files and the heuristic):
it is reported as such and the exit status is 0. Exit status: 0, or 1 when a file named with
--cache is missing, or any listed file is unusable.
"""
from __future__ import annotations

import argparse
import sys

from taco_triton import env

from . import cache, meta
from .runtime import TUNED_DIR

# The command line and `show` (one file's table) are the public interface.
__all__ = ["main", "show"]

COLUMNS = [
    "kernel", "device", "cc", "triton", "torch", "dtype", "codec", "G", "hadamard", "scales", "rounding",
    "numel_bucket", "num_warps", "num_stages", "median_ms", "source", "date",
]


def _bucket_text(b: int) -> str:
    lo, hi = cache.bucket_range(b)
    return f"4^{b} [{lo:,}, {hi:,})"


def rows_of(entries: dict) -> list[dict]:
    rows = []
    for e in entries.values():
        k = e["key"]
        rows.append({
            "kernel": k["kernel"], "device": k["device"], "cc": k["cc"], "triton": k["triton"],
            "torch": e.get("torch", ""), "dtype": k["dtype"], "codec": k["codec"], "G": k["group_size"],
            "hadamard": k["hadamard"], "scales": k["scales"], "rounding": k["rounding"],
            "numel_bucket": _bucket_text(k["bucket"]), "num_warps": e["config"]["num_warps"],
            "num_stages": e["config"]["num_stages"], "median_ms": e.get("median_ms"),
            "source": e.get("source", ""), "date": e.get("date", ""),
        })
    return rows


def show(path: str, out=None, missing_ok: bool = False) -> bool:
    """Print one cache file's table.

    Args:
        path: the cache file.
        out: where to print (default: stdout).
        missing_ok: report a missing file as "nothing tuned yet" (the user's default cache).

    Returns:
        False when the file is unusable for every version, or missing unless `missing_ok`.
    """
    out = out or sys.stdout
    running = meta.triton_version()
    entries, problem = cache.read(path, running)
    print(f"== {path}", file=out)
    if problem == "missing" and missing_ok:
        print("   no user cache yet: nothing has been tuned on this machine (launches use the shipped files,\n"
              "   then the heuristic). `python -m autotune.sweep --cache PATH` or TACO_AUTOTUNE=online fills it.",
              file=out)
        return True
    if problem == "missing":
        print("   (no such file)", file=out)
        return False
    if problem is not None and not entries:
        print(f"   IGNORED by the runtime: {problem}", file=out)
        return False
    if problem is not None:
        print(f"   IGNORED by the runtime: {problem}; its entries:", file=out)
    print(f"   {len(entries)} entries; running triton {running}", file=out)
    if entries:
        import pandas as pd

        df = pd.DataFrame(rows_of(entries), columns=COLUMNS)
        with pd.option_context("display.width", 250, "display.max_columns", None, "display.max_rows", None):
            print(df.to_string(index=False, float_format=lambda v: f"{v:.4g}"), file=out)
    return True


def main(argv=None) -> int:
    """Print the tables: `python -m autotune.show --help` lists the options.

    Args:
        argv: the command-line arguments (default: `sys.argv[1:]`).

    Returns:
        The exit status: 0, or 1 when a file named with --cache is missing or a listed file is
        unusable.
    """
    p = argparse.ArgumentParser(prog="python -m autotune.show", description=__doc__.split("\n\n")[0])
    p.add_argument("--cache", action="append", default=None, metavar="PATH",
                   help="cache file to list (repeatable; a missing one is an error). Default: the user's cache, "
                        "TACO_AUTOTUNE_CACHE or ~/.cache/taco_triton/autotune.json, which may not exist yet")
    p.add_argument("--shipped", action="store_true",
                   help="list the shipped per-GPU files in autotune/tuned/ (instead of the user's cache "
                        "unless --cache is given too)")
    args = p.parse_args(argv)
    default_user_cache = not args.cache and not args.shipped
    paths = list(args.cache or ([env.autotune_cache_path()] if default_user_cache else []))
    if args.shipped:
        shipped = sorted(str(f) for f in TUNED_DIR.glob("*.json"))
        if not shipped:
            print(f"== {TUNED_DIR}: no shipped tuned files (none has been produced on a GPU yet)")
        paths += shipped
    ok = True
    for path in paths:
        ok = show(path, missing_ok=default_user_cache) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
