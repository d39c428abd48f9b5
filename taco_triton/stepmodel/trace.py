"""The communications of one micro-batch, taken from the code that issues them.

TP: one transformer layer is built from `taco_triton.parallel`'s column- and row-parallel layers
(megatron's scheme: qkv and fc1 column-parallel, the attention projection and fc2 row-parallel)
on the meta device, and its forward and backward run with the layers' own mappings; their
collectives are recorded instead of issued (`_Recorder` stands in for the collectives module, the
group's world size is the layout's TP degree). Each message is decided by
`taco_triton.policy.decide`, called by the mappings as in training, so `exempt`, `overrides`,
`forward` / `backward` and `min_bytes` apply as they do there. Meta tensors hold no data: nothing
is computed or sent, and the policy is never shown a sample (`observe=False`).
The vocabulary-parallel embedding and output layer are traced the same way (megatron's
`reduce_from_tp` of the embedding output, the output layer's column-parallel input).

PP: megatron's stage-boundary send of the activation (forward) and of its gradient (backward),
decided with `decide` at the megatron integration's site names and sized with `p2p.wire_like`.
DP: megatron's gradient buckets, decided with `decide` at `megatron.dp.bucket<k>.<collective>`;
the parameter all-gather of the distributed optimizer stays native, as the integration keeps it.
"""
from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass
from unittest import mock

import torch
from torch import nn

from ..collectives import p2p
from ..config import CompressionConfig
from ..parallel import layers as _layers
from ..parallel import mappings as _mappings
from ..parallel.layers import ColumnParallelLinear, RowParallelLinear
from ..policy import CompressionPolicy, decide
from .spec import Layout, ModelSpec

__all__ = ["Comm", "dp_comms", "pp_comms", "tp_comms"]

_META = torch.device("meta")


@dataclass(frozen=True)
class Comm:
    """One communication of a micro-batch (TP, PP) or of a step (DP), as its code issues it."""

    axis: str
    """"tp", "pp" or "dp"."""
    collective: str
    """all_reduce, all_gather, reduce_scatter or send."""
    direction: str
    """"forward" or "backward" (the policy's direction)."""
    site: str
    """The site name the policy decided it at."""
    numel: int
    """Elements of the whole message (all_gather: the output; reduce_scatter: the input)."""
    dtype: torch.dtype
    """The message's dtype."""
    ranks: int
    """Processes in the group."""
    config: CompressionConfig | None
    """The config it travels with; None: native."""


class _Recorder:
    """Stands in for `taco_triton.collectives.compressed` in the TP mappings: records each call
    with the site and direction of the decision just made for it."""

    def __init__(self, ranks: int):
        self.ranks, self.comms, self._site = ranks, [], None

    def decide(self, policy, site, direction, tensor, *, nbytes=None, ranks=2, compressible=True, observe=True):
        self._site = (site, direction)
        return decide(policy, site, direction, tensor, nbytes=nbytes, ranks=ranks, compressible=compressible,
                      observe=False)

    def _record(self, kind, tensor, numel, config):
        site, direction = self._site
        self._site = None
        cfg = config if config is not None and config.enabled else None
        self.comms.append(Comm("tp", kind, direction, site, int(numel), tensor.dtype, self.ranks, cfg))

    def all_reduce(self, tensor, group=None, config=None, op="sum", async_op=False, **kw):
        self._record("all_reduce", tensor, tensor.numel(), config)

    def reduce_scatter(self, output, input_, group=None, config=None, op="sum", async_op=False, **kw):
        self._record("reduce_scatter", input_, input_.numel(), config)

    def all_gather(self, output, input_, group=None, config=None, async_op=False, **kw):
        self._record("all_gather", input_, output.numel(), config)


@contextlib.contextmanager
def _recording(ranks: int):
    """The TP mappings and layers see a group of `ranks` processes (this one rank 0) and record
    their collectives. Module globals are swapped while the block runs: not thread-safe."""
    rec = _Recorder(ranks)
    with contextlib.ExitStack() as stack:
        for mod in (_mappings, _layers):
            stack.enter_context(mock.patch.object(mod, "tp_world_size", lambda group=None: ranks))
            stack.enter_context(mock.patch.object(mod, "tp_rank", lambda group=None: 0))
        stack.enter_context(mock.patch.object(_mappings, "_coll", rec))
        stack.enter_context(mock.patch.object(_mappings, "decide", rec.decide))
        yield rec


