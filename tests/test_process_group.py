"""The compressing process group: plain torch.distributed calls, functional collectives, DTensor,
DDP, a TransformerEngine-shaped layer and megatron-core's group mode, on gloo ranks (CPU)."""
import pytest

from . import process_group_cases as cases
from .dist_utils import run_ranks


@pytest.mark.parametrize("world", [2, 4], ids=["P2", "P4"])
def test_bf16_all_reduce_sends_at_most_0_52x_of_the_inner_group(world):
    """WireStats of the group's all_reduce against the same call forwarded, and the bytes each
    process really wrote to its sockets against the inner group's own all_reduce."""
    for r in run_ranks(cases.wire_bytes, world):
        assert r["compressed"] <= 0.52 * r["forwarded"], r
        assert r["forwarded"] == 2 * (world - 1) / world * r["nbytes"], r
        assert r["compressed_kinds"] == ["all_gather", "all_to_all", "fingerprint"], r
        assert r["socket_compressed"] <= 0.52 * r["socket_native"], r


def test_plain_dist_calls_compress_or_forward_exactly():
    reports = run_ranks(cases.plain_calls, 2)
    for r in reports:
        errors = r["errors"]
        assert "no backend for meta tensors" in errors["device"], errors
        assert "already a compressing group" in errors["twice"], errors
        assert "must be a CompressionPolicy" in errors["policy"], errors
        assert "size" in errors, errors
        stats = r["stats"]
        # calls outside any tracked module use the bare collective name as site
        assert stats["all_reduce|forward"][1] >= 5 and stats["all_reduce|forward"][0] > stats["all_reduce|forward"][1]
        assert stats["reduce_scatter|forward"][1] >= 3 and stats["all_gather|forward"][1] >= 3


def test_compressed_group_needs_an_initialized_torch_distributed():
    from taco_triton.integrations.process_group import compressed_group

    with pytest.raises(RuntimeError, match="init_process_group"):
        compressed_group()


def test_backend_is_registered_under_its_name():
    import torch.distributed as dist

    from taco_triton.integrations import process_group

    assert process_group.BACKEND.upper() in dist.Backend._plugins
    assert process_group.BACKEND in dist.Backend.backend_list
