"""The step-time model (`taco_triton.plan`) against measured CPU training steps, side by side.

    sudo python bench/plan_validation.py [--rates 0.1,0.5,1,2] [--modes none,fp8] [--steps 12]

On a shared machine give it the CPU ahead of other work (for instance from a session whose
autogroup nice is -20: `echo -20 > /proc/self/autogroup`): its rates are measured in its own
processes, but the link's latency and the ranks' skew suffer from other processes' load.

What is measured: bench/train_throughput.py's training step (taco_triton.examples.train_gpt's TP=2
TinyGPT, its loop: forward, backward, AdamW on FP32 master weights, FP32 compute, bf16
communication, the mode's policy with min_bytes 0, one thread per rank as train_gpt runs) on two
ranks whose loopback is throttled by tc to each link rate (bench/netns.py; root only); the median
step time after --warmup steps.

What the model is fed: this machine's rates, each measured by a microbenchmark in the same
processes, alternated with the steps (the machine's load moves as other processes come and go,
so each rate is timed with the steps it predicts, not minutes apart), never a step's own time:

- GEMM throughput: one step's matrix products at the model's shapes (each linear layer's
  forward, input-gradient and weight-gradient products; the attention kernel forward and
  backward; the output layer) on random tensors: the plan's FLOPs of a step over their time is
  the cluster's `tflops` (at efficiency 1);
- the non-GEMM passes' rate: the passes the plan counts (`ModelSpec.layer_elementwise_elements`:
  the norms, residual adds, the attention output's change of layout, the activation, the
  embedding, the final norm and the loss, forward and backward) run on random tensors of the
  model's shapes: the plan's bytes over their time is the cluster's HBM rate (share 1), which
  also times the optimizer. On a CPU these passes are bound by arithmetic (erf, reductions) as
  much as by memory, so the rate is measured on them, not on a copy;
- codec: compress then decompress of one TP message (b x s x h bf16) with the mode's config,
  timed after each step: dense GB/s of one pass (their mean);
- link: the throttled rate, shared by both ranks (one loopback queue carries every rank's bytes),
  so each rank gets rate / 2; and its latency per communication step, half the time of an
  all-reduce of 64 bf16 elements (two ring steps at 2 ranks), timed after each step.

The rates stay at or below 2 Gbit/s: at 10 Gbit/s this 2-core machine's loopback is CPU-bound
before the token bucket binds (bench/netns.py), so the link is no longer the emulated one.

`measured_compute_ms` (the step's time outside its TP collectives: the collectives module the
layers call is wrapped with a timer) is kept beside `model_compute_ms` (the plan's GEMMs,
non-GEMM passes and optimizer) to show which part of a miss is compute.

CSV: bench/results/plan_validation_cpu.csv (link, mode, measured_step_ms, predicted_step_ms, the
parameters, machine, commit, date). CPU figures: they check the model's composition, not GPU speed.
"""
from __future__ import annotations

import argparse
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
    """The ModelSpec and Layout of train_throughput's TinyGPT (replicated embeddings and head,
    FP32 compute)."""
    import torch

    from taco_triton.plan import Layout, ModelSpec

    spec = ModelSpec(layers=args.layers, hidden=args.hidden, ffn=4 * args.hidden, heads=args.heads, vocab=256,
                     seq=args.seq, micro_batch=args.batch, parallel_embedding=False, compute_dtype=torch.float32,
                     name="TinyGPT")
    return spec, Layout(tp=RANKS)


def policy_of(mode: str):
    """The mode's policy as train_gpt builds it (min_bytes 0: train_throughput's default)."""
    from taco_triton.examples.modes import make_policy

    return make_policy(mode, argparse.Namespace(min_bytes=0, calibrate_steps=0, plan=None))


def unit_cluster(link_gbps: float, codec_gbytes_s: float | None = None, tflops: float = 1.0,
                 hbm_gbytes_s: float = 1.0, latency_us: float = 0.0):
    """One node of 2 "GPUs" (the ranks) on a link of link_gbps / 2 per rank, every share 1: the
    model at the given rates (default 1 TFLOP/s and 1 GB/s, which give the plan's FLOPs and
    bytes as times)."""
    from taco_triton.plan import Cluster

    return Cluster(gpu="cpu", tflops=tflops, hbm_gbytes_s=hbm_gbytes_s, gpus_per_node=RANKS,
                   intra_gbytes_s=link_gbps / 8 / RANKS, intra_latency_us=latency_us, gemm_efficiency=1.0,
                   elementwise_share=1.0, codec_gbytes_s=codec_gbytes_s)


