"""`make demo`: compress real tensor-parallel traffic with every codec, on CPU, in about a minute.

    python -m taco_triton.demo [--quick]

1. Real TP tensors (all-MiniLM-L6-v2 sharded TP=4, forward partial sums and backward input
   gradients; see taco_triton.realdata), or realistic synthetic ones if the [real] extra is
   missing: each codec's compression ratio, relative L2 error, max error and round-trip time
   with the torch backend.
2. The fused Triton kernels in Triton's CPU interpreter on a small slice, checked against the
   reference (interpreter timings say nothing about GPU speed).
3. What `calibrate` picks for these tensors.
4. Two ranks (gloo, CPU processes) all-reduce real TP=2 partial sums natively in bf16 and
   compressed: bytes on the wire, time and error against the exact sum.
5. TP=2 training of a small GPT on the standard library's source text, communication
   uncompressed (bf16) vs FP8 vs INT8: loss, bytes and step time side by side.
"""
from __future__ import annotations

import argparse
import time

import torch

import taco_triton as taco
from taco_triton.calibrate import relative_l2
from taco_triton.env import use_interpreter_on_cpu

DEMO_CONFIGS = [
    taco.CompressionConfig(scales="taco_fp32x2"),
    taco.CompressionConfig(),
    taco.CompressionConfig(hadamard=False),
    taco.CompressionConfig(codec="fp8_e5m2"),
    taco.CompressionConfig(codec="int8", hadamard=False),
    taco.CompressionConfig(codec="int8"),
    taco.CompressionConfig(codec="int8", group_size=32),
    taco.CompressionConfig(codec="int8", group_size=512),
    taco.CompressionConfig(codec="int6", group_size=32),
    taco.CompressionConfig(codec="int6", group_size=32, hadamard=False),
    taco.CompressionConfig(codec="int4", group_size=32),
]


def load_tensors(quick: bool) -> tuple[dict[str, torch.Tensor], str]:
    from taco_triton.realdata import capture_tp_tensors, model_available

    if model_available():
        t = capture_tp_tensors(tp=4, rank=0, n_texts=16 if quick else 32, max_tokens=64 if quick else 128)
        keep = ["layer2.attn_out.fwd", "layer2.ffn_out.fwd", "layer4.ffn_out.fwd", "layer2.qkv_in.bwd", "layer2.ffn_in.bwd"]
        return {k: t[k].bfloat16() for k in keep}, "real: all-MiniLM-L6-v2, TP=4 rank 0"
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 384, generator=g)
    x[:, ::97] *= 150.0  # outlier channels, as in trained transformers
    return {"synthetic.outliers": x.bfloat16(), "synthetic.dense": torch.randn(2048, 384, generator=g).bfloat16()}, \
        "synthetic (install the [real] extra for real tensors)"


def codec_table(tensors: dict[str, torch.Tensor]):
    import pandas as pd

    rows = []
    taco.decompress(taco.compress(torch.zeros(8), backend="torch"), backend="torch")  # warm-up: first op call
    for cfg in DEMO_CONFIGS:
        errs, maxerr, secs, ratio = [], 0.0, 0.0, 0.0
        for x in tensors.values():
            t0 = time.perf_counter()
            c = taco.compress(x, cfg, backend="torch")
            y = taco.decompress(c, backend="torch")
            secs += time.perf_counter() - t0
            errs.append(relative_l2(x, y))
            maxerr = max(maxerr, float((y.float() - x.float()).abs().max() / x.float().abs().max()))
            ratio = c.ratio
        rows.append({"codec": cfg.codec, "G": cfg.group_size, "hadamard": cfg.hadamard, "scales": cfg.scales,
                     "ratio_vs_bf16": round(ratio, 3), "rel_l2_%_mean": round(100 * sum(errs) / len(errs), 3),
                     "rel_l2_%_max": round(100 * max(errs), 3), "max_err_/amax": f"{maxerr:.2e}",
                     "cpu_ms_per_MB": round(1e3 * secs / (sum(x.numel() * 2 for x in tensors.values()) / 2**20), 1)})
    return pd.DataFrame(rows)


