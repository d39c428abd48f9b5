"""Per-rank bodies of the megatron group-mode tests (module-level: spawned ranks import them).

The group mode (`integrations.megatron.enable_groups`) against the mappings mode (`enable`) on
megatron-core's local spec, at TP = 2, PP = 2 and DP = 2 on 2 gloo ranks, in one spawn.
"""
from __future__ import annotations

import math

import torch

import taco_triton as taco
from taco_triton.parallel import CompressionPolicy

from . import megatron_cases as mc
from .process_group_cases import MIN_BYTES


# ------------------------------------------------------------------------------- megatron group mode
def _compressed_bytes(ws) -> tuple[int, float]:
    return sum(c.compressed for c in ws.calls), sum(c.wire_bytes for c in ws.calls if c.compressed)


def megatron_group_mode(rank: int, world: int) -> dict:
    """megatron-core's local-spec GPT, one forward/backward step in the mappings mode (`enable`)
    and in the group mode (`enable_groups`, model built after it) from the same weights and batch,
    same uniform policy: the same compressed calls and bytes, bitwise the same loss and gradients.
    Then enable/disable round trips of the group mode (TP, DP, PP groups restored)."""
    import os

    from megatron.core import parallel_state as ps

    from taco_triton.integrations import megatron as tm

    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    out = {}
    policy = CompressionPolicy(min_bytes=MIN_BYTES)
    with tm.cpu_compat():
        mc._init(world)
        try:
            tp_orig = ps.get_tensor_model_parallel_group()
            batch = mc._batch()
            model = mc._gpt(world)
            with taco.WireStats() as ws_map, tm.enable(policy, model=model) as h:
                ref = mc._step(model, batch)
            out["mappings_calls"] = sum(s.compressed for s in h.stats.values())
            out["mappings"] = _compressed_bytes(ws_map)

            with tm.enable_groups(policy) as gh:
                assert ps.get_tensor_model_parallel_group() is gh.groups["tp"]
                model = mc._gpt(world)  # built after the groups were replaced
                gh.track(model)
                with taco.WireStats() as ws_grp:
                    got = mc._step(model, batch)
                out["group"] = _compressed_bytes(ws_grp)
                tp = gh.groups["tp"]
                out["group_sites"] = sorted(f"{s}|{d}" for (s, d, _), st in tp.stats.items() if st.compressed)
                out["group_forwarded"] = sorted(f"{s}|{d}" for (s, d, _), st in tp.stats.items()
                                                if st.calls > st.compressed)
                try:
                    tm.enable(policy).disable()
                    out["both"] = "no error"
                except RuntimeError as e:
                    out["both"] = str(e)
            out["restored_tp"] = ps.get_tensor_model_parallel_group() is tp_orig
            out["loss_equal"] = bool(torch.equal(ref["loss"], got["loss"]))
            out["grads_equal"] = mc._same(ref["grads"], got["grads"])
            out["loss"] = float(got["loss"])

            dp_orig, pp_orig = ps.get_data_parallel_group(), ps.get_pipeline_model_parallel_group()
            gh = tm.enable_groups(policy, dp=True, pp=True)
            swapped = {a: type(g).__name__ for a, g in gh.groups.items()}
            same_dp = ps.get_data_parallel_group() is ps.get_data_parallel_group(with_context_parallel=True)
            try:
                tm.enable_groups(policy)
                second = "no error"
            except RuntimeError as e:
                second = str(e)
            gh.disable()
            gh.disable()
            out["round_trip"] = {"swapped": swapped, "same_dp": same_dp, "second": second,
                                 "restored": ps.get_data_parallel_group() is dp_orig
                                 and ps.get_pipeline_model_parallel_group() is pp_orig
                                 and ps.get_tensor_model_parallel_group() is tp_orig}
        finally:
            ps.destroy_model_parallel()
    return out


