"""The compressing process group: plain torch.distributed calls, functional collectives, DTensor,
DDP, a TransformerEngine-shaped layer and megatron-core's group mode, on gloo ranks (CPU)."""
import os
import warnings

import pytest
import torch

from . import process_group_cases as cases
from .dist_utils import run_ranks


def _check_wire(r: dict, world: int) -> None:
    """WireStats of the group's bf16 all_reduce against the same call forwarded, and the bytes
    each process really wrote to its sockets against the inner group's own all_reduce."""
    assert r["compressed"] <= 0.52 * r["forwarded"], r
    assert r["forwarded"] == 2 * (world - 1) / world * r["nbytes"], r
    assert r["compressed_kinds"] == ["all_gather", "all_to_all", "fingerprint"], r
    assert r["socket_compressed"] <= 0.52 * r["socket_native"], r


def test_bf16_all_reduce_sends_at_most_0_52x_of_the_inner_group_at_P4():
    for r in run_ranks(cases.wire_bytes, 4):
        _check_wire(r, 4)


def test_plain_dist_calls_compress_or_forward_exactly():
    """At P=2: the wire-byte check above, then compressed results bit for bit what
    taco.all_reduce / reduce_scatter / all_gather over the inner group give (and within the
    format bound), forwarded calls bit for bit the inner group's, list/coalesced/functional
    forms, Work semantics, point-to-point and the other forwarded collectives, clear errors."""
    reports = run_ranks(cases.plain_calls, 2)
    for r in reports:
        _check_wire(r["wire"], 2)
        errors = r["errors"]
        assert "no backend for meta tensors" in errors["device"], errors
        assert "already a compressing group" in errors["twice"], errors
        assert "must be a CompressionPolicy" in errors["policy"], errors
        assert "reduce_scatter: the input must hold world_size (2) times the output's elements" in errors["reduce_scatter"]
        assert "(7,) torch.bfloat16, output (3,)" in errors["reduce_scatter"]
        assert "Cannot use ReduceOp.PREMUL_SUM with Gloo" in errors["inner_lacks"], errors
        assert "all_gather: the output must hold world_size (2) times the input's elements" in errors["all_gather"]
        # p2p: the float message compressed (about half its 6000 bytes), the int32 one forwarded
        (c0, b0), (c1, b1) = r["p2p_sends"]
        assert (c0, b0) == (False, 8000.0) and c1 and b1 <= 0.52 * 6000, r["p2p_sends"]
        assert list(r["plan"]) == ["all_reduce|forward"] and r["plan"] == reports[0]["plan"]  # one plan, every rank
        stats = r["stats"]
        # calls outside any tracked module use the bare collective name as site
        assert stats["all_reduce|forward"][1] >= 5 and stats["all_reduce|forward"][0] > stats["all_reduce|forward"][1]
        assert stats["reduce_scatter|forward"][1] >= 3 and stats["all_gather|forward"][1] >= 3


def test_compressed_group_needs_an_initialized_torch_distributed():
    from taco_triton.integrations.process_group import compressed_group

    with pytest.raises(RuntimeError, match="init_process_group"):
        compressed_group()


def test_import_taco_triton_registers_the_backend():
    """`import taco_triton` alone registers "taco" (a fresh interpreter: this one has imported
    everything), without importing Triton."""
    import subprocess
    import sys

    code = ("import sys, taco_triton, torch.distributed as dist; "
            "assert 'TACO' in dist.Backend._plugins and 'taco' in dist.Backend.backend_list; "
            "assert 'triton' not in sys.modules; print('ok')")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]


@pytest.fixture(scope="module")
def users():
    return run_ranks(cases.model_users, 2)


def test_te_shaped_layers_compress_every_call_within_its_bound(users):
    """TransformerEngine's calls (all_reduce of the row-parallel output and of the column-parallel
    dgrad, SP all_gather / reduce_scatter along dim 0 with async_op and wait) through the group:
    each collective within its format bound (checked on the ranks), about half the bytes."""
    for r in users:
        te = r["te"]
        plain, sp = te["sp=False"], te["sp=True"]
        assert plain["used"]["all_reduce"][0] == 2 and plain["forwarded_calls"] == 0
        assert sp["used"]["all_gather"][0] == 3 and sp["used"]["reduce_scatter"][0] == 2 and sp["forwarded_calls"] == 0
        for case in (plain, sp):
            assert case["wire_bytes"] <= 0.6 * case["native_bytes"], case  # fp8 of bf16 plus scales, tags and chunk padding
            assert all(0 < use <= 1 for _, use in case["used"].values()), case


