"""The step-time model (`taco_triton.plan`) against measured CPU training steps, side by side.

    sudo nice -n 19 python bench/plan_validation.py [--rates 0.1,0.5,2] [--modes none,fp8] [--steps 12]

What is measured: bench/train_throughput.py's training step (taco_triton.examples.train_gpt's TP=2
TinyGPT, its loop: forward, backward, AdamW on FP32 master weights, bf16 communication, the
mode's policy with min_bytes 0) on two ranks whose loopback is throttled by tc to each link
rate (bench/netns.py; root only); the median step time after --warmup steps.

What the model is fed, measured in the same processes and steps (this machine's load moves as
other processes come and go, so each parameter is timed with the steps it predicts, not minutes
apart):

- compute: the step's time outside its TP collectives (the collectives module the layers call
  is wrapped with a timer in the benchmark's processes): the median is the compute the model is
  given (an effective TFLOP/s over the plan's FLOPs), optimizer included. So the check is of what
  the model adds: the collectives' time from the link rate, the ring bytes, the codec passes.
  (`twin_compute_ms`: the same step of a twin model on torch's fake process group, which sends
  nothing, for comparison; at the lowest priority on a loaded machine it is starved unlike the
  measured steps, whose waits on the link keep their compute scheduled);
- codec: compress then decompress of one TP message (b x s x h bf16) with the mode's config,
  timed after each step: dense GB/s of one pass (their mean);
- link: the throttled rate, shared by both ranks (one loopback queue carries every rank's bytes),
  so each rank gets rate / 2, no latency.

CSV: bench/results/plan_validation_cpu.csv (link, mode, measured_step_ms, predicted_step_ms, the
parameters, machine, commit, date). CPU figures: they check the model's composition, not GPU speed.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

RANKS = 2  # bench/train_throughput.py trains at TP=2
DEFAULTS = dict(batch=16, seq=128, hidden=256, layers=2, heads=4)


def spec_layout(args):
    """The ModelSpec and Layout of train_throughput's TinyGPT (replicated embeddings and head)."""
    from taco_triton.plan import Layout, ModelSpec

    spec = ModelSpec(layers=args.layers, hidden=args.hidden, ffn=4 * args.hidden, heads=args.heads, vocab=256,
                     seq=args.seq, micro_batch=args.batch, parallel_embedding=False, name="TinyGPT")
    return spec, Layout(tp=RANKS)


def policy_of(mode: str):
    """The mode's policy as train_gpt builds it (min_bytes 0: train_throughput's default)."""
    from taco_triton.examples.modes import make_policy

    return make_policy(mode, argparse.Namespace(min_bytes=0, calibrate_steps=0, plan=None))


def predict(link_gbps: float, mode: str, compute_ms: float, codec_gbytes_s: float, args) -> dict:
    """The model's step for one (link, mode) from the measured parameters.

    The cluster: one node of 2 "GPUs" (the ranks) on a link of link_gbps / 2 per rank, no
    latency, the compute rate that gives the measured compute time (efficiency 1), and an HBM
    rate so large that the model's optimizer time is nil (the measured compute holds it).

    Returns:
        {"predicted_step_ms", "model_compute_ms", "model_tp_ms", "model_tflops"}.
    """
    from taco_triton.plan import Cluster, step

    spec, layout = spec_layout(args)
    base = Cluster(gpu="cpu", tflops=1.0, hbm_gbytes_s=1e12, gpus_per_node=RANKS,
                   intra_gbytes_s=link_gbps / 8 / RANKS, intra_latency_us=0.0, gemm_efficiency=1.0,
                   codec_gbytes_s=codec_gbytes_s)
    unit = step(spec, layout, base).summary["compute_ms"]  # ms at 1 TFLOP/s
    cluster = dataclasses.replace(base, tflops=unit / compute_ms)
    policy = None if mode == "none" else policy_of(mode)
    r = step(spec, layout, cluster, policy)
    return {"predicted_step_ms": r.summary["step_ms_compressed"], "model_compute_ms": r.summary["compute_ms"],
            "model_tp_ms": r.summary["tp_exposed_ms_compressed"], "model_tflops": cluster.tflops}


# ---------------------------------------------------------------------------- the ranks
def _rank(rank, world, port, args, queue):
    """One rank: alternately a real step (gloo, the throttled link, the mode's policy), a step of
    the compute-only twin (fake group) and, for a compressing mode, one codec timing."""
    import datetime as dt

    import torch
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers the "fake" backend

    import taco_triton as taco
    from taco_triton.examples import train_gpt
    from taco_triton.examples.gpt import TinyGPT

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=dt.timedelta(seconds=600))
    fake = dist.new_group(ranks=list(range(world)), backend="fake")
    policy = policy_of(args.mode)

    def build(group, pol):
        torch.manual_seed(0)
        model = TinyGPT(args.layers, args.hidden, args.heads, 4 * args.hidden, args.seq, group=group, policy=pol)
        master = [p.detach().clone().float().requires_grad_(True) for p in model.parameters()]
        return model, master, torch.optim.AdamW(master, lr=1e-3, weight_decay=0.01)

    native = policy_of("none")
    real, twin = build(None, policy), build(fake, native)
    gen = torch.Generator().manual_seed(1)
    in_collectives = _time_collectives()

    def one_step(model, master, opt, pol):  # train_gpt's step
        x = torch.randint(0, 256, (args.batch, args.seq), generator=gen)
        in_collectives[0] = 0.0
        t0 = time.perf_counter()
        model.loss(x, x).backward()
        model.sync_replicated_grads()
        train_gpt.master_step(model, master, opt)
        pol.step()
        return 1e3 * (time.perf_counter() - t0), 1e3 * in_collectives[0]

    msg = torch.randn(args.batch * args.seq, args.hidden).to(torch.bfloat16)
    out = {"step_ms": [], "outside_ms": [], "twin_ms": [], "codec_s": []}
    for _ in range(args.steps):
        dist.barrier()
        step_ms, coll_ms = one_step(*real, policy)
        out["step_ms"].append(step_ms)
        out["outside_ms"].append(step_ms - coll_ms)
        out["twin_ms"].append(one_step(*twin, native)[0])
        if args.mode != "none":
            t0 = time.perf_counter()
            c = taco.compress(msg, policy.default)
            t1 = time.perf_counter()
            taco.decompress(c)
            out["codec_s"].append(((t1 - t0) + (time.perf_counter() - t1)) / 2)
    dist.barrier()
    dist.destroy_process_group()
    queue.put((rank, out))


