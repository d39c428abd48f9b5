"""The `--megatron` body of `train_gpt`: the same training with megatron-core's GPTModel, in 3D.

    python -m taco_triton.examples.train_gpt --megatron --tp 2 --compress none,fp8 --steps 300
    python -m taco_triton.examples.train_gpt --megatron --tp 2 --pp 2 --dp 2 --compress none,int8 --steps 3

Each spawned rank initializes megatron's parallel state (tensor_model_parallel_size = --tp,
pipeline_model_parallel_size = --pp; data parallel = the rest: world = tp * pp * dp), builds its
pipeline stage of a GPTModel with the local layer spec (byte vocabulary 256, --layers split over
the stages, --hidden/--heads/--ffn, max sequence --seq, learned absolute positions, no dropout,
untied output layer), wraps it in megatron's `DistributedDataParallel` (FP32 gradient buffers, one
synchronous reduction per step) and trains it with megatron's pipeline schedule
(`get_forward_backward_func`, --microbatches per step) and AdamW on FP32 master weights. Every DP
rank draws its own slice of one global batch (--batch rows per DP rank), so runs with the same
--batch * --dp see the same tokens.

`taco_triton.integrations.megatron.enable` routes the TP collectives, the pipeline send/recv and
the DDP gradient reduction (and, with --dist-opt, the distributed optimizer's parameter all-gather)
through taco_triton in every mode: mode "none" is enabled with
``CompressionPolicy(default=None)``, so every routed call is native (megatron's own numerics)
and still counted. In the other modes TP and PP use the mode's policy (`make_policy`) and DP
gradients `integrations.megatron.gradient_policy` (INT8, Hadamard, stochastic rounding;
--error-feedback: nearest rounding with a per-bucket residual), on the axes --compress-axes
names (one run per group, e.g. ``--compress-axes tp,pp,tp+pp+dp``; the others stay native). The
modes of `LOW_BIT_MODES` (defaults, dp4, pp6, dp4+pp6; `enable_low_bit`) compare today's defaults
with 4-bit DP and 6-bit PP. Each logged row has the loss and the bytes all ranks together sent per
axis that step (wire_tp, wire_pp, wire_dp; wire_dp_param_gather: the part of wire_dp that is the
parameter all-gather).

--dist-opt: megatron's DDP reduce-scatters the gradients and the example runs AdamW on each DP
rank's shard, then all-gathers the parameters, as megatron's distributed optimizer does.

Precision: megatron's collectives communicate the activations' dtype (the integration does not
apply the policy's ``comm_dtype``), so to keep the baseline bf16 as in `train_gpt`, the model
always computes in bf16 (``TransformerConfig(bf16=True)``, softmax in FP32; stage boundaries
carry bf16) on FP32 master weights, as megatron's mixed precision does; ``--compute-dtype``
does not apply here. DP gradients are reduced in FP32 (megatron's ``grad_reduce_in_fp32``), so
their uncompressed baseline is FP32.

Not routed (so not in the wire bytes in any mode): the three small FP32 all-reduces of
``vocab_parallel_cross_entropy``, and the loss/byte reports of this example. Sequence
parallelism is not supported here (megatron's torch LayerNorm wrapper refuses it on CPU).
"""
from __future__ import annotations

import math
import os
import time

import torch

VOCAB = 256


def _config(args, tp, pp):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        ffn_hidden_size=args.ffn, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.bfloat16, use_cpu_initialization=True, gradient_accumulation_fusion=False,
        params_dtype=torch.float32, bf16=True, masked_softmax_fusion=False, attention_softmax_in_fp32=True,
        hidden_dropout=0.0, attention_dropout=0.0,
    )


def check_layout(args, world: int) -> tuple[int, int, int]:
    """(tp, pp, dp) of the run; ValueError naming the numbers when they do not fit."""
    tp, pp = args.tp, getattr(args, "pp", 1)
    dp = world // (tp * pp)
    if tp * pp * dp != world or min(tp, pp, dp) < 1:
        raise ValueError(f"world size {world} is not tp * pp * dp (tp={tp}, pp={pp})")
    if args.layers % pp:
        raise ValueError(f"--layers ({args.layers}) must be divisible by --pp ({pp})")
    if args.batch % args.microbatches:
        raise ValueError(f"--batch ({args.batch}) must be divisible by --microbatches ({args.microbatches})")
    return tp, pp, dp


