"""Two-level gradient reduction: 8 bits inside a node, 4 bits between nodes (SDP4Bit's scheme,
arXiv 2410.15526), composed from the compressed collectives on two kinds of subgroups.

A data-parallel group of P = N x L ranks, L on each of N nodes, reduces a gradient in two steps:

1. inside each node, a compressed reduce-scatter (default INT8, G=128, Hadamard, stochastic
   rounding) leaves local rank l with its node's sum of the N chunks that ranks at local index l
   own (chunk c belongs to group rank c, as in torch's and megatron's reduce-scatter);
2. between nodes, the L groups of ranks at one local index each reduce those N chunks (default
   INT4, G=32, Hadamard, nearest rounding, with error feedback: each rank's residual of this
   quantization is added to the next reduction of the same buffer), by reduce-scatter (chunk c
   ends on its owner) or all-reduce.

An all-reduce then all-gathers the node's pieces inside the node (the intra codec, nearest
rounding, so the gathered bits are the same on every node), and every rank ends with the same
bits. One node (N = 1) runs the first step only; one rank per node (L = 1) the second only; which
codec each step uses is the caller's (`TwoLevel(intra=..., inter=...)`, None: exact).

The node boundary: rank r's node is r // ranks_per_node, as torchrun places consecutive ranks on
a node (``LOCAL_WORLD_SIZE`` is ranks_per_node; that is the default); with a device mesh
``init_device_mesh("cuda", (nodes, ranks_per_node))`` the same split is the mesh's first
dimension. Every node must hold the same number of the group's ranks. On CPU, pass
ranks_per_node to emulate nodes with rank groups.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ..collectives import compressed as coll
from ..config import CompressionConfig
from .residuals import feed_back

INTRA_CONFIG = CompressionConfig(codec="int8", group_size=128, hadamard=True, rounding="stochastic")
"""Inside a node: INT8 after the block Hadamard transform, stochastic rounding (unbiased)."""
INTER_CONFIG = CompressionConfig(codec="int4", group_size=32, hadamard=True)
"""Between nodes: INT4, G=32, Hadamard, nearest rounding (error feedback carries what it drops)."""
_EXACT = CompressionConfig(enabled=False)
_OPS = ("sum", "avg")


def ranks_per_node_from_env() -> int:
    """``LOCAL_WORLD_SIZE`` (set by torchrun), else ValueError: pass ranks_per_node."""
    value = os.environ.get("LOCAL_WORLD_SIZE")
    if value is None or not value.isdigit() or int(value) < 1:
        raise ValueError(f"two-level reduction needs ranks_per_node or LOCAL_WORLD_SIZE (torchrun sets it), "
                         f"got LOCAL_WORLD_SIZE={value!r}")
    return int(value)


def split_by_node(ranks: list[int], ranks_per_node: int) -> list[list[int]]:
    """The group's global `ranks` as nodes (ascending), each its ranks in ascending order;
    ValueError unless every node holds the same number of them."""
    nodes: dict[int, list[int]] = {}
    for r in sorted(ranks):
        nodes.setdefault(r // ranks_per_node, []).append(r)
    members = [nodes[n] for n in sorted(nodes)]
    if len({len(m) for m in members}) != 1:
        raise ValueError(f"two-level reduction needs the same number of the group's ranks on every node; ranks "
                         f"{sorted(ranks)} with {ranks_per_node} per node give {[len(m) for m in members]}")
    return members


class TwoLevel:
    """A two-level reduction over `group` (see the module). Collective over the default group:
    every rank of the world creates it at the same point, for its own `group` (the subgroups of
    every group the ranks name are created everywhere, in one order, as ``new_group`` requires).

    Args:
        group: the reducing process group (None: the world).
        ranks_per_node: ranks per node (None: ``LOCAL_WORLD_SIZE``).
        intra: the codec inside a node (None: exact).
        inter: the codec between nodes (None: exact).
        error_feedback: carry each buffer's residual of the between-node quantization (needs
            nearest rounding there).
    """

    def __init__(self, group=None, ranks_per_node: int | None = None, *, intra: CompressionConfig | None = INTRA_CONFIG,
                 inter: CompressionConfig | None = INTER_CONFIG, error_feedback: bool = True):
        self.ranks_per_node = ranks_per_node if ranks_per_node is not None else ranks_per_node_from_env()
        self.intra = intra if intra is not None else _EXACT
        self.inter = inter if inter is not None else _EXACT
        self.error_feedback = error_feedback and self.inter.enabled
        if self.error_feedback and self.inter.stochastic:
            raise ValueError(f"error feedback needs nearest rounding between nodes, got inter={inter}")
        self.ranks = tuple(dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size()))
        named: list = [None] * dist.get_world_size()
        dist.all_gather_object(named, self.ranks)
        me = dist.get_rank()
        for ranks in sorted(set(named)):  # the same subgroups, in the same order, on every rank
            members = split_by_node(list(ranks), self.ranks_per_node)
            intra = [dist.new_group(node) for node in members]
            inter = [dist.new_group([node[j] for node in members]) for j in range(len(members[0]))]
            if ranks == self.ranks:
                n, self.local = next((n, node.index(me)) for n, node in enumerate(members) if me in node)
                self.nodes, self.per_node = len(members), len(members[0])
                self.intra_group, self.inter_group = intra[n], inter[self.local]
                # group ranks (chunk owners) in the order the intra-node reduce-scatter lays them out:
                # local index first, then node
                position = {r: i for i, r in enumerate(sorted(ranks))}
                self.order = torch.tensor([position[members[n][j]] for j in range(self.per_node)
                                           for n in range(self.nodes)])
        #: {key: FP32 residual of the between-node quantization}
        self.residuals: dict = {}

    def serves(self, group) -> bool:
        """Whether `group` has the ranks this reduction was built for."""
        return tuple(dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())) \
            == self.ranks

    def _node_sums(self, rows: torch.Tensor, op: str) -> torch.Tensor:
        """Step 1: this rank's node's sum of the chunks its local index owns ([N x chunk], node order)."""
        x = rows.index_select(0, self.order.to(rows.device)).view(-1)  # a copy: local index first
        if self.per_node == 1:
            return x
        out = torch.empty(x.numel() // self.per_node, dtype=x.dtype, device=x.device)
        coll.reduce_scatter(out, x, self.intra_group, self.intra, op, min_bytes=0)
        return out

    def _feed_back(self, s: torch.Tensor, key) -> None:
        if self.error_feedback and self.nodes > 1:
            feed_back(self.residuals, key, s, self.inter, self.nodes, f"two-level reduction of {key}")

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str = "sum", key=None) -> None:
        """`output` (this rank's chunk, 1/P of `input`) = the reduction of every rank's chunk, like
        `dist.reduce_scatter_tensor`; `key` names the buffer's residual (default: `input`'s storage)."""
        p = len(self.ranks)
        _check(op, input.numel() % p == 0 and output.numel() * p == input.numel(),
               f"reduce_scatter needs input = {p} x output elements, got {input.numel()} and {output.numel()}")
        s = self._node_sums(input.reshape(p, -1), op)
        self._feed_back(s, key if key is not None else (input.data_ptr(), input.numel()))
        if self.nodes == 1:
            output.view(-1).copy_(s)
            return
        out = torch.empty(output.numel(), dtype=s.dtype, device=s.device)
        coll.reduce_scatter(out, s, self.inter_group, self.inter, op, min_bytes=0)
        output.view(-1).copy_(out)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", key=None) -> None:
        """In place, like `dist.all_reduce`; every rank ends with the same bits. Any size (the
        message is padded to a multiple of P); `key` names the buffer's residual."""
        p, n = len(self.ranks), tensor.numel()
        _check(op, True, "")
        chunk = -(-n // p)
        rows = torch.zeros(p * chunk, dtype=tensor.dtype, device=tensor.device)
        rows[:n] = tensor.reshape(-1)
        s = self._node_sums(rows.view(p, chunk), op)
        self._feed_back(s, key if key is not None else (tensor.data_ptr(), n))
        if self.nodes > 1:
            coll.all_reduce(s, self.inter_group, self.inter, op, min_bytes=0)
        if self.per_node > 1:
            gathered = torch.empty(p * chunk, dtype=s.dtype, device=s.device)
            # nearest rounding: identical inputs give identical bits on every node
            coll.all_gather(gathered, s, self.intra_group, self.intra.replace(rounding="nearest"), min_bytes=0)
            s = gathered
        rows.view(p, chunk).index_copy_(0, self.order.to(rows.device), s.view(p, chunk))
        tensor.copy_(rows[:n].view(tensor.shape))


def ddp_comm_hook(state: TwoLevel, bucket):  # no annotations: DDP compares them with its own objects
    """A ``torch.nn.parallel.DistributedDataParallel`` communication hook averaging each gradient
    bucket with `state`'s two-level reduction (residuals keyed by the bucket's index and size):
    ``ddp.register_comm_hook(TwoLevel(ranks_per_node=8), ddp_comm_hook)``. It reduces when DDP
    hands it the bucket and returns a completed future (no overlap with the rest of the backward)."""
    t = bucket.buffer()
    state.all_reduce(t, "avg", key=("ddp", bucket.index(), t.numel()))
    fut = torch.futures.Future()
    fut.set_result(t)
    return fut


def _check(op: str, ok: bool, what: str) -> None:
    if op not in _OPS:
        raise ValueError(f"two-level reduction supports op in {_OPS}, got {op!r}")
    if not ok:
        raise ValueError(what)
