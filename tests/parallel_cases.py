"""Per-rank bodies of the tensor-parallel tests (module-level so spawned processes can import them).

The model: a two-layer MLP  y = gelu(x W1^T + b1) W2^T + b2  with x [T, H], W1 [F, H], W2 [H, F],
run as ColumnParallelLinear("fc1") -> gelu -> RowParallelLinear("fc2") on P gloo ranks and
compared with the same model evaluated densely in float64 ("exact"), on the forward output y
and on dx, dW1, db1, dW2, db2 for the loss sum(y * G) (so dy = G).

Bounds (u = 2^-24, gamma(K) = K u / (1 - K u), |.| elementwise, all from exact float64 values)
-----------------------------------------------------------------------------------------------
FP32 arithmetic, any summation order. A K-term dot product computed in FP32 in any order (one
GEMM, or P partial GEMMs whose results a collective sums: still a tree of K leaves) is within
gamma(K) sum_k |a_k||b_k| of the exact value. Adding the bias makes it K + 1 terms. Through gelu
(|gelu'| <= L1 = 1.13, |gelu''| <= L2 = 0.8; torch's FP32 gelu is within u|h|(6 + |h|) of the
exact value of its rounded input and gelu' within u(8 + 2|h|): measured below 0.76 and 0.59 of
these over [-12, 12] and 10^6 normal samples). First-order propagation:
    B_h   = gamma(H+1) (|x||W1|^T + |b1|)
    B_a   = L1 B_h + u |h| (6 + |h|)
    B_y   = gamma(F+1) (|a||W2|^T + |b2|) + B_a |W2|^T
    B_da  = gamma(H) |G||W2|                         (da = G W2)
    B_gp  = L2 B_h + u (8 + 2|h|)                    (gp = gelu'(h))
    B_dh  = B_da |gp| + |da| B_gp + u |da gp|
    B_dW2 = gamma(T) |G|^T|a| + |G|^T B_a;   B_db2 = gamma(T) sum_t |G|
    B_dW1 = gamma(T) |dh|^T|x| + B_dh^T |x|;  B_db1 = gamma(T) sum_t |dh| + sum_t B_dh
    B_dx  = gamma(F) |dh||W1| + B_dh |W1|
The neglected second-order terms are products of two gamma-sized relative errors (< 1e-8 of the
first-order ones here); the checks allow 1.01 B. Native runs (no compression) must satisfy
|tp - exact| <= 1.01 B elementwise, which the dense FP32 model also satisfies (checked), so
|tp - dense_fp32| <= 2.02 B: "equal to the dense reference up to summation order".

Compression. Each message m a site sends is recorded (the policy's `observe`); `taco_triton.bounds.
l2_error_bound` of compress(m) bounds what one quantization of m costs in L2 (derived from the
format and the scales actually used). Per collective (L2, over the whole result):
    all-gather:      C = sqrt(sum_r l(m_r)^2)            (each shard quantized once, disjoint)
    reduce-scatter:  per output slice s: sum_r l(m_r[s]) + (P + 2) 2u sum_r ||m_r[s]||  (the FP32
                     sum of P dequantized terms, in the orthogonal transform's domain); C = sqrt(sum_s C_s^2)
    all-reduce:      `collective_cases.two_quantization_bound` (the ranks' quantization, the
                     requantized sum, the FP32 sums), computed chunk by chunk as the collective cuts.
These errors then flow through the rest of the model; with ||.||_2 the spectral norm and
||.|| Frobenius, every step below is an exact identity bounded by the triangle and
Cauchy-Schwarz inequalities (perturbed factors are bounded by exact norm + error):
    C_h   = C_x ||W1||_2 + C_gather_output           (x~ = x + E_x: SP all-gather of the input)
    C_a   = L1 C_h
    C_y   = C_a ||W2||_2 + C_y,comm                  (all-reduce / reduce-scatter of the partials)
    C_dW2 = C_G (||a||_2 + C_a) + ||G||_2 C_a          (G~^T a~ - G^T a = (G~-G)^T a~ + G^T (a~-a))
    C_da  = C_G ||W2||_2 + C_scatter                 (SP all-gather of G; all-gather of da)
    C_dh  = L1 C_da + max|da| L2 C_h                 (dh~ - dh = (da~-da) gp~ + da (gp~-gp))
    C_dW1 = C_dh (||x||_2 + C_x) + ||dh||_2 C_x;     C_db1 = sqrt(T) C_dh
    C_dx  = C_dh ||W1||_2 + C_dx,comm
A compressed run must satisfy ||tp - exact|| <= 1.01 (||B|| + C) for every quantity (the 1.01
also covers the FP32 roundings of the perturbed values, gamma-relative to C), and exactly 1.01 B
elementwise where C = 0 (for example every weight grad without sequence parallelism: compression
touches only y and dx there). It must also show compression happened: WireStats records
compressed calls in both directions, and ||y - exact|| exceeds the whole FP32 budget 1.01 ||B_y||.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import taco_triton as taco
from taco_triton import bounds
from taco_triton.parallel import (
    ColumnParallelLinear,
    CompressionPolicy,
    RowParallelLinear,
    allreduce_sequence_parallel_grads,
    copy_to_tp_region,
    init_dense_weight,
    reduce_from_tp_region,
    reduce_scatter_to_sp_region,
)

from .collective_cases import two_quantization_bound

T, H, FFN = 60, 256, 384  # tokens, hidden, ffn: T and FFN divisible by 2 and 3
U = 2.0**-24
L1, L2 = 1.13, 0.8  # sup |gelu'| = 1.1289, sup |gelu''| = 2 phi(0) = 0.7979
SLACK = 1.01
FP8, INT8 = taco.CompressionConfig(), taco.CompressionConfig(codec="int8")
INT6 = taco.CompressionConfig(codec="int6", group_size=32)
NAMES = ("y", "dx", "dW1", "db1", "dW2", "db2")


def gamma(k: int) -> float:
    return k * U / (1 - k * U)


@dataclass
class RecordingPolicy(CompressionPolicy):
    """A CompressionPolicy that also keeps every (site, direction, tensor) it is shown."""

    sent: list = field(default_factory=list, repr=False)

    def observe(self, site, direction, tensor):
        self.sent.append((site, direction, tensor.detach().clone()))
        super().observe(site, direction, tensor)


# ---------------------------------------------------------------------------- model and reference
def dense_model(seed: int = 0) -> nn.Sequential:
    fc1, fc2 = nn.Linear(H, FFN), nn.Linear(FFN, H)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        fc1.weight.copy_(init_dense_weight(FFN, H, seed=seed + 1))
        fc2.weight.copy_(init_dense_weight(H, FFN, seed=seed + 2))
        fc1.bias.uniform_(-0.5, 0.5, generator=g)  # large enough that a misplaced bias shows
        fc2.bias.uniform_(-0.5, 0.5, generator=g)
    return nn.Sequential(fc1, nn.GELU(), fc2)


def data(seed: int = 0):
    g = torch.Generator().manual_seed(100 + seed)
    return torch.randn(T, H, generator=g), torch.randn(T, H, generator=g)


def dense_run(model: nn.Sequential, x, gy, dtype) -> dict:
    fc1 = nn.Linear(H, FFN, dtype=dtype)  # fresh copies: the model itself stays FP32
    fc2 = nn.Linear(FFN, H, dtype=dtype)
    with torch.no_grad():
        for src, dst in zip((model[0], model[2]), (fc1, fc2)):
            dst.weight.copy_(src.weight)
            dst.bias.copy_(src.bias)
    xx = x.to(dtype, copy=True).requires_grad_()  # copy: never mark the caller's tensor
    h = fc1(xx)
    a = F.gelu(h)
    y = fc2(a)
    y.backward(gy.to(dtype))
    return {"y": y.detach(), "dx": xx.grad, "dW1": fc1.weight.grad, "db1": fc1.bias.grad,
            "dW2": fc2.weight.grad, "db2": fc2.bias.grad, "h": h.detach(), "a": a.detach()}


def fp32_bounds(model, x, gy) -> tuple[dict, dict]:
    """(exact float64 values, elementwise FP32 bounds B) of the module docstring."""
    ex = dense_run(model, x, gy, torch.float64)
    w1, b1 = model[0].weight.detach().double(), model[0].bias.detach().double()
    w2, b2 = model[2].weight.detach().double(), model[2].bias.detach().double()
    x, g = x.double(), gy.double()
    h, a = ex["h"], ex["a"]
    hd = h.detach().requires_grad_()
    (gp,) = torch.autograd.grad(F.gelu(hd).sum(), hd)
    da = g @ w2
    dh = da * gp
    B = {}
    bh = gamma(H + 1) * (x.abs() @ w1.abs().T + b1.abs())
    ba = L1 * bh + U * h.abs() * (6 + h.abs())
    B["y"] = gamma(FFN + 1) * (a.abs() @ w2.abs().T + b2.abs()) + ba @ w2.abs().T
    bda = gamma(H) * (g.abs() @ w2.abs())
    bgp = L2 * bh + U * (8 + 2 * h.abs())
    bdh = bda * gp.abs() + da.abs() * bgp + U * (da * gp).abs()
    B["dW2"] = gamma(T) * (g.abs().T @ a.abs()) + g.abs().T @ ba
    B["db2"] = gamma(T) * g.abs().sum(0)
    B["dW1"] = gamma(T) * (dh.abs().T @ x.abs()) + bdh.T @ x.abs()
    B["db1"] = gamma(T) * dh.abs().sum(0) + bdh.sum(0)
    B["dx"] = gamma(FFN) * (dh.abs() @ w1.abs()) + bdh @ w1.abs()
    ex.update(da=da, dh=dh, gp=gp, w1=w1, w2=w2, x=x, g=g)
    return ex, B


# ---------------------------------------------------------------------------- communication bounds
def _ell(m: torch.Tensor, cfg) -> float:
    m = m.float().contiguous()
    return bounds.l2_error_bound(m, taco.compress(m, cfg, backend="torch"), torch.float32)


def comm_bound(kind: str, msgs: list[torch.Tensor], cfg) -> float:
    """L2 bound on one compressed collective's error, from every rank's message (module docstring)."""
    p = len(msgs)
    if kind == "all_gather":
        return math.sqrt(sum(_ell(m, cfg) ** 2 for m in msgs))
    if kind == "all_reduce":
        return two_quantization_bound([m.float() for m in msgs], cfg, torch.float32, "sum")
    if kind == "reduce_scatter":
        rows = msgs[0].shape[0] // p
        total = 0.0
        for s in range(p):
            pieces = [m[s * rows : (s + 1) * rows] for m in msgs]
            c = sum(_ell(q, cfg) for q in pieces) + (p + 2) * 2 * U * sum(float(q.double().norm()) for q in pieces)
            total += c * c
        return math.sqrt(total)
    raise ValueError(kind)


#: (role, direction) -> the collective it runs
COLLECTIVE = {
    ("copy", "backward"): "all_reduce", ("reduce", "forward"): "all_reduce",
    ("gather", "forward"): "all_gather", ("gather", "backward"): "reduce_scatter",
    ("reduce_scatter", "forward"): "reduce_scatter", ("reduce_scatter", "backward"): "all_gather",
    ("gather_output", "forward"): "all_gather", ("scatter", "backward"): "all_gather",
}


def expected_sites(sp: bool, gather_output: bool) -> set:
    if sp:
        return {("fc1.gather", "forward"), ("fc2.reduce_scatter", "forward"),
                ("fc2.reduce_scatter", "backward"), ("fc1.gather", "backward")}
    out = {("fc2.reduce", "forward"), ("fc1.copy", "backward")}
    if gather_output:
        out |= {("fc1.gather_output", "forward"), ("fc2.scatter", "backward")}
    return out


def propagated_bounds(ex: dict, comm: dict) -> dict:
    """The C_* of the module docstring from the per-site bounds `comm[(site, direction)]`."""
    s2 = lambda m: float(torch.linalg.matrix_norm(m, ord=2))  # noqa: E731 - spectral norm
    c = lambda *k: comm.get(k, 0.0)  # noqa: E731
    w1, w2, x, g, a, dh, da = (ex[k] for k in ("w1", "w2", "x", "g", "a", "dh", "da"))
    cx = c("fc1.gather", "forward")
    ch = cx * s2(w1) + c("fc1.gather_output", "forward")
    ca = L1 * ch
    cg = c("fc2.reduce_scatter", "backward")
    cda = cg * s2(w2) + c("fc2.scatter", "backward")
    cdh = L1 * cda + float(da.abs().max()) * L2 * ch
    return {
        "y": ca * s2(w2) + c("fc2.reduce", "forward") + c("fc2.reduce_scatter", "forward"),
        "dW2": cg * (s2(a) + ca) + s2(g) * ca,
        "db2": 0.0,
        "dW1": cdh * (s2(x) + cx) + s2(dh) * cx,
        "db1": math.sqrt(T) * cdh,
        "dx": cdh * s2(w1) + c("fc1.copy", "backward") + c("fc1.gather", "backward"),
    }


# ---------------------------------------------------------------------------- the TP run
def _all(t: torch.Tensor, world: int) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(out, t.contiguous())
    return out


def _replicated(t: torch.Tensor, world: int, what: str) -> torch.Tensor:
    ts = _all(t, world)
    assert all(torch.equal(q, ts[0]) for q in ts), f"{what} differs across ranks"
    return t


def tp_run(rank, world, model, x, gy, policy, sp: bool, gather_output: bool = False) -> dict:
    """One forward/backward of the parallel MLP; full (gathered) results and the WireStats."""
    fc1 = ColumnParallelLinear.from_dense(model[0], policy=policy, sequence_parallel=sp,
                                          gather_output=gather_output, name="fc1")
    fc2 = RowParallelLinear.from_dense(model[2], policy=policy, sequence_parallel=sp,
                                       input_is_parallel=not gather_output, name="fc2")
    n = T // world
    xin = (x[rank * n : (rank + 1) * n] if sp else x).clone()
    xin.requires_grad_()
    with taco.WireStats() as fwd:
        y = fc2(F.gelu(fc1(xin)))
    with taco.WireStats() as bwd:
        y.backward(gy[rank * n : (rank + 1) * n] if sp else gy)
    if sp:
        assert allreduce_sequence_parallel_grads(fc2) == 1  # fc2.bias saw this rank's tokens only
    cat0 = lambda t: torch.cat(_all(t, world), 0)  # noqa: E731
    out = {
        "y": cat0(y.detach()) if sp else _replicated(y.detach(), world, "y"),
        "dx": cat0(xin.grad) if sp else _replicated(xin.grad, world, "dx"),
        "dW1": cat0(fc1.weight.grad), "db1": cat0(fc1.bias.grad),
        "dW2": torch.cat(_all(fc2.weight.grad, world), 1),
        "db2": _replicated(fc2.bias.grad, world, "db2"),
    }
    return {"out": out, "fwd": fwd, "bwd": bwd}


def _check(name, got, want, B, C, label) -> float:
    """Assert the module docstring's bound; returns the share of the bound used."""
    err = (got.double() - want).abs()
    assert bool(torch.isfinite(got).all()), f"{label} {name}: non-finite values"
    if C == 0.0:
        use = float((err / (SLACK * B).clamp_min(1e-300)).max())
        i = int((err - SLACK * B).flatten().argmax())
        assert use <= 1.0, (f"{label} {name}: elementwise error {float(err.flatten()[i]):.3e} > "
                            f"bound {SLACK * float(B.flatten()[i]):.3e} (at flat index {i}); use {use:.3g}")
        return use
    e, b = float(err.norm()), SLACK * (float(B.norm()) + C)
    assert e <= b, f"{label} {name}: ||error|| {e:.4e} > bound {b:.4e} (FP32 part {float(B.norm()):.3e}, comm {C:.3e})"
    return e / b


