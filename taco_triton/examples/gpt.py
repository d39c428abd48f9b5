"""A small GPT built from taco_triton's tensor-parallel layers (byte vocabulary, pre-LN blocks).

Attention heads and the MLP's hidden units are split across the TP group (Megatron's scheme:
QKV and fc1 column-parallel, the output projection and fc2 row-parallel); embeddings, layer
norms and the LM head are replicated. The full QKV weight is laid out [heads, (q, k, v), head_dim]
so a contiguous slice of rows holds whole heads.

With sequence parallelism the token dimension between blocks is split across ranks: column
layers all-gather their input, row layers reduce-scatter their output, the loss is computed on
local tokens, and the replicated parameters' gradients are summed across the group
(`sync_replicated_grads`), as in Megatron.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ..parallel import ColumnParallelLinear, CompressionPolicy, RowParallelLinear


class Block(nn.Module):
    def __init__(self, i: int, d: int, heads: int, ffn: int, group, policy, sp: bool, world: int):
        super().__init__()
        if heads % world:
            raise ValueError(f"heads ({heads}) must be divisible by the TP size ({world})")
        self.heads_local, self.head_dim = heads // world, d // heads
        kw = dict(group=group, policy=policy, sequence_parallel=sp)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = ColumnParallelLinear(d, 3 * d, name=f"layers.{i}.attn.qkv", **kw)
        self.proj = RowParallelLinear(d, d, name=f"layers.{i}.attn.proj", **kw)
        self.fc1 = ColumnParallelLinear(d, ffn, name=f"layers.{i}.mlp.fc1", **kw)
        self.fc2 = RowParallelLinear(ffn, d, name=f"layers.{i}.mlp.fc2", **kw)

    def forward(self, x: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
        h = self.qkv(self.ln1(x))  # [batch*seq, heads_local * 3 * head_dim]: all tokens
        q, k, v = h.view(batch, seq, self.heads_local, 3, self.head_dim).permute(3, 0, 2, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(batch * seq, -1))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyGPT(nn.Module):
    """GPT over bytes. forward(tokens [batch, seq]) -> logits of this rank's tokens [n, 256]."""

    def __init__(self, layers=2, d=256, heads=4, ffn=1024, seq=128, group=None,
                 policy: CompressionPolicy | None = None, sequence_parallel=False):
        super().__init__()
        self.group, self.sp = group, sequence_parallel
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.tok, self.pos = nn.Embedding(256, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(i, d, heads, ffn, group, policy, sequence_parallel, self.world) for i in range(layers))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, 256)

    def local_tokens(self, n: int) -> slice:
        """The token rows this rank holds between blocks (all of them without SP)."""
        if not self.sp:
            return slice(0, n)
        if n % self.world:
            raise ValueError(f"batch*seq ({n}) must be divisible by the TP size ({self.world}) with sequence parallelism")
        m = n // self.world
        return slice(self.rank * m, (self.rank + 1) * m)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        b, s = tokens.shape
        x = (self.tok(tokens) + self.pos(torch.arange(s, device=tokens.device))).reshape(b * s, -1)
        x = x[self.local_tokens(b * s)]
        for blk in self.blocks:
            x = blk(x, b, s)
        return self.head(self.ln_f(x))

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over all tokens; with SP each rank holds its share of the sum."""
        logits = self.forward(tokens)
        t = targets.reshape(-1)[self.local_tokens(targets.numel())]
        return F.cross_entropy(logits.float(), t, reduction="sum") / targets.numel()

    def replicated_parameters(self):
        """Parameters every rank holds whole (not split by the TP layers)."""
        split = [(blk.qkv, blk.fc1, blk.proj.weight, blk.fc2.weight) for blk in self.blocks]  # row biases are whole
        tp = {id(p) for group in split for m in group for p in (m.parameters() if isinstance(m, nn.Module) else [m])}
        for p in self.parameters():
            if id(p) not in tp:
                yield p

    def sync_replicated_grads(self) -> None:
        """With SP, replicated parameters saw only local tokens: sum their grads over the group."""
        if not self.sp or self.world == 1:
            return
        grads = [p.grad for p in self.replicated_parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.group)
        for g, chunk in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(chunk.view_as(g))