def test_site_helper_names_the_module_and_direction(users):
    for r in users:
        assert r["te"]["sp=False"]["stats"] == {"fc2.all_reduce|forward": (1, 1), "fc1.all_reduce|backward": (1, 1)}
        assert r["te"]["sp=True"]["stats"] == {
            "fc1.all_gather|forward": (1, 1), "fc2.reduce_scatter|forward": (1, 1), "fc2.all_gather|backward": (1, 1),
            "fc1.all_gather|backward": (1, 1), "fc1.reduce_scatter|backward": (1, 1)}
        # exempt=["fc1.*"]: fc1's dgrad all_reduce is forwarded, fc2's output all_reduce compressed
        assert r["te"]["exempt_fc1"] == {"fc2.all_reduce|forward": (1, 1), "fc1.all_reduce|backward": (1, 0)}


def test_dtensor_and_ddp_over_a_compressing_group(users):
    for r in users:
        assert 0 < r["dtensor_matmul_bound_use"] <= 1
        ddp = r["ddp"]
        assert ddp["buckets"] >= 1 and ddp["sites"] == ["all_reduce"] and 0 < ddp["bound_use"] <= 1
        assert ddp["compressed_wire"] < 0.5 * ddp["grad_bytes"]  # FP32 gradients as FP8: about a quarter


def test_fsdp2_over_a_compressing_group(users):
    """fully_shard over DeviceMesh.from_group(compressing group): gradient reduce-scatters within
    their format bounds (parameter all-gathers exempt), and all-gathers compressed when not."""
    for r in users:
        f = r["fsdp2"]
        assert 0 < f["bound_use"] <= 1
        assert f["stats_exempt=['all_gather']"] == {"all_gather|forward": (2, 0), "all_gather|backward": (2, 0),
                                                     "reduce_scatter|backward": (2, 2)}
        assert f["stats_exempt=[]"] == {"all_gather|forward": (2, 2), "all_gather|backward": (2, 2),
                                        "reduce_scatter|backward": (2, 2)}


def test_track_sites_outside_distributed():
    from taco_triton.integrations.sites import current_site, track_sites

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Sequential(torch.nn.Linear(4, 2)))
    seen = []
    model[2][0].register_forward_hook(lambda m, a, o: seen.append(current_site("all_reduce")))
    model[2][0].weight.register_hook(lambda g: seen.append(current_site("all_reduce")))
    x = torch.ones(3, 4)
    with track_sites(model) as tracker:
        model(x).sum().backward()
        assert tracker.names == ["0", "2.0"]  # modules that own parameters
    assert seen == [("2.0.all_reduce", "forward"), ("2.0.all_reduce", "backward")]
    seen.clear()
    model(x).sum().backward()  # removed: calls use the bare collective name
    assert seen == [("all_reduce", "forward"), ("all_reduce", "backward")]
    with track_sites(model):  # a forward that raises leaves no stale site behind
        with pytest.raises(RuntimeError):
            model(torch.ones(3, 5))
        assert current_site("all_reduce") == ("all_reduce", "forward")


def test_a_pattern_that_names_no_site_warns_once():
    from taco_triton.integrations.sites import track_sites
    from taco_triton.parallel import CompressionPolicy

    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    policy = CompressionPolicy(exempt=["0.*", "layers.9.*"])
    with pytest.warns(UserWarning, match="'layers.9.\\*' matches no communication site"), \
            track_sites(model, policies=[policy]):
        pass
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        track_sites(model, policies=[policy]).remove()  # once per policy and pattern


def _have_megatron() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("megatron.core") is not None
    except (ImportError, ValueError):
        return False


