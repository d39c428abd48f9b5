"""Published end-to-end setups, as the step-time model takes them (the documentation's table).

Each setup states what was published about it and what is assumed where the publication is silent
(`Setup.assumed`). The published figures compare their authors' systems (COCCL: TACO for TP
all-gathers, SDP4Bit for reduce-scatters, TAH-Quant for pipeline sends, against NCCL); the
policies here are what taco-triton offers in their place (see each setup's `policy_note`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..config import CompressionConfig
from ..policy import CompressionPolicy
from .hardware import Cluster
from .spec import Layout, ModelSpec

__all__ = ["Setup", "describe", "markdown_row", "setups"]

MIB = 1 << 20
FP8 = CompressionConfig()
INT8 = CompressionConfig(codec="int8")
INT4 = CompressionConfig(codec="int4", group_size=32)
NATIVE = CompressionPolicy(default=None)


@dataclass
class Setup:
    """One modelled setup and what was published about it."""

    name: str
    model: ModelSpec
    layout: Layout
    cluster: Cluster
    policies: dict
    """{"tp": ..., "pp": ..., "dp": ...} policies (`taco_triton.plan.step`'s keywords)."""
    published: str = ""
    """The published figure, or "" where none exists."""
    assumed: list = field(default_factory=list)
    """What the publication does not state and the model assumes."""
    policy_note: str = ""
    """What is compressed, and how it differs from the published system."""


def _gpt(name: str, layers: int, hidden: int, heads: int) -> ModelSpec:
    return ModelSpec(layers=layers, hidden=hidden, ffn=4 * hidden, heads=heads, vocab=50257, seq=2048, micro_batch=1,
                     name=name)


def _coccl_policies(min_bytes: int = 10 * MIB) -> dict:
    """COCCL's GPT script as taco-triton's pieces: FP8 (TACO) on TP, INT8 on pipeline sends (for
    TAH-Quant), INT4 G=32 with Hadamard on DP gradient reduce-scatters (for SDP4Bit's 4-bit
    inter-node gradients); its 10 MB threshold."""
    return {"tp": CompressionPolicy(default=FP8, min_bytes=min_bytes),
            "pp": CompressionPolicy(default=INT8, min_bytes=min_bytes),
            "dp": CompressionPolicy(default=INT4, min_bytes=min_bytes)}


def setups() -> list[Setup]:
    """The documentation's setups.

    Returns:
        The `Setup`s, in the table's order.
    """
    h800 = Cluster.preset("H800")
    qwen = ModelSpec(layers=28, hidden=3584, ffn=18944, heads=28, kv_heads=4, vocab=152064, seq=512, micro_batch=8,
                     gated_mlp=True, name="Qwen2.5-7B")
    taco_layout = Layout(tp=2, pp=2, dp=2, sequence_parallel=True, micro_batches=4)
    coccl_layout = Layout(tp=4, pp=2, dp=4, sequence_parallel=True, micro_batches=32, distributed_optimizer=True)
    coccl_assumed = ["TP 4 x PP 2 x DP 4 (TP inside a node, PP across nodes), sequence parallelism, distributed "
                     "optimizer", "sequence 2048, micro-batch 1, global batch 128 (32 micro-batches)",
                     "H800 NVLink 200 GB/s, one 400 Gb/s InfiniBand NIC per GPU"]
    llama70 = ModelSpec(layers=80, hidden=8192, ffn=28672, heads=64, kv_heads=8, vocab=128256, seq=4096,
                        micro_batch=1, gated_mlp=True, name="70B (Llama-3 shape)")
    h100 = Cluster.preset("H100")
    out = [
        Setup("TACO's Qwen2.5-7B script, all-reduce only", qwen, taco_layout, h800,
              {"tp": NATIVE, "pp": NATIVE, "dp": CompressionPolicy(default=FP8, min_bytes=10 * MIB)},
              assumed=["8 x H800 in one node (the script runs on 8 GPUs; the paper's GPUs are not stated here)"],
              policy_note="FP8 on all-reduces only: with sequence parallelism TP has none, so the DP gradient "
                          "all-reduce is what it compresses"),
        Setup("TACO's Qwen2.5-7B script, TP collectives FP8", qwen, taco_layout, h800,
              {"tp": CompressionPolicy(default=FP8, min_bytes=10 * MIB), "pp": NATIVE, "dp": NATIVE},
              assumed=["as above"], policy_note="FP8 on TP's all-gathers and reduce-scatters instead"),
    ]
    for name, layers, hidden, heads, published in (("GPT 2.7B", 32, 2560, 32, "88.5 -> 94.5, 1.06x"),
                                                    ("GPT 6.7B", 32, 4096, 32, "148.6 -> 163.2, 1.10x"),
                                                    ("GPT 13B", 40, 5120, 40, "158.8 -> 197.1, 1.24x")):
        out.append(Setup(f"COCCL {name}, 32 x H800", _gpt(name, layers, hidden, heads), coccl_layout, h800,
                         _coccl_policies(), published=published, assumed=coccl_assumed,
                         policy_note="TP FP8, PP INT8, DP reduce-scatter INT4 G=32 (for SDP4Bit's 4-bit); the "
                                     "parameter all-gather native (SDP4Bit sends 4-bit weight differences)"))
    out.append(Setup("COCCL Qwen2.5-7B, 32 x H800", ModelSpec(**{**qwen.__dict__, "seq": 2048, "micro_batch": 1}),
                     coccl_layout, h800, _coccl_policies(), published="222.3 -> 234.2, 1.05x",
                     assumed=coccl_assumed, policy_note="as the GPT rows"))
    for name, layout in (("70B, TP 8 x PP 2 (two nodes)", Layout(tp=8, pp=2, sequence_parallel=True, micro_batches=16)),
                         ("70B, TP 16 across two nodes", Layout(tp=16, sequence_parallel=True, micro_batches=16))):
        out.append(Setup(name, llama70, layout, h100,
                         {"tp": CompressionPolicy(default=FP8), "pp": CompressionPolicy(default=FP8), "dp": NATIVE},
                         assumed=["16 x H100, 8 per node, NVLink 450 GB/s, one 400 Gb/s NIC per GPU",
                                  "sequence 4096, micro-batch 1, 16 micro-batches"],
                         policy_note="the library's defaults (FP8 G=128 Hadamard, min_bytes 1 MiB) on TP and PP"))
    return out


def describe(layout: Layout) -> str:
    """A layout in a few words: "TP 2 x PP 2 x DP 2, SP, 4 micro-batches"."""
    parts = [f"TP {layout.tp}", f"PP {layout.pp}", f"DP {layout.dp}"]
    extra = (["SP"] if layout.sequence_parallel else []) + (["dist. opt."] if layout.distributed_optimizer else [])
    return " x ".join(parts) + ", " + ", ".join(extra + [f"{layout.micro_batches} micro-batches"])


def markdown_row(setup: Setup, summary: dict) -> str:
    """The documentation table's row of `setup` from its modelled `summary`.

    Args:
        setup: the setup.
        summary: `taco_triton.plan.step(...).summary` of it.

    Returns:
        One markdown table row.
    """
    s = summary
    return (f"| {setup.name} | {describe(setup.layout)} | {s['step_ms_native']:.0f} -> {s['step_ms_compressed']:.0f} | "
            f"{s['tflops_per_gpu_native']:.0f} -> {s['tflops_per_gpu_compressed']:.0f} | {s['speedup']:.2f}x | "
            f"{setup.published or '-'} |")
