"""The step-time model (`taco_triton.plan`): its communications are those the library's code issues,
its byte counts are the ring formulas `WireStats` counts, its compute the GEMM FLOPs at the stated
efficiency and the non-GEMM passes' bytes at the stated share of HBM, and its composition the 1F1B schedule with the overlaps that exist."""
from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from taco_triton import CompressionConfig, CompressionPolicy
from taco_triton.estimate import compressed_wire_bytes, estimate, ring_bytes
from taco_triton.plan import FABRICS, GPUS, Cluster, Layout, ModelSpec, main, step
from tests.dist_utils import run_ranks

ROOT = Path(__file__).resolve().parents[1]
NATIVE = CompressionPolicy(default=None)


def gpt(**kw) -> ModelSpec:
    """A GPT-style stack: ffn = 4h, no GQA, no gating; replicated embeddings unless asked."""
    base = dict(layers=4, hidden=1024, ffn=4096, heads=16, vocab=50257, seq=512, micro_batch=2,
                parallel_embedding=False)
    return ModelSpec(**{**base, **kw})


H100 = Cluster.preset("H100")


@pytest.mark.parametrize("p", [2, 4, 8])
def test_tp_bytes_are_four_all_reduces_per_layer_per_micro_batch(p):
    spec, m = gpt(), 3
    msg = spec.micro_batch * spec.seq * spec.hidden  # elements of one all-reduce
    r = step(spec, Layout(tp=p, micro_batches=m), H100, CompressionPolicy(min_bytes=0))
    calls = 4 * spec.layers * m
    assert set(r.table.collective) == {"all_reduce"} and r.table["count"].sum() == calls
    assert r.summary["tp_bytes_native"] == pytest.approx(calls * 2 * (p - 1) / p * msg * 2, rel=1e-12)
    wire = compressed_wire_bytes(msg, CompressionConfig(), p, "all_reduce")
    assert r.summary["tp_bytes_compressed"] == pytest.approx(calls * 2 * (p - 1) / p * wire, rel=1e-12)
    # two forward (proj, fc2 outputs) and two backward (qkv, fc1 input gradients) per layer
    assert sorted(r.table.site) == ["layers.*.attn.proj.reduce", "layers.*.attn.qkv.copy",
                                    "layers.*.mlp.fc1.copy", "layers.*.mlp.fc2.reduce"]
    assert dict(r.table.groupby("direction")["count"].sum()) == {"forward": calls // 2, "backward": calls // 2}


@pytest.mark.parametrize("p", [1, 2, 8])
def test_compute_is_three_passes_of_the_gemm_flops_over_tp_at_the_stated_efficiency(p):
    spec, m = gpt(), 5
    cluster = Cluster.preset("A100", gemm_efficiency=0.5)
    b, s, h = spec.micro_batch, spec.seq, spec.hidden
    rate = cluster.tflops * 1e12 * cluster.gemm_efficiency
    r = step(spec, Layout(tp=p, micro_batches=m), cluster)
    layers = m * spec.layers * 3 * (24 * b * s * h ** 2 + 4 * b * s ** 2 * h) / p / rate * 1e3
    assert r.summary["layer_compute_ms"] == pytest.approx(layers, rel=1e-12)
    head = m * 3 * 2 * b * s * h * spec.vocab / rate * 1e3  # replicated output layer: every rank computes it all
    assert r.summary["compute_ms"] == pytest.approx(layers + head, rel=1e-12)


@pytest.mark.parametrize("p,sp", [(1, False), (2, False), (4, True)])
def test_non_gemm_passes_are_the_layers_unfused_reads_and_writes_at_the_elementwise_share(p, sp):
    """Per token and layer, forward: two norms (2h each), two residual adds (3h each), the
    attention output's layout change (2h / p) and GELU (2 ffn / p); backward 3h per norm and
    residual, 2h / p and 3 ffn / p. Norms and residuals on tokens / p under SP. The embedding
    (4h, 3h) and the final norm (2h, 3h) and loss (2V, 3V) once; bf16 at 0.7 of HBM."""
    spec, m = gpt(), 3
    h, f, v, t = spec.hidden, spec.ffn, spec.vocab, spec.tokens
    cluster = Cluster.preset("H100", elementwise_share=0.7)
    r = step(spec, Layout(tp=p, sequence_parallel=sp, micro_batches=m), cluster)
    local = t / (p if sp else 1)
    layer = local * (10 * h + 12 * h) + t * (2 * h + 2 * f + 2 * h + 3 * f) / p
    edges = local * (4 * h + 3 * h + 2 * h + 3 * h) + t * 5 * v
    want = m * (spec.layers * layer + edges) * 2 / (cluster.hbm_gbytes_s * 1e9 * 0.7) * 1e3
    assert r.summary["elementwise_ms"] == pytest.approx(want, rel=1e-12)
    s = r.summary  # one stage, no DP: the step is its micro-batches' GEMMs, passes and TP, then the optimizer
    assert s["step_ms_native"] == pytest.approx(s["compute_ms"] + s["elementwise_ms"] + s["tp_exposed_ms_native"]
                                                + s["optimizer_ms"], rel=1e-12)


def test_tp_messages_sent_in_another_dtype_than_the_compute_add_their_two_casts():
    """FP32 layers sending bf16: each TP all-reduce's message is cast down (read 4, write 2 bytes an
    element) and up again (read 2, write 4): 4 all-reduces per layer and micro-batch."""
    spec, m = gpt(), 2
    cluster = Cluster.preset("H100")
    layout = Layout(tp=2, micro_batches=m)
    bf16, fp32 = (step(gpt(compute_dtype=d), layout, cluster).summary for d in (torch.bfloat16, torch.float32))
    rate = cluster.hbm_gbytes_s * 1e9 * cluster.elementwise_share
    passes = bf16["elementwise_ms"] * 2  # the same passes in 4-byte elements
    casts = m * spec.layers * 4 * 2 * spec.tokens * spec.hidden * (2 + 4) / rate * 1e3
    assert fp32["elementwise_ms"] == pytest.approx(passes + casts, rel=1e-12)


def test_vocabulary_parallel_embedding_and_output_add_one_all_reduce_each():
    spec = gpt(parallel_embedding=True)
    r = step(spec, Layout(tp=4, micro_batches=2), H100)
    assert r.table["count"].sum() == (4 * spec.layers + 2) * 2
    rows = r.table.set_index("site")
    assert rows.loc["embedding.reduce", "direction"] == "forward"
    assert rows.loc["output_layer.copy", "direction"] == "backward"
    assert spec.padded_vocab(4) == 50688 and spec.padded_vocab(4) % (128 * 4) == 0


def test_sequence_parallel_gathers_and_reduce_scatters_with_megatrons_regather():
    spec, p, m = gpt(), 4, 2
    r = step(spec, Layout(tp=p, sequence_parallel=True, micro_batches=m), H100)
    per_layer = r.table.groupby(["direction", "collective"])["count"].sum() / (spec.layers * m)
    # forward: gather into qkv and fc1, reduce-scatter out of proj and fc2; backward: the
    # transposes, plus the re-gather of qkv's and fc1's inputs for their weight gradients
    assert dict(per_layer) == {("backward", "all_gather"): 4, ("backward", "reduce_scatter"): 2,
                               ("forward", "all_gather"): 2, ("forward", "reduce_scatter"): 2}
    assert {"layers.*.attn.qkv.regather", "layers.*.mlp.fc1.regather"} <= set(r.table.site)
    msg = spec.micro_batch * spec.seq * spec.hidden * 2
    ag = r.table[r.table.collective == "all_gather"].iloc[0]
    assert ag.message_bytes == msg and ag.native_bytes == ring_bytes("all_gather", msg / p, p)
    no_regather = step(spec, Layout(tp=p, sequence_parallel=True, micro_batches=m, sp_regather=False), H100)
    without_sp = step(spec, Layout(tp=p, micro_batches=m), H100)
    # an all-gather plus a reduce-scatter send what one all-reduce sends
    assert no_regather.summary["tp_bytes_native"] == pytest.approx(without_sp.summary["tp_bytes_native"])


def test_the_policy_decides_each_site_as_in_training():
    spec, p = gpt(), 2
    exempt = step(spec, Layout(tp=p), H100, CompressionPolicy(exempt=["layers.0.*"], min_bytes=0))
    native = exempt.table[exempt.table.codec == "native"]
    assert len(native) == 4 and set(native["count"]) == {1}  # layer 0's four sites, once each
    assert exempt.table[exempt.table.codec != "native"]["count"].sum() == 4 * (spec.layers - 1)
    fwd_only = step(spec, Layout(tp=p), H100, CompressionPolicy(backward=False, min_bytes=0))
    assert set(fwd_only.table[fwd_only.table.direction == "backward"].codec) == {"native"}
    msg = spec.micro_batch * spec.seq * spec.hidden * 2
    for policy in (None, NATIVE, CompressionPolicy(min_bytes=msg + 1)):
        r = step(spec, Layout(tp=p, micro_batches=2), H100, policy)
        assert set(r.table.codec) == {"native"} and r.summary["speedup"] == 1.0
        assert r.summary["tp_bytes_compressed"] == r.summary["tp_bytes_native"]
    at = step(spec, Layout(tp=p), H100, CompressionPolicy(min_bytes=msg))  # min_bytes is inclusive
    assert "native" not in set(at.table.codec)


def test_each_collective_is_timed_by_estimate():
    spec, p = gpt(), 8
    cfg = CompressionConfig(codec="int8")
    r = step(spec, Layout(tp=p), H100, CompressionPolicy(default=cfg, min_bytes=0))
    row = r.table.iloc[0]
    numel = row.message_bytes // 2
    e = estimate(numel, torch.bfloat16, cfg, H100.intra_gbytes_s * 8, p, codec_gbytes_s=H100.codec_rate(cfg),
                 latency_us=H100.intra_latency_us, pipeline=1)
    assert numel * 2 < 8 << 20  # one pipeline slice: the estimate as it is
    assert row.time_native_ms == pytest.approx(e.native_s * 1e3, rel=1e-12)
    assert row.time_compressed_ms == pytest.approx(e.compressed_s * 1e3, rel=1e-12)
    assert row.wire_bytes == e.compressed_bytes_per_rank


@pytest.mark.parametrize("pp, v", [(4, 1), (4, 2), (2, 1)])
def test_the_pipeline_bubble_is_pp_minus_1_over_v_micro_batches(pp, v):
    spec, m = gpt(layers=8), 8
    r = step(spec, Layout(tp=2, pp=pp, virtual_pp=v, micro_batches=m), H100, CompressionPolicy(min_bytes=0))
    s = r.summary
    for which in ("native", "compressed"):
        pipeline = s[f"step_ms_{which}"] - s["optimizer_ms"] - s[f"dp_exposed_ms_{which}"]
        assert s[f"bubble_ms_{which}"] / pipeline == pytest.approx((pp - 1) / v / (m + (pp - 1) / v), rel=1e-9)
    sends = r.table[r.table.axis == "pp"]
    # plain 1F1B: one send per micro-batch and boundary each way; interleaved: one per chunk,
    # less the wrap-around's missing one at the ends
    assert sends["count"].sum() == m * (2 * (pp - 1) if v == 1 else 2 * (pp * v - 1))
    assert sends.site.str.startswith("megatron.pp.").all()


def test_dp_gradients_hide_under_backward_only_with_overlap_grad_reduce():
    spec = gpt(layers=8, hidden=2048, ffn=8192, heads=16)
    kw = dict(tp=2, dp=4, micro_batches=4, bucket_elems=10_000_000)
    on = step(spec, Layout(overlap_grad_reduce=True, **kw), H100, CompressionPolicy()).summary
    off = step(spec, Layout(**kw), H100, CompressionPolicy()).summary
    assert off["dp_exposed_ms_native"] == pytest.approx(off["dp_ms_native"])
    assert on["dp_exposed_ms_native"] < on["dp_ms_native"] and on["step_ms_native"] < off["step_ms_native"]
    # DP gets the gradient policy megatron's enable derives: INT8 with Hadamard
    r = step(spec, Layout(**kw), H100, CompressionPolicy())
    dp = r.table[r.table.axis == "dp"]
    assert set(dp.codec) == {"int8 G128 hadamard"} and dp.site.str.match(r"megatron\.dp\.bucket\d+\.all_reduce").all()
    params = spec.layers * spec.layer_params() // 2 + 2 * spec.vocab * spec.hidden
    assert dp.message_bytes.sum() >= params * 2 and len(dp) == math.ceil(params / 10_000_000)
    dist_opt = step(spec, Layout(distributed_optimizer=True, **kw), H100, CompressionPolicy(), dp=NATIVE)
    assert set(dist_opt.table[dist_opt.table.axis == "dp"].collective) == {"reduce_scatter", "all_gather"}


def test_links_follow_megatrons_rank_order():
    c = Cluster.preset("H800")
    assert c.link(8) == (200.0, 3.0) and c.link(16) == (50.0, 8.0)
    spec = gpt(layers=8)
    inside = step(spec, Layout(tp=8), c)
    across = step(spec, Layout(tp=16, micro_batches=1), Cluster.preset("H800", gpus_per_node=8))
    row_in, row_out = inside.table.iloc[0], across.table.iloc[0]
    assert row_in.time_native_ms < row_out.time_native_ms


def test_presets_are_the_datasheet_values_and_every_field_overrides():
    assert set(GPUS) == {"A100", "A800", "H100", "H800", "H200", "B200", "MI300X"}
    h800 = Cluster.preset("H800")
    assert (h800.tflops, h800.hbm_gbytes_s, h800.intra_gbytes_s, h800.inter_gbytes_s) == (989.0, 3350.0, 200.0, 50.0)
    assert Cluster.preset("mi300x", "roce-200").inter_gbytes_s == FABRICS["roce-200"] == 25.0
    c = Cluster.preset("B200", gemm_efficiency=0.8, codec_gbytes_s=1000.0)
    assert c.gemm_efficiency == 0.8 and c.codec_rate(CompressionConfig()) == 1000.0
    # a codec pass moves the dense message and its compressed form (FP8 G=128: 0.504 of bf16's bytes)
    derived = Cluster.preset("H100").codec_rate(CompressionConfig())
    assert 0.7 * 3350 / 1.505 < derived < 0.7 * 3350 / 1.503
    for bad in (dict(name="V100"), dict(name="H100", fabric="ethernet")):
        with pytest.raises(ValueError):
            Cluster.preset(**bad)
    with pytest.raises(ValueError, match="gemm_efficiency"):
        Cluster.preset("H100", gemm_efficiency=0)


QWEN25_7B = {"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28,
             "num_key_value_heads": 4, "num_hidden_layers": 28, "vocab_size": 152064, "hidden_act": "silu"}


def test_model_specs_from_hf_configs_and_megatron_arguments(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(pd.Series(QWEN25_7B).to_json())
    q = ModelSpec.from_hf_config(path, seq=512, micro_batch=8)
    assert (q.layers, q.hidden, q.ffn, q.heads, q.kv_heads, q.gated_mlp, q.kv_dim) == (28, 3584, 18944, 28, 4, True, 512)
    assert 6.9e9 < q.layers * q.layer_params() + 2 * q.vocab * q.hidden < 7.7e9  # "7B"
    g = ModelSpec.from_hf_config({"n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257,
                                  "activation_function": "gelu_new"}, seq=1024, micro_batch=4)
    assert (g.ffn, g.gated_mlp, g.kv_heads) == (3072, False, None)
    args = dict(num_layers=32, hidden_size=2560, num_attention_heads=32, seq_length=2048, micro_batch_size=1,
                padded_vocab_size=50304, tensor_model_parallel_size=4, pipeline_model_parallel_size=2,
                global_batch_size=64, sequence_parallel=True, use_distributed_optimizer=True)
    m = ModelSpec.from_megatron_args(args)
    assert (m.ffn, m.vocab) == (4 * 2560, 50304)
    lay = Layout.from_megatron_args(args, world_size=32)
    assert (lay.tp, lay.pp, lay.dp, lay.micro_batches, lay.sequence_parallel, lay.distributed_optimizer) == \
        (4, 2, 4, 16, True, True)
    with pytest.raises(ValueError, match="lacks"):
        ModelSpec.from_hf_config({"hidden_size": 8}, seq=1, micro_batch=1)
    with pytest.raises(ValueError, match="divisible"):
        step(gpt(), Layout(tp=3), H100)


def test_the_command_line_prints_the_summary_and_the_table(capsys):
    r = main(["--gpu", "H800", "--layers", "2", "--hidden", "1024", "--heads", "16", "--tp", "4", "--micro-batches", "2",
              "--axes", "tp", "--min-bytes", "0"])
    out = capsys.readouterr().out
    assert "MODEL (not a measurement)" in out and "step_ms_native" in out and "layers.*.mlp.fc2.reduce" in out
    assert r.summary["tp_bytes_compressed"] < r.summary["tp_bytes_native"]
    assert set(r.table[r.table.axis != "tp"].codec) <= {"native"}
    ran = subprocess.run([sys.executable, "-m", "taco_triton.plan", "--help"], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert ran.returncode == 0 and "--hf-config" in ran.stdout


def _wire_of_tinygpt(rank, world, mode):
    """Bytes this rank hands the process group in one TinyGPT forward and backward (no
    fingerprints), as WireStats counts them."""
    import taco_triton as taco
    from taco_triton.examples.gpt import TinyGPT

    torch.manual_seed(0)
    policy = CompressionPolicy(default=None if mode == "none" else CompressionConfig(), min_bytes=0,
                               comm_dtype=torch.bfloat16)
    model = TinyGPT(layers=2, d=64, heads=4, ffn=256, seq=64, policy=policy)
    tokens = torch.randint(0, 256, (2, 64))
    with taco.WireStats() as ws:
        model.loss(tokens, tokens).backward()
    return ws.wire_bytes - ws.fingerprint_bytes


def test_tp_bytes_match_what_wirestats_counts_in_a_real_step():
    # 2 x 64 tokens x 64 = 2 super-blocks: both ranks' chunks are the same size. (With uneven
    # chunks WireStats counts the all-gather's slots padded to the largest chunk, which
    # `estimate.compressed_wire_bytes` does not: a message under P super-blocks is undercounted.)
    spec = ModelSpec(layers=2, hidden=64, ffn=256, heads=4, vocab=256, seq=64, micro_batch=2, parallel_embedding=False)
    r = step(spec, Layout(tp=2), H100, CompressionPolicy(min_bytes=0))
    for mode, key in (("none", "tp_bytes_native"), ("fp8", "tp_bytes_compressed")):
        got = run_ranks(_wire_of_tinygpt, 2, mode)
        assert got[0] == got[1] == pytest.approx(r.summary[key], rel=1e-12), mode


def test_the_cpu_validation_predicts_every_measured_step_within_15_percent():
    """bench/plan_validation.py's table (the model, fed with this machine's rates measured by
    microbenchmarks, GEMMs and non-GEMM passes, the codec rate and the throttled link, next to
    the measured step medians): at least 3 link rates, the bf16 baseline and a compressed mode,
    every prediction what the model gives for the row's recorded rates, and within 15% of the
    measured median."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import plan_validation as pv
    finally:
        sys.path.remove(str(ROOT / "bench"))
    df = pd.read_csv(ROOT / "bench" / "results" / "plan_validation_cpu.csv", dtype={"link": str})
    assert {"link", "mode", "measured_step_ms", "predicted_step_ms", "gemm_s", "elementwise_s"} <= set(df.columns)
    assert df.link.nunique() >= 3 and {"none"} < set(df["mode"])
    for row in df.itertuples():
        args = type("A", (), {k: getattr(row, k) for k in pv.DEFAULTS})
        codec = row.codec_gbytes_s if row.mode != "none" else 1.0
        again = pv.predict(float(row.link), row.mode, row.gemm_s, row.elementwise_s, codec, row.latency_us, args)
        assert again["predicted_step_ms"] == pytest.approx(row.predicted_step_ms, rel=1e-9)
        # the microbenchmarks' time, plus the casts and the optimizer at the passes' rate
        assert again["model_compute_ms"] > 1e3 * (row.gemm_s + row.elementwise_s)
        # plus 8 all-reduces of b s h bf16 at rate / 2 per rank, 2 steps' latency each (and the codec)
        link_ms = 8 * row.batch * row.seq * row.hidden * 2 / (float(row.link) / 8 / 2 * 1e9) * 1e3
        link_ms += 8 * 2 * row.latency_us * 1e-3
        if row.mode == "none":
            assert row.predicted_step_ms == pytest.approx(again["model_compute_ms"] + link_ms, rel=1e-9)
        else:
            assert row.predicted_step_ms > again["model_compute_ms"] + link_ms / 2
        assert abs(row.predicted_step_ms / row.measured_step_ms - 1) <= 0.15, row


def test_the_cpu_validation_runs_end_to_end_on_a_small_model(tmp_path):
    """A small case of bench/plan_validation.py on the plain loopback: both ranks train a 1-layer
    TinyGPT (h = 32) with FP8 TP for 3 steps, the microbenchmarks and the codec timed between
    steps; the model is fed what they measured and adds the TP collectives to their time."""
    import argparse

    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import plan_validation as pv
    finally:
        sys.path.remove(str(ROOT / "bench"))
    args = argparse.Namespace(batch=2, seq=16, hidden=32, layers=1, heads=4, steps=3, warmup=1, cell_timeout=300)

    class Loopback:  # no namespace: the command as it is
        @staticmethod
        def wrap(argv):
            return argv

    got = pv.run_cell(Loopback(), "fp8", args, str(tmp_path))
    for k in ("measured_step_ms", "measured_compute_ms", "gemm_s", "elementwise_s", "latency_us", "codec_gbytes_s"):
        assert got[k] > 0 and math.isfinite(got[k]), (k, got)
    p = pv.predict(10.0, "fp8", got["gemm_s"], got["elementwise_s"], got["codec_gbytes_s"], got["latency_us"], args)
    flops, nbytes = pv.step_work(args)
    assert p["model_tflops"] == pytest.approx(flops / got["gemm_s"] / 1e12, rel=1e-12)
    assert p["model_gbytes_s"] == pytest.approx(nbytes / got["elementwise_s"] / 1e9, rel=1e-12)
    assert p["predicted_step_ms"] > p["model_compute_ms"] > 1e3 * (got["gemm_s"] + got["elementwise_s"])


def test_the_step_time_page_shows_what_its_blocks_print():
    """Every table row the guide's blocks print is on the page as printed (the first block is the
    quick example: it prints the table of one step, not a page table)."""
    import contextlib
    import io
    import re

    page = (ROOT / "docs" / "guides" / "step-time.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", page, re.S | re.M)
    assert len(blocks) == 4
    for code in blocks[1:]:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, "step-time.md", "exec"), {})
        rows = [line for line in out.getvalue().splitlines() if line.startswith("|")]
        assert rows and all(row in page.splitlines() for row in rows), rows
