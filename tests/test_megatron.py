"""megatron-core integration (`taco_triton.integrations.megatron`) at TP=2 on gloo/CPU.

One spawn of two ranks (tests/megatron_cases.all_parts, ~25 s) computes everything; the tests
below check its parts. They skip when megatron-core is not installed, except the ones that are
about megatron-core being absent.
"""
from __future__ import annotations

import importlib.util
import math
import subprocess
import sys

import pytest
import torch

import taco_triton as taco
from taco_triton.integrations import megatron as tm
from taco_triton.parallel import CompressionPolicy

from .dist_utils import run_ranks


def _have_megatron() -> bool:
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except (ImportError, ValueError):
        return False


needs_megatron = pytest.mark.skipif(not _have_megatron(), reason=f"megatron-core not installed ({tm.EXTRA})")

WORLD = 2


@pytest.fixture(scope="module")
def parts():
    from . import megatron_cases

    return run_ranks(megatron_cases.all_parts, WORLD, timeout_s=240, pg_timeout_s=120)


# ------------------------------------------------------------------------- without megatron
def test_importing_the_integration_does_not_import_megatron_or_triton():
    code = ("import sys, taco_triton, taco_triton.integrations.megatron as m; "
            "loaded = sorted(n for n in sys.modules if n.partition('.')[0] in ('megatron', 'triton')); "
            "assert not loaded, loaded; print('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_missing_megatron_names_the_extra(monkeypatch):
    # None in sys.modules makes the import fail, as if megatron-core were not installed
    for name in [n for n in sys.modules if n == "megatron" or n.startswith("megatron.")] + ["megatron"]:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match=r"pip install 'megatron-core==0.16.1'"):
        tm.enable(CompressionPolicy())
    assert tm.active_handle() is None


def test_enable_rejects_a_non_policy():
    with pytest.raises(TypeError, match="CompressionPolicy"):
        tm.enable(object())


def test_cpu_compat_is_reversible():
    before = torch.cuda.current_device
    with tm.cpu_compat():
        if not torch.cuda.is_available():
            assert torch.cuda.current_device() == torch.device("cpu")
    assert torch.cuda.current_device is before


# ------------------------------------------------------------------------- with megatron
@needs_megatron
def test_enable_disable_round_trip(parts):
    rt = parts[0]["round_trip"]
    # every patch point was replaced while enabled, and the very same objects are back afterwards
    assert rt["replaced"] == sorted(rt["patched"]), (rt["replaced"], rt["patched"])
    assert {"mappings._reduce", "mappings._gather_along_first_dim",
            "mappings._reduce_scatter_along_first_dim", "mappings._gather_along_last_dim", "layers.torch",
            "layers.dist_all_gather_func", "layers.dist_reduce_scatter_func"} <= set(rt["patched"])
    assert rt["restored"] and rt["restored_cm"] and rt["inside"] and rt["active_after"] is None
    assert "already enabled" in rt["second"] and "disable()" in rt["second"]
    assert parts[0]["current_device"] == "cpu"


@needs_megatron
def test_compression_off_is_bit_identical_to_unpatched(parts):
    for r in parts:
        g = r["gpt"]
        for key in ("off", "exempt"):  # default=None / default config with every site exempt
            assert g[key]["loss_equal"] and g[key]["grads_equal"], key
        assert g["bwd_only"]["loss_equal"]  # backward compression cannot touch the forward
    assert parts[0]["gpt"]["ref_loss"] == parts[1]["gpt"]["ref_loss"]


def _expected_sites(mc):
    fwd = {(s, "forward", "all_reduce") for s in mc.FWD_SITES}
    bwd = {(s, "backward", "all_reduce") for s in mc.BWD_SITES}
    return fwd | bwd


