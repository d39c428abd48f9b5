"""Compression noise against SGD noise: how much error compressing every TP collective adds to a
minibatch gradient, measured against the noise SGD's minibatch gradient already has.

    python bench/noise_ratio.py --csv bench/results/noise_ratio.csv      # TinyGPT, Llama (DTensor), MiniLM
    python bench/noise_ratio.py --quick                                  # a few seconds: a tiny TinyGPT
    python bench/noise_ratio.py --csv bench/results/noise_ratio.csv --plot docs/figures/noise_ratio.png --plot-only

Each model trains with `taco_triton.examples.train_gpt` (TP=2, gloo ranks on CPU, native bf16
communication: mode "none") and, at each step of `--points` (0: before the first step), a probe
(`train_gpt._train`'s `probe`) measures from the weights of that step, on K minibatches
b_1..b_K of the training batch size drawn from the training text:

- g_k: the gradient of b_k with native bf16 communication (the baseline every training
  comparison uses), every parameter tensor whole (TP shards gathered);
- s, the SGD noise: the RMS deviation of one minibatch gradient from the mean of the K,
  s^2 = sum_k ||g_k - mean_j g_j||^2 / (K - 1): the expected squared distance of one minibatch
  gradient from the full-data gradient, estimated without bias (relative standard error about
  1 / sqrt(2 (K - 1)));
- e, the compression noise: the RMS over the same K minibatches of ||g~_k - g_k||, g~_k the
  gradient of b_k from the same weights with every TP collective compressed (forward and
  backward; for int4-fwd / int4-bwd one direction only), e^2 = sum_k ||g~_k - g_k||^2 / K.

`--dp-modes dp-int8,dp-int4` measures data-parallel gradient codecs instead (`DP_MODES`): e is then
the error of reducing each minibatch's gradient over 2 DP replicas (each holding half the
minibatch) with that codec, against the exact mean of the replicas' gradients.

Both use the same norm (L2 over the tensor's elements; "all": over every parameter) and the same
batch size, so e / s compares the two noises directly. Rows with mode "bf16" measure the baseline
itself: g_k (bf16 communication) against the gradient with FP32 communication.

What the ratio means for SGD: if the compression error is uncorrelated with the minibatch noise and
has mean zero, the update's noise grows from s to sqrt(s^2 + e^2): by 0.5% at e/s = 0.1, 4.4% at
e/s = 0.3, the same as a batch 1 + (e/s)^2 times smaller. Limits: the error need not have
mean zero (round-to-nearest is a fixed function of the batch and the weights), so its part common
to all batches does not average out over steps: `e_mean` = ||mean_k (g~_k - g_k)|| shows it (about
e / sqrt(K) for errors independent across batches, up to e for a fixed bias); s shrinks as
1 / sqrt(batch) while a bias does not; Adam rescales every coordinate, so a tensor's ratio matters
more than the whole model's (hence the per-tensor rows); forward compression also changes the loss
being evaluated, which a gradient measured at one point shows only to first order; and the figures
hold for these models, batch sizes and points of training.

CSV: one row per (model, step, mode, tensor) with model, step, codec, group_size, hadamard, rounding,
tensor, e, s, e_over_s, and mode, direction, k, batch, tokens, numel, e_mean, g_norm (||mean_k g_k||),
loss (mean over the K batches), s_measurable (see `flag_unmeasurable`), machine, commit, date.
"""
from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import sys
from pathlib import Path

import pandas as pd
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from autotune.meta import git_commit  # noqa: E402
from taco_triton.examples import train_gpt  # noqa: E402
from taco_triton import codec  # noqa: E402
from taco_triton.examples.modes import make_policy  # noqa: E402
from taco_triton.integrations.megatron import GRADIENT_CONFIG  # noqa: E402
from taco_triton.integrations.two_level import INTER_CONFIG  # noqa: E402
from taco_triton.examples.ranks import spawn_ranks  # noqa: E402
from plots import pyplot, save  # noqa: E402