def _time_collectives() -> list:
    """Time what the TP layers spend inside their collectives: the collectives module the
    mappings call is wrapped (in this benchmark process only); returns the accumulator [seconds]."""
    from taco_triton.parallel import mappings

    inner, acc = mappings._coll, [0.0]

    class Timed:
        def __getattr__(self, name):
            fn = getattr(inner, name)

            def timed(*a, **k):
                t0 = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    acc[0] += time.perf_counter() - t0
            return timed

    mappings._coll = Timed()
    return acc


def worker(args) -> None:
    """Run both ranks (inside the namespace) and write their timings to --out."""
    from taco_triton.examples.ranks import spawn_ranks

    results = spawn_ranks(_rank, RANKS, args)
    Path(args.out).write_text(json.dumps({str(r): v for r, v in results.items()}))


# ---------------------------------------------------------------------------- the driver
def run_cell(link, mode: str, args, tmp: str) -> dict:
    out = os.path.join(tmp, f"{mode}.json")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--mode", mode, "--out", out,
           "--steps", str(args.steps)] + [a for k in DEFAULTS for a in (f"--{k}", str(getattr(args, k)))]
    subprocess.run(link.wrap(cmd), check=True, timeout=args.cell_timeout, cwd=HERE.parent,
                   env=dict(os.environ, PYTHONPATH=str(HERE.parent)))
    per_rank = json.loads(Path(out).read_text())
    w = args.warmup
    steps = pd.Series([t for r in per_rank.values() for t in r["step_ms"][w:]])
    compute = pd.Series([t for r in per_rank.values() for t in r["outside_ms"][w:]])
    twin = pd.Series([t for r in per_rank.values() for t in r["twin_ms"][w:]])
    codec = pd.Series([t for r in per_rank.values() for t in r["codec_s"][w:]], dtype=float)
    dense = args.batch * args.seq * args.hidden * 2
    return {"measured_step_ms": float(steps.median()), "measured_compute_ms": float(compute.median()),
            "twin_compute_ms": float(twin.median()),
            "codec_gbytes_s": float(dense / codec.median() / 1e9) if len(codec) else float("nan"),
            "p20_step_ms": float(steps.quantile(0.2)), "p80_step_ms": float(steps.quantile(0.8))}


def main(argv=None) -> pd.DataFrame | None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="0.1,0.5,2", help="link rates in Gbit/s (default: %(default)s)")
    ap.add_argument("--modes", default="none,fp8", help="train_gpt modes (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=12, help="steps per run (default: %(default)s)")
    ap.add_argument("--warmup", type=int, default=3, help="steps left out (default: %(default)s)")
    ap.add_argument("--cell-timeout", type=float, default=1800, help="seconds one (rate, mode) run may take")
    for k, v in DEFAULTS.items():
        ap.add_argument(f"--{k}", type=int, default=v, help=f"as bench/train_throughput.py (default: {v})")
    ap.add_argument("--csv", default=str(HERE / "results" / "plan_validation_cpu.csv"), help="output CSV")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    from netns import LinkEmulation, NetnsError, normalize_rate

    print("NOTE: CPU training: a check of the model's composition, not GPU performance.", flush=True)
    rows = []
    try:
        rates = [normalize_rate(r) for r in args.rates.split(",")]
        with LinkEmulation(rates[0]) as link, tempfile.TemporaryDirectory() as tmp:
            for rate in rates:
                link.set_rate(rate)
                for mode in [m.strip() for m in args.modes.split(",")]:
                    got = run_cell(link, mode, args, tmp)
                    codec = got["codec_gbytes_s"] if mode != "none" else 1.0
                    row = {"link": link.label, "mode": mode, **got,
                           **predict(float(link.label), mode, got["measured_compute_ms"], codec, args),
                           "link_gbps_per_rank": float(link.label) / RANKS}
                    rows.append(row)
                    print(f"  link {row['link']:>5} Gbit/s {mode:5s} measured {row['measured_step_ms']:8.1f} ms  "
                          f"predicted {row['predicted_step_ms']:8.1f} ms  (compute {row['measured_compute_ms']:.0f} ms, "
                          f"codec {row['codec_gbytes_s']:.4f} GB/s)", flush=True)
    except NetnsError as e:
        raise SystemExit(f"cannot emulate a link: {e}")
    out = pd.DataFrame(rows)
    out["error_%"] = 100 * (out.predicted_step_ms / out.measured_step_ms - 1)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout.strip()
    out["machine"], out["commit"] = platform.node() or "cpu", commit or "unknown"
    out["date"] = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    for k in DEFAULTS:
        out[k] = getattr(args, k)
    out.to_csv(args.csv, index=False)
    print(out[["link", "mode", "measured_step_ms", "predicted_step_ms", "error_%"]].round(1).to_string(index=False))
    print(f"CSV: {args.csv}")
    return out


if __name__ == "__main__":
    main()
