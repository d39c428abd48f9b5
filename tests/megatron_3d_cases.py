"""Per-rank bodies of the 3D (TP x PP, TP x DP) megatron-core integration tests: 4 gloo ranks,
the example's pipeline stage (`taco_triton.examples.train_megatron.Stage`), tiny sizes."""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import taco_triton as taco
from taco_triton.collectives import p2p
from taco_triton.integrations import megatron as tm
from taco_triton.parallel import CompressionPolicy

from .megatron_cases import _originals

ARGS = dict(layers=2, hidden=64, heads=4, ffn=128, seq=32, batch=4, microbatches=2, lr=1e-3, seed=3)


def _grads(stage) -> dict:
    return {i: p.main_grad.detach().clone() for i, p in enumerate(stage.params)}


def _step(stage, batch, policy=None, **kw):
    """One training step's loss and reduced gradients (before the optimizer), optionally routed."""
    stage.model.zero_grad_buffer()
    handle = tm.enable(policy, model=stage.gpt, **kw) if policy is not None else None
    try:
        with taco.WireStats() as ws:
            loss = stage._run(*batch, forward_only=False)
            stage.model.finish_grad_sync()
    finally:
        if handle is not None:
            handle.disable()
    axes = {a: (s.calls, s.compressed, s.wire_bytes) for a, s in handle.by_axis().items()} if handle else None
    return {"loss": loss, "grads": _grads(stage), "axes": axes, "wire": ws.wire_bytes}


def three_d(rank, world, tp, pp) -> dict:
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    from megatron.core import parallel_state as ps

    from taco_triton.examples.train_megatron import Stage

    args = argparse.Namespace(**ARGS)
    with tm.cpu_compat():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        try:
            stage = Stage(args, tp, pp, torch.device("cpu"))
            dp_rank = ps.get_data_parallel_rank()
            g = torch.Generator().manual_seed(11 + dp_rank)  # each DP replica its own batch
            x = torch.randint(0, 256, (args.batch, args.seq), generator=g)
            batch = (x, torch.roll(x, -1, dims=1))
            before = _originals()
            ref = _step(stage, batch)  # unpatched megatron-core
            off = _step(stage, batch, CompressionPolicy(default=None))
            restored = all(_originals()[k] is v for k, v in before.items())
            int8 = CompressionPolicy(default=taco.CompressionConfig(codec="int8"), min_bytes=0)
            on = _step(stage, batch, int8)  # megatron's default batched p2p (batch_isend_irecv)
            unbatched = on
            if pp > 1:
                stage.config.batch_p2p_comm = False  # megatron's individual isend/irecv instead
                try:
                    unbatched = _step(stage, batch, int8)
                finally:
                    stage.config.batch_p2p_comm = True
            flat_ref = torch.cat([g.double().view(-1) for g in ref["grads"].values()])
            flat_on = torch.cat([on["grads"][i].double().view(-1) for i in ref["grads"]])
            rel = float((flat_on - flat_ref).norm() / flat_ref.norm())
            return {"ref_loss": ref["loss"], "off_loss": off["loss"], "on_loss": on["loss"],
                    "off_grads_equal": all(torch.equal(off["grads"][i], ref["grads"][i]) for i in ref["grads"]),
                    "off_axes": off["axes"], "on_axes": on["axes"], "off_wire": off["wire"], "on_wire": on["wire"],
                    "rel_grad_change": rel, "unbatched_same": unbatched["loss"] == on["loss"] or on["loss"] != on["loss"],
                    "unbatched_grads_same": all(torch.equal(unbatched["grads"][i], on["grads"][i]) for i in on["grads"]), "restored": restored, "last_stage": ps.is_pipeline_last_stage(),
                    "dp": ps.get_data_parallel_world_size(), "rank": dist.get_rank()}
        finally:
            ps.destroy_model_parallel()


def p2p_round_trip(rank, world, cfg):
    """Rank 0 sends a bf16 tensor with outliers compressed; rank 1 returns (received == the codec's
    round trip, L2 error, the format's L2 bound)."""
    from taco_triton import bounds

    g = torch.Generator().manual_seed(5)
    x = (torch.randn(3, 2, 257, generator=g) * torch.logspace(-2, 2, 257)).bfloat16()
    if rank == 0:
        p2p.isend(x, 1, config=cfg, min_bytes=0).wait()
        return None
    out = torch.empty_like(x, requires_grad=True)  # megatron's receive buffers are autograd leaves
    p2p.irecv(out, 0, config=cfg, min_bytes=0).wait()
    c = taco.compress(x, cfg)
    return (torch.equal(out.detach(), taco.decompress(c)), float((out.detach().double() - x.double()).norm()),
            bounds.l2_error_bound(x, c, torch.bfloat16))