#: The compressed modes measured (train_gpt's), each also with stochastic rounding ("-sr").
MODES = ("fp8", "int8", "int6", "int4", "int4-fwd", "int4-bwd")
SR_MODES = ("fp8", "int8", "int6", "int4")
#: train_gpt arguments of each model at TP=2 (TinyGPT and Llama at the size the convergence
#: benchmark trains; the training batch is 8 sequences), the steps at which it is measured, K, and
#: the minibatch sizes measured (sequences).
SMALL = ["--layers", "2", "--hidden", "128", "--heads", "4", "--ffn", "512", "--seq", "64", "--batch", "8"]
MODELS = {
    # also at 4x the training batch: s falls as 1 / sqrt(batch), e's part common to all batches does not
    "tinygpt": (SMALL, (0, 100, 1000), 16, (8, 32)),
    "llama": (["--dtensor", *SMALL], (0, 100, 1000), 16, (8,)),
    # fine-tuning a pretrained encoder: a fine-tuning learning rate, its text in WordPiece tokens;
    # K=8: a gradient costs ~30x TinyGPT's on CPU
    "minilm": (["--minilm", "--seq", "128", "--batch", "8", "--lr", "1e-4", "--data-bytes", str(2 << 20)], (0, 100), 8,
               (8,)),
}
QUICK = ["--layers", "1", "--hidden", "32", "--heads", "2", "--ffn", "64", "--seq", "16", "--batch", "2",
         "--data-bytes", "65536"]


#: The data-parallel gradient codecs `--dp-modes` measures: today's default (INT8, G=128, Hadamard,
#: stochastic rounding) and the 4-bit inter-node level of the two-level reduction (INT4, G=32,
#: Hadamard, nearest). Each of DP_REPLICAS replicas holds the gradient of its share of the
#: minibatch, scaled by 1 / DP_REPLICAS as megatron does, as one flat bucket (Hadamard groups span
#: parameters, as in a DDP bucket); each is quantized once, as the reduce-scatter's first
#: quantization does, and the decoded shares are summed in FP32. The error of one reduction, with
#: no residual carried in (error feedback acts across steps, not within one).
DP_MODES = {"dp-int8": GRADIENT_CONFIG, "dp-int4": INTER_CONFIG}
DP_REPLICAS = 2


class Measure:
    """One measured communication setting: the policy fields it sets while a gradient is taken
    (`dp`: a DP gradient codec instead, applied to the replicas' gradients taken natively)."""

    def __init__(self, mode: str, default, forward: bool, backward: bool, comm_dtype, dp: bool = False):
        self.mode, self.default, self.forward, self.backward, self.comm_dtype = (
            mode, default, forward, backward, comm_dtype)
        self.dp = dp

    def apply(self, policy) -> None:
        policy.default, policy.forward, policy.backward, policy.comm_dtype = (
            self.default, self.forward, self.backward, self.comm_dtype)

    @property
    def direction(self) -> str:
        return "+".join(d for d, on in (("forward", self.forward), ("backward", self.backward)) if on)


def measures(modes, sr_modes, args, dp_modes=()) -> list[Measure]:
    """The settings compared with the baseline, from train_gpt's modes (`make_policy`) and `DP_MODES`."""
    out = [Measure("bf16", None, True, True, torch.float32)]  # the baseline against FP32 communication
    for mode, sr in [(m, False) for m in modes] + [(m, True) for m in sr_modes]:
        p = make_policy(mode, args)
        cfg = p.default.replace(rounding="stochastic") if sr else p.default
        out.append(Measure(mode + ("-sr" if sr else ""), cfg, p.forward, p.backward, p.comm_dtype))
    out += [Measure(m, DP_MODES[m], False, True, None, dp=True) for m in dp_modes]
    return out


def dp_reduced(parts: list[dict], cfg) -> dict:
    """The DP replicas' gradients `parts` ({name: flat gradient} each) reduced as `DP_MODES`
    describes, minus their exact mean: the reduction's error, per parameter."""
    names, r = list(parts[0]), len(parts)
    flat = [torch.cat([p[n] for n in names]) / r for p in parts]
    err = sum(codec.decompress(codec.compress(f, cfg)).float().view(-1) - f for f in flat)
    return dict(zip(names, err.split([parts[0][n].numel() for n in names])))


