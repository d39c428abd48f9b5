"""Training accuracy over seeds: final validation loss per mode, side by side with the run-to-run spread.

    python bench/train_seeds.py --seeds 0,1,2 --compress none,fp8,int8,int6 -- --tp 2 --steps 300
    python bench/train_seeds.py --seeds 0,1,2 --compress none,fp8,int8 -- --dtensor --tp 2 --steps 300

Everything after `--` goes to `python -m taco_triton.examples.train_gpt` (model size, --dtensor,
--megatron, ...). For each seed every mode starts from the same weights and sees the same batches;
the seed changes both. Prints, per mode: the final validation loss of each seed, its difference
from the uncompressed run of the same seed (%), and the seed spread ((max - min) / mean over seeds,
%), the scale against which a compressed mode's difference is judged. `--csv` writes one row per
(mode, seed) with machine, commit and date.
"""
from __future__ import annotations

import argparse
import datetime
import platform
import sys
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from autotune.meta import git_commit  # noqa: E402
from taco_triton.examples import train_gpt  # noqa: E402


def summarize(runs: pd.DataFrame) -> pd.DataFrame:
    """runs: one row per (mode, seed) with final_val_loss -> one row per mode: each seed's loss and
    difference from mode "none" of that seed, the seed spread, and the largest |difference|."""
    wide = runs.pivot(index="mode", columns="seed", values="final_val_loss")
    out = wide.rename(columns=lambda s: f"val_seed{s}")
    out["seed_spread_%"] = 100 * (wide.max(axis=1) - wide.min(axis=1)) / wide.mean(axis=1)
    if "none" in wide.index:
        delta = 100 * (wide / wide.loc["none"] - 1)
        for s in wide.columns:
            out[f"vs_none_seed{s}_%"] = delta[s]
        out["max_abs_vs_none_%"] = delta.abs().max(axis=1)
    out["wire_vs_none"] = runs.groupby("mode").wire_vs_none.mean() if "wire_vs_none" in runs else float("nan")
    return out


def run_seeds(seeds: list[int], modes: str, passthrough: list[str]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Train every mode of `modes` (train_gpt's --compress) once per seed with train_gpt's
    `passthrough` arguments. Returns (one row per (mode, seed): final validation loss, as the run
    communicates and with native collectives, wire bytes, median step time; every logged step of
    every run, with its seed)."""
    rows, curves = [], []
    for seed in seeds:
        print(f"=== seed {seed}", flush=True)
        steps, summary = train_gpt.main([*passthrough, "--compress", modes, "--seed", str(seed), "--quiet"])
        curves.append(steps.assign(seed=seed))
        for mode, r in summary.iterrows():
            rows.append(dict(mode=mode, seed=seed, final_val_loss=r.final_val_loss,
                             final_val_loss_native=r.final_val_loss_native, wire_MiB_per_step=r.wire_MiB_per_step, wire_vs_none=r.get("wire_vs_none", float("nan")),
                             step_ms_median=r.step_ms_median))
    return pd.DataFrame(rows), pd.concat(curves, ignore_index=True)


def main(argv=None) -> pd.DataFrame:
    argv = sys.argv[1:] if argv is None else list(argv)
    passthrough = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default: %(default)s)")
    ap.add_argument("--compress", default="none,fp8,int8,int6", help="modes, as train_gpt's --compress")
    ap.add_argument("--csv", default=None, help="write one row per (mode, seed) here")
    args = ap.parse_args(own)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    commit = git_commit()  # the code that runs, not what HEAD is when the runs end
    runs, _ = run_seeds(seeds, args.compress, passthrough)
    runs["args"] = " ".join(passthrough)
    runs["machine"], runs["commit"] = platform.node() or "unknown", commit
    runs["date"] = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    if args.csv:
        Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
        runs.to_csv(args.csv, index=False)
    table = summarize(runs)
    pd.set_option("display.width", 250)
    print(f"final validation loss over seeds {seeds} ({' '.join(passthrough)}):")
    print(table.round(4).to_string())
    return runs


if __name__ == "__main__":
    main()
