"""Train a small GPT with tensor parallelism, communication uncompressed vs compressed.

    python -m taco_triton.examples.train_gpt --tp 2 --compress none,fp8,int8 --steps 300

Each mode starts from the same weights and sees the same batches (byte-level text of the
Python standard library's sources, last 10% held out for validation). Prints loss, wire bytes
per step and step time side by side; `--csv` writes every logged step. The validation loss is taken
as the mode communicates, and at the last step once more with every collective native
(`val_loss_native`: the trained weights without the mode's forward compression). On CPU the ranks are
processes talking over gloo; on a machine with >= tp GPUs they use NCCL.

Modes: none (native bf16 collectives), fp8 (the default config: E4M3, G=128, Hadamard),
int8 (INT8, G=128, Hadamard), int6 (INT6, G=32, Hadamard: 2.56x fewer bytes than bf16),
int4 (INT4, G=32, Hadamard: 3.76x) in both directions, int4-fwd / int4-bwd (INT4 in the forward
or the backward collectives only, the other direction native bf16), auto (the policy calibrates
every site on the first --calibrate-steps steps, then freezes the plan; saved with --plan).

--minilm fine-tunes the pretrained all-MiniLM-L6-v2 instead (masked-LM loss, DTensor TP; see
minilm.py).

--megatron trains megatron-core's GPTModel instead (TP via megatron, its communication routed
through taco_triton by `integrations.megatron.enable`; see train_megatron.py); only there
--pp (pipeline stages) and --dp (data-parallel replicas) may exceed 1, on tp * pp * dp ranks:

    python -m taco_triton.examples.train_gpt --megatron --tp 2 --pp 2 --dp 2 --compress none,int8 --steps 3

and --compress-axes chooses which of them a mode compresses (`tp,pp,tp+pp` runs TP alone, PP
alone, then both; the other axes stay native). There the modes defaults, dp4, pp6 and dp4+pp6
compare today's defaults with 4-bit DP and 6-bit PP (train_megatron.enable_low_bit; with
--dist-opt for the parameter all-gather, --ranks-per-node for the emulated nodes).
"""
from __future__ import annotations

import argparse
import datetime
import os
import time

import torch
import torch.distributed as dist

import taco_triton as taco
from taco_triton.examples.data import TextBatches, stdlib_bytes
from taco_triton.examples.gpt import TinyGPT
from taco_triton.examples.llama import build_model as build_llama
from taco_triton.examples.minilm import build as build_minilm  # imports transformers only when called
from taco_triton.examples.modes import MODES, make_policy, progress
from taco_triton.examples.ranks import spawn_ranks
from taco_triton.examples.train_megatron import LOW_BIT_MODES, train_rank_megatron  # imports megatron-core only when called
from taco_triton.integrations.megatron import AXES  # importing it does not import megatron-core

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _loss_all(model: TinyGPT, x, y, group) -> torch.Tensor:
    loss = model.loss(x, y)
    if model.sp:  # each rank holds its tokens' share: the sum is the mean over all tokens
        loss = loss.detach().clone()
        dist.all_reduce(loss, group=group)
    return loss


def train_rank(rank: int, world: int, port: int, mode: str, args, queue=None, probe=None) -> list[dict]:
    """Train `mode` as rank `rank` of `world`; returns (and puts on `queue`) the logged rows. `probe`:
    see `_train`."""
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
    if use_cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if use_cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=args.pg_timeout))
    try:
        rows = _train(rank, world, mode, args, torch.device("cuda", rank) if use_cuda else torch.device("cpu"), probe)
        if queue is not None:
            queue.put((rank, rows))
        return rows
    finally:
        dist.destroy_process_group()


