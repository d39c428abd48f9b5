"""Per-rank bodies of the 4-bit data-parallel and 6-bit pipeline tests: the parameter all-gather as
quantized weight differences, the two-level gradient reduction (megatron's DDP with and without
the distributed optimizer, torch DDP's comm hook) on 4 gloo ranks (DP = 4, emulated as 2 nodes
of 2 ranks), and INT6 pipeline messages on 2 (PP = 2)."""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import taco_triton as taco
from taco_triton import bounds
from taco_triton.integrations import megatron as tm
from taco_triton.integrations.two_level import TwoLevel, ddp_comm_hook
from taco_triton.integrations.weight_deltas import WEIGHT_DELTA_CONFIG
from taco_triton.parallel import CompressionPolicy

ARGS = dict(layers=2, hidden=64, heads=4, ffn=128, seq=32, batch=4, microbatches=2, lr=1e-3, seed=3)
#: bf16's unit roundoff (8 significant bits)
U_BF16 = 2.0**-8
#: compress every DP message whatever its size (on CPU the default keeps small ones native)
ALL_DP = dict(default=taco.CompressionConfig(codec="int8"), min_bytes=0)


def _stage(dist_opt: bool, pp: int = 1):
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    from taco_triton.examples.train_megatron import Stage

    return Stage(argparse.Namespace(**ARGS), 1, pp, torch.device("cpu"), use_distributed_optimizer=dist_opt)


def _batch(step: int):
    from megatron.core import parallel_state as ps

    g = torch.Generator().manual_seed(100 * step + ps.get_data_parallel_rank())  # each DP rank its own batch
    x = torch.randint(0, 256, (ARGS["batch"], ARGS["seq"]), generator=g)
    return x, torch.roll(x, -1, dims=1)


def _all_equal(t: torch.Tensor) -> bool:
    """Whether every rank holds the same bits of `t`."""
    bits = t.contiguous().view(-1).view(torch.uint8)
    got = [torch.empty_like(bits) for _ in range(dist.get_world_size())]
    dist.all_gather(got, bits)
    return all(torch.equal(g, got[0]) for g in got)


def weight_deltas(rank, world, steps) -> dict:
    """`steps` training steps of the distributed optimizer with the parameter all-gather as INT4
    weight differences (gradients reduced natively); per step, this rank's shard: the applied
    weights' L2 distance from the master's bf16 rounding and its bound (the last difference's
    codec bound plus one bf16 rounding), and the all-gather's wire bytes."""
    from megatron.core import parallel_state as ps

    with tm.cpu_compat():
        ps.initialize_model_parallel()
        try:
            stage = _stage(True)
            p = ps.get_data_parallel_world_size()
            handle = tm.enable(dp=CompressionPolicy(**ALL_DP, backward=False), model=stage.gpt, weight_deltas=True)
            errors, limits, wire, native = [], [], 0.0, 0
            try:
                for step in range(steps):
                    handle.reset_stats()
                    stage.model.zero_grad_buffer()
                    stage._run(*_batch(step), forward_only=False)
                    stage.model.finish_grad_sync()
                    for m, (_, g) in zip(stage.master, stage.shards):
                        m.grad = g.float()
                    stage.opt.step()
                    held = [w.clone() for w, _ in stage.shards]  # what every rank holds of this shard
                    with torch.no_grad():
                        for m, (w, _) in zip(stage.master, stage.shards):
                            w.copy_(m)
                    new = [w.clone() for w, _ in stage.shards]
                    stage.model.start_param_sync(force_sync=True)
                    applied = [w.clone() for w, _ in stage.shards]
                    err = sum(float((a.double() - n.double()).norm()) ** 2 for a, n in zip(applied, new)) ** 0.5
                    limit = 0.0
                    for h, n, a in zip(held, new, applied):
                        delta = n.float() - h.float()
                        limit += bounds.l2_error_bound(delta, taco.compress(delta, WEIGHT_DELTA_CONFIG), torch.float32)
                        limit += U_BF16 / (1 - U_BF16) * float(a.double().norm())
                    errors.append(err)
                    limits.append(limit if step else 0.0)  # the first gather is exact
                    if step:
                        wire += sum(st.wire_bytes for (site, d, kind), st in handle.stats.items() if kind == "all_gather")
                        native += sum((p - 1) * w.numel() * w.element_size() for w, _ in stage.shards)
            finally:
                handle.disable()
            buffers = torch.cat([b.param_data.view(-1) for buf in stage.model.buffers for b in buf.buckets])
            return {"identical": _all_equal(buffers), "errors": errors, "limits": limits, "wire_ratio": wire / native}
        finally:
            ps.destroy_model_parallel()