def nudge_one_weight(embedding: torch.Tensor) -> None:
    """Mode "control": the embedding of the space byte (row 32, the most frequent byte of Python
    source), its first element, rounded to bf16 and moved one bf16 unit in the last place away from
    zero, in place; every DP replica does the same. A change of one rounding step in one weight,
    nothing compressed: how far two otherwise identical runs end apart measures the benchmark's
    noise floor (the chaos of training), against which a compressed mode's change is read."""
    with torch.no_grad():
        b = embedding[32, 0].to(torch.bfloat16).reshape(1)
        embedding[32, 0] = (b.view(torch.int16) + 1).view(torch.bfloat16).float()[0]


def lr_factor(step: int, args) -> float:
    """The learning rate of `step` (1-based) over --lr: a linear warm-up over --warmup-steps, then
    constant, or (--lr-schedule cosine) a cosine decay from 1 to --min-lr-ratio at --steps.

        >>> from types import SimpleNamespace as A
        >>> a = A(warmup_steps=10, lr_schedule="cosine", min_lr_ratio=0.1, steps=110)
        >>> [round(lr_factor(s, a), 3) for s in (1, 10, 60, 110)]
        [0.1, 1.0, 0.55, 0.1]
    """
    warmup = getattr(args, "warmup_steps", 0)
    if step <= warmup:
        return step / warmup
    if getattr(args, "lr_schedule", "constant") != "cosine":
        return 1.0
    done = min(1.0, (step - warmup) / max(1, args.steps - warmup))
    low = args.min_lr_ratio
    return low + (1 - low) * 0.5 * (1 + math.cos(math.pi * done))


