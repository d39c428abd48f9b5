"""taco_triton.integrations.dtensor: compressed DTensor parallel styles against torch's own, on
2 gloo ranks (bodies and bounds in tests/dtensor_cases.py), plus plan conversion in one process."""
import pytest
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from taco_triton.integrations import dtensor as td
from taco_triton.parallel import CompressionPolicy

from . import dtensor_cases as cases
from .dist_utils import run_ranks


def test_styles_match_torch_styles_on_an_mlp(record_property):
    """Colwise -> gelu -> Rowwise, sequence parallelism off/on, gather_output/scatter: native runs
    equal torch's styles bit for bit; fp8 / int8 within the format-derived bound, compressed in
    both directions, at the same sites as our TP layers; outputs and parameters keep torch's placements."""
    rep = run_ranks(cases.mlp_battery, 2)[0]
    assert len(rep["exact_vs_torch"]) == 5, rep["exact_vs_torch"]
    e = rep["errors"]
    assert "fc1.gather" in e["uneven"] and "(5, 256)" in e["uneven"] and "mesh size 2" in e["uneven"], e["uneven"]
    assert "2-D mesh of shape (1, 2)" in e["2d_mesh"], e["2d_mesh"]
    record_property("max_bound_use", max(rep["use"].values()))


def test_llama_plan_with_and_without_sequence_parallel():
    """The example's Llama-style model under torchtitan's plan: compress_plan with every site native
    equals the torch plan exactly (loss, every gradient); with fp8 every expected site compresses."""
    rep = run_ranks(cases.llama_battery, 2)[0]
    assert rep["sp=False"]["messages"] == 16 and rep["sp=True"]["messages"] == 20, rep


def test_torch_compile_of_a_parallelized_block():
    """torch.compile runs a compressed SwiGLU block forward and backward (graph breaks at each
    redistribution, which runs eagerly); the result is the eager compressed one."""
    rep = run_ranks(cases.compile_block, 2)[0]
    assert rep["loss_equal"] and rep["native_loss_differs"], rep
    assert rep["to_eager"] < rep["to_native"], rep
    assert rep["calls_compiled"] == rep["calls_eager"] > 0, rep


def test_compress_plan_converts_torch_styles_and_keeps_their_arguments():
    policy = CompressionPolicy(min_bytes=0)
    out = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1))

    class MyColwise(ColwiseParallel):  # a subclass prepares inputs its own way: kept
        pass

    mine = MyColwise()
    plan = td.compress_plan({
        "a": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate(), use_local_output=False),
        "b": RowwiseParallel(output_layouts=Shard(1)),
        "n": SequenceParallel(sequence_dim=0, use_local_output=True),
        "p": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
        "o": out, "m": mine,
    }, policy)
    a, b, n, p = plan["a"], plan["b"], plan["n"], plan["p"]
    assert isinstance(a, td.CompressedColwiseParallel) and isinstance(a, ColwiseParallel)
    assert (a.input_layouts, a.output_layouts, a.use_local_output, a.policy) == ((Shard(1),), (Replicate(),), False, policy)
    assert isinstance(b, td.CompressedRowwiseParallel) and b.output_layouts == (Shard(1),) and b.use_local_output
    assert isinstance(n, td.CompressedSequenceParallel) and n.sequence_sharding == (Shard(0),) and n.use_local_output
    assert isinstance(p, td.CompressedPrepareModuleInput)
    assert p.input_layouts == (Shard(1), None) and p.desired_input_layouts == (Replicate(), None)
    assert plan["o"] is out and plan["m"] is mine
    assert isinstance(td.compress_plan(ColwiseParallel(), None), td.CompressedColwiseParallel)


@pytest.mark.parametrize("bad", [["not", "a", "plan"], 3], ids=["list", "int"])
def test_compress_plan_rejects_what_parallelize_module_would(bad):
    with pytest.raises(TypeError, match="plan must be a ParallelStyle or a dict"):
        td.compress_plan(bad, None)


def test_policy_must_be_a_compression_policy():
    with pytest.raises(TypeError, match="policy must be a CompressionPolicy or None, got str"):
        td.CompressedRowwiseParallel(policy="fp8")
    with pytest.raises(TypeError, match="got dict"):
        td.compress_plan({}, {"default": None})
