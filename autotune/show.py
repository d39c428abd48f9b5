"""Print what an autotune cache holds, as a table.

    python -m autotune.show                        # the user's cache (TACO_AUTOTUNE_CACHE or ~/.cache/...)
    python -m autotune.show --cache PATH           # one file (repeat --cache for several)
    python -m autotune.show --shipped              # every file in autotune/tuned/

One row per entry: kernel, device, compute capability, triton/torch versions, the key's fields,
the config and its measured time. A file that the runtime would ignore (bad JSON, another schema,
another triton version) is reported with the reason; a stale file's entries are still listed so
you can see what it held. Exit status: 0, or 1 when a named file is missing or unreadable.
"""
from __future__ import annotations

import argparse
import sys

from taco_triton import env

from . import cache, meta
from .runtime import TUNED_DIR

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


def show(path: str, out=None) -> bool:
    """Print one file's table; False when it is missing or unusable for every version."""
    out = out or sys.stdout
    running = meta.triton_version()
    entries, problem = cache.read(path, running)
    print(f"== {path}", file=out)
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
    p = argparse.ArgumentParser(prog="python -m autotune.show", description=__doc__.split("\n\n")[0])
    p.add_argument("--cache", action="append", default=None, help="cache file (repeatable; default: the user's)")
    p.add_argument("--shipped", action="store_true", help="also list the shipped files in autotune/tuned/")
    args = p.parse_args(argv)
    paths = list(args.cache or ([] if args.shipped else [env.autotune_cache_path()]))
    if args.shipped:
        shipped = sorted(str(f) for f in TUNED_DIR.glob("*.json"))
        if not shipped:
            print(f"== {TUNED_DIR}: no shipped tuned files (none has been produced on a GPU yet)")
        paths += shipped
    ok = True
    for path in paths:
        ok = show(path) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
