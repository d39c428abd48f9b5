"""Codec error on real TP tensors captured from a pretrained model.

    python bench/real_tensors.py [--csv bench/results/real_tensor_errors.csv] [--n-texts 32] [--budgets 0.025 0.01]

For each captured tensor (taco_triton.realdata: all-MiniLM-L6-v2 sharded TP=4, forward
row-parallel partial sums and backward column-parallel input gradients) and each codec config,
the relative L2 error ||x - x'|| / ||x|| of a bf16 round trip through the torch reference
backend (the Triton kernels are bit-identical to it without Hadamard, see tests/test_kernels.py);
then what `calibrate(max_error=...)` picks for all tensors at each error budget (default candidates:
every codec x G x Hadamard; CSV beside the first, suffix _calibration).
Error numbers are device-independent; no timings here.
"""
from __future__ import annotations

import argparse
import datetime
import platform
import sys
from pathlib import Path

import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import taco_triton as taco  # noqa: E402
from autotune.meta import git_commit  # noqa: E402
from taco_triton.calibrate import relative_l2  # noqa: E402

#: The candidate codecs (TACO's released layout, FP8 and INT8 with and without Hadamard), plus ours: name -> config
CONFIGS = {
    "fp8_e4m3 G128 noH": taco.CompressionConfig(hadamard=False),
    "fp8_e4m3 G128 H (default)": taco.CompressionConfig(),
    "taco_fp32x2 (TACO released)": taco.CompressionConfig(scales="taco_fp32x2"),
    "int8 G128 noH": taco.CompressionConfig(codec="int8", hadamard=False),
    "int8 G128 H": taco.CompressionConfig(codec="int8"),
    "int8 G32 H": taco.CompressionConfig(codec="int8", group_size=32),
    "int6 G32 H": taco.CompressionConfig(codec="int6", group_size=32),
    "int6 G32 noH": taco.CompressionConfig(codec="int6", group_size=32, hadamard=False),
    "int6 G64 H": taco.CompressionConfig(codec="int6", group_size=64),
    "int4 G32 H": taco.CompressionConfig(codec="int4", group_size=32),
    "int4 G32 noH": taco.CompressionConfig(codec="int4", group_size=32, hadamard=False),
}


def outlier_ratio(x: torch.Tensor) -> float:
    """max over hidden channels of channel amax / tensor rms."""
    return float(x.abs().amax(dim=0).max() / x.pow(2).mean().sqrt())


def measure(tensors: dict[str, torch.Tensor], configs=CONFIGS) -> pd.DataFrame:
    rows = []
    for name, x in tensors.items():
        xb = x.bfloat16()
        for label, cfg in configs.items():
            c = taco.compress(xb, cfg, backend="torch")
            y = taco.decompress(c, backend="torch")
            rows.append(dict(tensor=name, config=label, codec=cfg.codec, group_size=cfg.group_size,
                             hadamard=cfg.hadamard, scales=cfg.scales, ratio_vs_bf16=c.ratio,
                             rel_l2=relative_l2(xb.float(), y.float()),
                             max_abs_err=float((y.float() - xb.float()).abs().max()),
                             outlier_ratio=outlier_ratio(x)))
    return pd.DataFrame(rows)


def main(argv=None) -> pd.DataFrame:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--csv", default="bench/results/real_tensor_errors.csv", help="output CSV (default: %(default)s)")
    ap.add_argument("--n-texts", type=int, default=32,
                    help="input texts run through the model to capture tensors (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens per text, at most (default: %(default)s)")
    ap.add_argument("--budgets", type=float, nargs="*", default=[0.025, 0.01],
                    help="error budgets to run calibrate(max_error=...) with on all tensors (default: %(default)s)")
    args = ap.parse_args(argv)
    from taco_triton.realdata import capture_tp_tensors

    tensors = capture_tp_tensors(tp=4, rank=0, n_texts=args.n_texts, max_tokens=args.max_tokens)
    df = measure(tensors)
    df["machine"] = platform.node() or "unknown"
    df["commit"] = git_commit()
    df["date"] = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    if args.csv:
        Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
        df.to_csv(args.csv, index=False)
    wide = df.pivot(index="tensor", columns="config", values="rel_l2")[list(CONFIGS)] * 100
    summary = wide.agg(["min", "mean", "max"]).T
    summary["ratio_vs_bf16"] = df.groupby("config").ratio_vs_bf16.mean()
    pd.set_option("display.width", 200)
    print("relative L2 error (%) over", len(tensors), "real TP tensors (MiniLM-L6, TP=4, rank 0, bf16):")
    print(summary.round(3).to_string())
    worst = (wide["fp8_e4m3 G128 H (default)"] / wide["taco_fp32x2 (TACO released)"]).max()
    print(f"default vs TACO's released layout: worst-tensor error ratio {worst:.4f} "
          f"at {summary.loc['fp8_e4m3 G128 H (default)', 'ratio_vs_bf16']:.3f}x vs "
          f"{summary.loc['taco_fp32x2 (TACO released)', 'ratio_vs_bf16']:.3f}x compression")
    samples = [x.bfloat16() for x in tensors.values()]
    picks = []
    for budget in args.budgets:
        res = taco.calibrate(samples, max_error=budget, backend="torch")
        row = res.table[res.table.chosen].iloc[0]
        picks.append(dict(max_error=budget, codec=row.codec, group_size=row.group_size, hadamard=row.hadamard,
                          rate_bytes_per_element=row.rate_bytes_per_element, rel_l2_max=row.rel_l2_max,
                          rel_l2_mean=row.rel_l2_mean, candidates=len(res.table),
                          machine=df.machine.iloc[0], commit=df.commit.iloc[0], date=df.date.iloc[0]))
        print(f"calibrate(max_error={budget}): {row.codec} G={row.group_size} hadamard={row.hadamard}, "
              f"{row.rate_bytes_per_element:.4f} bytes/element ({2 / row.rate_bytes_per_element:.2f}x vs bf16), "
              f"worst relative L2 error {100 * row.rel_l2_max:.2f}% (mean {100 * row.rel_l2_mean:.2f}%)")
    if args.csv and picks:
        pd.DataFrame(picks).to_csv(Path(args.csv).with_name(Path(args.csv).stem + "_calibration.csv"), index=False)
    return df


if __name__ == "__main__":
    main()