@needs_megatron
def test_every_tp_collective_of_a_gpt_step_is_routed(parts):
    from . import megatron_cases as mc

    g = parts[0]["gpt"]
    hidden = {(mc.SEQ, mc.BATCH, mc.HIDDEN), (mc.BATCH, mc.SEQ, mc.HIDDEN)}  # embedding output is [b, s, h]
    # unpatched megatron-core 0.16 (counted on CPU/gloo): 5 forward all-reduces of activations + 3 small
    # cross-entropy all-reduces (one MAX), 5 backward dgrad all-reduces
    native = g["native_calls"]
    fwd_big = [c for c in native if c[0] == "forward" and c[1] in hidden]
    ce = [c for c in native if c[0] == "forward" and c[1] == (mc.SEQ, mc.BATCH)]
    bwd = [c for c in native if c[0] == "backward"]
    assert (len(fwd_big), len(ce), len(bwd), len(native)) == (5, 3, 5, 13), native
    assert sorted(c[2] for c in ce) == ["MAX", "SUM", "SUM"]
    assert all(c[1] in hidden and c[2] == "SUM" for c in bwd)

    # routed: exactly the 10 activation/dgrad all-reduces, each once, under its site name; the same
    # 13 calls still reach torch.distributed (ours natively), and WireStats sees our 10 only
    for key in ("off", "exempt"):
        assert set(g[key]["stats"]) == _expected_sites(mc), g[key]["stats"]
        assert all(v == (1, 0) for v in g[key]["stats"].values())
        assert g[key]["dist_calls"] == native
        assert g[key]["wire_kinds"] == ["all_reduce"] * 10
    # compressed: the same 10 sites, every one compressed (two-shot: all_to_all + all_gather)
    assert set(g["on"]["stats"]) == _expected_sites(mc)
    assert all(v == (1, 1) for v in g["on"]["stats"].values())
    assert g["on"]["wire_kinds"] == ["all_gather", "all_to_all"]
    assert g["fwd_only"]["stats"] == {k: (1, int(k[1] == "forward")) for k in _expected_sites(mc)}
    # without `model`, site names carry no layer
    assert g["no_model_stats"] == {("megatron.reduce_from_tp.all_reduce", "forward", "all_reduce"): (5, 0),
                                   ("megatron.linear.all_reduce", "backward", "all_reduce"): (5, 0)}


@needs_megatron
def test_compressed_all_reduces_meet_the_format_bound_in_place(parts):
    """Inside megatron, every compressed all-reduce's output is within the FP8 format's L2 bound
    of the exact sum of what the ranks handed it (tests.collective_cases.two_quantization_bound:
    each rank's quantization + the requantized sum + FP32 sums), forward and backward."""
    from . import megatron_cases as mc

    for r in parts:
        checks = r["gpt"]["on"]["checks"]
        assert set(checks) == {k[:2] for k in _expected_sites(mc)}
        for site, (err, bound) in checks.items():
            assert 0 < err <= bound, (site, err, bound)
        # ...and the check can fail: a 25 % corruption of one rank's input at one site is caught
        t = r["gpt"]["tampered"]
        for (site, _), (err, bound) in t["checks"].items():
            assert (err > bound) == (site == t["victim"]), (site, err, bound)