def _train(rank, world, mode, args, device, probe=None) -> list[dict]:
    """The training loop of TinyGPT, `--dtensor` and `--minilm` (`--megatron` runs its own).

    `probe(step, model, policy, data)`, if given, is called before the first step (step 0) and
    after every step, with the model holding that step's weights: it may run forward and backward
    passes of its own (for example gradients of one batch with and without compression), and must
    leave the parameters, their `.grad` (None) and the policy as it found them."""
    if getattr(args, "megatron", False):
        if probe is not None:
            raise ValueError("a probe needs the TinyGPT / --dtensor / --minilm loop, not --megatron")
        return train_rank_megatron(rank, world, mode, args, device)
    torch.manual_seed(args.seed)  # identical replicated weights and the same full TP matrices
    policy = make_policy(mode, args)
    data = None
    if getattr(args, "minilm", False):  # the pretrained all-MiniLM-L6-v2, masked-LM loss (minilm.py)
        model, data = build_minilm(args, policy)
        model = model.to(device)
    elif getattr(args, "dtensor", False):  # torch's DTensor TP with compressed styles (train_dtensor.py)
        model = build_llama(args, policy).to(device)
    else:
        model = TinyGPT(args.layers, args.hidden, args.heads, args.ffn, args.seq, policy=policy,
                        sequence_parallel=args.sequence_parallel).to(device)
    # Communication is bf16 in every mode (the policy's comm_dtype). Compute is FP32 by default
    # (fast on CPUs); --compute-dtype bf16 runs the model in bf16 on FP32 master weights, as
    # Megatron does.
    master = [p.detach().clone().float().requires_grad_(True) for p in model.parameters()]
    model.to(DTYPES[args.compute_dtype])
    opt = torch.optim.AdamW(master, lr=args.lr, weight_decay=0.01)
    data = data or TextBatches(stdlib_bytes(args.data_bytes), args.seq)
    gen = torch.Generator().manual_seed(args.seed + 1)  # every rank of the TP group sees the same batch
    rows = []
    if probe is not None:
        probe(0, model, policy, data)

    def evaluate(native: bool = False):
        """Mean loss over the same validation batches every time; `native`: with every collective
        uncompressed (the trained weights judged without the run's forward compression)."""
        g = torch.Generator().manual_seed(args.seed + 2)
        forward, policy.forward = policy.forward, policy.forward and not native
        try:
            with torch.no_grad():
                losses = [float(_loss_all(model, *(t.to(device) for t in data.batch("val", args.batch, g)), None))
                          for _ in range(args.eval_batches)]
        finally:
            policy.forward = forward
        return sum(losses) / len(losses)

    for step in range(1, args.steps + 1):
        x, y = (t.to(device) for t in data.batch("train", args.batch, gen))
        t0 = time.perf_counter()
        with taco.WireStats() as ws:
            loss = model.loss(x, y)
            loss.backward()
            model.sync_replicated_grads()
        master_step(model, master, opt)
        policy.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if model.sp:
            loss = loss.detach().clone()
            dist.all_reduce(loss)
        row = {"mode": mode, "step": step, "train_loss": float(loss.detach()), "wire_bytes": ws.wire_bytes,
               "compressed_calls": sum(c.compressed for c in ws.calls), "step_ms": 1e3 * dt, "val_loss": float("nan"),
               "val_loss_native": float("nan")}
        if step % args.eval_every == 0 or step == args.steps:
            row["val_loss"] = evaluate()
        if step == args.steps:
            row["val_loss_native"] = evaluate(native=True)
        rows.append(row)
        if rank == 0 and args.verbose and (step % args.eval_every == 0 or step == args.steps):
            print(progress(f"[{mode}]", row, f"wire {row['wire_bytes'] / 2**20:.2f} MiB  {row['step_ms']:.0f} ms"),
                  flush=True)
        if probe is not None:
            probe(step, model, policy, data)
    if policy.frozen and rank == 0 and args.verbose:
        print(f"  [{mode}] frozen plan: {len(policy.plan_dict())} sites, codecs "
              f"{sorted({(c.codec, c.group_size, c.hadamard) for c in policy.plan_dict().values()})}")
    return rows