class _Layer(nn.Module):
    """The communication skeleton of one transformer layer: megatron's four parallel linear
    layers in order, with attention and the activation reduced to the slices that keep each
    tensor's shape (they do not communicate)."""

    def __init__(self, i: int, spec: ModelSpec, layout: Layout, policy):
        super().__init__()
        h, p = spec.hidden, layout.tp
        kw = dict(policy=policy, sequence_parallel=layout.sequence_parallel, bias=False, dtype=spec.dtype,
                  device=_META, skip_init=True)
        self.qkv = ColumnParallelLinear(h, h + 2 * spec.kv_dim, name=f"layers.{i}.attn.qkv", **kw)
        self.proj = RowParallelLinear(h, h, name=f"layers.{i}.attn.proj", **kw)
        self.fc1 = ColumnParallelLinear(h, (2 if spec.gated_mlp else 1) * spec.ffn, name=f"layers.{i}.mlp.fc1", **kw)
        self.fc2 = RowParallelLinear(spec.ffn, h, name=f"layers.{i}.mlp.fc2", **kw)
        self.q_local, self.f_local = h // p, spec.ffn // p

    def forward(self, x):
        x = x + self.proj(self.qkv(x)[..., : self.q_local])  # attention: [t, q heads / P] into proj
        return x + self.fc2(self.fc1(x)[..., : self.f_local])


