"""What will compression do to my training step? A step-time model of 3D-parallel training.

    >>> from taco_triton import CompressionPolicy
    >>> from taco_triton.plan import Cluster, Layout, ModelSpec, step
    >>> gpt = ModelSpec(layers=32, hidden=4096, ffn=16384, heads=32, vocab=50257, seq=2048, micro_batch=1)
    >>> r = step(gpt, Layout(tp=8, micro_batches=8), Cluster.preset("H800"), CompressionPolicy())
    >>> sorted(r.table.collective.unique())
    ['all_reduce']
    >>> r.summary["tp_bytes_compressed"] < 0.6 * r.summary["tp_bytes_native"]
    True

A step is modelled from the model's sizes (`ModelSpec`), its split over GPUs (`Layout`) and
the hardware (`Cluster`, vendor datasheet figures, every one overridable):

- Communications come from the code that issues them (`taco_triton.stepmodel.trace`): the TP
  collectives of one micro-batch are recorded from `taco_triton.parallel`'s layers running a
  layer's forward and backward on the meta device, each decided by `taco_triton.policy.decide`
  as in training; PP sends and DP buckets are decided at the megatron integration's site names.
  The policy is given as `taco_triton.integrations.megatron.enable` takes it: `policy` for
  TP and PP, DP gets `gradient_policy(policy)` (INT8, Hadamard), or each axis its own.
- Each collective is timed by `taco_triton.estimate` (ring bytes, compressed wire bytes, codec
  passes at the cluster's codec rate, kernel launches); GEMMs from their FLOPs at
  `Cluster.gemm_efficiency` of the dense peak; the non-GEMM passes (norms, residual adds,
  activations, the loss's softmax: `ModelSpec.layer_elementwise_elements`) from the elements
  they read and write at `Cluster.elementwise_share` of HBM bandwidth.
- The step: (micro_batches + (pp - 1) / virtual_pp) times the slowest stage's micro-batch
  (forward, backward = 2 x forward's GEMMs, the non-GEMM passes, exposed TP and the
  stage-boundary sends), then the exposed DP reduction (under the last backward with
  `overlap_grad_reduce`) and the optimizer.

Left out: activation recomputation, the loss's vocabulary-parallel all-reduces (tiny), sequence-
parallel norm gradients (tiny), memory, contention between codec kernels and GEMMs or NCCL for
SMs and HBM, NCCL algorithms other than the ring, fused kernels (a fused norm or activation moves
fewer bytes than counted) and kernel launches: the model is a first-order one, not a simulator.

`python -m taco_triton.plan --help` prints the command line.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from .stepmodel.compose import break_even_bytes, build_stages, compose
from .stepmodel.hardware import FABRICS, GPUS, Cluster
from .stepmodel.spec import Layout, ModelSpec
from .stepmodel.trace import site_pattern

__all__ = ["FABRICS", "GPUS", "TABLE_COLUMNS", "Cluster", "Layout", "ModelSpec", "StepModel", "axis_policies",
           "break_even_bytes", "main", "step"]

TABLE_COLUMNS = ["stage", "axis", "phase", "collective", "site", "direction", "ranks", "count", "message_bytes",
                 "wire_bytes", "native_bytes", "codec", "time_native_ms", "time_compressed_ms",
                 "total_native_ms", "total_compressed_ms", "overlap"]
"""The columns of `StepModel.table`."""


@dataclass
class StepModel:
    """The modelled step (see `step`).

    Attributes:
        table: a pandas DataFrame, one row per communication of a step and stage (identical
            calls of every layer as one row with their `count`): `TABLE_COLUMNS`. Bytes per rank
            and call as `WireStats` counts them (`wire_bytes` under the policy, `native_bytes`
            without it), times per call and in total per step (`count` calls), and whether it
            is `exposed` or overlapped.
        summary: step times in ms (native and compressed), `speedup`, `compute_ms` (the GEMMs),
            `layer_compute_ms`, `output_compute_ms`, `elementwise_ms` (the non-GEMM passes), per-axis communication and exposed times,
            bubble and optimizer times, `tp_bytes_native` / `tp_bytes_compressed` (bytes a TP rank
            of the critical stage sends per step; likewise pp_ and dp_), TFLOP/s per GPU.
        cluster: the `Cluster` modelled.
        model: the `ModelSpec`.
        layout: the `Layout`.
    """

    table: object
    summary: dict
    cluster: Cluster
    model: ModelSpec
    layout: Layout

    def report(self) -> str:
        """The summary and the table as text.

        Returns:
            A printable report.
        """
        s = self.summary
        lines = [f"{self.model.name or 'model'} on {s['gpus']} x {self.cluster.gpu} ({self.cluster.fabric or 'custom'}); "
                 f"tp={self.layout.tp} pp={self.layout.pp} dp={self.layout.dp} sp={self.layout.sequence_parallel} "
                 f"micro-batches={self.layout.micro_batches}",
                 "MODEL (not a measurement): " + ", ".join(
                     f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in s.items())]
        return "\n".join(lines) + "\n" + self.table.to_string(index=False, float_format=lambda x: f"{x:.4g}")


def axis_policies(policy=None, *, tp=None, pp=None, dp=None) -> dict:
    """The policy of each axis, as `taco_triton.integrations.megatron.enable` derives them: `tp`
    and `pp` default to `policy`, `dp` to `gradient_policy(policy)`; an axis with none is native.

    Args:
        policy: a `CompressionPolicy` (None: native unless an axis gets its own).
        tp: the TP axis's policy.
        pp: the PP axis's policy.
        dp: the DP axis's policy.

    Returns:
        {"tp": ..., "pp": ..., "dp": ...} (None: native).
    """
    from .integrations.megatron.dp import gradient_policy

    return {"tp": tp if tp is not None else policy, "pp": pp if pp is not None else policy,
            "dp": dp if dp is not None else (gradient_policy(policy) if policy is not None else None)}


def _overlap(axis: str, collective: str, layout: Layout) -> str:
    if axis == "tp":
        return "overlapped with GEMMs" if layout.tp_comm_overlap else "exposed"
    if axis == "dp" and collective != "all_gather":
        return "under backward" if layout.overlap_grad_reduce else "exposed"
    if axis == "dp":
        return "under forward" if layout.overlap_param_gather else "exposed"
    return "exposed"


def _codec(cfg) -> str:
    if cfg is None:
        return "native"
    return f"{cfg.codec} G{cfg.group_size}" + (" hadamard" if cfg.hadamard else "")


def step(model: ModelSpec, layout: Layout, cluster: Cluster, policy=None, *, tp=None, pp=None, dp=None) -> StepModel:
    """Model one training step with and without compression.

    Args:
        model: the `ModelSpec`.
        layout: the `Layout`.
        cluster: the `Cluster`.
        policy: a `taco_triton.CompressionPolicy` as megatron's `enable` takes it (None: the
            compressed step is the native one, speedup 1). A calibrating policy is modelled
            with its configured configs (or its frozen plan).
        tp: the TP axis's policy, replacing `policy` there.
        pp: the PP axis's policy, likewise.
        dp: the DP axis's policy (default `gradient_policy(policy)`).

    Returns:
        The `StepModel`.

    Raises:
        ValueError: sizes the layout does not divide (heads, widths, tokens under sequence
            parallelism), or fewer layers than pipeline chunks.
        TypeError: an argument of the wrong type.
    """
    import pandas as pd

    for name, value, cls in (("model", model, ModelSpec), ("layout", layout, Layout), ("cluster", cluster, Cluster)):
        if not isinstance(value, cls):
            raise TypeError(f"{name} must be a {cls.__name__}, got {type(value).__name__}")
    if model.heads % layout.tp:
        raise ValueError(f"heads ({model.heads}) must be divisible by tp ({layout.tp})")
    policies = axis_policies(policy, tp=tp, pp=pp, dp=dp)
    stages = build_stages(model, layout, cluster, policies)
    summary, _ = compose(model, layout, cluster, stages)
    rows = []
    m = layout.micro_batches
    for st in stages:
        for group, per in ((st.tp, m), (st.pp, m), (st.dp, 1)):
            for t, n in group:
                c = t.comm
                phase = "optimizer" if c.axis == "dp" and c.collective == "all_gather" else c.direction
                rows.append(dict(stage=st.index, axis=c.axis, phase=phase, collective=c.collective, site=site_pattern(c.site),
                                 direction=c.direction, ranks=c.ranks, count=n * per,
                                 message_bytes=c.numel * c.dtype.itemsize, wire_bytes=t.compressed_bytes,
                                 native_bytes=t.native_bytes, codec=_codec(c.config),
                                 time_native_ms=t.native_s * 1e3, time_compressed_ms=t.compressed_s * 1e3,
                                 total_native_ms=t.native_s * 1e3 * n * per,
                                 total_compressed_ms=t.compressed_s * 1e3 * n * per,
                                 overlap=_overlap(c.axis, c.collective, layout)))
    return StepModel(pd.DataFrame(rows, columns=TABLE_COLUMNS), summary, cluster, model, layout)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m taco_triton.plan",
                                 description="Model a training step's time with and without compressed "
                                             "communication (a model, not a measurement).")
    ap.add_argument("--gpu", default="H100", help=f"GPU preset, one of {sorted(GPUS)} (default: %(default)s)")
    ap.add_argument("--fabric", default=None, help=f"inter-node fabric, one of {sorted(FABRICS)} (default: the GPU's)")
    ap.add_argument("--hf-config", default=None, help="a Hugging Face config.json for the model's sizes")
    for name, default in (("layers", 32), ("hidden", 4096), ("ffn", None), ("heads", 32), ("kv-heads", None),
                          ("vocab", 50304), ("seq", 2048), ("micro-batch", 1)):
        ap.add_argument(f"--{name}", type=int, default=default,
                        help=f"model {name} (default: {default if default is not None else 'see --help text'})")
    ap.add_argument("--gated-mlp", action="store_true", help="a gated (SwiGLU) MLP")
    for name, default in (("tp", 8), ("pp", 1), ("dp", 1), ("micro-batches", 8), ("virtual-pp", 1)):
        ap.add_argument(f"--{name}", type=int, default=default, help=f"layout {name} (default: {default})")
    ap.add_argument("--sp", action="store_true", help="sequence parallelism")
    ap.add_argument("--tp-comm-overlap", action="store_true", help="TP communication overlaps the GEMMs")
    ap.add_argument("--overlap-grad-reduce", action="store_true", help="DP gradient reduction under backward")
    ap.add_argument("--distributed-optimizer", action="store_true", help="megatron's distributed optimizer")
    ap.add_argument("--codec", default="fp8_e4m3", help="the policy's codec (default: %(default)s; 'none': native)")
    ap.add_argument("--group-size", type=int, default=128, help="the codec's group size (default: %(default)s)")
    ap.add_argument("--min-bytes", type=int, default=None, help="the policy's min_bytes (default: the library's)")
    ap.add_argument("--axes", default="tp", help="axes compressed, comma-separated among tp,pp,dp (default: %(default)s)")
    for name in ("intra-gbytes-s", "inter-gbytes-s", "gpus-per-node", "gemm-efficiency", "elementwise-share",
                 "codec-gbytes-s", "tflops"):
        ap.add_argument(f"--{name}", type=float, default=None, help=f"override the preset's {name.replace('-', '_')}")
    return ap


def main(argv=None) -> StepModel:
    """The command line: print the modelled summary and table.

    Args:
        argv: the arguments (default: sys.argv[1:]).

    Returns:
        The `StepModel` printed.
    """
    from .config import CompressionConfig
    from .policy import CompressionPolicy

    args = _parser().parse_args(argv)
    sizes = dict(seq=args.seq, micro_batch=args.micro_batch)
    if args.hf_config:
        spec = ModelSpec.from_hf_config(args.hf_config, **sizes)
    else:
        spec = ModelSpec(layers=args.layers, hidden=args.hidden, ffn=args.ffn or 4 * args.hidden, heads=args.heads,
                         kv_heads=args.kv_heads, vocab=args.vocab, gated_mlp=args.gated_mlp, **sizes)
    layout = Layout(tp=args.tp, pp=args.pp, dp=args.dp, sequence_parallel=args.sp, micro_batches=args.micro_batches,
                    virtual_pp=args.virtual_pp, tp_comm_overlap=args.tp_comm_overlap,
                    overlap_grad_reduce=args.overlap_grad_reduce,
                    distributed_optimizer=args.distributed_optimizer)
    overrides = {k: (int(v) if k == "gpus_per_node" else v) for k in
                 ("intra_gbytes_s", "inter_gbytes_s", "gpus_per_node", "gemm_efficiency", "elementwise_share",
                  "codec_gbytes_s", "tflops")
                 if (v := getattr(args, k)) is not None}
    cluster = Cluster.preset(args.gpu, args.fabric, **overrides)
    policy = axes = None
    if args.codec != "none":
        kw = {} if args.min_bytes is None else {"min_bytes": args.min_bytes}
        policy = CompressionPolicy(default=CompressionConfig(codec=args.codec, group_size=args.group_size), **kw)
        axes = {a.strip() for a in args.axes.split(",")}
        if axes - {"tp", "pp", "dp"}:
            _parser().error(f"--axes must name tp, pp, dp; got {args.axes!r}")
    native = CompressionPolicy(default=None)
    kwargs = {} if policy is None else {a: (None if a in axes else native) for a in ("tp", "pp", "dp")}
    result = step(spec, layout, cluster, policy, **kwargs)
    print(result.report())
    return result


if __name__ == "__main__":  # pragma: no cover - the command line
    main(sys.argv[1:])