def step_work(args) -> tuple[float, float]:
    """(FLOPs, bytes) of one rank's step as the plan counts them: what `gemm_pass` computes (the
    plan's GEMMs and attention) and what `elementwise_pass` moves (the plan's non-GEMM passes of
    the layers, the embedding, the final norm and the loss, FP32)."""
    from taco_triton.plan import step

    spec, layout = spec_layout(args)
    flops = step(spec, layout, unit_cluster(1.0)).summary["compute_ms"] * 1e-3 * 1e12
    layer = spec.layer_elementwise_elements(layout.tp, layout.sequence_parallel)
    edge = spec.edge_elementwise_elements(layout.tp, layout.sequence_parallel, True, True)
    return flops, (spec.layers * sum(layer) + sum(edge)) * spec.compute_dtype.itemsize


def predict(link_gbps: float, mode: str, gemm_s: float, elementwise_s: float, codec_gbytes_s: float,
            latency_us: float, args) -> dict:
    """The model's step for one (link, mode) from the measured rates: `gemm_s` and
    `elementwise_s`, the microbenchmarks' seconds for one step's GEMMs and non-GEMM passes
    (`step_work`; the plan's casts around the TP messages and the optimizer's bytes go at the
    latter's rate), the codec's rate and the link's latency per step.

    Returns:
        {"predicted_step_ms", "model_compute_ms", "model_tp_ms", "model_tflops", "model_gbytes_s"}.
    """
    from taco_triton.plan import step

    spec, layout = spec_layout(args)
    flops, nbytes = step_work(args)
    cluster = unit_cluster(link_gbps, codec_gbytes_s, tflops=flops / gemm_s / 1e12,
                           hbm_gbytes_s=nbytes / elementwise_s / 1e9, latency_us=latency_us)
    policy = None if mode == "none" else policy_of(mode)
    s = step(spec, layout, cluster, policy).summary
    return {"predicted_step_ms": s["step_ms_compressed"],
            "model_compute_ms": s["compute_ms"] + s["elementwise_ms"] + s["optimizer_ms"],
            "model_tp_ms": s["tp_exposed_ms_compressed"], "model_tflops": cluster.tflops,
            "model_gbytes_s": cluster.hbm_gbytes_s}


