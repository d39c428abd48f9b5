"""Tensor-parallel layers and mappings: dense-reference equivalence (native and compressed, with and
without sequence parallelism) on P gloo ranks, plus the single-process edges.

The bounds and their derivation are in tests/parallel_cases.py's docstring.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import taco_triton.parallel as tp
from taco_triton.parallel import ColumnParallelLinear, RowParallelLinear

from . import parallel_cases as cases
from .dist_utils import run_ranks


@pytest.mark.parametrize("world", [2, 3], ids=["TP2", "TP3"])
def test_mlp_matches_dense_reference(world, record_property):
    """Column -> gelu -> Row vs the dense model: y, dx, dW1, db1, dW2, db2 at TP=world, sequence
    parallelism off/on, policy None / default=None (FP32 summation-order bound, elementwise) and fp8 /
    int8 / int6 (format-derived L2 bound, and the error must exceed FP32's), plus gather_output/scatter."""
    reports = run_ranks(cases.mlp_battery, world)
    rep = reports[0]
    assert all(r["init_same_for_any_p"] for r in reports)
    e = rep["errors"]
    assert f"out_features={world * 64 + 1}" in e["column"] and f"size {world}" in e["column"], e["column"]
    assert f"in_features={world * 64 + 1}" in e["row"] and f"size {world}" in e["row"], e["row"]
    assert f"({world * 4 + 1}, 8)" in e["sp_tokens"] and "fc2.reduce_scatter" in e["sp_tokens"], e["sp_tokens"]
    assert f"({world * 2 + 1}, {cases.H})" in e["sp_layer_tokens"], e["sp_layer_tokens"]
    assert f"= {cases.FFN // world}" in e["row_input"] and "last dim 384" in e["row_input"], e["row_input"]
    n_variants = 2 * 5 + 2
    assert len(rep["use"]) == n_variants + 1, sorted(rep["use"])
    record_property("max_bound_use", max(rep["use"].values()))
    record_property("compressed_bound_use", rep["comm_share"])


def test_world_size_one_is_plain_linear():
    """Without torch.distributed every mapping is the identity and the layers are nn.Linear."""
    torch.manual_seed(0)
    model = cases.dense_model(3)
    x = torch.randn(7, cases.H, requires_grad=True)
    policy = tp.CompressionPolicy(min_bytes=0)
    fc1 = ColumnParallelLinear.from_dense(model[0], policy=policy, name="fc1")
    fc2 = RowParallelLinear.from_dense(model[2], policy=policy, name="fc2")
    y = fc2(F.gelu(fc1(x)))
    want = F.linear(F.gelu(model[0](x)), model[2].weight) + model[2].bias  # Row adds its bias last
    assert torch.equal(y, want)
    g = torch.randn_like(y)
    (gx,) = torch.autograd.grad(y, x, g)
    (wx,) = torch.autograd.grad(want, x, g)
    assert torch.equal(gx, wx)
    for f in (tp.copy_to_tp_region, tp.reduce_from_tp_region, tp.gather_from_sp_region,
              tp.reduce_scatter_to_sp_region, tp.gather_from_tp_region, tp.scatter_to_tp_region):
        assert f(x, "s", policy) is x


def test_default_init_is_seeded_and_slices_the_full_matrix():
    a = ColumnParallelLinear(16, 32, name="a")
    assert torch.equal(a.weight, tp.init_dense_weight(32, 16, seed=a.seed))
    assert torch.equal(a.bias, torch.zeros(32))
    assert a.seed != ColumnParallelLinear(16, 32, name="b").seed  # names seed differently
    assert torch.equal(RowParallelLinear(16, 32, seed=5).weight, tp.init_dense_weight(32, 16, seed=5))
    state = torch.get_rng_state()
    c = ColumnParallelLinear(16, 32, init_method=lambda w: nn.init.normal_(w, std=0.02), seed=9)
    assert torch.equal(torch.get_rng_state(), state), "init_method must not move the global RNG"
    torch.manual_seed(9)
    assert torch.equal(c.weight, nn.init.normal_(torch.empty(32, 16), std=0.02))
    assert ColumnParallelLinear(16, 32, dtype=torch.bfloat16).weight.dtype == torch.bfloat16


def test_sites_and_names():
    m = nn.Sequential(
        ColumnParallelLinear(8, 16, gather_output=True), nn.GELU(), RowParallelLinear(16, 8, input_is_parallel=False),
        ColumnParallelLinear(8, 16, sequence_parallel=True), RowParallelLinear(16, 8, sequence_parallel=True, name="out"),
    )
    assert tp.parallel_sites(tp.assign_site_names(m)) == [
        "0.copy", "0.gather_output", "2.scatter", "2.reduce", "3.gather", "out.reduce_scatter"]
    assert m[4].bias.sequence_parallel and not hasattr(m[2].bias, "sequence_parallel")


def test_clear_errors_single_process():
    lin = nn.Linear(8, 16)
    with pytest.raises(ValueError, match=r"weight shape \(16, 8\), expected \(16, 9\)"):
        ColumnParallelLinear(9, 16).load_dense_(lin.weight, lin.bias)
    with pytest.raises(ValueError, match="bias given=False but the layer has bias=True"):
        RowParallelLinear(8, 16).load_dense_(lin.weight)
    with pytest.raises(ValueError, match="last dim 9, expected 8"):
        ColumnParallelLinear(8, 16)(torch.zeros(2, 9))
    with pytest.raises(ValueError, match="gather_output=True is not supported with sequence_parallel"):
        ColumnParallelLinear(8, 16, sequence_parallel=True, gather_output=True)
    with pytest.raises(ValueError, match="sequence_parallel=True needs input_is_parallel=True"):
        RowParallelLinear(8, 16, sequence_parallel=True, input_is_parallel=False)
    with pytest.raises(ValueError, match="out_features must be a positive int, got 0"):
        ColumnParallelLinear(8, 0)
    with pytest.raises(TypeError, match="site must be a str"):
        tp.copy_to_tp_region(torch.zeros(2), None)