def full_grads(model) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, whole, as a flat FP32 tensor (a collective: every rank calls it);
    the parameters' .grad are cleared. A TP shard (DTensor, or a TinyGPT layer's slice) is gathered;
    a replicated parameter's gradient is the same on every rank and taken as it is."""
    from torch.distributed.tensor import DTensor

    replicated = {id(p) for p in model.replicated_parameters()} if hasattr(model, "replicated_parameters") else None
    out = {}
    for name, p in model.named_parameters():
        g, p.grad = p.grad, None
        if g is None:
            continue
        if isinstance(g, DTensor):
            g = g.full_tensor()
        elif replicated is not None and id(p) not in replicated and dist.is_initialized():
            parts = [torch.empty_like(g) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, g.contiguous())
            g = torch.cat([t.reshape(-1) for t in parts])
        out[name] = g.detach().float().reshape(-1).cpu()
    return out


class NoiseProbe:
    """`train_gpt._train`'s probe: at each step of `points`, K minibatches' gradients under the
    baseline and under every `Measure`; rank 0 keeps the rows."""

    def __init__(self, model_name: str, points, k: int, batches, seed: int, settings: list[Measure]):
        self.model_name, self.points, self.k, self.seed = model_name, set(points), k, seed
        self.batches = (batches,) if isinstance(batches, int) else tuple(batches)  # sequences per minibatch
        self.settings, self.rows = settings, []

    def _grads(self, model, policy, setting, x, y, device):
        setting.apply(policy)
        loss = model.loss(x.to(device), y.to(device))
        loss.backward()
        model.sync_replicated_grads()
        return full_grads(model), float(loss.detach())

    def __call__(self, step, model, policy, data) -> None:
        if step in self.points:
            for batch in self.batches:
                self._measure(step, batch, model, policy, data)

    def _measure(self, step, batch, model, policy, data) -> None:
        device = next(model.parameters()).device
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        # batches apart from the training's: a generator of their own
        gen = torch.Generator().manual_seed(1_000_003 * (self.seed + 1) + 1009 * step + batch)
        saved = Measure("saved", policy.default, policy.forward, policy.backward, policy.comm_dtype)
        baseline = Measure("baseline", None, True, True, policy.comm_dtype)
        batches = [data.batch("train", batch, gen) for _ in range(self.k)]
        try:
            exact, losses = [], []  # the baseline's gradients of the K batches (kept on rank 0 only)
            for x, y in batches:
                g, loss = self._grads(model, policy, baseline, x, y, device)
                exact.append(g if rank0 else None)
                losses.append(loss)
            deltas = {}
            for m in self.settings:  # per setting: sum_k ||d_k||^2 and sum_k d_k, per tensor
                d_sq, d_sum = {}, {}
                for (x, y), g in zip(batches, exact):
                    if m.dp:  # the replicas' shares taken natively; g plus the reduction's error
                        parts = [self._grads(model, policy, baseline, xr, yr, device)[0]
                                 for xr, yr in zip(x.chunk(DP_REPLICAS), y.chunk(DP_REPLICAS))]
                        gm = {n: g[n] + e for n, e in dp_reduced(parts, m.default).items()} if rank0 else None
                    else:
                        gm, _ = self._grads(model, policy, m, x, y, device)
                    if rank0:
                        for n, t in g.items():
                            # the bf16 row: the baseline (g) against FP32 communication (gm)
                            d = ((t - gm[n]) if m.mode == "bf16" else (gm[n] - t)).double()
                            d_sq[n] = d_sq.get(n, 0.0) + float(d.square().sum())
                            d_sum[n] = d_sum.get(n, 0) + d
                if rank0:
                    deltas[m.mode] = (d_sq, {n: float((v / self.k).square().sum()) for n, v in d_sum.items()})
        finally:
            saved.apply(policy)
        if rank0:
            self._rows(step, batch, exact, deltas, sum(losses) / len(losses), batches[0][0].numel())

    def _rows(self, step, batch, exact, deltas, loss, tokens) -> None:
        k, names = self.k, list(exact[0])
        mean = {n: sum(g[n].double() for g in exact) / k for n in names}
        s2 = {n: sum(float((g[n].double() - mean[n]).square().sum()) for g in exact) / (k - 1) for n in names}
        for m in self.settings:
            cfg, (d_sq, em2) = m.default, deltas[m.mode]
            common = dict(model=self.model_name, step=step, mode=m.mode, direction=m.direction,
                          codec=cfg.codec if cfg else "bf16", group_size=cfg.group_size if cfg else float("nan"),
                          hadamard=cfg.hadamard if cfg else float("nan"),
                          rounding=cfg.rounding if cfg else "nearest", k=k, batch=batch, tokens=tokens,
                          loss=loss)
            for n in [*names, "all"]:
                part = names if n == "all" else [n]
                e, s = math.sqrt(sum(d_sq[i] for i in part) / k), math.sqrt(sum(s2[i] for i in part))
                self.rows.append(dict(common, tensor=n, numel=sum(mean[i].numel() for i in part), e=e, s=s,
                                      e_over_s=e / s if s > 0 else float("nan"),
                                      e_mean=math.sqrt(sum(em2[i] for i in part)),
                                      g_norm=math.sqrt(sum(float(mean[i].square().sum()) for i in part))))