def _shards(stage) -> list[torch.Tensor]:
    """This DP rank's shard of every gradient bucket (what the distributed optimizer's
    reduce-scatter leaves reduced), as FP64 copies."""
    from megatron.core import parallel_state as ps

    dp, me = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    return [b.grad_data.chunk(dp)[me].double().clone() for buf in stage.model.buffers for b in buf.buckets]


def distributed_optimizer(rank, world, steps) -> dict:
    """TP2 x DP2 with the distributed optimizer's routes: bucket reduce-scatter (native, compressed,
    compressed with error feedback over `steps` repeats of one batch) and the parameter all-gather."""
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    from megatron.core import parallel_state as ps

    from taco_triton.examples.train_megatron import Stage

    args = argparse.Namespace(**ARGS)
    int8 = CompressionPolicy(default=taco.CompressionConfig(codec="int8"), min_bytes=0)
    with tm.cpu_compat():
        ps.initialize_model_parallel(tensor_model_parallel_size=2)
        try:
            stage = Stage(args, 2, 1, torch.device("cpu"), use_distributed_optimizer=True)
            g = torch.Generator().manual_seed(11 + ps.get_data_parallel_rank())
            x = torch.randint(0, 256, (args.batch, args.seq), generator=g)
            batch = (x, torch.roll(x, -1, dims=1))
            _step(stage, batch)  # the reference step: its shards are what the disabled run must equal
            ref_shards = _shards(stage)
            off = _step(stage, batch, CompressionPolicy(default=None))
            out = {"off_equal": all(torch.equal(a.double(), b) for a, b in zip(_shards(stage), ref_shards)),
                   "off_axes": off["axes"]}
            on = _step(stage, batch, int8)
            out["on_axes"] = on["axes"]
            out["on_rel"] = _rel(_shards(stage), ref_shards)

            # error feedback: what each rank sends is its gradient plus its residual minus its new
            # residual, so `steps` reductions of one batch sum to steps * exact - the residuals' sum
            # (DP alone: TP compression would change the gradients themselves)
            handle = tm.enable(dp=tm.gradient_policy(int8, error_feedback=True), model=stage.gpt, error_feedback=True)
            try:
                total = [torch.zeros_like(s) for s in ref_shards]
                for _ in range(steps):
                    stage.model.zero_grad_buffer()
                    stage._run(*batch, forward_only=False)
                    stage.model.finish_grad_sync()
                    total = [t + s for t, s in zip(total, _shards(stage))]
                residual = [r.double() for r in handle.residuals.values()]
            finally:
                handle.disable()
            dp, me = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
            for r in residual:
                dist.all_reduce(r, group=ps.get_data_parallel_group())
            expected = [steps * s - r.chunk(dp)[me] for s, r in zip(ref_shards, residual)]
            out["ef_buckets"] = len(residual)
            out["ef_identity_rel"] = _rel(total, expected)
            out["ef_compressed"] = handle.by_axis()["dp"].compressed
            out["ef_residual_share"] = float(torch.cat([r.chunk(dp)[me] for r in residual]).norm()
                                             / torch.cat(ref_shards).norm())

            # parameter all-gather: exact by default, the codec's error with compress_param_gather
            params = [p.detach().clone() for p in stage.params]
            with tm.enable(int8, model=stage.gpt) as h:
                stage.model.start_param_sync(force_sync=True)
            out["gather_native_equal"] = all(torch.equal(p, q) for p, q in zip(stage.params, params))
            out["gather_native_axes"] = (h.by_axis()["dp"].calls, h.by_axis()["dp"].compressed)
            with tm.enable(int8, model=stage.gpt, compress_param_gather=True) as h:
                stage.model.start_param_sync(force_sync=True)
            out["gather_on_axes"] = (h.by_axis()["dp"].calls, h.by_axis()["dp"].compressed)
            out["gather_on_rel"] = _rel([p.detach().double() for p in stage.params], [p.double() for p in params])
            return out
        finally:
            ps.destroy_model_parallel()


def _rel(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    a = torch.cat([t.double().view(-1) for t in got])
    b = torch.cat([t.double().view(-1) for t in want])
    return float((a - b).norm() / b.norm())