@pytest.mark.skipif(not _have_megatron(), reason="megatron-core not installed (pip install 'megatron-core==0.16.1')")
def test_megatron_group_mode_matches_the_mappings_mode():
    """megatron-core's local-spec GPT at TP = 2: the group mode (groups replaced before the model
    is built) compresses the same calls with the same bytes as the mappings mode, and the loss and
    every gradient are bitwise the same; sites carry the issuing module; disable restores the
    groups. Then PP = 2 (megatron's schedule and p2p code, its DDP): the group mode with the
    pipeline group replaced sends the same compressed stage-boundary bytes as the mappings mode,
    with bitwise the same loss and gradients. Then DP = 2: megatron's DDP over the replaced
    data-parallel group, the same compressed gradient bytes and bitwise the same gradients."""
    from . import megatron_cases as mc
    from . import process_group_megatron_cases as pmc

    results = run_ranks(pmc.megatron_modes, 2, timeout_s=400, pg_timeout_s=120)
    for rr in results:
        r = rr["tp"]
        assert r["mappings_calls"] == 2 * mc.LAYERS * 2 + 2  # forward: embedding + 2 per layer; backward: 2 per layer + output
        assert r["group"] == r["mappings"] and r["group"][0] == 2 * r["mappings_calls"], r  # all_to_all + all_gather each
        assert r["loss_equal"] and r["grads_equal"], r
        fwd = {"embedding.word_embeddings.all_reduce|forward"} | {
            f"decoder.layers.{i}.{m}.all_reduce|forward" for i in range(mc.LAYERS)
            for m in ("self_attention.linear_proj", "mlp.linear_fc2")}
        bwd = {"output_layer.all_reduce|backward"} | {
            f"decoder.layers.{i}.{m}.all_reduce|backward" for i in range(mc.LAYERS)
            for m in ("self_attention.linear_qkv", "mlp.linear_fc1")}
        assert set(r["group_sites"]) == fwd | bwd, r["group_sites"]
        assert r["group_forwarded"] == ["all_reduce|forward"]  # the cross-entropy's small FP32 and MAX all-reduces
        assert "use one mode at a time" in r["both"]
        assert r["restored_tp"]
        rt = r["round_trip"]
        assert rt["swapped"] == {a: "CompressingProcessGroup" for a in ("tp", "dp", "pp")} and rt["restored"], rt
        assert "already enabled" in rt["second"], rt
    for rr in results:
        pp = rr["pp"]
        assert pp["loss_equal"] and pp["grads_equal"], pp
        calls, compressed, wire = pp["mapped_pp"]
        assert calls == compressed > 0 and pp["group_pp"] == (calls // 2, wire), pp  # mappings count sends and receives
        assert pp["pp_stats"] == {"p2p|send": (2, 2), "p2p|recv": (2, 2)}, pp  # 2 microbatches, one way each
    assert [rr["pp"]["last_stage"] for rr in results] == [False, True]
    for rr in results:
        dp = rr["dp"]
        assert dp["grads_equal"] and dp["grads_changed"], dp
        calls, compressed, wire = dp["mapped_dp"]
        assert calls == compressed == 1 and dp["group_dp"] == (2, wire), dp  # one bucket: all_to_all + all_gather
        # without overlap_grad_reduce megatron reduces in finish_grad_sync, after the backward pass:
        # outside it, the group sees direction "forward"
        assert dp["dp_stats"] == {"all_reduce|forward|all_reduce": (1, 1)}, dp


def test_a_failed_compressed_receive_keeps_raising():
    """The receive Work of a compressed message: an error of the inner receive surfaces at wait(),
    again at every later wait(), and the Work is complete (its error known) but never successful."""
    from taco_triton.integrations.process_group import _receive_work

    class Broken:
        def wait(self, timeout=None):
            raise RuntimeError("peer closed the connection")

    w = _receive_work(Broken(), torch.zeros(8, dtype=torch.uint8), torch.zeros(4), None)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="peer closed"):
            w.wait()
    assert w.is_completed() and not w.is_success() and isinstance(w.exception(), RuntimeError)


def test_forwarded_calls_wait_for_the_inner_group_before_touching_outputs():
    """Issue 28 item 1: a tensor the policy could compress but does not (an exempt site,
    default=None, forward=False) is forwarded; every kind of forwarded call, sync and async, with
    the peer entering late, gives bit for bit the inner group's outputs once waited (the list
    all_gather used to copy its flat buffer out before the inner all_gather had finished)."""
    for r in run_ranks(cases.forwarded_works, 2):
        assert r["wrong"] == [], r["wrong"]


def test_taco_as_the_default_group_trains_ddp_and_makes_compressing_subgroups():
    """dist.init_process_group("taco") (issue 33): DDP's buckets compressed within their bound and
    a few SGD steps lower the loss; dist.new_group() with or without backend="taco" makes a
    compressing group over a new gloo group; destroy_process_group works on each and destroys
    the inner groups the library made, not a caller's; monitored_barrier's limit and workaround."""
    for r in run_ranks(cases.taco_default, 2):
        assert r["ddp"]["buckets"] >= 1 and 0 < r["ddp"]["bound_use"] <= 1, r["ddp"]
        losses = r["losses"]
        assert losses[-1] < 0.8 * losses[0], losses
        assert r["train_compressed"] >= 8, r  # every step's gradient buckets
        errors = r["errors"]
        assert errors["monitored_barrier"] == "monitored_barrier is only implemented for GLOO backend.", errors
        assert "not 'cpu:taco' itself" in errors["taco_inner"], errors
        assert "pg_options of a 'taco' group must be a taco_triton GroupOptions, got int" in errors["options_type"], errors
        assert r["destroyed"]