@needs_megatron
def test_loss_with_compression_is_within_the_derived_bound(parts):
    """Loss with the forward all-reduces compressed (default FP8 E4M3 config) vs. exact.

    Let delta_k be the error of compressed all-reduce k (output minus the exact sum of this run's
    inputs; ||delta_k|| <= B_k, the format bound, checked in place by the test above) and L(delta)
    the loss with those errors injected, L(0) the exact loss. Along t -> L(t delta):
        L(delta) - L(0) = integral_0^1 sum_k <g_k(t delta), delta_k> dt,
    g_k = dL/dy_k, the gradient at site k's output (the same on every rank: checked). We measure
    g_k at both ends (exact run; compressed-forward run with exact backward), so:
    (1) format-based, first order: |dL| <= sum_k max|g_k| B_k (x2 for the second-order remainder);
    (2) tight: the trapezoid rule dL ~ sum_k <(g_k(0) + g_k(delta)) / 2, delta_k>, whose error is
        about |f'(1) - f'(0)| / 12 for f(t) = L(t delta); we allow 6x that (half the spread of
        the two one-sided first-order estimates), so (2) fails if anything other than the routed,
        format-bounded site errors moved the loss - e.g. a compression not seen at a site.
    """
    for r in parts:
        g = r["gpt"]
        t = g["fwd_only"]["terms"]
        assert g["fwd_only"]["site_grads_replicated"]
        assert g["on"]["loss_equal_fwd_only"]  # backward compression does not touch the loss
        d_loss = g["fwd_only"]["loss"] - g["ref_loss"]
        assert math.isfinite(d_loss) and d_loss != 0.0
        first_order = sum(v["grad_norm"] * v["bound"] for v in t.values())
        assert abs(d_loss) <= 2 * first_order, (d_loss, first_order)
        pred = sum((v["dot_ref"] + v["dot_on"]) / 2 for v in t.values())
        tol = sum(abs(v["dot_on"] - v["dot_ref"]) for v in t.values()) / 2 + 1e-6 * abs(g["ref_loss"])
        assert abs(d_loss - pred) <= tol, (d_loss, pred, tol)
        # (2) is not vacuous: leaving out the largest site's term would already violate it
        biggest = max(abs(v["dot_ref"] + v["dot_on"]) / 2 for v in t.values())
        assert biggest > 2 * tol, (biggest, tol)
        assert abs(d_loss) / g["ref_loss"] < 2.0**-4  # measured ~0.5 % (E4M3: 2^-4 per element)


@needs_megatron
def test_sequence_parallel_patch_points(parts):
    """ColumnParallelLinear -> RowParallelLinear with sequence_parallel=True (megatron allows it on
    CPU; only its torch LayerNorm refuses SP, so a whole GPTModel cannot use it here)."""
    for r in parts:
        sp = r["sp"]
        assert sp["off_equal"]  # native routing: output and every gradient bit-identical
        expected = {("megatron.col.linear.all_gather", "forward", "all_gather"),  # layers.py: SP input gather
                    ("megatron.col.linear.all_gather", "backward", "all_gather"),  # ... again for wgrad
                    ("megatron.col.linear.reduce_scatter", "backward", "reduce_scatter"),  # SP dgrad
                    ("megatron.row.reduce_scatter_to_sp.reduce_scatter", "forward", "reduce_scatter"),
                    ("megatron.row.reduce_scatter_to_sp.all_gather", "backward", "all_gather")}
        assert sp["off_stats"] == {k: (1, 0) for k in expected}
        assert sp["on_stats"] == {k: (1, 1) for k in expected}
        assert sp["on_wire"] == ["all_gather", "all_to_all"]
        # the compressed forward equals taco.all_gather -> matmul -> matmul -> taco.reduce_scatter
        assert sp["on_forward_bitwise"]
        # two E4M3 quantizations on every path, each <= 2^-4 relative per element (measured ~3.8 %)
        assert all(0 < v < 2 * 2.0**-4 for v in sp["on_rel_change"].values()), sp["on_rel_change"]


def _megatron_modules():
    pytest.importorskip("megatron.core", reason="megatron-core not installed (the `megatron` extra)")
    from taco_triton.integrations import megatron as tm

    return tm, tm.common.import_megatron()


class _FakeGroup:
    """A two-rank group as megatron's helpers see it (no process group behind it)."""

    def size(self):
        return 2

    def rank(self):
        return 0