def _grads(stage, dist_opt: bool, reduce) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's unreduced bucket gradients, what the reduction left: its shards with the
    distributed optimizer, else the whole buffers), after one backward of batch 0."""
    from megatron.core import parallel_state as ps

    stage.model.zero_grad_buffer()
    stage._run(*_batch(0), forward_only=False)
    buckets = [b.grad_data for buf in stage.model.buffers for b in buf.buckets]
    local = torch.cat([b.view(-1).double() for b in buckets])
    reduce()
    p, me = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    out = [b.view(-1).chunk(p)[me] if dist_opt else b.view(-1) for b in buckets]
    return local, torch.cat([o.double() for o in out])


def two_level(rank, world, ranks_per_node, repeats) -> dict:
    """Megatron DDP at DP = 4 (2 emulated nodes of 2) with the two-level reduction: with exact
    codecs (must equal the native reduction), INT4 between nodes only (format bound, error
    feedback identity over `repeats` reductions of one gradient), and the defaults (INT8 inside,
    INT4 between: replicas identical)."""
    from megatron.core import parallel_state as ps

    out = {}
    with tm.cpu_compat():
        ps.initialize_model_parallel()
        try:
            stage = _stage(True)
            group = ps.get_data_parallel_group()
            pol = CompressionPolicy(**ALL_DP)
            for name, all_reduce in (("rs", False), ("ar", True)):
                def reduce(tl=None):
                    def run():
                        with tm.enable(dp=pol, model=stage.gpt, two_level=tl) if tl is not None else _nothing():
                            stage.model.finish_grad_sync(force_all_reduce=all_reduce)
                    return run

                # built here, by every rank: each path starts without residuals
                exact = TwoLevel(group, ranks_per_node, intra=None, inter=None)
                inter_only = TwoLevel(group, ranks_per_node, intra=None)
                default = TwoLevel(group, ranks_per_node)
                dist_opt = not all_reduce
                local, ref = _grads(stage, dist_opt, reduce())
                out[f"{name}_exact_rel"] = _rel(_grads(stage, dist_opt, reduce(exact))[1], ref)
                inter = _grads(stage, dist_opt, reduce(inter_only))[1]
                out[f"{name}_inter_rel"] = _rel(inter, ref)
                got = _grads(stage, dist_opt, reduce(default))[1]
                out[f"{name}_default_rel"] = _rel(got, ref)
                if all_reduce:
                    out["ar_default_identical"] = _all_equal(got)
                    out["ar_inter_identical"] = _all_equal(inter)
                else:  # the format bound of INT4 between nodes, exact inside (see _inter_bound)
                    every = [torch.empty_like(local) for _ in range(world)]
                    dist.all_gather(every, local)
                    out["rs_inter_limit"] = _inter_bound(every, inter_only) / float(ref.norm())
            # error feedback: `repeats` reduce-scatters of one gradient sum to repeats * exact minus the
            # residuals of the node-level senders of this rank's chunk
            ef = TwoLevel(group, ranks_per_node, intra=None)
            _, ref = _grads(stage, True, lambda: stage.model.finish_grad_sync())
            total = torch.zeros_like(ref)
            with tm.enable(dp=pol, model=stage.gpt, two_level=ef):
                for _ in range(repeats):
                    total += _grads(stage, True, lambda: stage.model.finish_grad_sync())[1]
            residual = torch.cat([r.double() for r in ef.residuals.values()])
            dist.all_reduce(residual, group=ef.inter_group)
            mine = residual.chunk(ef.nodes)[dist.get_rank(ef.inter_group)]
            out["ef_identity_rel"] = _rel(total, repeats * ref - mine)
            out["ef_residual_share"] = float(mine.norm() / ref.norm())
            out["ef_buffers"] = len(ef.residuals)
            out["dp"] = ps.get_data_parallel_world_size()
            return out
        finally:
            ps.destroy_model_parallel()


def _nothing():
    import contextlib

    return contextlib.nullcontext()


def _inter_bound(every: list[torch.Tensor], tl: TwoLevel) -> float:
    """The L2 bound of the INT4 error in this rank's chunk: each node's rank at this rank's local
    index compresses its node's exact sum of that chunk once (bounds.l2_error_bound), and the
    reduction adds the N decoded pieces."""
    from taco_triton.integrations.two_level import split_by_node

    p, me = len(every), dist.get_rank()
    members = split_by_node(list(range(p)), tl.ranks_per_node)
    n_me, l_me = next((n, node.index(me)) for n, node in enumerate(members) if me in node)
    total = 0.0
    for node in members:
        piece = sum(every[r].float() for r in node).view(p, -1)[members[n_me][l_me]]
        total += bounds.l2_error_bound(piece, taco.compress(piece, tl.inter), torch.float32)
    return total


def ddp_hook(rank, world, ranks_per_node) -> dict:
    """torch DDP over 4 ranks (2 emulated nodes) with `ddp_comm_hook`: exact codecs reproduce DDP's
    own averaging; the defaults leave every replica the same gradients and weights."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 33))
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(16, 64, generator=g), torch.randn(16, 33, generator=g)

    def grads(state=None):
        m = torch.nn.parallel.DistributedDataParallel(_copy(model))
        if state is not None:
            m.register_comm_hook(state, ddp_comm_hook)
        for _ in range(2):  # the second backward runs DDP's rebuilt buckets
            m.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
        return torch.cat([p.grad.view(-1) for p in m.parameters()])

    ref = grads()
    got_exact = grads(TwoLevel(None, ranks_per_node, intra=None, inter=None))
    got = grads(TwoLevel(None, ranks_per_node))
    return {"exact_rel": _rel(got_exact, ref), "default_rel": _rel(got, ref), "identical": _all_equal(got)}