# ---------------------------------------------------------------------------- the microbenchmarks
def gemm_pass(args, tp: int = RANKS):
    """One rank's step of matrix products at TinyGPT's shapes, as a callable: per layer the four
    linear layers' forward, input-gradient and weight-gradient products (qkv and fc1 split by
    output, proj and fc2 by input over `tp`) and the causal attention kernel forward and backward
    on heads / tp heads; the output layer's three products once."""
    import torch
    import torch.nn.functional as F

    h, f, t, v = args.hidden, 4 * args.hidden, args.batch * args.seq, 256
    heads, d = args.heads // tp, args.hidden // args.heads

    def rand(*shape):
        return torch.randn(*shape).requires_grad_(True)

    linears = [(rand(t, i), rand(o, i), torch.randn(t, o))
               for i, o in ((h, 3 * h // tp), (h // tp, h), (h, f // tp), (f // tp, h))] * args.layers
    linears.append((rand(t, h), rand(v, h), torch.randn(t, v)))
    qkv = [rand(args.batch, heads, args.seq, d) for _ in range(3)]
    dout = torch.randn(args.batch, heads, args.seq, d)

    def run():
        for x, w, dy in linears:
            torch.autograd.grad(F.linear(x, w), (x, w), dy)
        for _ in range(args.layers):
            torch.autograd.grad(F.scaled_dot_product_attention(*qkv, is_causal=True), qkv, dout)
    return run


def elementwise_pass(args, tp: int = RANKS):
    """One rank's step of the non-GEMM passes the plan counts, at TinyGPT's shapes, as a callable:
    per layer two layer norms, two residual adds (and, backward, the two gradient sums), the
    attention output's change of layout and the GELU, forward and backward; the embedding
    (lookup, position add), the final norm and the loss's softmax once."""
    import torch
    import torch.nn.functional as F

    h, f, t, v = args.hidden, 4 * args.hidden, args.batch * args.seq, 256
    heads, d = args.heads // tp, args.hidden // args.heads

    def rand(*shape):
        return torch.randn(*shape).requires_grad_(True)

    x, w, bias, dx = rand(t, h), rand(h), rand(h), torch.randn(t, h)
    a, da = rand(args.batch, heads, args.seq, d), torch.randn(t, h // tp)
    u, du = rand(t, f // tp), torch.randn(t, f // tp)
    tok, pos = rand(v, h), rand(args.seq, h)
    ids, logits = torch.randint(0, v, (args.batch, args.seq)), rand(t, v)

    def run():
        for _ in range(args.layers):
            for _ in range(2):
                torch.autograd.grad(F.layer_norm(x, (h,), w, bias), (x, w, bias), dx)
                _ = x.detach() + dx  # the residual add forward
                _ = dx + dx          # and the sum of its two branches' gradients
            torch.autograd.grad(a.transpose(1, 2).reshape(t, -1), a, da)
            torch.autograd.grad(F.gelu(u), u, du)
        emb = F.embedding(ids, tok) + F.embedding(torch.arange(args.seq), pos)
        torch.autograd.grad(emb, (tok, pos), dx.view(args.batch, args.seq, h))
        torch.autograd.grad(F.layer_norm(x, (h,), w, bias), (x, w, bias), dx)
        torch.autograd.grad(F.cross_entropy(logits, ids.reshape(-1), reduction="sum"), logits)
    return run


# ---------------------------------------------------------------------------- the ranks
def _rank(rank, world, port, args, queue):
    """One rank: alternately a real step (gloo, the throttled link, the mode's policy), the GEMM and
    the non-GEMM microbenchmarks, the link's latency and, for a compressing mode, one codec timing."""
    import datetime as dt

    import torch
    import torch.distributed as dist

    import taco_triton as taco
    from taco_triton.examples import train_gpt
    from taco_triton.examples.gpt import TinyGPT

    torch.set_num_threads(1)  # as train_gpt runs its ranks: one thread each, the ranks share the cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=dt.timedelta(seconds=600))
    policy = policy_of(args.mode)
    torch.manual_seed(0)
    model = TinyGPT(args.layers, args.hidden, args.heads, 4 * args.hidden, args.seq, policy=policy)
    master = [p.detach().clone().float().requires_grad_(True) for p in model.parameters()]
    opt = torch.optim.AdamW(master, lr=1e-3, weight_decay=0.01)
    gen = torch.Generator().manual_seed(1)
    in_collectives = _time_collectives()
    gemm, elementwise = gemm_pass(args), elementwise_pass(args)

    def one_step():  # train_gpt's step
        x = torch.randint(0, 256, (args.batch, args.seq), generator=gen)
        in_collectives[0] = 0.0
        t0 = time.perf_counter()
        model.loss(x, x).backward()
        model.sync_replicated_grads()
        train_gpt.master_step(model, master, opt)
        policy.step()
        return 1e3 * (time.perf_counter() - t0), 1e3 * in_collectives[0]

    def timed(fn):
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    msg = torch.randn(args.batch * args.seq, args.hidden).to(torch.bfloat16)
    tiny = torch.zeros(64, dtype=torch.bfloat16)
    out = {"step_ms": [], "outside_ms": [], "gemm_s": [], "elementwise_s": [], "latency_s": [], "codec_s": []}
    for _ in range(args.steps):
        dist.barrier()
        step_ms, coll_ms = one_step()
        out["step_ms"].append(step_ms)
        out["outside_ms"].append(step_ms - coll_ms)
        out["gemm_s"].append(timed(gemm))
        out["elementwise_s"].append(timed(elementwise))
        dist.barrier()
        out["latency_s"].append(timed(lambda: dist.all_reduce(tiny)))
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
    gemm = pd.Series([t for r in per_rank.values() for t in r["gemm_s"][w:]])
    elementwise = pd.Series([t for r in per_rank.values() for t in r["elementwise_s"][w:]])
    latency = pd.Series([t for r in per_rank.values() for t in r["latency_s"][w:]])
    codec = pd.Series([t for r in per_rank.values() for t in r["codec_s"][w:]], dtype=float)
    dense = args.batch * args.seq * args.hidden * 2
    return {"measured_step_ms": float(steps.median()), "measured_compute_ms": float(compute.median()),
            "gemm_s": float(gemm.median()), "elementwise_s": float(elementwise.median()),
            "latency_us": float(latency.median()) / 2 * 1e6,
            "codec_gbytes_s": float(dense / codec.median() / 1e9) if len(codec) else float("nan"),
            "p20_step_ms": float(steps.quantile(0.2)), "p80_step_ms": float(steps.quantile(0.8))}


def main(argv=None) -> pd.DataFrame | None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="0.1,0.5,1,2", help="link rates in Gbit/s (default: %(default)s)")
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
                           **predict(float(link.label), mode, got["gemm_s"], got["elementwise_s"], codec, got["latency_us"], args),
                           "link_gbps_per_rank": float(link.label) / RANKS}
                    rows.append(row)
                    print(f"  link {row['link']:>5} Gbit/s {mode:5s} measured {row['measured_step_ms']:8.1f} ms  "
                          f"predicted {row['predicted_step_ms']:8.1f} ms  (compute {row['measured_compute_ms']:.0f} ms, "
                          f"model {row['model_compute_ms']:.0f} ms, "
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