def megatron_pp_group_mode(rank: int, world: int) -> dict:
    """megatron-core's pipeline (PP = 2, the example's stage, its own p2p code and schedule): one
    training step in the mappings mode and one in the group mode with the pipeline group replaced
    (pp=True), same INT8 policy: every stage-boundary message compressed in both, the same bytes,
    bitwise the same loss and gradients."""
    import argparse
    import os

    from megatron.core import parallel_state as ps

    from taco_triton.examples.train_megatron import Stage
    from taco_triton.integrations import megatron as tm

    from .megatron_3d_cases import ARGS, _grads, _step

    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    args = argparse.Namespace(**ARGS)
    policy = CompressionPolicy(default=taco.CompressionConfig(codec="int8"), min_bytes=0)
    out = {}
    with tm.cpu_compat():
        ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=world)
        try:
            x = torch.randint(0, 256, (args.batch, args.seq), generator=torch.Generator().manual_seed(11))
            batch = (x, torch.roll(x, -1, dims=1))
            mapped = _step(Stage(args, 1, world, torch.device("cpu")), batch, policy)
            with tm.enable_groups(policy, pp=True) as gh:
                stage = Stage(args, 1, world, torch.device("cpu"))  # built after the groups were replaced
                stage.model.zero_grad_buffer()
                with taco.WireStats() as ws:
                    loss = stage._run(*batch, forward_only=False)
                    stage.model.finish_grad_sync()
                grads = _grads(stage)
                pp_stats = {f"{s}|{k}": (st.calls, st.compressed) for (s, _, k), st in gh.groups["pp"].stats.items()}
            out["mapped_pp"] = mapped["axes"]["pp"]
            out["group_pp"] = (sum(st[0] for k, st in pp_stats.items() if k == "p2p|send"),
                               sum(c.wire_bytes for c in ws.calls if c.kind == "send" and c.compressed))
            out["pp_stats"] = pp_stats
            # the loss is NaN off the last stage (it has none) in both modes
            out["loss_equal"] = loss == mapped["loss"] or (math.isnan(loss) and math.isnan(mapped["loss"]))
            out["grads_equal"] = mc._same(grads, mapped["grads"])
            out["last_stage"] = ps.is_pipeline_last_stage()
        finally:
            ps.destroy_model_parallel()
    return out


def megatron_modes(rank: int, world: int) -> dict:
    """One spawn for both megatron comparisons (importing megatron-core costs most of the time)."""
    return {"tp": megatron_group_mode(rank, world), "pp": megatron_pp_group_mode(rank, world),
            "dp": megatron_dp_group_mode(rank, world)}


def megatron_dp_group_mode(rank: int, world: int) -> dict:
    """megatron-core's DDP at DP = 2 (TP = PP = 1): one training step's gradient reduction in the
    mappings mode and in the group mode with the data-parallel group replaced (dp=policy), same
    INT8 nearest-rounding DP policy: the same compressed bytes, bitwise the same gradients."""
    import argparse
    import os

    from megatron.core import parallel_state as ps

    from taco_triton.examples.train_megatron import Stage
    from taco_triton.integrations import megatron as tm

    from .megatron_3d_cases import ARGS, _grads, _step

    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    # both modes exchange the rank-agreement fingerprint on every call, so their byte counts
    # compare (by default the group mode's DP all_reduce reuses the agreement the mappings mode's
    # first call of the same signature on the same inner group made)
    os.environ["TACO_TRITON_CHECK_COLLECTIVES"] = "always"
    args = argparse.Namespace(**ARGS)
    dp = CompressionPolicy(default=taco.CompressionConfig(codec="int8"), min_bytes=0)
    tp = CompressionPolicy(default=None)
    out = {}
    with tm.cpu_compat():
        ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
        try:
            x = torch.randint(0, 256, (args.batch, args.seq), generator=torch.Generator().manual_seed(20 + rank))
            batch = (x, torch.roll(x, -1, dims=1))
            ref = _step(Stage(args, 1, 1, torch.device("cpu")), batch)
            mapped = _step(Stage(args, 1, 1, torch.device("cpu")), batch, tp, dp=dp)
            with tm.enable_groups(tp, dp=dp) as gh:
                stage = Stage(args, 1, 1, torch.device("cpu"))  # built after the groups were replaced
                stage.model.zero_grad_buffer()
                with taco.WireStats() as ws:
                    stage._run(*batch, forward_only=False)
                    stage.model.finish_grad_sync()
                grads = _grads(stage)
                ddp_group = gh.replaced["_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP"]  # what megatron's DDP reduces over
                dp_stats = {f"{s}|{d}|{k}": (st.calls, st.compressed) for (s, d, k), st in ddp_group.stats.items()}
            out["mapped_dp"] = mapped["axes"]["dp"]
            # the payload of the compressed calls plus the per-call fingerprints (the mappings mode counts both)
            out["group_dp"] = (sum(c.compressed for c in ws.calls),
                               sum(c.wire_bytes for c in ws.calls if c.compressed) + ws.fingerprint_bytes)
            out["dp_stats"] = dp_stats
            out["grads_equal"] = mc._same(grads, mapped["grads"])
            out["grads_changed"] = not mc._same(grads, ref["grads"])
        finally:
            ps.destroy_model_parallel()
    return out
