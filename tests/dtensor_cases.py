"""Per-rank bodies of tests/test_dtensor.py (module-level so spawned processes can import them).

MLP battery: the two-layer MLP of tests/parallel_cases.py (x [T, H] -> Linear -> gelu -> Linear),
parallelized by `parallelize_module` with torch's ColwiseParallel / RowwiseParallel and with our
compressed styles; sequence parallelism shards the token dim 0 (input Shard(0), output Shard(0)).
Native runs (policy None, or a policy whose default is None) must equal the torch styles' run
bit for bit (at P = 2 every sum has two terms, so the order of summation cannot differ);
every run must satisfy parallel_cases' bounds against the exact float64 model: the FP32 bound B
for native runs, B + C (C from the format's error bound on the messages actually sent,
propagated through the model) for fp8 / int8, whose error must also exceed the FP32 budget
(compression happened). One difference from our layers: DTensor adds the row-parallel bias
before the reduction, so under sequence parallelism its gradient sees the compressed all-gather
of the output gradient (C_db2 = sqrt(T) C_G instead of 0). Those bounds and their derivation are in parallel_cases' docstring.

Llama battery: the example's model under torchtitan's plan (with and without sequence
parallelism): compress_plan with every site native equals the torch plan bit for bit (loss and
every gradient); compressed, the sites, directions and collectives are the expected ones.
"""
from __future__ import annotations

import copy
import math

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import taco_triton as taco
from taco_triton.integrations.dtensor import CompressedColwiseParallel, CompressedRowwiseParallel, compress_plan

from .parallel_cases import (
    COLLECTIVE, FP8, INT8, NAMES, SLACK, T, RecordingPolicy, _all, _check, _replicated, comm_bound, data,
    dense_model, expected_sites, fp32_bounds, propagated_bounds,
)


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def mlp_plan(sp: bool, gather_output: bool, policy, compressed: bool) -> dict:
    col = dict(input_layouts=Shard(0) if sp else Replicate(), output_layouts=Replicate() if gather_output else None)
    row = dict(input_layouts=Replicate() if gather_output else None, output_layouts=Shard(0) if sp else Replicate())
    if not compressed:
        return {"0": ColwiseParallel(**col), "2": RowwiseParallel(**row)}
    return {"0": CompressedColwiseParallel(**col, policy=policy, name="fc1"),
            "2": CompressedRowwiseParallel(**row, policy=policy, name="fc2")}


def mlp_run(rank, world, mesh, model, x, gy, policy, sp, gather_output, compressed) -> dict:
    m = parallelize_module(copy.deepcopy(model), mesh, mlp_plan(sp, gather_output, policy, compressed))
    n = T // world
    xin = (x[rank * n : (rank + 1) * n] if sp else x).clone().requires_grad_()
    with taco.WireStats() as fwd:
        y = m(xin)
    with taco.WireStats() as bwd:
        y.backward(gy[rank * n : (rank + 1) * n] if sp else gy)
    assert not isinstance(y, DTensor) and y.shape == (n if sp else T, x.shape[1]), (type(y), y.shape)
    cat0 = lambda t: torch.cat(_all(t, world), 0)  # noqa: E731
    out = {
        "y": cat0(y.detach()) if sp else _replicated(y.detach(), world, "y"),
        "dx": cat0(xin.grad) if sp else _replicated(xin.grad, world, "dx"),
        "dW1": _full(m[0].weight.grad), "db1": _full(m[0].bias.grad),
        "dW2": _full(m[2].weight.grad), "db2": _full(m[2].bias.grad),
    }
    placements = [(k, p.placements) for k, p in m.named_parameters()]
    return {"out": out, "fwd": fwd, "bwd": bwd, "placements": placements}


