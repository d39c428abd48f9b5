"""bench/noise_ratio.py and bench/convergence.py: their statistics are the ones their docs define,
the probe they hang on train_gpt sees the same batch with and without compression and leaves the
training as it was, both run from a shell (`--quick`) writing the rows the docs describe, and
`train_gpt --minilm`'s TP split of the pretrained encoder computes the unsplit model's loss."""
from __future__ import annotations

import math
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pandas as pd
import pytest
import torch

from taco_triton.examples import train_gpt

from .helpers import load_script
from .test_entry_points import clean_env

ROOT = Path(__file__).resolve().parents[1]
noise_ratio = load_script(ROOT / "bench" / "noise_ratio.py")
NOISE_COLUMNS = ["model", "step", "codec", "group_size", "hadamard", "rounding", "tensor", "e", "s", "e_over_s",
                 "machine", "commit", "date"]
CONVERGENCE_COLUMNS = ["model", "mode", "seed", "steps", "final_val_loss", "delta_vs_none_pct", "machine", "commit",
                       "date"]


def test_noise_statistics_follow_their_definitions():
    # s^2: the unbiased variance of each element over the K gradients, summed; e^2: mean over the K
    # batches of ||d_k||^2; e_mean: ||mean_k d_k||. Computed here from the definitions directly.
    g = torch.Generator().manual_seed(0)
    k, shapes = 5, {"a": (3, 4), "b": (7,)}
    exact = [{n: torch.randn(s, generator=g).reshape(-1) for n, s in shapes.items()} for _ in range(k)]
    d = [{n: 0.1 * torch.randn(s, generator=g).reshape(-1) for n, s in shapes.items()} for _ in range(k)]
    d_sq = {n: sum(float(dk[n].double().square().sum()) for dk in d) for n in shapes}
    em2 = {n: float((sum(dk[n].double() for dk in d) / k).square().sum()) for n in shapes}
    setting = noise_ratio.Measure("fp8", None, True, True, None)
    probe = noise_ratio.NoiseProbe("m", [0], k, 2, 0, [setting])
    probe._rows(0, 2, exact, {"fp8": (d_sq, em2)}, loss=1.0, tokens=8)
    rows = pd.DataFrame(probe.rows).set_index("tensor")
    for part in (["a"], ["b"], ["a", "b"]):
        stack = {n: torch.stack([x[n].double() for x in exact]) for n in part}
        s = math.sqrt(sum(float(stack[n].var(dim=0, unbiased=True).sum()) for n in part))
        e = math.sqrt(sum(float(torch.stack([x[n].double() for x in d]).square().sum()) for n in part) / k)
        e_mean = math.sqrt(sum(float(torch.stack([x[n].double() for x in d]).mean(0).square().sum()) for n in part))
        row = rows.loc["all" if len(part) == 2 else part[0]]
        assert row.s == pytest.approx(s, rel=1e-12) and row.e == pytest.approx(e, rel=1e-12)
        assert row.e_mean == pytest.approx(e_mean, rel=1e-12) and row.e_over_s == pytest.approx(e / s, rel=1e-12)


def test_a_tensor_whose_sgd_noise_is_bf16_rounding_is_left_out_of_the_maximum():
    rows = pd.DataFrame([
        dict(model="m", step=0, batch=8, mode=mode, tensor=t, e_over_s=r)
        for mode, per in (("bf16", {"w": 0.001, "key.bias": 2.0, "all": 0.001}), ("fp8", {"w": 0.1, "key.bias": 9.0,
                                                                                         "all": 0.1}))
        for t, r in per.items()])
    flagged = noise_ratio.flag_unmeasurable(rows).set_index(["mode", "tensor"]).s_measurable
    assert not flagged[("fp8", "key.bias")] and not flagged[("bf16", "key.bias")]
    assert flagged[("fp8", "w")] and flagged[("fp8", "all")]


TINY = dict(layers=1, hidden=32, heads=2, ffn=64, seq=16, batch=2, lr=2e-3, seed=0, eval_every=2, eval_batches=1,
            data_bytes=65536, min_bytes=0, compute_dtype="fp32", sequence_parallel=False, megatron=False,
            dtensor=False, minilm=False, verbose=False, calibrate_steps=5, plan=None)


def test_probe_sees_the_same_batch_and_leaves_training_unchanged():
    # One process, no process group: nothing is communicated, so a probe that compares gradients of
    # the same batch must find e == 0 exactly; the policy, the grads and the training's losses are
    # those of a run without it.
    args = Namespace(**TINY, steps=3)
    plain = train_gpt._train(0, 1, "int4", args, torch.device("cpu"))
    probe = noise_ratio.NoiseProbe("tiny", [0, 2], 3, 2, 0, noise_ratio.measures(["fp8", "int4"], ["int4"], args))
    seen = []

    def checked(step, model, policy, data):
        before = (policy.default, policy.forward, policy.backward, policy.comm_dtype)
        probe(step, model, policy, data)
        seen.append((before == (policy.default, policy.forward, policy.backward, policy.comm_dtype),
                     all(p.grad is None for p in model.parameters())))

    probed = train_gpt._train(0, 1, "int4", args, torch.device("cpu"), checked)
    cols = ["step", "train_loss", "val_loss"]
    assert pd.DataFrame(plain)[cols].equals(pd.DataFrame(probed)[cols])
    assert seen == [(True, True)] * 4  # steps 0..3
    rows = pd.DataFrame(probe.rows)
    assert sorted(rows.step.unique()) == [0, 2] and set(rows["mode"]) == {"bf16", "fp8", "int4", "int4-sr"}
    assert (rows.e == 0).all() and (rows.s > 0).all()