def rank_main(rank: int, world: int, port: int, args, probe: NoiseProbe, queue) -> None:
    train_gpt.train_rank(rank, world, port, "none", args, probe=probe)
    queue.put((rank, probe.rows))


def run_model(name: str, train_args: list[str], points, k: int, batches, modes, sr_modes, seed: int,
              dp_modes=()) -> pd.DataFrame:
    args = train_gpt.parser().parse_args([*train_args, "--tp", "2", "--steps", str(max(points)), "--seed", str(seed),
                                          "--eval-every", str(10**9), "--eval-batches", "1", "--min-bytes", "0",
                                          "--quiet"])
    args.axes, args.label = ("tp",), "none"
    probe = NoiseProbe(name, points, k, batches or args.batch, seed, measures(modes, sr_modes, args, dp_modes))
    print(f"{name}: training {max(points)} steps, measuring at steps {sorted(points)} (K={k}) ...", flush=True)
    return pd.DataFrame(spawn_ranks(rank_main, args.tp, args, probe)[0])


def flag_unmeasurable(df: pd.DataFrame, floor: float = 0.1) -> pd.DataFrame:
    """Add `s_measurable`: False for the tensors (at a model, step and batch size) whose SGD noise is
    within a factor 1/floor of what bf16 communication alone changes their gradient by (the "bf16"
    rows' e/s): there s is rounding noise, not minibatch noise (a gradient that is zero in exact
    arithmetic, such as an attention key's bias, which the softmax cancels), and e/s says nothing.
    Measured: every other tensor has a bf16 e/s below 0.01, the key biases 0.3 and more."""
    keys = ["model", "step", "batch", "tensor"]
    floor_rows = df[df["mode"] == "bf16"].set_index(keys).e_over_s
    key = pd.MultiIndex.from_frame(df[keys])
    return df.assign(s_measurable=(floor_rows.reindex(key).to_numpy() < floor) | (df.tensor == "all").to_numpy())


def summary(df: pd.DataFrame) -> pd.DataFrame:
    """Per model, step, batch size and mode: e/s of the whole model, the largest over its tensors (those
    with a measurable s), and how much of the error is common to all K batches (1: independent,
    sqrt(K): fixed)."""
    keys = ["model", "step", "batch", "mode"]
    whole = df[df.tensor == "all"].set_index(keys)
    per = df[(df.tensor != "all") & df.s_measurable].groupby(keys)
    out = pd.DataFrame({"e_over_s_all": whole.e_over_s, "e_over_s_max_tensor": per.e_over_s.max(),
                        "worst_tensor": per.apply(lambda t: t.loc[t.e_over_s.idxmax(), "tensor"], include_groups=False),
                        "common_part": whole.e_mean * whole.k ** 0.5 / whole.e, "loss": whole.loss})
    order = {m: i for i, m in enumerate(["bf16", *MODES, *(m + "-sr" for m in SR_MODES), *DP_MODES])}
    return out.sort_index(key=lambda ix: ix.map(order) if ix.name == "mode" else ix)