def mlp_battery(rank: int, world: int) -> dict:
    """Every variant at this P: sp off/on x (policy None, default=None, fp8, int8, int6), plus
    gather_output/scatter (native and fp8). Rank 0 checks bounds; returns a summary."""
    model = dense_model()
    x, gy = data()
    ex, B = fp32_bounds(model, x, gy) if rank == 0 else (None, None)
    report = {"use": {}, "comm_share": {}}
    if rank == 0:  # the bound B is sound for the dense FP32 model too (else it would prove nothing)
        d32 = dense_run(model, x, gy, torch.float32)
        report["use"]["dense_fp32"] = max(_check(k, d32[k], ex[k], B[k], 0.0, "dense fp32") for k in NAMES)
    variants = [(sp, go, mode) for sp in (False, True) for go in (False,) for mode in ("none", "default_none", "fp8", "int8", "int6")]
    variants += [(False, True, "none"), (False, True, "fp8")]
    native_out = {}
    for sp, go, mode in variants:
        label = f"P{world} sp={sp} gather_output={go} {mode}"
        cfg = {"fp8": FP8, "int8": INT8, "int6": INT6}.get(mode)
        policy = None if mode == "none" else RecordingPolicy(default=cfg, min_bytes=0)
        r = tp_run(rank, world, model, x, gy, policy, sp, go)
        fwd_c = [c.compressed for c in r["fwd"].calls]
        bwd_c = [c.compressed for c in r["bwd"].calls]
        if cfg is None:
            assert fwd_c and bwd_c and not any(fwd_c + bwd_c), (label, r["fwd"].calls, r["bwd"].calls)
        else:  # compression really happened, in both directions
            assert fwd_c and bwd_c and all(fwd_c) and all(bwd_c), (label, r["fwd"].calls, r["bwd"].calls)
        if mode == "default_none":  # default=None is exactly the native path
            assert all(torch.equal(r["out"][k], native_out[(sp, go)][k]) for k in NAMES), label
        if mode == "none":
            native_out[(sp, go)] = r["out"]
        if cfg is not None:  # replaying fc2's forward collective on what it sent gives y bit for bit
            assert torch.equal(r["out"]["y"], replay_fc2(rank, world, policy, cfg, sp, model[2].bias.detach())), label
        comm = {}
        if policy is not None:
            sent = [(s, d, t) for s, d, t in policy.sent]
            everyone = [None] * world
            dist.all_gather_object(everyone, sent)
            keys = {(s, d) for s, d, _ in sent}
            assert keys == expected_sites(sp, go), (label, keys)
            assert len(sent) == len(keys), (label, "one message per site and direction")
            if rank == 0 and cfg is not None:
                for s, d in keys:
                    msgs = [next(t for s2, d2, t in ranks if (s2, d2) == (s, d)) for ranks in everyone]
                    comm[(s, d)] = comm_bound(COLLECTIVE[(s.split(".", 1)[1], d)], msgs, cfg)
        if rank == 0:
            C = propagated_bounds(ex, comm) if comm else dict.fromkeys(NAMES, 0.0)
            uses = {k: _check(k, r["out"][k], ex[k], B[k], C[k], label) for k in NAMES}
            report["use"][label] = max(uses.values())
            if cfg is not None:
                e = float((r["out"]["y"].double() - ex["y"]).norm())
                assert e > SLACK * float(B["y"].norm()), f"{label}: y error {e:.3e} is within FP32 rounding: not compressed?"
                report["comm_share"][label] = {k: round(uses[k], 3) for k in NAMES}
    report["errors"] = error_messages(rank, world)
    report["init_same_for_any_p"] = init_is_world_size_free(rank, world)
    return report