def mlp_battery(rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    model = dense_model()
    x, gy = data()
    ex, B = fp32_bounds(model, x, gy) if rank == 0 else (None, None)
    variants = [(sp, False, mode) for sp in (False, True) for mode in ("none", "default_none", "fp8", "int8")]
    variants += [(False, True, "none"), (False, True, "fp8")]
    report = {"use": {}, "exact_vs_torch": []}
    for sp, go, mode in variants:
        label = f"P{world} sp={sp} gather_output={go} {mode}"
        cfg = {"fp8": FP8, "int8": INT8}.get(mode)
        policy = None if mode == "none" else RecordingPolicy(default=cfg, min_bytes=0)
        torch_run = mlp_run(rank, world, mesh, model, x, gy, None, sp, go, compressed=False)
        r = mlp_run(rank, world, mesh, model, x, gy, policy, sp, go, compressed=True)
        assert r["placements"] == torch_run["placements"], (label, r["placements"], torch_run["placements"])
        flags = [c.compressed for c in r["fwd"].calls], [c.compressed for c in r["bwd"].calls]
        assert all(flags) and all(f == [cfg is not None] * len(f) for f in flags), (label, r["fwd"].calls, r["bwd"].calls)
        if cfg is None:
            assert all(torch.equal(r["out"][k], torch_run["out"][k]) for k in NAMES), label
            report["exact_vs_torch"].append(label)
        comm = {}
        if policy is not None:
            everyone = [None] * world
            dist.all_gather_object(everyone, policy.sent)
            keys = {(s, d) for s, d, _ in policy.sent}
            assert keys == expected_sites(sp, go), (label, keys)
            assert len(policy.sent) == len(keys), (label, "one message per site and direction")
            if rank == 0 and cfg is not None:
                for s, d in keys:
                    msgs = [next(t for s2, d2, t in ranks if (s2, d2) == (s, d)) for ranks in everyone]
                    comm[(s, d)] = comm_bound(COLLECTIVE[(s.split(".", 1)[1], d)], msgs, cfg)
        if rank == 0:
            C = propagated_bounds(ex, comm) if comm else dict.fromkeys(NAMES, 0.0)
            # DTensor adds a rowwise bias to the partial sums (before the reduce-scatter), so its
            # gradient is the token sum of the all-gathered output gradient: sqrt(T) C_G, by
            # Cauchy-Schwarz (our layers add it after, on exact local gradients: C = 0 there).
            C["db2"] = math.sqrt(T) * comm.get(("fc2.reduce_scatter", "backward"), 0.0)
            report["use"][label] = max(_check(k, r["out"][k], ex[k], B[k], C[k], label) for k in NAMES)
            if cfg is None:  # the torch styles' own run is within the same FP32 bound
                report["use"][label + " torch"] = max(
                    _check(k, torch_run["out"][k], ex[k], B[k], 0.0, label + " torch") for k in NAMES)
            else:
                e = float((r["out"]["y"].double() - ex["y"]).norm())
                assert e > SLACK * float(B["y"].norm()), f"{label}: y error {e:.3e} within FP32 rounding: not compressed?"
    report["errors"] = error_messages(rank, world, mesh)
    return report


def error_messages(rank: int, world: int, mesh) -> dict:
    """The errors a user meets first, with the values they name."""
    model = dense_model()
    msgs = {}

    def uneven():  # a DTensor input whose token dim does not split evenly
        m = parallelize_module(copy.deepcopy(model), mesh, mlp_plan(True, False, None, True))
        m(distribute_tensor(torch.zeros(world * 2 + 1, model[0].in_features), mesh, [Shard(0)]))

    def two_d():
        mesh2 = init_device_mesh("cpu", (1, world))
        parallelize_module(copy.deepcopy(model), mesh2, {"0": CompressedColwiseParallel()})

    for key, make in {"uneven": uneven, "2d_mesh": two_d}.items():
        try:
            make()
            msgs[key] = "no error"
        except ValueError as e:
            msgs[key] = str(e)
    return msgs


# ---------------------------------------------------------------------------- the example's model
def llama_sites(layers: int, sp: bool) -> set:
    """(site, direction) of every compressed communication of one training step of TinyLlama."""
    out = set()
    for i in range(layers):
        b = f"layers.{i}"
        if sp:
            for mod, row in (("attention", "attention.wo"), ("feed_forward", "feed_forward.w2")):
                out |= {(f"{b}.{mod}.gather", d) for d in ("forward", "backward")}
                out |= {(f"{b}.{row}.reduce_scatter", d) for d in ("forward", "backward")}
        else:
            out |= {(f"{b}.attention.{w}.copy", "backward") for w in ("wq", "wk", "wv")}
            out |= {(f"{b}.feed_forward.{w}.copy", "backward") for w in ("w1", "w3")}
            out |= {(f"{b}.attention.wo.reduce", "forward"), (f"{b}.feed_forward.w2.reduce", "forward")}
    out.add(("output.gather_output", "forward"))
    if sp:  # the embedding's forward reduction is DTensor's; its backward all-gather is ours
        out |= {("output.gather", "forward"), ("output.gather", "backward"), ("tok_embeddings.reduce_scatter", "backward")}
    else:
        out.add(("output.copy", "backward"))
    return out


def llama_step(world, mesh, policy, sp: bool, compressed: bool, layers: int = 2):
    from taco_triton.examples.train_dtensor import TinyLlama, parallelize

    torch.manual_seed(0)
    m = parallelize(TinyLlama(layers, 64, 4, 128, 16), mesh, policy, sp, compress=compressed)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 256, (2, 16), generator=g), torch.randint(0, 256, (2, 16), generator=g)
    with taco.WireStats() as ws:
        loss = m.loss(x, y)
        loss.backward()
    m.sync_replicated_grads()
    grads = {k: _full(p.grad) for k, p in m.named_parameters()}
    return loss.detach(), grads, ws