def test_disable_makes_a_captured_replacement_fall_through_to_megatrons_original(monkeypatch):
    """Before: a wrapper installed after enable() kept calling our replacement after disable(),
    which kept compressing."""
    import types

    tm, (mappings, layers, p2pc, pgb) = _megatron_modules()
    seen = []

    def spy(name):
        def original(*args, **kwargs):
            seen.append((name, args, kwargs))
        return original

    points = {(mappings, n): spy(n) for n in tm.patching.MAPPINGS_GLOBALS}
    points.update({(p2pc, n): spy(n) for n in tm.patching.P2P_GLOBALS})
    points.update({(mod, n): spy(f"{mod.__name__}.{n}") for mod in (layers, pgb)
                   for n in ("dist_all_gather_func", "dist_reduce_scatter_func")})
    points[(pgb, "_coalescing_manager")] = spy("_coalescing_manager")
    for mod in (layers, pgb):  # the module global `torch`: only its distributed.all_reduce is used
        points[(mod, "torch")] = types.SimpleNamespace(
            distributed=types.SimpleNamespace(all_reduce=spy(f"{mod.__name__}.all_reduce")))
    for (mod, name), orig in points.items():
        monkeypatch.setattr(mod, name, orig)  # "megatron's originals" as enable() finds them

    h = tm.enable(CompressionPolicy(min_bytes=0))
    ours = {key: getattr(*key) for key in points}
    monkeypatch.setattr(mappings, "_reduce", lambda x, g: ours[(mappings, "_reduce")](x, g))  # someone's wrapper
    h.disable()

    x, g = torch.randn(64, 64), _FakeGroup()
    for (mod, name), fn in ours.items():
        seen.clear()
        if name == "torch":
            fn.distributed.all_reduce(x, group=g)
        elif name in tm.patching.P2P_GLOBALS:
            fn(tensor_send_prev=None, tensor_recv_prev=None, tensor_send_next=x, tensor_recv_next=None, group=g,
               prev_pipeline_rank=1, next_pipeline_rank=1)
        elif name == "_coalescing_manager":
            fn(group=g)
        elif mod is mappings:
            fn(x, g)
        else:
            fn(torch.empty(128, 64), x, group=g)
        assert len(seen) == 1, (mod.__name__, name, seen)
        args, kwargs = seen[0][1:]
        sent = g if name == "_coalescing_manager" else x
        assert any(a is sent for a in [*args, *kwargs.values()]), (name, "megatron's original got other arguments")
    assert h.stats == {}  # nothing was routed after disable


def test_dp_gradient_policy_follows_the_policys_switches_overrides_and_comm_dtype():
    """Before: forward=backward=False still compressed DP gradients (INT8, stochastic), and the
    derived DP policy dropped overrides and comm_dtype."""
    from taco_triton.integrations.megatron import gradient_policy

    grads, params = "megatron.dp.bucket0.all_reduce", "megatron.dp.bucket0.all_gather"
    int4 = taco.CompressionConfig(codec="int4", group_size=32)
    assert gradient_policy(CompressionPolicy(forward=False, backward=False)).config_for(grads, "backward") is None
    assert gradient_policy(CompressionPolicy(backward=False)).config_for(grads, "backward") is None
    fwd_off = gradient_policy(CompressionPolicy(forward=False))
    assert fwd_off.config_for(params, "forward") is None and fwd_off.config_for(grads, "backward") is not None
    over = gradient_policy(CompressionPolicy(overrides={"megatron.dp.*": int4}, comm_dtype=torch.bfloat16))
    assert over.config_for(grads, "backward") == int4 and over.comm_dtype == torch.bfloat16
    assert over.config_for("megatron.pp.forward.stage0_to_stage1", "backward").codec == "int8"  # not overridden
    tm, _ = _megatron_modules()
    with tm.enable(CompressionPolicy(forward=False, backward=False)) as h:
        assert h.policies["dp"].config_for(grads, "backward") is None


def test_megatron_disable_keeps_a_patch_applied_after_enable():
    tm = pytest.importorskip("taco_triton.integrations.megatron")
    try:
        h = tm.enable(CompressionPolicy())
    except ImportError:
        pytest.skip("megatron-core is not installed")
    obj, attr, orig, ours = h._saved[0]
    def third_party(*a, **k):
        return None
    setattr(obj, attr, third_party)
    h.disable()
    current = obj.__dict__.get(attr) if isinstance(obj, type) else getattr(obj, attr)
    assert current is third_party
    setattr(obj, attr, orig)  # leave megatron as we found it
