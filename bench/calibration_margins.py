"""Does an error budget hold on tensors calibration never saw? Held-out errors with and without the margin.

    python bench/calibration_margins.py [--csv bench/results/calibration_margins.csv] [--no-real]

For each case, candidates are measured on calibration samples (`taco_triton.calibrate.measure`,
merged over ranks as `CompressionPolicy` does), then chosen two ways at each budget: by the
samples' worst error alone (`rel_l2_max`, what calibration compared before the margin existed)
and by `rel_l2_bound` (worst sample + margin, what it compares now). Each choice is then run on
held-out tensors of the same kind, and the CSV records the worst held-out error and how many
exceeded the budget.

Cases:
- synthetic: 4 samples of N(0, 1) [64, 384] (seed 0), 150 held-out ones, every default candidate.
- real, TP = 2 and TP = 4 (needs the `real` extra): the TP payloads of all-MiniLM-L6-v2
  (`taco_triton.realdata`), calibrated per site on one batch of every rank (seed 0), held out:
  the next batches (seeds 1, 2) of every rank and site; candidates INT6 G = 32, 64, 128 and
  INT8 G = 128 (Hadamard), the ones around a 2.5% budget.
Error numbers are device-independent (torch backend); no timings here.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import taco_triton as taco  # noqa: E402
from taco_triton.calibrate import choose, default_candidates, measure, merge, relative_l2  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
REAL_CANDIDATES = [taco.CompressionConfig(codec="int6", group_size=g) for g in (32, 64, 128)] + [
    taco.CompressionConfig(codec="int8", group_size=128)]


def _round_trip(x: torch.Tensor, cfg: taco.CompressionConfig) -> float:
    return relative_l2(x, taco.decompress(taco.compress(x, cfg, backend="torch"), backend="torch"))


def _by_worst_sample(table, budget: float):
    """The choice calibration made before the margin: fewest bytes whose worst sample fits."""
    fit = table[table.rel_l2_max <= budget].sort_values(["rate_bytes_per_element", "rel_l2_mean"], kind="stable")
    return None if fit.empty else fit.iloc[0]


def _rows(case: str, sites: dict, budget: float) -> list[dict]:
    """sites: name -> (measure tables per rank, held-out tensors). One row per selection rule."""
    out = []
    for rule in ("worst sample", "worst sample + margin"):
        n, above, worst, rates, margins = 0, 0, 0.0, [], []
        for tables, held in sites.values():
            table = merge(tables)
            if rule == "worst sample":
                row = _by_worst_sample(table, budget)
            else:
                res = choose(table, max_error=budget)
                row = res.table[res.table.chosen].iloc[0].copy()
                row["config"] = res.config
            if row is None:
                continue
            rates.append(row["rate_bytes_per_element"])
            margins.append(row["rel_l2_bound"] - row["rel_l2_max"])
            for x in held:
                err = _round_trip(x, row["config"])
                n, above, worst = n + 1, above + (err > budget), max(worst, err)
        out.append(dict(case=case, budget=budget, rule=rule, sites=len(sites), held_out=n, held_out_above=above,
                        held_out_worst=worst, mean_rate_bytes_per_element=sum(rates) / max(len(rates), 1),
                        mean_margin=sum(margins) / max(len(margins), 1)))
    return out


def synthetic(budget: float) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    samples = [torch.randn(64, 384, generator=g) for _ in range(4)]
    held = [torch.randn(64, 384, generator=g) for _ in range(150)]
    table = measure(samples, default_candidates(), backend="torch")
    return _rows("synthetic N(0,1) [64,384], 4 samples", {"x": ([table], held)}, budget)


def real(tp: int, n_texts: int, max_tokens: int, budget: float) -> list[dict]:
    from taco_triton import realdata

    model, tok = realdata._load_model()
    calib, *later = (realdata._capture(model, realdata._make_batch(tok, n_texts, max_tokens, seed), tp, range(tp))
                     for seed in (0, 1, 2))
    sites = {}
    for site in calib[0]:
        tables = [measure([calib[r][site].bfloat16()], REAL_CANDIDATES, backend="torch") for r in range(tp)]
        sites[site] = (tables, [batch[r][site].bfloat16() for batch in later for r in range(tp)])
    return _rows(f"MiniLM TP={tp}, {n_texts} texts x {max_tokens} tokens, per site", sites, budget)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--csv", default=str(ROOT / "bench" / "results" / "calibration_margins.csv"), help="output CSV")
    p.add_argument("--budget", type=float, default=0.025, help="the error budget (default 0.025)")
    p.add_argument("--no-real", action="store_true", help="skip the real-tensor cases")
    args = p.parse_args(argv)
    if not 0 < args.budget < 1:
        p.error(f"--budget must be in (0, 1), got {args.budget}")
    rows = synthetic(args.budget)
    if not args.no_real:
        from taco_triton.realdata import model_available

        if not model_available():
            print("error: the real cases need the `real` extra; pass --no-real to skip them", file=sys.stderr)
            return 2
        rows += real(2, 8, 32, args.budget) + real(4, 16, 64, args.budget)
    df = pd.DataFrame(rows)
    Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(args.csv, index=False)
    print(df.to_string(index=False))
    print(f"wrote {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