def hadamard_note(table) -> str:
    """Two lines on the default's Hadamard transform, from `codec_table`'s own measurements: on
    FP8 it may cost error (as on the real tensors), while the integer codes need it."""

    def mean(codec: str, hadamard: bool) -> float:
        row = table[(table.codec == codec) & (table.G == 128) & (table.hadamard == hadamard) & (table.scales == "dual")]
        return float(row["rel_l2_%_mean"].iloc[0])

    def side(pair: tuple[float, float]) -> str:
        return "less" if pair[0] < pair[1] else "more"

    fp8, int8 = (mean("fp8_e4m3", True), mean("fp8_e4m3", False)), (mean("int8", True), mean("int8", False))
    return (f"   Hadamard: FP8 E4M3 errs {side(fp8)} with it here (mean {fp8[0]:.3f}% with, {fp8[1]:.3f}% without), "
            f"INT8 {side(int8)} ({int8[0]:.3f}% vs {int8[1]:.3f}%).\n"
            "   The default keeps it for FP8 as the TACO paper validated FP8 + Hadamard in training; see "
            "docs/choosing-a-config.md.")


def interpreter_check(x: torch.Tensor) -> None:
    from taco_triton import reference

    on_gpu = x.is_cuda
    where = "GPU" if on_gpu else "Triton interpreter on CPU (timings are NOT GPU performance)"
    print(f"\n2) Fused Triton kernels, {where}: {tuple(x.shape)} bf16")
    for cfg in (taco.CompressionConfig(hadamard=False), taco.CompressionConfig(), taco.CompressionConfig(codec="int8"),
                taco.CompressionConfig(codec="int6", group_size=32)):
        t0 = time.perf_counter()
        c = taco.compress(x, cfg, backend="triton")
        y = taco.decompress(c, backend="triton")
        dt = time.perf_counter() - t0
        ref_bytes = reference.compress_reference(x.cpu(), cfg)
        same = int((c.data.cpu() == ref_bytes).sum())
        print(f"   {cfg.codec:9s} G={cfg.group_size} hadamard={cfg.hadamard!s:5s}: wire bytes equal to the "
              f"reference {same}/{ref_bytes.numel()}, rel. L2 error {100 * relative_l2(x, y):.3f}%, {dt:.2f} s")


def _all_reduce_worker(rank: int, world: int, port: int, inputs: dict, queue) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        rows = []
        for name, x in inputs[rank].items():
            exact = sum(inputs[r][name].double() for r in range(world))
            for label, cfg in (("native bf16", taco.CompressionConfig(enabled=False)),
                               ("fp8_e4m3 G128 H", taco.CompressionConfig()),
                               ("int8 G128 H", taco.CompressionConfig(codec="int8")),
                               ("int6 G32 H", taco.CompressionConfig(codec="int6", group_size=32))):
                t = x.clone()
                taco.all_reduce(t.clone(), config=cfg, min_bytes=0)  # warm-up
                dist.barrier()
                with taco.WireStats() as ws:
                    t0 = time.perf_counter()
                    taco.all_reduce(t, config=cfg, min_bytes=0)
                    secs = time.perf_counter() - t0
                rows.append({"tensor": name, "all_reduce": label, "wire_MB_per_rank": ws.wire_bytes / 2**20,
                             "ms": 1e3 * secs, "rel_l2_%": 100 * relative_l2(exact, t)})
        queue.put((rank, rows))
    finally:
        dist.destroy_process_group()