def llama_battery(rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    report = {}
    for sp in (False, True):
        loss0, g0, _ = llama_step(world, mesh, None, sp, compressed=False)
        native = RecordingPolicy(default=None, min_bytes=0)
        loss1, g1, ws1 = llama_step(world, mesh, native, sp, compressed=True)
        assert torch.equal(loss0, loss1), (sp, loss0, loss1)
        assert g0.keys() == g1.keys() and all(torch.equal(g0[k], g1[k]) for k in g0), sp
        assert ws1.calls and not any(c.compressed for c in ws1.calls)
        fp8 = RecordingPolicy(min_bytes=0)
        loss2, g2, ws2 = llama_step(world, mesh, fp8, sp, compressed=True)
        keys = [(s, d) for s, d, _ in fp8.sent]
        assert set(keys) == llama_sites(2, sp), (sp, set(keys) ^ llama_sites(2, sp))
        assert len(keys) == len(set(keys)), "one message per site and direction"
        assert ws2.calls and all(c.compressed for c in ws2.calls), ws2.calls
        assert bool(torch.isfinite(loss2)) and not torch.equal(loss2, loss0)
        report[f"sp={sp}"] = {"loss_torch": float(loss0), "loss_fp8": float(loss2), "messages": len(keys)}
    return report


def compile_block(rank: int, world: int) -> dict:
    """torch.compile of a parallelized SwiGLU block (compressed styles, fp8): forward and backward
    run, give the eager run's loss, and gradients nearer the eager compressed ones than the native
    (uncompressed) ones are: the compiled backward compressed too."""
    from taco_triton.examples.train_dtensor import FeedForward
    from taco_triton.parallel import CompressionPolicy

    mesh = init_device_mesh("cpu", (world,))
    x = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(3))

    def run(policy, compile_it: bool):
        plan = compress_plan({"w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": RowwiseParallel()}, policy)
        torch.manual_seed(0)
        ff = parallelize_module(FeedForward(64, 128), mesh, plan)
        fn = torch.compile(ff) if compile_it else ff
        with taco.WireStats() as ws:
            loss = fn(x).square().sum()
            loss.backward()
        return loss.detach(), {k: _full(p.grad) for k, p in ff.named_parameters()}, ws

    native_loss, native_g, _ = run(CompressionPolicy(default=None, min_bytes=0), False)
    eager_loss, eager_g, eager_ws = run(CompressionPolicy(min_bytes=0), False)
    torch._dynamo.reset()
    loss, g, ws = run(CompressionPolicy(min_bytes=0), True)
    dist_to = lambda ref: max(float((g[k] - ref[k]).abs().max()) for k in g)  # noqa: E731
    return {"loss_equal": bool(torch.equal(loss, eager_loss)), "native_loss_differs": not torch.equal(loss, native_loss),
            "to_eager": dist_to(eager_g), "to_native": dist_to(native_g),
            "calls_eager": len(eager_ws.calls), "calls_compiled": len(ws.calls)}