class Stage:
    """This rank's pipeline stage of the GPT, wrapped in megatron's DDP, with FP32 master weights,
    and one training / evaluation step through megatron's pipeline schedule.

    `use_distributed_optimizer`: DDP reduce-scatters each gradient bucket (each DP rank gets its
    shard, as megatron's distributed optimizer expects); `train_step` then runs AdamW on FP32
    master copies of this rank's shard of each bucket (AdamW is elementwise: the same update as
    on whole tensors) and all-gathers the parameters (`model.start_param_sync`). `perturb`: the
    initial weights with `nudge_one_weight` applied to the byte embedding (mode "control")."""

    def __init__(self, args, tp: int, pp: int, device: torch.device, use_distributed_optimizer: bool = False,
                 perturb: bool = False):
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.models.gpt.gpt_model import GPTModel
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        self.args, self.device = args, device
        model_parallel_cuda_manual_seed(args.seed, inference_rng_tracker=True)
        torch.manual_seed(args.seed)  # the same full weights in every mode
        self.config = _config(args, tp, pp)
        gpt = GPTModel(config=self.config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                       max_sequence_length=args.seq, pre_process=ps.is_pipeline_first_stage(),
                       post_process=ps.is_pipeline_last_stage(), share_embeddings_and_output_weights=False)
        if perturb and ps.is_pipeline_first_stage() and ps.get_tensor_model_parallel_rank() == 0:
            nudge_one_weight(gpt.embedding.word_embeddings.weight)
        self.params = [p for p in gpt.parameters() if p.requires_grad]
        self.master = [p.detach().clone().float().requires_grad_(True) for p in self.params]
        gpt.to(device=device, dtype=torch.bfloat16)  # bf16 compute and communication on FP32 master weights
        self.gpt = gpt
        self.model = DistributedDataParallel(
            self.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                       use_distributed_optimizer=use_distributed_optimizer), gpt)
        self.dist_opt = use_distributed_optimizer
        if use_distributed_optimizer:  # AdamW on this DP rank's shard of every bucket, as megatron's
            dp, me = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
            self.shards = [(b.param_data.view(-1).chunk(dp)[me], b.grad_data.view(-1).chunk(dp)[me])
                           for buf in self.model.buffers for b in buf.buckets]
            self.master = [w.detach().float().clone().requires_grad_(True) for w, _ in self.shards]
        self.opt = torch.optim.AdamW(self.master, lr=args.lr, betas=(0.9, getattr(args, "adam_beta2", 0.999)),
                                     weight_decay=0.01)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda i: lr_factor(i + 1, args))
        self.clip = getattr(args, "clip_grad", 0.0)
        if self.clip and tp > 1:  # TP-duplicated parameters (layer norms) would count tp times in the norm
            raise ValueError("--clip-grad is implemented for --tp 1 only")
        # the ranks whose gradients together make the whole model's, each part once: the pipeline stages
        # and, with the distributed optimizer, the DP ranks' shards
        self.norm_groups = [ps.get_pipeline_model_parallel_group()] + (
            [ps.get_data_parallel_group()] if use_distributed_optimizer else [])
        self.forward_backward = get_forward_backward_func()
        self.last_stage = ps.is_pipeline_last_stage()
        self.pos = torch.arange(args.seq, device=device)[None]
        self.mask = torch.triu(torch.ones(args.seq, args.seq, device=device), diagonal=1).bool()[None, None]

    def _forward_step(self, data_iterator, model):
        x, y = next(data_iterator)
        out = model(x, self.pos.expand_as(x), self.mask, labels=y)

        def loss_func(per_token):  # mean over this microbatch's tokens, in FP32
            loss = per_token.float().mean()
            return loss, {"loss": loss.detach()}

        return out, loss_func

    def _run(self, x, y, forward_only: bool) -> float:
        """One pass over a batch in --microbatches pieces; the mean loss (NaN off the last stage)."""
        m = self.args.microbatches
        mbs = list(zip(x.chunk(m), y.chunk(m)))
        losses = self.forward_backward(
            forward_step_func=self._forward_step, data_iterator=iter(mbs), model=[self.model], num_microbatches=m,
            seq_length=self.args.seq, micro_batch_size=x.shape[0] // m, forward_only=forward_only)
        if not self.last_stage:
            return float("nan")
        return float(sum(d["loss"] for d in losses) / len(losses))

    def train_step(self, x, y) -> float:
        """Forward, backward, DP gradient reduction, AdamW on the master weights (with the
        distributed optimizer: on this rank's shards, then the parameter all-gather)."""
        self.model.zero_grad_buffer()
        loss = self._run(x, y, forward_only=False)
        self.model.finish_grad_sync()
        if self.dist_opt:
            for m, (_, g) in zip(self.master, self.shards):
                m.grad = g.float()
            self._clip_and_step()
            with torch.no_grad():
                for m, (w, _) in zip(self.master, self.shards):
                    w.copy_(m)
            self.model.start_param_sync(force_sync=True)
            return loss
        for m, p in zip(self.master, self.params):
            m.grad = p.main_grad.float()
        self._clip_and_step()
        with torch.no_grad():
            for m, p in zip(self.master, self.params):
                p.copy_(m)
        return loss

    def _clip_and_step(self) -> None:
        """AdamW on the master weights' gradients (clipped to a global norm of --clip-grad first, when
        set: the norm over every stage's and shard's gradients, kept as `grad_norm`), then the
        schedule's next lr."""
        if self.clip:
            import torch.distributed as dist

            sq = torch.stack([m.grad.double().square().sum() for m in self.master]).sum().reshape(1)
            for g in self.norm_groups:  # a scalar per step, not routed (not counted as traffic)
                dist.all_reduce(sq, group=g)
            self.grad_norm = float(sq.sqrt())
            scale = self.clip / (self.grad_norm + 1e-6)
            if scale < 1:
                for m in self.master:
                    m.grad.mul_(scale)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.sched.step()

    def eval_loss(self, x, y) -> float:
        self.model.eval()
        with torch.no_grad():
            loss = self._run(x, y, forward_only=True)
        self.model.train()
        return loss


def enable_axes(policy, gpt, axes, error_feedback: bool):
    """`integrations.megatron.enable` with `policy` on the `axes` named (TP, PP: the policy; DP:
    `gradient_policy(policy)`) and every other axis routed natively (counted, not compressed)."""
    from taco_triton.integrations import megatron as tm
    from taco_triton.parallel import CompressionPolicy

    native = CompressionPolicy(default=None)
    per_axis = {"tp": policy, "pp": policy, "dp": tm.gradient_policy(policy, error_feedback=error_feedback)}
    return tm.enable(model=gpt, error_feedback=error_feedback,
                     **{a: per_axis[a] if a in axes else native for a in tm.AXES})


#: The modes of the 3D low-bit comparison (besides "none"): the control (nothing compressed, one
#: weight nudged by one bf16 rounding step: `nudge_one_weight`), today's defaults on every axis,
#: 4-bit DP (between nodes: nearest rounding with error feedback, or "sr": stochastic rounding),
#: 6-bit PP, and both (see `enable_low_bit`).
LOW_BIT_MODES = ("control", "defaults", "dp4", "dp4sr", "pp6", "dp4+pp6", "dp4sr+pp6")


def enable_low_bit(mode: str, gpt, args):
    """`integrations.megatron.enable` for one of `LOW_BIT_MODES` (the axes a mode leaves alone are
    routed natively, counted):

    - control: every axis native, as "none" (the run differs by the weight `nudge_one_weight` moves);
    - defaults: `enable(policy)` with the default policy: TP and PP FP8 (E4M3, G=128, Hadamard), DP
      gradients `GRADIENT_CONFIG` (INT8, Hadamard, stochastic rounding), parameter all-gather exact;
    - dp4: DP gradients by the two-level reduction (`integrations.two_level`: INT8 inside a node,
      INT4 with error feedback between nodes; `--ranks-per-node` ranks per emulated node) and, with
      the distributed optimizer, the parameter all-gather as INT4 weight differences;
    - dp4sr: as dp4, the between-node INT4 rounded stochastically (unbiased every step) and no
      error feedback, as SDP4Bit's gradients are;
    - pp6: pipeline messages INT6, G=32, Hadamard (`pipeline_policy`);
    - dp4+pp6, dp4sr+pp6: both.
    """
    from megatron.core import parallel_state as ps

    from taco_triton.integrations import megatron as tm
    from taco_triton.integrations.two_level import INTER_CONFIG, TwoLevel
    from taco_triton.parallel import CompressionPolicy

    common = dict(min_bytes=args.min_bytes)
    native = CompressionPolicy(default=None)
    if mode == "control":  # as "none"; the difference is the initial weight `Stage` nudges
        return tm.enable(model=gpt, tp=native, pp=native, dp=native)
    if mode == "defaults":
        pol = CompressionPolicy(**common)
        return tm.enable(model=gpt, tp=pol, pp=pol, dp=tm.gradient_policy(pol))
    if mode not in LOW_BIT_MODES:
        raise ValueError(f"low-bit modes are {LOW_BIT_MODES}, got {mode!r}")
    kw = dict(model=gpt, tp=native, pp=native, dp=native)
    if "pp6" in mode:
        kw["pp"] = tm.pipeline_policy(CompressionPolicy(**common))
    if "dp4" in mode:  # every rank builds the two-level subgroups, at the same point
        sr = dict(inter=INTER_CONFIG.replace(rounding="stochastic"), error_feedback=False) if "dp4sr" in mode else {}
        kw.update(dp=CompressionPolicy(**common), weight_deltas=True,
                  two_level=TwoLevel(ps.get_data_parallel_group(), getattr(args, "ranks_per_node", None), **sr))
    return tm.enable(**kw)


def _dp_slice(t: torch.Tensor, dp_rank: int, dp: int) -> torch.Tensor:
    return t.chunk(dp)[dp_rank]


def _from_last_stage(value: float) -> float:
    """The last pipeline stage's value, averaged over the DP replicas, on every rank (for reports;
    not counted as traffic)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    t = torch.tensor([value if ps.is_pipeline_last_stage() else 0.0], dtype=torch.float64)
    dist.all_reduce(t, group=ps.get_pipeline_model_parallel_group())
    dist.all_reduce(t, group=ps.get_data_parallel_group())
    return float(t) / ps.get_data_parallel_world_size()


def _summed(values: list[float]) -> list[float]:
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return t.tolist()


def train_rank_megatron(rank: int, world: int, mode: str, args, device: torch.device) -> list[dict]:
    """Train one mode on this rank (the process group is up); returns the logged rows."""
    if args.sequence_parallel:
        raise ValueError("--megatron does not support --sequence-parallel (torch LayerNorm on CPU)")
    tp, pp, dp = check_layout(args, world)
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    from megatron.core import parallel_state as ps

    from taco_triton.examples.data import TextBatches, stdlib_bytes
    from taco_triton.examples.modes import make_policy, progress
    from taco_triton.integrations import megatron as tm

    with tm.cpu_compat():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        handle = None
        try:
            stage = Stage(args, tp, pp, device, use_distributed_optimizer=getattr(args, "dist_opt", False),
                          perturb=mode == "control")
            dp_rank = ps.get_data_parallel_rank()
            if mode in LOW_BIT_MODES:
                policy = make_policy("none", args)  # stepped like the others; the handle holds the modes' policies
                handle = enable_low_bit(mode, stage.gpt, args)
            else:
                policy = make_policy(mode, args)
                handle = enable_axes(policy, stage.gpt, getattr(args, "axes", tm.AXES),
                                     getattr(args, "error_feedback", False))

            data = TextBatches(stdlib_bytes(args.data_bytes), args.seq)
            gen = torch.Generator().manual_seed(args.seed + 1)  # the same global batches on every rank

            def batch(split, g):
                return [_dp_slice(t, dp_rank, dp).to(device) for t in data.batch(split, args.batch * dp, g)]

            def evaluate():
                g = torch.Generator().manual_seed(args.seed + 2)  # the same validation batches every time
                losses = [stage.eval_loss(*batch("val", g)) for _ in range(args.eval_batches)]
                return _from_last_stage(sum(losses) / len(losses))

            rows = []
            for step in range(1, args.steps + 1):
                x, y = batch("train", gen)
                handle.reset_stats()
                t0 = time.perf_counter()
                loss = stage.train_step(x, y)
                policy.step()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                axes = handle.by_axis()
                param_gather = sum(st.wire_bytes for (_, d, kind), st in handle.stats.items()
                                   if st.axis == "dp" and kind == "all_gather")
                wire = _summed([axes[a].wire_bytes for a in tm.AXES] + [sum(axes[a].compressed for a in tm.AXES),
                                                                         param_gather])
                loss = _from_last_stage(loss)
                row = {"mode": getattr(args, "label", mode), "seed": args.seed, "step": step, "train_loss": loss,
                       **{f"wire_{a}": w for a, w in zip(tm.AXES, wire)}, "wire_bytes": sum(wire[:3]),
                       "wire_dp_param_gather": wire[4],
                       "compressed_calls": int(wire[3]), "step_ms": 1e3 * dt, "val_loss": float("nan")}
                if step % args.eval_every == 0 or step == args.steps:
                    row["val_loss"] = evaluate()
                rows.append(row)
                if rank == 0 and args.verbose and (args.steps <= 20 or step % args.eval_every == 0
                                                   or step == args.steps):
                    print(progress(f"[megatron {mode} tp{tp} pp{pp} dp{dp}]", row,
                                   f"wire MiB tp {row['wire_tp'] / 2**20:.3f}  pp {row['wire_pp'] / 2**20:.3f}  "
                                   f"dp {row['wire_dp'] / 2**20:.3f}  {row['step_ms']:.0f} ms"), flush=True)
            if rank == 0 and args.verbose and policy.frozen:
                print(f"  [megatron {mode}] frozen plan: {len(policy.plan_dict())} sites, codecs "
                      f"{sorted({(c.codec, c.group_size, c.hadamard) for c in policy.plan_dict().values()})}")
            return rows
        finally:
            if handle is not None:
                handle.disable()
            ps.destroy_model_parallel()