def replay_fc2(rank, world, policy, cfg, sp: bool, bias) -> torch.Tensor:
    """fc2's output rebuilt from its recorded partial with a direct collective, plus the bias."""
    site = "fc2.reduce_scatter" if sp else "fc2.reduce"
    partial = next(t for s, d, t in policy.sent if (s, d) == (site, "forward"))
    if sp:
        out = torch.empty(T // world, H)
        taco.reduce_scatter(out, partial, config=cfg, min_bytes=0)
        return torch.cat(_all(out + bias, world), 0)
    out = partial.clone()
    taco.all_reduce(out, config=cfg, min_bytes=0)
    return out + bias


# ---------------------------------------------------------------------------- smaller checks
def error_messages(rank: int, world: int) -> dict:
    """The ValueErrors a user meets first, with the values they name."""
    msgs = {}
    for key, make in {
        "column": lambda: ColumnParallelLinear(H, world * 64 + 1),
        "row": lambda: RowParallelLinear(world * 64 + 1, H),
        "sp_tokens": lambda: reduce_scatter_to_sp_region(torch.zeros(world * 4 + 1, 8), "fc2.reduce_scatter"),
        "sp_layer_tokens": lambda: RowParallelLinear(FFN, H, sequence_parallel=True, name="fc2")(torch.zeros(world * 2 + 1, FFN // world)),
        "row_input": lambda: RowParallelLinear(FFN, H, name="fc2")(torch.zeros(3, FFN)),
    }.items():
        try:
            make()
            msgs[key] = "no error"
        except ValueError as e:
            msgs[key] = str(e)
    return msgs


def init_is_world_size_free(rank: int, world: int) -> bool:
    """Default-initialised shards, gathered, are the full matrix init_dense_weight draws (P = 1's)."""
    fc1 = ColumnParallelLinear(H, FFN, name="mlp.fc1")
    fc2 = RowParallelLinear(FFN, H, name="mlp.fc2", seed=7)
    w1 = torch.cat(_all(fc1.weight.detach(), world), 0)
    w2 = torch.cat(_all(fc2.weight.detach(), world), 1)
    return torch.equal(w1, init_dense_weight(FFN, H, seed=fc1.seed)) and torch.equal(w2, init_dense_weight(H, FFN, seed=7))


# ---------------------------------------------------------------------------- policy
def _layers(model, policy):
    return (ColumnParallelLinear.from_dense(model[0], policy=policy, name="fc1"),
            RowParallelLinear.from_dense(model[2], policy=policy, name="fc2"))


def _step(model, policy, x, gy):
    fc1, fc2 = _layers(model, policy)
    xin = x.clone().requires_grad_()
    with taco.WireStats() as fwd:
        y = fc2(F.gelu(fc1(xin)))
    with taco.WireStats() as bwd:
        y.backward(gy)
    return y.detach(), xin.grad, fwd.calls, bwd.calls


def _compressed(calls) -> bool:
    """True if every call was compressed, False if none was (mixed is a failure)."""
    flags = {c.compressed for c in calls}
    assert len(flags) == 1, calls
    return flags.pop()


def policy_battery(rank: int, world: int, plan_path: str) -> dict:
    """Exemptions, direction switches, min_bytes, overrides and plan calibration on P ranks."""
    model = dense_model(1)
    x, gy = data(1)
    native_y, native_dx, f, b = _step(model, None, x, gy)
    assert not _compressed(f) and not _compressed(b)
    out = {}

    # exempt: fc2's site communicates natively (forward), fc1's is compressed (backward)
    y, dx, f, b = _step(model, CompressionPolicy(exempt=["fc2.*"], min_bytes=0), x, gy)
    assert not _compressed(f) and _compressed(b), "exempt fc2.*"
    assert [c.kind for c in f] == ["all_reduce"]
    assert torch.equal(y, native_y) and not torch.equal(dx, native_dx)
    y, dx, f, b = _step(model, CompressionPolicy(exempt=["fc1.copy"], min_bytes=0), x, gy)
    assert _compressed(f) and not _compressed(b) and torch.equal(dx, native_dx), "exempt fc1.copy"

    # direction switches
    y, dx, f, b = _step(model, CompressionPolicy(forward=False, min_bytes=0), x, gy)
    assert not _compressed(f) and _compressed(b) and torch.equal(y, native_y), "forward=False"
    y, dx, f, b = _step(model, CompressionPolicy(backward=False, min_bytes=0), x, gy)
    assert _compressed(f) and not _compressed(b) and torch.equal(dx, native_dx), "backward=False"

    # min_bytes: the default (1 MiB) leaves this model's 60 KB messages native; a threshold between
    # two message sizes splits them
    y, dx, f, b = _step(model, CompressionPolicy(), x, gy)
    assert not _compressed(f) and not _compressed(b) and torch.equal(y, native_y), "default min_bytes"
    small, large = torch.randn(4, H), torch.randn(T, H)  # 4 KiB and 60 KiB
    pol = CompressionPolicy(min_bytes=8192)
    for t, want in ((small, False), (large, True)):
        with taco.WireStats() as ws:
            reduce_from_tp_region(t, "fc2.reduce", pol)
        assert _compressed(ws.calls) is want, ("min_bytes", tuple(t.shape))

    # overrides: the first matching pattern wins; the collective then runs that config
    e5m2 = taco.CompressionConfig(codec="fp8_e5m2", hadamard=False)
    pol = CompressionPolicy(overrides={"fc2.*": INT8, "fc*": e5m2}, min_bytes=0)
    assert pol.config_for("fc2.reduce", "forward") == INT8 and pol.config_for("fc1.copy", "backward") == e5m2
    part = torch.randn(T, H, generator=torch.Generator().manual_seed(rank))
    got = reduce_from_tp_region(part, "fc2.reduce", pol)
    want_int8, want_fp8 = part.clone(), part.clone()
    taco.all_reduce(want_int8, config=INT8, min_bytes=0)
    taco.all_reduce(want_fp8, config=FP8, min_bytes=0)
    assert torch.equal(got, want_int8) and not torch.equal(got, want_fp8), "override fc2.* -> int8"
    x1 = torch.randn(T, H, requires_grad=True)
    copy_to_tp_region(x1, "fc1.copy", pol).backward(part)
    want = part.clone()
    taco.all_reduce(want, config=e5m2, min_bytes=0)
    assert torch.equal(x1.grad, want), "override fc* -> e5m2 (backward)"

    out["calibration"] = calibration(rank, world, plan_path)
    return out


def rank_data(rank: int, step: int) -> torch.Tensor:
    """Rank 0: Gaussian (calibrate picks int8); other ranks: two outlier channels (it picks fp8)."""
    g = torch.Generator().manual_seed(10 * step + rank)
    t = torch.randn(T, H, generator=g)
    if rank:
        t[:, 3] = 300.0
        t[:, 77] = -300.0
    return t


def calibration(rank: int, world: int, plan_path: str) -> dict:
    pol = RecordingPolicy(calibrate_steps=2, plan=plan_path, min_bytes=0)
    assert not pol.frozen and pol.calibrating
    frozen_after = []
    for step in range(2):
        t = rank_data(rank, step)
        reduce_from_tp_region(t, "cal.reduce", pol)  # forward site
        xg = torch.zeros(T, H, requires_grad=True)
        copy_to_tp_region(xg, "cal.copy", pol).backward(t)  # backward site
        pol.step()
        frozen_after.append(pol.frozen)
    assert frozen_after == [False, True], frozen_after
    plan = pol.plan_dict()
    assert set(plan) == {"cal.reduce|forward", "cal.copy|backward"}, plan
    plans = [None] * world
    dist.all_gather_object(plans, plan)
    assert all(p == plans[0] for p in plans), f"plans differ across ranks: {plans}"
    # what this rank would have picked alone: the ranks disagree, and the plan is the choice over
    # every rank's samples together
    sent = [t for s, d, t in pol.sent if s == "cal.reduce"]
    mine = taco.calibrate(sent, backend="torch").config
    choices, everyone = [None] * world, [None] * world
    dist.all_gather_object(choices, (mine.codec, mine.group_size, mine.hadamard))
    dist.all_gather_object(everyone, sent)
    assert len(set(choices)) > 1, f"ranks would choose alike ({choices}): the test would prove nothing"
    chosen = plan["cal.reduce|forward"]
    together = taco.calibrate([t for ts in everyone for t in ts], backend="torch").config
    assert chosen == together, (chosen, together, choices)
    # the frozen plan drives the collective, identically on every rank
    t = rank_data(rank, 5)
    got = reduce_from_tp_region(t, "cal.reduce", pol)
    want = t.clone()
    taco.all_reduce(want, config=chosen, min_bytes=0)
    assert torch.equal(got, want)
    _replicated(got, world, "calibrated all-reduce")
    dist.barrier()  # rank 0 wrote the plan file inside step()
    loaded = CompressionPolicy(plan=plan_path)
    assert loaded.frozen and not loaded.calibrating and loaded.plan_dict() == plan
    for key in plan:
        site, _, direction = key.rpartition("|")
        assert loaded.config_for(site, direction) == pol.config_for(site, direction) == plan[key]
    return {k: (c.codec, c.group_size, c.hadamard) for k, c in plan.items()} | {"choices": choices}
