"""Per-rank bodies of the megatron-core integration tests (module-level: spawned ranks import them).

Everything runs on gloo/CPU at TP = world size, inside `cpu_compat()`. One spawn runs every part
(`all_parts`), because starting ranks and importing megatron-core costs most of the time.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

import taco_triton as taco
from taco_triton.integrations import megatron as tm
from taco_triton.parallel import CompressionPolicy

from .collective_cases import two_quantization_bound

SEQ, BATCH, HIDDEN, HEADS, LAYERS, VOCAB = 32, 2, 64, 4, 2, 128
#: Weight init std of the tiny GPT: large enough that logits are far from uniform, so the loss is
#: sensitive to activation errors (with megatron's 0.02 the loss is ln(VOCAB) whatever happens).
INIT_STD = 0.2
SEED = 1234

FWD_MODULES = ["embedding.word_embeddings"] + [
    f"decoder.layers.{i}.{m}" for i in range(LAYERS) for m in ("self_attention.linear_proj", "mlp.linear_fc2")
]
BWD_MODULES = [
    f"decoder.layers.{i}.{m}" for i in range(LAYERS) for m in ("self_attention.linear_qkv", "mlp.linear_fc1")
] + ["output_layer"]
FWD_SITES = sorted(f"megatron.{m}.reduce_from_tp.all_reduce" for m in FWD_MODULES)
BWD_SITES = sorted(f"megatron.{m}.linear.all_reduce" for m in BWD_MODULES)


class RecordingPolicy(CompressionPolicy):
    """A CompressionPolicy that keeps (site, direction, copy of the input) of every observed call.

    `tamper(site, direction, tensor)`, if set, may change the tensor in place after it was
    recorded (simulates a collective that corrupts its input)."""

    def observe(self, site, direction, tensor):
        self.__dict__.setdefault("records", []).append((site, direction, tensor.detach().clone()))
        tamper = self.__dict__.get("tamper")
        if tamper is not None:
            tamper(site, direction, tensor)
        super().observe(site, direction, tensor)


# ---------------------------------------------------------------------------------------- set-up
def _init(world):
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    model_parallel_cuda_manual_seed(SEED, inference_rng_tracker=True)


def _config(world, **kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, tensor_model_parallel_size=world,
        use_cpu_initialization=True, gradient_accumulation_fusion=False, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=INIT_STD, **kw,
    )


def _gpt(world):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    torch.manual_seed(SEED)
    return GPTModel(config=_config(world), transformer_layer_spec=get_gpt_layer_local_spec(),
                    vocab_size=VOCAB, max_sequence_length=SEQ)


def _batch():
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    pos = torch.arange(SEQ).expand(BATCH, SEQ)
    mask = torch.triu(torch.ones(SEQ, SEQ), diagonal=1).bool()[None, None]  # True = masked
    return tokens, pos, mask, torch.roll(tokens, -1, dims=1)


class _DistCounter:
    """Counts torch.distributed.all_reduce calls by direction (and keeps their shapes/ops)."""

    def __init__(self):
        self.calls = []

    def __enter__(self):
        self._orig = dist.all_reduce

        def all_reduce(tensor, *args, **kwargs):
            direction = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
            op = kwargs.get("op", args[0] if args else dist.ReduceOp.SUM)
            self.calls.append((direction, tuple(tensor.shape), str(op).rsplit(".", 1)[-1]))
            return self._orig(tensor, *args, **kwargs)

        dist.all_reduce = all_reduce
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self._orig


def _step(model, batch, capture=False, backward=True):
    """One forward (+ backward) step. With capture: the forward all-reduce outputs (values and
    gradients) and the backward dgrad all-reduce outputs (the gradients of the inputs of the
    column-parallel layers), keyed by module name."""
    mods = dict(model.named_modules())
    outs, bwd_outs, hooks = {}, {}, []
    if capture:
        def fwd_hook(name):
            def hook(mod, args, out):
                t = out[0] if isinstance(out, tuple) else out
                t.retain_grad()
                outs[name] = t
            return hook

        def pre_hook(name):
            def hook(mod, args):
                if args[0].requires_grad:
                    args[0].register_hook(lambda g: bwd_outs.__setitem__(name, g.detach().clone()))
            return hook

        hooks = [mods[n].register_forward_hook(fwd_hook(n)) for n in FWD_MODULES]
        hooks += [mods[n].register_forward_pre_hook(pre_hook(n)) for n in BWD_MODULES]
    model.zero_grad(set_to_none=True)
    tokens, pos, mask, labels = batch
    loss = model(tokens, pos, mask, labels=labels).mean()
    if backward:
        loss.backward()
    for h in hooks:
        h.remove()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    fwd = {n: (t.detach().clone(), None if t.grad is None else t.grad.detach().clone())
           for n, t in outs.items()}
    return {"loss": loss.detach().clone(), "grads": grads, "fwd": fwd, "bwd": bwd_outs}


def _stats(h) -> dict:
    return {k: (s.calls, s.compressed) for k, s in h.stats.items()}


def _rel(a: dict, ref: dict) -> dict:
    """Relative L2 change of every tensor of `a` against `ref`."""
    return {n: float((a[n].double() - ref[n].double()).norm() / ref[n].double().norm()) for n in ref}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _originals():
    from megatron.core.distributed import param_and_grad_buffer
    from megatron.core.pipeline_parallel import p2p_communication
    from megatron.core.tensor_parallel import layers, mappings

    objs = {f"mappings.{n}": getattr(mappings, n) for n in tm.patching.MAPPINGS_GLOBALS}
    objs.update({f"layers.{n}": getattr(layers, n) for n in tm.patching.LAYERS_GLOBALS})
    objs.update({f"p2p_communication.{n}": getattr(p2p_communication, n) for n in tm.patching.P2P_GLOBALS})
    objs.update({f"param_and_grad_buffer.{n}": getattr(param_and_grad_buffer, n) for n in tm.patching.DDP_GLOBALS})
    for mod in (mappings, layers):
        for cls_name in tm.tp.ROLES:
            cls = getattr(mod, cls_name, None)
            if cls is not None:
                objs[f"{cls_name}.forward"] = cls.__dict__["forward"]
    objs["torch.cuda.current_device"] = torch.cuda.current_device
    return objs


def _gather(t: torch.Tensor, world: int) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(out, t.contiguous())
    return out


def _site_checks(records, outputs, site_of, world, cfg):
    """For each recorded routed all-reduce: ||output - exact sum of the ranks' inputs|| against
    the format bound of the two-quantization all-reduce. Returns {(site, direction): (input,
    err, bound)} (collective: every rank must pass the same records)."""
    res = {}
    for site, direction, x in records:
        name = site_of.get((site, direction))
        if name is None or name not in outputs:
            continue
        inputs = _gather(x, world)
        exact = sum(t.double() for t in inputs)
        y = outputs[name]
        err = float((y.double() - exact).norm())
        res[(site, direction)] = (x, err, two_quantization_bound(inputs, cfg, x.dtype, "sum"))
    return res


# ---------------------------------------------------------------------------------------- parts
def round_trip(world) -> dict:
    """enable/disable restores the very objects; enable twice raises; context-manager form."""
    before = _originals()
    h = tm.enable(CompressionPolicy(default=None), model=torch.nn.Sequential(torch.nn.Linear(2, 2)))
    during = _originals()
    replaced = sorted(k for k in before if during[k] is not before[k])
    try:
        tm.enable(CompressionPolicy())
        second = "no error"
    except RuntimeError as e:
        second = str(e)
    h.disable()
    h.disable()  # idempotent
    after = _originals()
    restored = all(after[k] is before[k] for k in before)
    with tm.enable(CompressionPolicy()) as h2:
        inside = tm.active_handle() is h2
    after2 = _originals()
    return {"replaced": replaced, "second": second, "restored": restored, "inside": inside,
            "restored_cm": all(after2[k] is before[k] for k in before), "active_after": tm.active_handle(),
            "patched": h.patched}


def gpt(world) -> dict:
    """A tiny GPTModel step: unpatched reference, compression off (two ways), compression on."""
    model, batch = _gpt(world), _batch()
    out = {}
    # unpatched megatron-core: the reference; its all-reduces counted at torch.distributed
    with _DistCounter() as c:
        ref = _step(model, batch, capture=True)
    out["native_calls"] = c.calls
    out["ref_loss"] = float(ref["loss"])

    # compression off, two ways: default=None, and the default config with every site exempt
    for key, pol in (("off", CompressionPolicy(default=None)),
                     ("exempt", CompressionPolicy(exempt=["megatron.*"], min_bytes=0))):
        with _DistCounter() as c, taco.WireStats() as ws, tm.enable(pol, model=model) as h:
            r = _step(model, batch)
        out[key] = {"loss_equal": torch.equal(r["loss"], ref["loss"]),
                    "grads_equal": _same(r["grads"], ref["grads"]), "dist_calls": c.calls,
                    "wire_kinds": [w.kind for w in ws.calls], "stats": _stats(h)}
    with tm.enable(CompressionPolicy(default=None)) as h:  # no model: site names without layers
        _step(model, batch)
    out["no_model_stats"] = _stats(h)

    cfg = taco.CompressionConfig()
    site_of = {(f"megatron.{m}.reduce_from_tp.all_reduce", "forward"): m for m in FWD_MODULES}
    site_of.update({(f"megatron.{m}.linear.all_reduce", "backward"): m for m in BWD_MODULES})

    # compression on, forward only (native backward), so that the gradients at the sites are the
    # exact derivatives of this run's loss w.r.t. the site outputs
    fpol = RecordingPolicy(default=cfg, min_bytes=0, backward=False)
    with tm.enable(fpol, model=model) as fh:
        fwd = _step(model, batch, capture=True)
    fwd_out = {m: fwd["fwd"][m][0] for m in FWD_MODULES}
    terms = {}
    for key, (x, err, bound) in _site_checks(fpol.records, fwd_out, site_of, world, cfg).items():
        m = site_of[key]
        delta = fwd_out[m].double() - sum(t.double() for t in _gather(x, world))
        g_ref, g_on = ref["fwd"][m][1].double(), fwd["fwd"][m][1].double()
        terms[m] = {"err": err, "bound": bound, "dot_ref": float((g_ref * delta).sum()),
                    "dot_on": float((g_on * delta).sum()),
                    "grad_norm": max(float(g_ref.norm()), float(g_on.norm()))}
    replicated = all(torch.equal(g, _gather(g, world)[0]) for g in (fwd["fwd"][m][1] for m in FWD_MODULES))
    out["fwd_only"] = {"loss": float(fwd["loss"]), "terms": terms, "site_grads_replicated": replicated,
                       "stats": _stats(fh), "rel_grad_change": _rel(fwd["grads"], ref["grads"])}
    with tm.enable(CompressionPolicy(default=cfg, min_bytes=0, forward=False), model=model):
        bwd = _step(model, batch)
    out["bwd_only"] = {"loss_equal": torch.equal(bwd["loss"], ref["loss"]),
                       "rel_grad_change": _rel(bwd["grads"], ref["grads"])}

    # compression on, both directions
    pol = RecordingPolicy(default=cfg, min_bytes=0)
    with taco.WireStats() as ws, tm.enable(pol, model=model) as h:
        on = _step(model, batch, capture=True)
    outputs = {**{m: on["fwd"][m][0] for m in FWD_MODULES}, **on["bwd"]}
    checks = {k: v[1:] for k, v in _site_checks(pol.records, outputs, site_of, world, cfg).items()}
    out["on"] = {"loss": float(on["loss"]), "loss_equal_fwd_only": torch.equal(on["loss"], fwd["loss"]),
                 "checks": checks, "rel_grad_change": _rel(on["grads"], ref["grads"]), "stats": _stats(h),
                 "wire_kinds": sorted({w.kind for w in ws.calls})}

    # the in-situ check can fail: rank 0's input of one forward all-reduce is scaled by 1.25
    victim = f"megatron.{FWD_MODULES[1]}.reduce_from_tp.all_reduce"
    bad = RecordingPolicy(default=cfg, min_bytes=0, backward=False)
    bad.tamper = lambda s, d, t: t.mul_(1.25) if (s == victim and dist.get_rank() == 0) else None
    with tm.enable(bad, model=model):
        r = _step(model, batch, capture=True, backward=False)
    bad_checks = _site_checks(bad.records, {m: r["fwd"][m][0] for m in FWD_MODULES}, site_of, world, cfg)
    out["tampered"] = {"victim": victim, "checks": {k: v[1:] for k, v in bad_checks.items()},
                       "loss_change": abs(float(r["loss"]) - out["ref_loss"])}
    return out


def sequence_parallel(world) -> dict:
    """ColumnParallelLinear -> RowParallelLinear with sequence_parallel=True: the SP all-gathers and
    reduce-scatters of layers.py and mappings.py."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    cfg = _config(world, sequence_parallel=True)
    torch.manual_seed(SEED)
    init = torch.nn.init.normal_
    col = ColumnParallelLinear(HIDDEN, 4 * HIDDEN, config=cfg, init_method=init, bias=False,
                               gather_output=False)
    row = RowParallelLinear(4 * HIDDEN, HIDDEN, config=cfg, init_method=init, bias=False,
                            input_is_parallel=True, skip_bias_add=True)
    named = torch.nn.ModuleDict({"col": col, "row": row})  # for the site names
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(100 + rank)
    x0 = torch.randn(SEQ // world, BATCH, HIDDEN, generator=g)
    w = torch.randn(SEQ // world, BATCH, HIDDEN, generator=g)

    def run():
        col.zero_grad(set_to_none=True)
        row.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_(True)
        y, _ = col(x)
        z, _ = row(y)
        (z * w).sum().backward()
        return {"z": z.detach().clone(), "x": x.grad.clone(), "w1": col.weight.grad.clone(),
                "w2": row.weight.grad.clone()}

    ref = run()
    out = {}
    with tm.enable(CompressionPolicy(default=None), model=named) as h:
        off = run()
    out["off_equal"] = _same(off, ref)
    out["off_stats"] = _stats(h)
    pcfg = taco.CompressionConfig()
    with taco.WireStats() as ws, tm.enable(CompressionPolicy(default=pcfg, min_bytes=0), model=named) as h:
        on = run()
    out["on_stats"] = _stats(h)
    out["on_wire"] = sorted({c.kind for c in ws.calls})
    # forward, recomputed from taco's collectives directly: must match bit for bit
    full = torch.empty(SEQ, BATCH, HIDDEN)
    taco.all_gather(full, x0, config=pcfg, min_bytes=0)
    part = torch.matmul(full, col.weight.t())
    z = torch.empty(SEQ // world, BATCH, HIDDEN)
    taco.reduce_scatter(z, torch.matmul(part, row.weight.t()), config=pcfg, min_bytes=0)
    out["on_forward_bitwise"] = torch.equal(z, on["z"])
    out["on_rel_change"] = _rel(on, ref)
    return out


def all_parts(rank, world) -> dict:
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    with tm.cpu_compat():
        _init(world)
        try:
            return {"round_trip": round_trip(world), "gpt": gpt(world), "sp": sequence_parallel(world),
                    "current_device": str(torch.cuda.current_device())}
        finally:
            from megatron.core import parallel_state as ps

            ps.destroy_model_parallel()
