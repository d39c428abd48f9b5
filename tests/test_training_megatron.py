"""`train_gpt --megatron`: megatron-core's GPTModel trained at TP=2 (gloo, CPU) with its TP
communication routed through taco_triton (`integrations.megatron.enable`).

One short run of modes none and fp8 (same weights, same batches). FP8 has to communicate
compressed (wire bytes about half of bf16: megatron's collectives carry the bf16 activations),
both runs have to learn, and FP8's validation loss may be at most 0.25% above none's (one-sided:
compression perturbs the trajectory, so it may also end lower).
"""
import importlib.util

import pytest
import torch

from taco_triton.examples import train_gpt


def _have_megatron() -> bool:
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except (ImportError, ValueError):
        return False


pytestmark = pytest.mark.skipif(not _have_megatron(), reason="megatron-core not installed")

ARGS = ["--megatron", "--tp", "2", "--compress", "none,fp8", "--steps", "15", "--eval-every", "15",
        "--eval-batches", "4", "--batch", "8", "--seq", "64", "--hidden", "128", "--ffn", "512", "--heads", "4",
        "--layers", "2", "--quiet", "--data-bytes", str(2 << 20)]


@pytest.fixture(scope="module")
def runs():
    return train_gpt.main(ARGS)


def test_both_modes_ran(runs):
    df, s = runs
    assert set(s.index) == {"none", "fp8"}, s
    assert (df.groupby("mode").step.max() == 15).all(), df
    assert (df[df["mode"] == "none"].compressed_calls == 0).all()
    assert (df[df["mode"] == "fp8"].compressed_calls > 0).all()
    assert (df.wire_bytes > 0).all()  # mode none is routed (natively) and counted too


def test_fp8_communicates_compressed(runs):
    _, s = runs
    assert 0.49 <= s.loc["fp8", "wire_vs_none"] <= 0.55, s


@pytest.mark.parametrize("mode", ["none", "fp8"])
def test_loss_fell(runs, mode):
    df, s = runs
    first = df[(df["mode"] == mode) & (df.step == 1)].train_loss.iloc[0]
    assert s.loc[mode, "final_val_loss"] < 0.9 * first, s


def test_fp8_validation_loss_parity(runs):
    _, s = runs
    assert s.loc["fp8", "val_loss_vs_none_%"] <= 0.25, s


# ---------------------------------------------------------------------- --compress-axes
def test_compress_axes_groups_and_labels():
    assert train_gpt.parse_axis_groups("dp+tp, pp ,tp+pp+dp") == [("tp", "dp"), ("pp",), ("tp", "pp", "dp")]
    assert train_gpt.run_label("int8", ("tp", "pp", "dp"), False) == "int8"
    assert train_gpt.run_label("fp8", ("pp",), True) == "fp8[pp]"  # no DP compressed: no error feedback
    assert train_gpt.run_label("fp8", ("tp", "dp"), True) == "fp8[tp+dp]+ef"
    assert train_gpt.run_label("none", ("pp",), True) == "none"
    for bad in ("tp,,pp", "tp+ep"):
        with pytest.raises(SystemExit, match="--compress-axes"):
            train_gpt.parse_axis_groups(bad)
    with pytest.raises(SystemExit, match="needs --megatron"):
        train_gpt.main(["--compress-axes", "pp", "--steps", "1"])


def test_enable_axes_compresses_only_the_named_axes():
    import taco_triton as taco
    from taco_triton.examples.train_megatron import enable_axes
    from taco_triton.integrations.megatron import GRADIENT_CONFIG
    from taco_triton.parallel import CompressionPolicy

    pol = CompressionPolicy(default=taco.CompressionConfig(codec="int8"), min_bytes=0)
    site = ("megatron.site", "backward")
    with enable_axes(pol, None, ("pp",), False) as h:
        assert h.policies["pp"] is pol
        assert h.policies["tp"].config_for(*site) is None and h.policies["dp"].config_for(*site) is None
    with enable_axes(pol, None, ("tp", "dp"), True) as h:
        assert h.policies["tp"] is pol and h.policies["pp"].config_for(*site) is None
        assert h.policies["dp"].config_for(*site) == GRADIENT_CONFIG.replace(rounding="nearest")
        assert h.error_feedback


# ---------------------------------------------------------------------- the 3D benchmark's recipe
def test_lr_factor_warms_up_then_decays_by_cosine():
    from types import SimpleNamespace

    from taco_triton.examples.train_megatron import lr_factor

    a = SimpleNamespace(warmup_steps=4, lr_schedule="cosine", min_lr_ratio=0.1, steps=104)
    assert [lr_factor(s, a) for s in (1, 2, 4)] == [0.25, 0.5, 1.0]
    assert lr_factor(54, a) == pytest.approx(0.55)  # half way down: the mean of 1 and 0.1
    assert lr_factor(104, a) == pytest.approx(0.1) and lr_factor(200, a) == pytest.approx(0.1)
    decay = [lr_factor(s, a) for s in range(4, 105)]
    assert all(x > y for x, y in zip(decay, decay[1:]))
    assert lr_factor(50, SimpleNamespace(warmup_steps=0, lr_schedule="constant")) == 1.0


def test_control_nudges_one_weight_by_one_bf16_step():
    from taco_triton.examples.train_megatron import nudge_one_weight

    for sign in (1, -1):
        w = sign * (torch.rand(256, 8, generator=torch.Generator().manual_seed(0)) + 0.5)
        before = w.clone()
        nudge_one_weight(w)
        changed = (w != before).nonzero().tolist()
        assert changed == [[32, 0]]
        b0, b1 = before[32, 0].bfloat16(), w[32, 0].bfloat16()
        assert float(b1) == float(w[32, 0])  # a bf16 value
        assert int(b1.view(torch.int16)) - int(b0.view(torch.int16)) == 1  # the next one away from zero
        assert abs(float(w[32, 0])) > abs(float(b0))


def test_recipe_flags_need_megatron():
    with pytest.raises(SystemExit, match="need --megatron"):
        train_gpt.main(["--clip-grad", "1.0", "--steps", "1"])