def _run(argv, tmp_path):
    run = subprocess.run([sys.executable, *argv], cwd=ROOT, env=clean_env(tmp_path / "fresh"), capture_output=True,
                         text=True, timeout=600)
    out = run.stdout + run.stderr
    assert run.returncode == 0 and "Traceback" not in out, out[-4000:]
    return out


def test_noise_ratio_quick_runs_from_a_shell(tmp_path):
    out = _run(["bench/noise_ratio.py", "--quick", "--csv", str(tmp_path / "n.csv")], tmp_path)
    assert "compression noise e over SGD noise s" in out
    df = pd.read_csv(tmp_path / "n.csv")
    assert set(NOISE_COLUMNS) <= set(df.columns)
    assert set(df["mode"]) == {"bf16", "fp8", "int4", "int4-sr"} and sorted(df.step.unique()) == [0, 2]
    compressed = df[df["mode"] != "bf16"]
    assert (compressed.e > 0).all() and (df.s > 0).all()  # TP=2: the collectives compressed something
    # "all" is the whole model: e^2 and s^2 add over tensors, to the CSV's 6 significant digits (a
    # value within 5e-6 relative, its square within 1e-5, on each side)
    for _, t in df.groupby(["step", "mode"]):
        whole, parts = t[t.tensor == "all"].iloc[0], t[t.tensor != "all"]
        assert whole.e ** 2 == pytest.approx((parts.e ** 2).sum(), rel=2e-5)
        assert whole.s ** 2 == pytest.approx((parts.s ** 2).sum(), rel=2e-5)


def test_convergence_quick_runs_from_a_shell(tmp_path):
    pytest.importorskip("matplotlib")
    csv, curves, png = tmp_path / "c.csv", tmp_path / "curves.csv", tmp_path / "c.png"
    out = _run(["bench/convergence.py", "--quick", "--csv", str(csv), "--curves-csv", str(curves), "--plot", str(png)],
               tmp_path)
    assert "paired by seed" in out
    runs = pd.read_csv(csv)
    assert set(CONVERGENCE_COLUMNS) <= set(runs.columns) and sorted(runs["mode"]) == ["fp8", "none"]
    base = runs.set_index("mode").final_val_loss["none"]
    assert runs.delta_vs_none_pct.to_list() == pytest.approx(list(100 * (runs.final_val_loss / base - 1)))
    assert runs.delta_native_vs_none_pct.to_list() == pytest.approx(list(100 * (runs.final_val_loss_native / base - 1)))
    none = runs.set_index("mode").loc["none"]  # nothing to turn off in the baseline: the same loss
    assert none.final_val_loss_native == none.final_val_loss
    steps = pd.read_csv(curves)
    assert sorted(steps.step.unique()) == [2, 4] and steps.val_loss.notna().sum() == 4  # evaluated: 2 steps x 2 modes
    assert png.stat().st_size > 10_000


def _minilm_loss(rank: int, world: int) -> float:
    """One masked-LM batch's loss of the pretrained encoder over `world` ranks, FP32 communication."""
    from taco_triton.examples import minilm
    from taco_triton.parallel import CompressionPolicy

    torch.manual_seed(0)  # the head the checkpoint lacks: the same initialisation everywhere
    model, tokenizer = minilm.load(world, CompressionPolicy(default=None, min_bytes=0, comm_dtype=torch.float32))
    x, labels = minilm.MaskedBatches(tokenizer, 65536, 16).batch("train", 2, torch.Generator().manual_seed(1))
    assert 0 < int((labels != minilm.IGNORE).sum()) < labels.numel()
    with torch.no_grad():
        return float(model.loss(x, labels))


def test_minilm_at_tp2_computes_the_loss_of_the_unsharded_model():
    # train_gpt --minilm's model split over 2 ranks (DTensor, native FP32 collectives) gives the loss
    # of the same model and batch in one process, up to the order of FP32 sums (each attention and
    # FFN output is the sum of two rank partials).
    from taco_triton.realdata import model_available

    from .dist_utils import run_ranks

    if not model_available():
        pytest.skip("needs the `real` extra (all-MiniLM-L6-v2)")
    whole = _minilm_loss(0, 1)
    split = run_ranks(_minilm_loss, 2)
    assert split[0] == split[1] == pytest.approx(whole, rel=1e-6)
