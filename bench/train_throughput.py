"""End-to-end TP=2 training step time on an emulated slow link: uncompressed (bf16) vs compressed.

    python bench/train_throughput.py [--rates 0.5,2,10,unlimited] [--modes none,fp8,int8] [--steps 20]

For every link rate, the training example (taco_triton.examples.train_gpt) runs each mode for
--steps steps inside a network namespace whose loopback is throttled by tc (bench/netns.py;
root only; --no-netns runs on the host loopback, 'unlimited' only). The baseline communicates
bf16. The median step time over the steps after --warmup is compared side by side in the same
run. CSV: bench/results/train_throughput_cpu_<date>.csv.

On CPU the codec is the torch reference on 2 cores: compression costs far more time here than a
GPU kernel would, so these figures bound the CPU case and say nothing about GPU speed.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # netns, and this checkout's taco_triton (as the runs use)
from netns import LinkEmulation, NetnsError, normalize_rate  # noqa: E402

from taco_triton.examples.train_gpt import MODES  # noqa: E402


def run_mode(link: LinkEmulation, mode: str, args, csv_path: str) -> pd.DataFrame:
    cmd = [sys.executable, "-m", "taco_triton.examples.train_gpt", "--tp", "2", "--compress", mode,
           "--steps", str(args.steps), "--eval-every", str(args.steps), "--eval-batches", "1",
           "--batch", str(args.batch), "--seq", str(args.seq), "--hidden", str(args.hidden),
           "--ffn", str(4 * args.hidden), "--layers", str(args.layers), "--csv", csv_path, "--quiet"]
    env = dict(os.environ, PYTHONPATH=str(HERE.parent))
    subprocess.run(link.wrap(cmd), check=True, env=env, timeout=args.cell_timeout, cwd=HERE.parent,
                   stdout=subprocess.DEVNULL)
    return pd.read_csv(csv_path)


def main(argv=None) -> pd.DataFrame:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="0.5,2,10,unlimited",
                    help="comma-separated link rates in Gbit/s, or 'unlimited' (default: %(default)s)")
    ap.add_argument("--modes", default="none,fp8,int8",
                    help="comma-separated train_gpt --compress modes; 'none' is the bf16 baseline the speedup "
                         "is computed against (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=20,
                    help="training steps per (rate, mode); must exceed --warmup (default: %(default)s)")
    ap.add_argument("--warmup", type=int, default=5,
                    help="first steps left out of the step-time statistics (default: %(default)s)")
    ap.add_argument("--batch", type=int, default=16, help="sequences per step (default: %(default)s)")
    ap.add_argument("--seq", type=int, default=128, help="tokens per sequence (default: %(default)s)")
    ap.add_argument("--hidden", type=int, default=256,
                    help="model width; the MLP is 4x wider (default: %(default)s)")
    ap.add_argument("--layers", type=int, default=2, help="transformer layers (default: %(default)s)")
    ap.add_argument("--cell-timeout", type=float, default=900,
                    help="seconds one (rate, mode) run may take before it is killed (default: %(default)s)")
    ap.add_argument("--no-netns", action="store_true",
                    help="run on the host loopback without throttling (needs no root; only --rates unlimited)")
    ap.add_argument("--csv", default=None,
                    help="output CSV (default: bench/results/train_throughput_cpu_<UTC date>.csv)")
    args = ap.parse_args(argv)
    for name in ("steps", "batch", "seq", "hidden", "layers"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        ap.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.steps <= args.warmup:
        ap.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup}): the step times after the "
                 f"warm-up are the measurement")
    rates = [normalize_rate(r) for r in args.rates.split(",")]
    modes = [m.strip() for m in args.modes.split(",")]
    unknown = [m for m in modes if m not in MODES]
    if unknown or "none" not in modes:
        ap.error(f"--modes must name modes from {list(MODES)} including 'none' (the baseline), got {modes}")
    print("NOTE: CPU training with the torch reference codec: not GPU performance.", flush=True)
    rows = []
    try:
        with LinkEmulation(rates[0], disabled=args.no_netns) as link, tempfile.TemporaryDirectory() as tmp:
            for rate in rates:
                link.set_rate(rate)
                for mode in modes:
                    df = run_mode(link, mode, args, os.path.join(tmp, f"{mode}.csv"))
                    steady = df[df.step > args.warmup]
                    rows.append({"link": link.label, "mode": mode, "median_step_ms": steady.step_ms.median(),
                                 "p20_step_ms": steady.step_ms.quantile(0.2), "p80_step_ms": steady.step_ms.quantile(0.8),
                                 "wire_MiB_per_step": steady.wire_bytes.median() / 2**20,
                                 "final_train_loss": float(df.train_loss.iloc[-1])})
                    print(f"  link {link.label:>9} Gbit/s  {mode:5s}  {rows[-1]['median_step_ms']:8.1f} ms/step  "
                          f"{rows[-1]['wire_MiB_per_step']:.2f} MiB/step", flush=True)
    except NetnsError as e:
        raise SystemExit(f"cannot emulate a link: {e}")
    out = pd.DataFrame(rows)
    base = out[out["mode"] == "none"].set_index("link").median_step_ms
    out["speedup_vs_none"] = [base[r.link] / r.median_step_ms for r in out.itertuples()]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout.strip()
    out["machine"], out["commit"] = platform.node() or "cpu", commit or "unknown"
    out["date"] = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    path = args.csv or str(HERE / "results" / f"train_throughput_cpu_{out['date'][0]}.csv")
    out.to_csv(path, index=False)
    print(out.pivot(index="link", columns="mode", values="speedup_vs_none").round(3).to_string())
    print(f"CSV: {path}")
    return out


if __name__ == "__main__":
    main()