def _copy(model):
    import copy

    return copy.deepcopy(model)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def pipeline_int6(rank, world) -> dict:
    """One step of a 2-stage pipeline, natively and with `pipeline_policy` (INT6, G=32, Hadamard):
    the PP bytes of each and the loss (last stage)."""
    from megatron.core import parallel_state as ps

    out = {}
    with tm.cpu_compat():
        ps.initialize_model_parallel(pipeline_model_parallel_size=2)
        try:
            stage = _stage(False, pp=2)
            for name, pol in (("native", CompressionPolicy(default=None)),
                              ("int6", tm.pipeline_policy(CompressionPolicy(min_bytes=0)))):
                with tm.enable(pp=pol, model=stage.gpt) as h:
                    stage.model.zero_grad_buffer()
                    out[f"{name}_loss"] = stage._run(*_batch(0), forward_only=False)
                pp = h.by_axis()["pp"]
                out[f"{name}_pp"] = (pp.calls, pp.compressed, pp.wire_bytes)
            out["last_stage"] = ps.is_pipeline_last_stage()
            return out
        finally:
            ps.destroy_model_parallel()


def weight_deltas_plain(rank, world, steps) -> dict:
    """`WeightDeltas` without megatron: a bf16 buffer of `world` shards, each rank moving its own
    FP32 master shard by a random step `steps` times and gathering (odd steps async); whether
    every rank holds the same bits, and per step this rank's error against its bound."""
    from taco_triton.integrations.weight_deltas import WeightDeltas

    m = 3000  # not a multiple of the group size: a padded last group
    g = torch.Generator().manual_seed(7)  # the same initial weights everywhere
    buf = (torch.randn(world * m, generator=g) * 0.05).bfloat16()
    mine = buf[rank * m:(rank + 1) * m]
    master = mine.float()
    wd, errors, limits = WeightDeltas(), [], []
    step_gen = torch.Generator().manual_seed(100 + rank)
    wd.all_gather(buf, mine, None, None)  # the first gather: exact
    for step in range(steps):
        master += 1e-3 * torch.randn(m, generator=step_gen)
        held = mine.clone()
        mine.copy_(master)
        new = mine.clone()
        work = wd.all_gather(buf, mine, None, wd.config, async_op=bool(step % 2))
        if work is not None:
            work.wait()
        delta = new.float() - held.float()
        errors.append(float((mine.double() - new.double()).norm()))
        limits.append(bounds.l2_error_bound(delta, taco.compress(delta, wd.config), torch.float32)
                      + U_BF16 / (1 - U_BF16) * float(mine.double().norm()))
    return {"identical": _all_equal(buf), "errors": errors, "limits": limits}


def clipped_step(rank, world) -> dict:
    """One training step at PP = 2 x DP = 2 (every axis native) with --clip-grad far below the
    gradients' norm, with and without the distributed optimizer: the global norm `Stage` computed
    (`grad_norm`), and the norm of the gradients AdamW was handed, summed here without `Stage`'s
    groups: every rank's sum of squares gathered over the world, each part of the model counted
    once (with the distributed optimizer every rank holds its own shards; without it, the DP
    replicas hold the same whole-stage gradients, so DP rank 0's alone)."""
    from megatron.core import parallel_state as ps

    from taco_triton.examples.train_megatron import Stage

    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    native = CompressionPolicy(default=None)
    out = {}
    for dist_opt in (False, True):
        with tm.cpu_compat():
            ps.initialize_model_parallel(pipeline_model_parallel_size=2)
            try:
                stage = Stage(argparse.Namespace(**ARGS, clip_grad=1e-3), 1, 2, torch.device("cpu"),
                              use_distributed_optimizer=dist_opt)
                handle = tm.enable(model=stage.gpt, tp=native, pp=native, dp=native)
                seen = []
                step = stage.opt.step

                def spy(*a, **k):
                    seen.append(sum(float(m.grad.double().square().sum()) for m in stage.master))
                    return step(*a, **k)

                stage.opt.step = spy
                try:
                    stage.train_step(*_batch(0))
                finally:
                    handle.disable()
                counted = dist_opt or ps.get_data_parallel_rank() == 0
                parts: list = [None] * world
                dist.all_gather_object(parts, seen[0] if counted else 0.0)
                out[dist_opt] = {"grad_norm": stage.grad_norm, "clipped_norm": sum(parts) ** 0.5}
            finally:
                ps.destroy_model_parallel()
    return out