def _regathers(comms: list[Comm], policy, ranks: int) -> list[Comm]:
    """Megatron-core's backward re-gather of a column-parallel layer's sequence-parallel input
    (for the weight gradient): one all-gather per forward gather, at site "<layer>.regather",
    decided in the backward direction (the megatron integration routes it as a backward
    all-gather of the linear layer)."""
    out = []
    for c in comms:
        if c.collective == "all_gather" and c.direction == "forward" and c.site.endswith(".gather"):
            site = c.site[: -len("gather")] + "regather"
            shard = torch.empty(c.numel // ranks, dtype=c.dtype, device=_META)
            cfg = decide(policy, site, "backward", shard, nbytes=c.numel * shard.element_size(), ranks=ranks,
                         observe=False)
            out.append(Comm("tp", "all_gather", "backward", site, c.numel, c.dtype, ranks, cfg))
    return out


def _run(module_fn, x: torch.Tensor) -> None:
    y = module_fn(x)
    torch.autograd.backward(y, torch.empty_like(y))


def tp_comms(spec: ModelSpec, layout: Layout, policy, layer_ids, *, first: bool = False,
             last: bool = False) -> list[Comm]:
    """The TP communications of one micro-batch through layers `layer_ids` (and the embedding
    on the first stage, the output layer on the last, when they are vocabulary-parallel).

    Args:
        spec: the model.
        layout: the layout (its tp, sequence_parallel, sp_regather).
        policy: the TP policy (anything `decide` takes; None: native).
        layer_ids: the global indices of the layers (they name the sites).
        first: the stage holds the embedding.
        last: the stage holds the output layer.

    Returns:
        The `Comm`s in issue order (forward, then backward); none when tp is 1.

    Raises:
        ValueError: a width the TP degree does not divide (from the layers).
    """
    p, sp = layout.tp, layout.sequence_parallel
    if p == 1:
        return []
    t = spec.tokens
    if sp and t % p:
        raise ValueError(f"sequence parallelism needs b x s ({t}) divisible by tp ({p})")
    rows = t // p if sp else t
    if policy is None:  # the mappings decide nothing without a policy: one that keeps every site native
        policy = CompressionPolicy(default=None)
    with _recording(p) as rec:
        for i in layer_ids:
            x = torch.empty(rows, spec.hidden, dtype=spec.dtype, device=_META, requires_grad=True)
            _run(_Layer(i, spec, layout, policy), x)
        if spec.parallel_embedding and first:  # the partial lookups are summed (or reduce-scattered)
            x = torch.empty(t, spec.hidden, dtype=spec.dtype, device=_META, requires_grad=True)
            fn = _mappings.reduce_scatter_to_sp_region if sp else _mappings.reduce_from_tp_region
            _run(lambda v: fn(v, "embedding." + ("reduce_scatter" if sp else "reduce"), policy), x)
        if spec.parallel_embedding and last:
            out = ColumnParallelLinear(spec.hidden, spec.padded_vocab(p), policy=policy, sequence_parallel=sp,
                                       bias=False, name="output_layer", dtype=spec.dtype, device=_META, skip_init=True)
            _run(out, torch.empty(rows, spec.hidden, dtype=spec.dtype, device=_META, requires_grad=True))
        comms = rec.comms
    if sp and layout.sp_regather:
        comms = comms + _regathers(comms, policy, p)
    return comms


def pp_comms(spec: ModelSpec, layout: Layout, policy, stage: int) -> list[tuple[Comm, int]]:
    """The stage-boundary sends of one micro-batch from `stage`: the activation to the next
    stage (forward), its gradient to the previous one (backward), once per model chunk; with
    interleaving (`virtual_pp` > 1) the last stage also sends forward to the first and the first
    backward to the last, one chunk fewer.

    Args:
        spec: the model.
        layout: the layout.
        policy: the PP policy.
        stage: the pipeline rank.

    Returns:
        (Comm, sends per micro-batch) pairs (numel: the dense message; the wire size is
        `pp_wire_bytes`); none when pp is 1.
    """
    if layout.pp == 1:
        return []
    rows = spec.tokens // layout.tp if layout.sequence_parallel else spec.tokens
    x = torch.empty(rows, spec.hidden, dtype=spec.dtype, device=_META)
    v, out = layout.virtual_pp, []
    for direction, peer in (("forward", stage + 1), ("backward", stage - 1)):
        sends = v if 0 <= peer < layout.pp else v - 1
        if sends == 0:
            continue
        site = f"megatron.pp.{direction}.stage{stage}_to_stage{peer % layout.pp}"
        cfg = decide(policy, site, direction, x, ranks=layout.pp, observe=False)
        out.append((Comm("pp", "send", direction, site, x.numel(), x.dtype, 2, cfg), sends))
    return out


def pp_wire_bytes(comm: Comm) -> int:
    """Bytes a stage-boundary send puts on the wire: the dense tensor, or `p2p.wire_like`'s buffer."""
    if comm.config is None:
        return comm.numel * comm.dtype.itemsize
    return p2p.wire_like(torch.empty(comm.numel, dtype=comm.dtype, device=_META), comm.config).numel()


def dp_comms(spec: ModelSpec, layout: Layout, policy, stage_layers: int, *, first: bool, last: bool) -> list[Comm]:
    """The DP communications of one step on a stage: the gradient buckets (all-reduce, or
    reduce-scatter with the distributed optimizer), then its parameter all-gather (native).

    Args:
        spec: the model.
        layout: the layout.
        policy: the DP policy.
        stage_layers: layers on the stage.
        first: the stage holds the embedding.
        last: the stage holds the output layer.

    Returns:
        The `Comm`s; none when dp is 1.
    """
    if layout.dp == 1:
        return []
    n = stage_layers * spec.layer_params() // layout.tp
    vocab = spec.padded_vocab(layout.tp) // layout.tp if spec.parallel_embedding else spec.vocab
    n += (first + last) * vocab * spec.hidden  # untied embedding and output weights
    dtype = torch.float32 if layout.grad_reduce_in_fp32 else spec.dtype
    kind = "reduce_scatter" if layout.distributed_optimizer else "all_reduce"
    out = []
    for k in range(math.ceil(n / layout.bucket_elems)):
        numel = min(layout.bucket_elems, n - k * layout.bucket_elems)
        numel += -numel % layout.dp  # megatron pads each bucket to a multiple of dp
        site = f"megatron.dp.bucket{k}.{kind}"
        g = torch.empty(numel, dtype=dtype, device=_META)
        out.append(Comm("dp", kind, "backward", site, numel, dtype, layout.dp,
                        decide(policy, site, "backward", g, ranks=layout.dp, observe=False)))
        if layout.distributed_optimizer:
            out.append(Comm("dp", "all_gather", "forward", f"megatron.dp.bucket{k}.all_gather", numel, spec.dtype,
                            layout.dp, None))
    return out


_LAYER = re.compile(r"(^|\.)layers\.\d+\.")


def site_pattern(site: str) -> str:
    """`site` with its layer index replaced by `*` (the rows of every layer share it)."""
    return _LAYER.sub(r"\1layers.*.", site)