def world_size(args) -> int:
    return args.tp * args.pp * args.dp


def run(mode: str, args) -> list[dict]:
    """Train one mode on tp * pp * dp processes; returns rank 0's logged rows."""
    try:
        return spawn_ranks(train_rank, world_size(args), mode, args)[0]
    except RuntimeError as exc:
        raise RuntimeError(f"mode {mode!r}: {exc}") from None


SUMMARY_LEGEND = """\
   final_val_loss: validation loss at the last step, communicating as the mode does; final_val_loss_native:
   the same trained weights evaluated with every collective uncompressed (what the mode did to training,
   without its compression of the evaluation's forward pass); val_loss_vs_none_%: final_val_loss against
   the uncompressed run's; wire_vs_none: bytes each rank handed to the process group per step, against bf16."""
"""What the columns of `summarize`'s table mean (printed under it)."""


def summarize(rows: list[dict]):
    """Per mode: final validation losses, wire bytes and step time (`SUMMARY_LEGEND`).

    Args:
        rows: the logged rows of every mode (`run`), in the order the modes ran.

    Returns:
        (every row as a DataFrame, the summary indexed by mode: "none" first, then the modes in
        the order they ran).
    """
    import pandas as pd

    df = pd.DataFrame(rows)
    order = sorted(dict.fromkeys(df["mode"]), key=lambda m: m != "none")  # stable: the rest as given
    last = df.sort_values("step").groupby("mode").tail(1).set_index("mode")
    out = pd.DataFrame({
        "final_val_loss": last.val_loss,
        "final_val_loss_native": last.get("val_loss_native", float("nan")),  # --megatron logs none
        "wire_MiB_per_step": df.groupby("mode").wire_bytes.median() / 2**20,
        "step_ms_median": df.groupby("mode").step_ms.median(),
    }).reindex(order)
    axes = [c[len("wire_"):] for c in df.columns if c.startswith("wire_") and c != "wire_bytes"]  # --megatron
    for a in axes:
        out[f"{a}_MiB_per_step"] = df.groupby("mode")[f"wire_{a}"].median() / 2**20
    if "none" in out.index:
        base = out.loc["none"]
        out["val_loss_vs_none_%"] = 100 * (out.final_val_loss / base.final_val_loss - 1)
        out["wire_vs_none"] = out.wire_MiB_per_step / base.wire_MiB_per_step
        for a in axes:
            if base[f"{a}_MiB_per_step"] > 0:
                out[f"{a}_vs_none"] = out[f"{a}_MiB_per_step"] / base[f"{a}_MiB_per_step"]
    return df, out