def plot(df: pd.DataFrame, path: str) -> None:
    """e/s per mode (log scale), a panel per model: a bar per step and batch size for the whole model,
    a dot for the largest over its tensors with a measurable s."""
    plt = pyplot()
    table = summary(df).reset_index()
    modes = [m for m in ["bf16", *MODES, *(m + "-sr" for m in SR_MODES), *DP_MODES] if m in set(table["mode"])]
    models = [m for m in MODELS if m in set(table.model)] + sorted(set(table.model) - set(MODELS))
    fig, axes = plt.subplots(len(models), 1, figsize=(12, 3.4 * len(models)), sharex=True, squeeze=False)
    for ax, model in zip(axes[:, 0], models):
        mt = table[table.model == model]
        groups = list(mt[["step", "batch"]].drop_duplicates().itertuples(index=False, name=None))
        width = 0.8 / len(groups)
        for i, (step, batch) in enumerate(groups):
            t = mt[(mt.step == step) & (mt.batch == batch)].set_index("mode").reindex(modes)
            x = [j + (i - (len(groups) - 1) / 2) * width for j in range(len(modes))]
            bars = ax.bar(x, t.e_over_s_all, width, label=f"step {step}, batch {batch}")
            ax.plot(x, t.e_over_s_max_tensor, ".", color=bars.patches[0].get_facecolor(), markersize=5)
        ax.set_yscale("log")
        for y in (0.1, 1.0):
            ax.axhline(y, color="black", lw=0.7, ls="--")
        ax.set(ylabel="e / s", title=f"{model}, TP=2: bars the whole model, dots its worst tensor")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7, ncol=3)
    axes[-1, 0].set_xticks(range(len(modes)), modes)
    save(fig, path, dpi=100)


def main(argv=None) -> pd.DataFrame:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated from {list(MODELS)}")
    ap.add_argument("--points", default=None,
                    help="training steps at which to measure (0: the initial or pretrained weights); default per model")
    ap.add_argument("--k", type=int, default=None, help="minibatches per measurement (K >= 2); default per model")
    ap.add_argument("--modes", default=",".join(MODES), help="compressed modes, as train_gpt's --compress")
    ap.add_argument("--sr-modes", default=",".join(SR_MODES), help="modes measured with stochastic rounding too")
    ap.add_argument("--dp-modes", default="", help=f"DP gradient codecs from {list(DP_MODES)} (see DP_MODES)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the weights, the training and the probe's batches")
    ap.add_argument("--quick", action="store_true", help="a tiny TinyGPT, 2 steps, K=3, fp8 and int4: seconds")
    ap.add_argument("--csv", default=None, help="write every row here")
    ap.add_argument("--plot", default=None, help="draw e/s per mode into this PNG (needs matplotlib)")
    ap.add_argument("--plot-only", action="store_true", help="measure nothing: redraw --plot from --csv")
    args = ap.parse_args(argv)
    if args.plot_only:
        if not (args.plot and args.csv):
            ap.error("--plot-only needs --plot and --csv")
        plot(pd.read_csv(args.csv), args.plot)
        return pd.DataFrame()
    split = lambda s: [x.strip() for x in s.split(",") if x.strip()]  # noqa: E731
    modes, sr_modes, dp_modes = split(args.modes), split(args.sr_modes), split(args.dp_modes)
    models = split(args.models)
    points = sorted({int(p) for p in split(args.points)}) if args.points else None
    if args.quick:
        models, points, args.k, modes, sr_modes = ["tinygpt"], [0, 2], 3, ["fp8", "int4"], ["int4"]
    unknown = ([m for m in models if m not in MODELS] + [m for m in modes + sr_modes if m not in MODES]
               + [m for m in dp_modes if m not in DP_MODES])
    if unknown:
        raise SystemExit(f"unknown model or mode {unknown}; models {list(MODELS)}, modes {list(MODES)}")
    if args.k is not None and args.k < 2:
        raise SystemExit(f"--k must be >= 2 (s is a spread over K minibatches), got {args.k}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the two ranks share the cores
    commit = git_commit()
    frames = []
    for name in models:
        train_args, model_points, k, batches = MODELS[name]
        frames.append(run_model(name, QUICK if args.quick else train_args, points or model_points, args.k or k,
                                None if args.quick else batches, modes, sr_modes, args.seed, dp_modes))
    df = flag_unmeasurable(pd.concat(frames, ignore_index=True))
    df["machine"], df["commit"] = platform.node() or "unknown", commit
    df["date"] = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    if args.csv:
        Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
        df.to_csv(args.csv, index=False, float_format="%.6g")  # 6 digits: s itself is known to ~18%
    if args.plot:
        plot(df, args.plot)
    pd.set_option("display.width", 250)
    print("compression noise e over SGD noise s (TP=2, every TP collective compressed):")
    print(summary(df).round(4).to_string())
    skipped = sorted(set(df.loc[~df.s_measurable, "tensor"]))
    if skipped:
        print(f"left out of the per-tensor maximum (s at the level of bf16 rounding): {skipped}")
    return df


if __name__ == "__main__":
    main()