def two_rank_all_reduce(quick: bool) -> None:
    import pandas as pd

    from taco_triton.examples.ranks import spawn_ranks
    from taco_triton.realdata import capture_tp_tensors, model_available

    keep = ["layer2.ffn_out.fwd", "layer2.qkv_in.bwd"]
    if model_available():
        kw = dict(tp=2, n_texts=16 if quick else 32, max_tokens=64 if quick else 128)
        inputs = [{k: capture_tp_tensors(rank=r, **kw)[k].bfloat16() for k in keep} for r in range(2)]
    else:
        g = torch.Generator().manual_seed(1)
        inputs = [{"synthetic": torch.randn(2048, 384, generator=g).bfloat16()} for _ in range(2)]
    results = spawn_ranks(_all_reduce_worker, 2, inputs)
    print("\n4) all_reduce of real TP=2 partial sums on 2 gloo ranks (CPU; loopback, no link emulation):")
    print(pd.DataFrame(results[0]).round(3).to_string(index=False))
    print("   wire_MB_per_rank: bytes each rank hands to the process group (ring all-reduce 2(P-1)/P of the\n"
          "   buffer; compressed: all-to-all + all-gather of the wire buffers). On CPU the codec is the torch\n"
          "   reference and loopback is fast, so time favours native here: see bench/collectives.py for links.")


def tp_training(quick: bool) -> None:
    from taco_triton.examples import train_gpt

    steps = 40 if quick else 120
    print(f"\n5) TP=2 training, {steps} steps, same weights and batches per mode (gloo on CPU; the\n"
          "   baseline communicates bf16; CPU step times include the torch reference codec):")
    _, summary = train_gpt.main(["--tp", "2", "--compress", "none,fp8,int8,int6", "--steps", str(steps),
                                 "--eval-every", str(steps), "--eval-batches", "4", "--batch", "8", "--seq", "64",
                                 "--hidden", "128", "--ffn", "512", "--data-bytes", str(2 << 20), "--quiet"])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="taco-triton demo")
    ap.add_argument("--quick", action="store_true", help="smaller capture")
    args = ap.parse_args(argv)
    # Section 2 runs the Triton kernels; on CPU that is Triton's interpreter. Decided first, before
    # section 1 loads a model through transformers (which imports torch._dynamo, which imports Triton).
    device = "cuda" if torch.cuda.is_available() else "cpu"
    use_interpreter_on_cpu(device)
    import pandas as pd

    pd.set_option("display.width", 200)
    tensors, source = load_tensors(args.quick)
    n = sum(x.numel() for x in tensors.values())
    print(f"1) Every codec on {len(tensors)} TP tensors ({source}; {n / 1e6:.1f} M elements), torch backend:")
    table = codec_table(tensors)
    print(table.to_string(index=False))
    print("   ratio_vs_bf16: bytes of bf16 / bytes on the wire (scales included); errors vs the bf16 input.")
    print(hadamard_note(table))

    first = next(iter(tensors.values()))
    interpreter_check(first[:24].to(device) if device == "cpu" else first.to(device))

    res = taco.calibrate(list(tensors.values()), backend="torch")
    best = res.table.sort_values("rel_l2_mean").head(5)
    print("\n3) calibrate() on these tensors (max 1.0625 wire bytes per element): top 5 of", len(res.table))
    print(best[["codec", "group_size", "hadamard", "bytes_per_element", "rel_l2_mean", "rel_l2_max"]].to_string(index=False))
    print(f"   chosen: {res.config}")
    res = taco.calibrate(list(tensors.values()), max_error=0.025, backend="torch")
    row = res.table[res.table.chosen].iloc[0]
    print(f"   by error budget, calibrate(max_error=0.025): the fewest bytes whose error bound on held-out tensors "
          f"(worst sample + margin) is <= 2.5%: {row.codec} G={row.group_size} hadamard={row.hadamard}, "
          f"{row.rate_bytes_per_element:.3f} bytes/element ({2 / row.rate_bytes_per_element:.2f}x vs bf16), worst error "
          f"{100 * row.rel_l2_max:.2f}% + margin {100 * row.margin:.2f}%")

    two_rank_all_reduce(args.quick)
    tp_training(args.quick)


if __name__ == "__main__":
    main()
