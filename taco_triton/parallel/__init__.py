"""Tensor-parallel building blocks with compressed communication (Megatron semantics).

    >>> import torch
    >>> from taco_triton.parallel import ColumnParallelLinear, CompressionPolicy, RowParallelLinear
    >>> policy = CompressionPolicy(exempt=["*.copy"])          # fp8 everywhere else
    >>> fc1 = ColumnParallelLinear(64, 256, policy=policy, name="mlp.fc1")
    >>> fc2 = RowParallelLinear(256, 64, policy=policy, name="mlp.fc2")
    >>> fc2(torch.nn.functional.gelu(fc1(torch.randn(8, 64)))).shape   # world size 1 here
    torch.Size([8, 64])

`mappings` holds the autograd functions (copy/reduce/gather/scatter), `layers` the column- and
row-parallel linear layers and their site names; `CompressionPolicy` (the per-site compression
policy, from `taco_triton.policy`) is re-exported here.
"""
from .layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    allreduce_sequence_parallel_grads,
    assign_site_names,
    init_dense_weight,
    parallel_sites,
)
from .mappings import (
    copy_to_tp_region,
    gather_from_sp_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sp_region,
    scatter_to_tp_region,
)
from ..policy import CompressionPolicy

__all__ = [
    "ColumnParallelLinear",
    "CompressionPolicy",
    "RowParallelLinear",
    "allreduce_sequence_parallel_grads",
    "assign_site_names",
    "copy_to_tp_region",
    "gather_from_sp_region",
    "gather_from_tp_region",
    "init_dense_weight",
    "parallel_sites",
    "reduce_from_tp_region",
    "reduce_scatter_to_sp_region",
    "scatter_to_tp_region",
]
