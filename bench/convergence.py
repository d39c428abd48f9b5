"""Paired training at TP=2: does compressing every TP collective change where training ends up?

    python bench/convergence.py --csv bench/results/convergence.csv \\
        --curves-csv bench/results/convergence_curves.csv --plot docs/figures/convergence.png
    python bench/convergence.py --quick            # a tiny model, 4 steps, one seed: seconds
    python bench/convergence.py --plot docs/figures/convergence.png --plot-only   # redraw from the CSVs

TinyGPT (2 layers, hidden 128, 4 heads, FFN 512, byte vocabulary; `taco_triton.examples.gpt`)
trains with TP=2 on the Python standard library's source text for `--steps` steps of 8 sequences
of 64 tokens (AdamW, lr 2e-3, FP32 compute, bf16 communication in the baseline), once per mode and
seed (`train_seeds.run_seeds`, which runs `train_gpt`): every mode of a seed starts from the same
weights and sees the same batches as the seed's baseline run ("none"); the seed changes both. The
validation loss is taken every 50 steps on the same 16 held-out batches in every run.

Per seed, the paired delta of the final validation loss, 100 (L_mode / L_none - 1) in %; per mode,
the mean of the deltas over the seeds, their sample standard deviation, standard error, minimum and
maximum. The baseline's seed spread ((max - min) / mean of its final losses) is the scale the
deltas are judged against. The validation loss is taken as the run communicates (a mode's forward
collectives compressed, as in training), and once more at the end with every collective native:
that delta (delta_native_vs_none_pct) is what the compressed training did to the weights alone.

CSV (one row per mode and seed): model, mode ("none" for bf16, else the codec's mode), seed, steps,
final_val_loss, delta_vs_none_pct, final_val_loss_native, delta_native_vs_none_pct, wire_vs_none,
step_ms_median, args, machine, commit, date. The curves CSV holds
every evaluated step of every run (model, mode, seed, step, train_loss, val_loss, wire_bytes,
step_ms, ...); the plot is drawn from it. Step times are CPU timings on a shared machine, not a speed result.
"""
from __future__ import annotations

import argparse
import datetime
import platform
import sys
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from autotune.meta import git_commit  # noqa: E402
from plots import paired_curves, paired_run_arguments, redraw_only  # noqa: E402
from train_seeds import run_seeds  # noqa: E402

MODEL = "tinygpt"
MODES = "none,fp8,int8,int6,int4"
TRAIN = ["--tp", "2", "--layers", "2", "--hidden", "128", "--heads", "4", "--ffn", "512", "--seq", "64",
         "--batch", "8", "--eval-every", "50", "--eval-batches", "16"]
QUICK = ["--tp", "2", "--layers", "1", "--hidden", "32", "--heads", "2", "--ffn", "64", "--seq", "16",
         "--batch", "2", "--eval-every", "2", "--eval-batches", "1", "--data-bytes", "65536"]


def paired(runs: pd.DataFrame) -> pd.DataFrame:
    """runs: one row per (mode, seed) with final_val_loss and final_val_loss_native -> the same rows
    with delta_vs_none_pct and delta_native_vs_none_pct, their differences in % from the final
    validation loss of mode "none" of the same seed."""
    base = runs.seed.map(runs[runs["mode"] == "none"].set_index("seed").final_val_loss).to_numpy()
    return runs.assign(delta_vs_none_pct=100 * (runs.final_val_loss / base - 1),
                       delta_native_vs_none_pct=100 * (runs.final_val_loss_native / base - 1))


def summarize(runs: pd.DataFrame, column: str = "delta_vs_none_pct") -> pd.DataFrame:
    """Per mode: each seed's delta (`column`), the deltas' mean, sample standard deviation, standard
    error, min and max; the row "none" carries the baseline's seed spread ((max - min) / mean, %)."""
    wide = runs.pivot(index="mode", columns="seed", values=column)
    d = wide.drop(index="none")
    out = wide.rename(columns=lambda s: f"delta_seed{s}_%")
    out["mean_%"], out["sd_%"] = d.mean(axis=1), d.std(axis=1, ddof=1)
    out["se_%"] = out["sd_%"] / d.notna().sum(axis=1) ** 0.5
    out["min_%"], out["max_%"] = d.min(axis=1), d.max(axis=1)
    base = runs[runs["mode"] == "none"].final_val_loss
    out.loc["none", "seed_spread_%"] = 100 * (base.max() - base.min()) / base.mean()
    order = {m: i for i, m in enumerate(MODES.split(","))}
    return out.sort_index(key=lambda ix: ix.map(lambda m: order.get(m, len(order))))


def plot(curves: pd.DataFrame, path: str) -> None:
    """Two panels from the curves: the validation loss over training (mean over seeds) per mode, and
    the paired difference from the baseline of the same seed and step (mean over seeds, with the
    range of the seeds shaded)."""
    paired_curves(curves, path, MODES.split(","), f"{MODEL}, TP=2")


def main(argv=None) -> pd.DataFrame:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    paired_run_arguments(ap, MODES, "a tiny model, 4 steps, seed 0, none and fp8: seconds")
    args = ap.parse_args(argv)
    if redraw_only(args, ap, plot):
        return pd.DataFrame()
    train, seeds, modes = TRAIN, [int(s) for s in args.seeds.split(",") if s.strip()], args.compress
    if args.quick:
        train, seeds, modes, args.steps = QUICK, [0], "none,fp8", 4
    if "none" not in modes.split(","):
        ap.error(f"--compress must include the baseline 'none' (got {modes!r}): deltas are paired with it")
    commit = git_commit()  # the code that runs, not what HEAD is when the runs end
    passthrough = [*train, "--steps", str(args.steps)]
    runs, curves = run_seeds(seeds, modes, passthrough)
    stamp = dict(model=MODEL, machine=platform.node() or "unknown", commit=commit,
                 date=datetime.datetime.now(datetime.timezone.utc).date().isoformat())
    runs = paired(runs).assign(steps=args.steps, args=" ".join(passthrough), **stamp)
    runs = runs[["model", "mode", "seed", "steps", "final_val_loss", "delta_vs_none_pct", "final_val_loss_native",
                 "delta_native_vs_none_pct", "wire_vs_none", "step_ms_median", "args", "machine", "commit", "date"]]
    curves = curves.dropna(subset=["val_loss"]).assign(**stamp)  # the evaluated steps: what the plot draws
    for path, df in ((args.csv, runs), (args.curves_csv, curves)):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            df.to_csv(path, index=False)
    if args.plot:
        plot(curves, args.plot)
    pd.set_option("display.width", 250)
    print(f"final validation loss vs none, paired by seed ({' '.join(passthrough)}):")
    print(summarize(runs).round(3).to_string())
    print("the same weights evaluated with native (uncompressed) collectives, vs none:")
    print(summarize(runs, "delta_native_vs_none_pct").round(3).to_string())
    return runs


if __name__ == "__main__":
    main()