def parser(prog: str = "python -m taco_triton.examples.train_gpt", doc: str = __doc__) -> argparse.ArgumentParser:
    """The command line of `prog`, described by `doc` (first line: the description; the rest, the
    epilog); `train_dtensor` passes its own."""
    ap = argparse.ArgumentParser(prog=prog, description=doc.splitlines()[0],
                                 epilog="\n".join(doc.splitlines()[1:]).strip(),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks (gloo on CPU, NCCL on GPUs)")
    ap.add_argument("--pp", type=int, default=1, help="pipeline stages (--megatron only)")
    ap.add_argument("--dp", type=int, default=1, help="data-parallel replicas (--megatron only)")
    ap.add_argument("--microbatches", type=int, default=2, help="microbatches per step (--megatron only)")
    ap.add_argument("--error-feedback", action="store_true",
                    help="--megatron: DP gradients rounded to nearest with a per-bucket residual carried over")
    ap.add_argument("--dist-opt", action="store_true",
                    help="--megatron: the distributed optimizer (gradient reduce-scatter, AdamW on each DP rank's "
                         "shard, parameter all-gather)")
    ap.add_argument("--ranks-per-node", type=int, default=None,
                    help="--megatron, modes dp4 / dp4+pp6: ranks per (emulated) node of the two-level DP reduction "
                         "(default: LOCAL_WORLD_SIZE)")
    ap.add_argument("--compress-axes", default="tp+pp+dp",
                    help="--megatron: comma-separated groups of axes ('+'-joined from tp, pp, dp) that a compressing "
                         "mode compresses, one run per group; the other axes stay native (e.g. tp,pp,dp,tp+pp+dp)")
    ap.add_argument("--compress", default="none,fp8,int8", help=f"comma-separated modes from {MODES}")
    ap.add_argument("--steps", type=int, default=300, help="training steps per mode")
    ap.add_argument("--layers", type=int, default=2, help="transformer layers")
    ap.add_argument("--hidden", type=int, default=256, help="model width")
    ap.add_argument("--heads", type=int, default=4, help="attention heads (divisible by --tp)")
    ap.add_argument("--ffn", type=int, default=1024, help="MLP width")
    ap.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    ap.add_argument("--batch", type=int, default=16, help="sequences per step")
    ap.add_argument("--lr", type=float, default=2e-3, help="learning rate")
    ap.add_argument("--warmup-steps", type=int, default=0,
                    help="--megatron: the learning rate rises linearly from lr / warmup to lr over this many steps")
    ap.add_argument("--lr-schedule", choices=("constant", "cosine"), default="constant",
                    help="--megatron: after the warm-up, constant, or a cosine decay to --min-lr-ratio * lr at --steps")
    ap.add_argument("--min-lr-ratio", type=float, default=0.1, help="--megatron: the cosine decay's final lr / lr")
    ap.add_argument("--adam-beta2", type=float, default=0.999, help="--megatron: AdamW's beta2 (GPT training: 0.95)")
    ap.add_argument("--clip-grad", type=float, default=0.0,
                    help="--megatron: clip the global gradient norm (all stages and shards) to this (0: off)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the weights and batches (the same in every mode)")
    ap.add_argument("--eval-every", type=int, default=50, help="validation loss every this many steps (and at the last)")
    ap.add_argument("--eval-batches", type=int, default=8, help="batches per validation")
    ap.add_argument("--data-bytes", type=int, default=8 << 20, help="bytes of Python standard-library source used as the corpus")
    ap.add_argument("--min-bytes", type=int, default=0, help="compress messages of at least this many bytes")
    ap.add_argument("--calibrate-steps", type=int, default=5, help="auto mode: steps sampled per site before the plan is fixed")
    ap.add_argument("--plan", default=None, help="JSON path for the auto mode's plan")
    ap.add_argument("--compute-dtype", choices=list(DTYPES), default="fp32",
                    help="model dtype (communication is bf16 in every mode)")
    ap.add_argument("--sequence-parallel", action="store_true", help="sequence parallelism (all-gather / reduce-scatter instead of all-reduce)")
    ap.add_argument("--megatron", action="store_true",
                    help="train megatron-core's GPTModel instead (see taco_triton/examples/train_megatron.py)")
    ap.add_argument("--dtensor", action="store_true",
                    help="a Llama-style model under torch's DTensor TP instead (see taco_triton/examples/train_dtensor.py)")
    ap.add_argument("--minilm", action="store_true",
                    help="fine-tune the pretrained all-MiniLM-L6-v2 (masked-LM loss, DTensor TP) instead; the model "
                         "size flags do not apply (see taco_triton/examples/minilm.py; needs the `real` extra)")
    ap.add_argument("--pg-timeout", type=float, default=300, help="process-group timeout in seconds (a stuck rank fails after it)")
    ap.add_argument("--csv", default=None, help="write one row per (mode, step) to this CSV")
    ap.add_argument("--quiet", dest="verbose", action="store_false", help="print only the summary")
    return ap


def parse_axis_groups(spec: str) -> list[tuple[str, ...]]:
    """`--compress-axes` as a list of axis groups: "tp,pp+dp" -> [("tp",), ("pp", "dp")] (each in
    tp, pp, dp order); SystemExit naming an unknown axis or an empty group."""
    groups = []
    for part in spec.split(","):
        axes = {a.strip() for a in part.split("+") if a.strip()}
        unknown = sorted(axes - set(AXES))
        if unknown or not axes:
            raise SystemExit(f"--compress-axes groups are '+'-joined axes from {AXES}, got {part!r}")
        groups.append(tuple(a for a in AXES if a in axes))
    return groups


def run_label(mode: str, axes: tuple[str, ...], error_feedback: bool) -> str:
    """The mode's name in rows and summaries: the mode, then the compressed axes unless all are,
    then "+ef" with DP error feedback ("int8", "int8[pp]", "int8[dp]+ef")."""
    if mode == "none":
        return mode
    label = mode if axes == AXES else f"{mode}[{'+'.join(axes)}]"
    return label + ("+ef" if error_feedback and "dp" in axes else "")


def master_step(model, master: list, opt) -> None:
    """The optimizer step on the FP32 master weights: the model's gradients moved onto them, the
    step, the updated weights copied back into the model (its dtype)."""
    for m, p in zip(master, model.parameters()):
        m.grad = p.grad.float() if p.grad is not None else None
        p.grad = None
    opt.step()
    opt.zero_grad(set_to_none=True)
    with torch.no_grad():
        for m, p in zip(master, model.parameters()):
            p.copy_(m)


def main(argv=None, cli: argparse.ArgumentParser | None = None):
    """Train every mode and print the summary; `cli` parses `argv` (default: `parser()`)."""
    args = (cli or parser()).parse_args(argv)
    modes = [m.strip() for m in args.compress.split(",") if m.strip()]
    known = MODES + (LOW_BIT_MODES if args.megatron else ())
    for m in modes:
        if m not in known:
            raise SystemExit(f"unknown --compress mode {m!r}; choose from {known}")
    if not args.megatron and (args.warmup_steps or args.lr_schedule != "constant" or args.clip_grad
                              or args.adam_beta2 != 0.999):
        raise SystemExit("--warmup-steps / --lr-schedule / --adam-beta2 / --clip-grad need --megatron")
    if not args.megatron and (args.pp, args.dp) != (1, 1):
        raise SystemExit(f"--pp {args.pp} / --dp {args.dp} need --megatron (TinyGPT is TP only)")
    models = [f"--{m}" for m in ("megatron", "dtensor", "minilm") if getattr(args, m)]
    if len(models) > 1:
        raise SystemExit(f"{' and '.join(models)}: choose one model")
    if args.minilm and args.sequence_parallel:
        raise SystemExit("--minilm runs without sequence parallelism")
    groups = parse_axis_groups(args.compress_axes)
    if not args.megatron and groups != [AXES]:
        raise SystemExit(f"--compress-axes {args.compress_axes} needs --megatron (TinyGPT compresses TP only)")
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # ranks share the cores
    rows = []
    for m in modes:
        # nothing is compressed in "none", and a low-bit mode names its axes itself: run each once
        for axes in groups[:1] if m == "none" or m in LOW_BIT_MODES else groups:
            args.axes, args.label = axes, m if m in LOW_BIT_MODES else run_label(m, axes, args.error_feedback)
            print(f"training mode={args.label} tp={args.tp} pp={args.pp} dp={args.dp} steps={args.steps} ...",
                  flush=True)
            rows += run(m, args)
    df, summary = summarize(rows)
    print(summary.round(4).to_string())
    print(SUMMARY_LEGEND)
    if args.csv:
        import platform
        import subprocess

        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        df["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        df["machine"], df["commit"] = platform.node() or "unknown", commit or "unknown"
        df["date"] = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
        df.to_csv(args.csv, index=False)
    return df, summary


if __name__ == "__main__":
    main()
