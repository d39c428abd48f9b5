"""Two-shot compressed all_reduce on real TP tensors: error and wire bytes per codec, TP=4.

    python bench/real_allreduce.py [--csv bench/results/real_allreduce_tp4.csv] [--n-texts 32]

Four gloo processes each hold their own rank's captured tensors (taco_triton.realdata:
all-MiniLM-L6-v2 sharded TP=4; forward row-parallel partial sums, backward column-parallel
input gradients) and all-reduce them with `taco_triton.all_reduce` under each codec of
bench/real_tensors.py (torch reference codec, bf16 in and out). Error: relative L2 distance of the
result from the exact FP64 sum of the four bf16 inputs; the native bf16 all_reduce is measured the
same way ("bf16 native"). Wire bytes are counted by `WireStats` and compared, side by side in one
run, with the native bf16 all_reduce of the same tensor. Errors are device-independent; no timings.
"""
from __future__ import annotations

import argparse
import datetime
import platform
import sys
from pathlib import Path

import pandas as pd
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import taco_triton as taco  # noqa: E402
from real_tensors import CONFIGS  # noqa: E402
from taco_triton.examples.ranks import spawn_ranks  # noqa: E402
from autotune.meta import git_commit  # noqa: E402
from taco_triton.calibrate import relative_l2  # noqa: E402

NATIVE = taco.CompressionConfig(enabled=False)


def rank_main(rank: int, world: int, port: int, n_texts: int, max_tokens: int, queue) -> None:
    from taco_triton.realdata import capture_tp_tensors

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        tensors = capture_tp_tensors(tp=world, rank=rank, n_texts=n_texts, max_tokens=max_tokens)
        rows = []
        for name, x in tensors.items():
            xb = x.bfloat16().contiguous()
            parts = [torch.empty_like(xb) for _ in range(world)]
            dist.all_gather(parts, xb)
            exact = sum(p.double() for p in parts)
            with taco.WireStats() as ws:
                t = xb.clone()
                taco.all_reduce(t, config=NATIVE)
            native_bytes = ws.wire_bytes
            rows.append(dict(tensor=name, config="bf16 native", rel_l2=relative_l2(exact, t.double()),
                             wire_bytes=native_bytes, native_wire_bytes=native_bytes))
            for label, cfg in CONFIGS.items():
                t = xb.clone()
                with taco.WireStats() as ws:
                    taco.all_reduce(t, config=cfg, min_bytes=0, backend="torch")
                rows.append(dict(tensor=name, config=label, rel_l2=relative_l2(exact, t.double()),
                                 wire_bytes=ws.wire_bytes, native_wire_bytes=native_bytes))
        queue.put((rank, rows))
    finally:
        dist.destroy_process_group()


def run(world: int, n_texts: int, max_tokens: int) -> pd.DataFrame:
    got = spawn_ranks(rank_main, world, n_texts, max_tokens, poll_s=10)
    df = pd.DataFrame(got[0])  # every rank holds the same result (the collective is bitwise identical)
    df["wire_vs_bf16"] = df.wire_bytes / df.native_wire_bytes
    return df


def main(argv=None) -> pd.DataFrame:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--csv", default="bench/results/real_allreduce_tp4.csv", help="output CSV (default: %(default)s)")
    ap.add_argument("--tp", type=int, default=4, help="ranks (default: %(default)s)")
    ap.add_argument("--n-texts", type=int, default=32, help="input texts run through the model (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens per text, at most (default: %(default)s)")
    args = ap.parse_args(argv)
    df = run(args.tp, args.n_texts, args.max_tokens)
    df["tp"] = args.tp
    df["machine"], df["commit"] = platform.node() or "unknown", git_commit()
    df["date"] = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    if args.csv:
        Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
        df.to_csv(args.csv, index=False)
    order = ["bf16 native", *CONFIGS]
    summary = df.groupby("config").agg(rel_l2_mean=("rel_l2", "mean"), rel_l2_max=("rel_l2", "max"),
                                       wire_vs_bf16=("wire_vs_bf16", "mean")).loc[order]
    summary[["rel_l2_mean", "rel_l2_max"]] *= 100
    pd.set_option("display.width", 200)
    print(f"two-shot all_reduce at TP={args.tp} over {df.tensor.nunique()} real TP tensors: "
          "relative L2 error (%) vs the exact sum, wire bytes vs bf16 all_reduce")
    print(summary.round(4).to_string())
    return df


if __name__ == "__main__":
    main()
