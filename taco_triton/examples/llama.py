"""A small Llama-style model and the tensor-parallel plan `train_dtensor` trains it under.

The model (RMSNorm, rotary attention, SwiGLU, byte vocabulary) is parallelized by
`torch.distributed.tensor.parallel.parallelize_module` with the plan torchtitan's earlier releases
used for Llama (`tp_plan`), turned into compressed styles by
`taco_triton.integrations.dtensor.compress_plan` under a `CompressionPolicy` (`parallelize`).
`build_model` is what `python -m taco_triton.examples.train_dtensor` (that is, `train_gpt
--dtensor`) trains.

Not in wire_bytes in any mode (left to DTensor, native): the token embedding's output reduction
and the gradient reduction of replicated norm weights under sequence parallelism.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 256


class Attention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.head_dim = d // heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1: the heads this rank holds (all of them without TP)
        q, k, v = (w(x).view(b, s, -1, self.head_dim) for w in (self.wq, self.wk, self.wv))
        q, k = rotate(q, rope), rotate(k, rope)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(a.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, d: int, ffn: int):
        super().__init__()
        self.w1, self.w3 = nn.Linear(d, ffn, bias=False), nn.Linear(d, ffn, bias=False)
        self.w2 = nn.Linear(ffn, d, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, d: int, heads: int, ffn: int):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(d), nn.RMSNorm(d)
        self.attention, self.feed_forward = Attention(d, heads), FeedForward(d, ffn)

    def forward(self, x, rope):
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))


def rope_table(seq: int, head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    """[seq, head_dim/2, 2] cos/sin of rotary position embedding."""
    inv = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    ang = torch.arange(seq, dtype=torch.float64)[:, None] * inv[None]
    return torch.stack((ang.cos(), ang.sin()), -1).float()


def rotate(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of x [b, s, heads, head_dim] by the angles of `rope` (first s positions)."""
    xr = x.float().unflatten(-1, (-1, 2))
    cos, sin = (rope[: x.shape[1], None, :, i].to(x.device) for i in (0, 1))
    out = torch.stack((xr[..., 0] * cos - xr[..., 1] * sin, xr[..., 0] * sin + xr[..., 1] * cos), -1)
    return out.flatten(-2).to(x.dtype)


class TinyLlama(nn.Module):
    """forward(tokens [b, s]) -> logits [b, s, 256]; `loss` is the mean next-byte cross-entropy."""

    def __init__(self, layers=2, d=256, heads=4, ffn=1024, seq=128):
        super().__init__()
        if d % heads or (d // heads) % 2:
            raise ValueError(f"hidden ({d}) must be divisible by heads ({heads}) into an even head_dim")
        self.tok_embeddings = nn.Embedding(VOCAB, d)
        self.layers = nn.ModuleDict({str(i): Block(d, heads, ffn) for i in range(layers)})
        self.norm, self.output = nn.RMSNorm(d), nn.Linear(d, VOCAB, bias=False)
        self.register_buffer("rope", rope_table(seq, d // heads), persistent=False)
        self.sp = False  # the loss is computed on replicated logits, whole on every rank

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for blk in self.layers.values():
            h = blk(h, self.rope)
        return self.output(self.norm(h))

    def loss(self, tokens, targets):
        return F.cross_entropy(self.forward(tokens).flatten(0, 1).float(), targets.flatten())

    def sync_replicated_grads(self) -> None:
        """Replicated parameters whose grads DTensor left partial (norm weights with sequence
        parallelism): reduce them (native, exact), so the optimizer sees plain replicated grads."""
        from torch.distributed.tensor import DTensor, Replicate

        for p in self.parameters():
            g = p.grad
            if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
                p.grad = g.redistribute(placements=[Replicate()] * len(g.placements))


def tp_plan(model: TinyLlama, sequence_parallel: bool):
    """(model-level plan, per-block plan) in torch styles: the `parallelize_module` plan of
    torchtitan's earlier releases for Llama, Float8 variants left out."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    sp = sequence_parallel
    top = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1) if sp else Replicate()),
        "output": ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(), output_layouts=Replicate()),
    }
    block = {
        "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1) if sp else Replicate()),
        "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1) if sp else Replicate()),
    }
    if sp:
        top["norm"] = SequenceParallel()
        block.update({
            "attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        })
    return top, block


def parallelize(model: TinyLlama, mesh, policy, sequence_parallel: bool = False, compress: bool = True) -> TinyLlama:
    """Apply `tp_plan` with `parallelize_module` (block by block, as torchtitan does); with
    `compress`, through `compress_plan(plan, policy)`, sites named after module paths."""
    from torch.distributed.tensor.parallel import parallelize_module

    from taco_triton.integrations.dtensor import compress_plan, name_sites

    top, block = tp_plan(model, sequence_parallel)
    conv = (lambda plan: compress_plan(plan, policy)) if compress else (lambda plan: plan)  # noqa: E731
    parallelize_module(model, mesh, conv(top))
    for blk in model.layers.values():
        parallelize_module(blk, mesh, conv(block))
    if compress:
        name_sites(model)
    return model


def build_model(args, policy) -> TinyLlama:
    """`train_gpt --dtensor`'s model: built identically on every rank, then parallelized."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if args.heads % world or args.ffn % world:
        raise ValueError(f"--heads ({args.heads}) and --ffn ({args.ffn}) must be divisible by --tp ({world})")
    if args.sequence_parallel and args.seq % world:
        raise ValueError(f"--seq ({args.seq}) must be divisible by --tp ({world}) with --sequence-parallel")
    model = TinyLlama(args.layers, args.hidden, args.heads, args.ffn, args.seq)
    mesh = init_device_mesh("cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= world else "cpu",
                            (world,), mesh_dim_names=("tp",))
    return parallelize(model, mesh, policy, args.sequence_parallel)

