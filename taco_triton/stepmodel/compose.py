"""Time each communication of a step (`taco_triton.estimate` for the collectives) and compose
them with the GEMMs and the non-GEMM passes into a step: 1F1B pipeline with its bubble, TP exposed unless it overlaps
the GEMMs, DP under the backward pass when its reduction overlaps, then the optimizer."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..collectives._call import depth
from ..config import CompressionConfig
from ..estimate import estimate
from .hardware import Cluster
from .spec import Layout, ModelSpec
from .trace import Comm, dp_comms, pp_comms, site_pattern, tp_comms

__all__ = ["ADAM_BYTES_PER_PARAM", "Timed", "break_even_bytes", "compose", "time_comm"]

ADAM_BYTES_PER_PARAM = 28
"""HBM bytes the optimizer step moves per parameter it updates (Adam on FP32 master weights: read
weight, gradient, both moments; write weight, both moments and the BF16 copy)."""

_NATIVE = CompressionConfig(enabled=False)


@dataclass(frozen=True)
class Timed:
    """One communication with its modelled cost per call on one rank."""

    comm: Comm
    native_s: float
    compressed_s: float
    native_bytes: float
    """Bytes this rank sends natively (as `WireStats` counts them)."""
    compressed_bytes: float
    """Bytes it sends under the policy (native bytes where the policy keeps it native)."""


def _pipelined(e, slices: int) -> float:
    """A call cut into `slices` pipeline slices: each stage (codec, link, host) of a slice
    waits for the previous slice's, so the time is one slice's stages in series plus the
    slowest stage for the other slices (`estimate` gives the two ends: serial, fully overlapped)."""
    parts = (e.link_s, e.codec_s, e.host_s)
    return sum(parts) / slices + (slices - 1) / slices * max(parts)


def time_comm(comm: Comm, cluster: Cluster, spanned: int) -> Timed:
    """The cost of one call of `comm` on a group spanning `spanned` consecutive GPUs.

    Collectives: `taco_triton.estimate` (ring bytes, the compressed wire bytes, codec passes at
    `cluster.codec_rate`, launches) with the collectives' own pipeline depth (`pipeline="auto"`),
    slices overlapped as in `_pipelined`; a send as `estimate`'s "p2p" message (the tensor, or its
    wire buffer plus one compress on the sender and one decompress on the receiver).

    Args:
        comm: the communication.
        cluster: the hardware.
        spanned: consecutive global ranks the group covers (intra- or inter-node link).

    Returns:
        The `Timed` communication.
    """
    gbytes_s, latency_us = cluster.link(spanned)
    cfg, itemsize = comm.config, comm.dtype.itemsize
    dense = comm.numel * itemsize
    collective, ranks = ("p2p", 2) if comm.collective == "send" else (comm.collective, comm.ranks)
    slices = depth(dense, "auto") if cfg is not None and collective != "p2p" else 1
    e = estimate(comm.numel, comm.dtype, cfg or _NATIVE, gbytes_s * 8, ranks,
                 codec_gbytes_s=cluster.codec_rate(cfg, itemsize) if cfg is not None else None,
                 collective=collective, latency_us=latency_us, pipeline=slices,
                 host_us_per_launch=cluster.host_us_per_launch)
    if cfg is None:
        return Timed(comm, e.native_s, e.native_s, e.native_bytes_per_rank, e.native_bytes_per_rank)
    return Timed(comm, e.native_s, _pipelined(e, slices), e.native_bytes_per_rank, e.compressed_bytes_per_rank)


@dataclass
class _Stage:
    """One pipeline stage's work: per micro-batch (compute, TP, PP) and per step (DP)."""

    index: int
    layers: int
    fwd_s: float                             # GEMMs (and attention) of the forward; backward 2x
    layer_fwd_s: float
    elem_fwd_s: float = 0.0                  # non-GEMM passes (norms, residuals, activations, loss)
    elem_bwd_s: float = 0.0
    tp: list = field(default_factory=list)   # (Timed, calls per micro-batch)
    pp: list = field(default_factory=list)   # (Timed, calls per micro-batch)
    dp: list = field(default_factory=list)   # (Timed, calls per step)
    params: int = 0                          # weights this rank holds (the optimizer updates them)

    def per_micro_batch(self, layout: Layout, which: str) -> dict:
        """Exposed seconds of one micro-batch's forward + backward on this stage (`which`:
        "native" or "compressed"), and its parts."""
        attr = f"{which}_s"
        fwd, bwd = self.fwd_s, 2 * self.fwd_s
        tp = {d: sum(getattr(t, attr) * n for t, n in self.tp if t.comm.direction == d) for d in ("forward", "backward")}
        if layout.tp_comm_overlap:  # hidden under the GEMMs of the same pass, what exceeds them shows
            exposed = max(0.0, tp["forward"] - fwd) + max(0.0, tp["backward"] - bwd)
        else:
            exposed = tp["forward"] + tp["backward"]
        pp = sum(getattr(t, attr) * n for t, n in self.pp)
        elem = self.elem_fwd_s + self.elem_bwd_s
        return dict(total=fwd + bwd + elem + exposed + pp, tp=tp["forward"] + tp["backward"], tp_exposed=exposed,
                    pp=pp)

    def after_pipeline(self, layout: Layout, cluster: Cluster, params: int, which: str) -> dict:
        """Exposed DP time and the optimizer step after the last micro-batch."""
        attr = f"{which}_s"
        grads = [getattr(t, attr) for t, _ in self.dp if t.comm.collective != "all_gather"]
        gather = sum(getattr(t, attr) for t, _ in self.dp if t.comm.collective == "all_gather")
        reduce = sum(grads)
        if layout.overlap_grad_reduce and grads:  # under the last micro-batch's backward; the last bucket waits
            reduce_exposed = max(grads[-1], reduce - 2 * self.fwd_s - self.elem_bwd_s)
        else:
            reduce_exposed = reduce
        gather_exposed = max(0.0, gather - self.fwd_s - self.elem_fwd_s) if layout.overlap_param_gather else gather
        local = params // (layout.dp if layout.distributed_optimizer else 1)
        optimizer = local * ADAM_BYTES_PER_PARAM / (cluster.hbm_gbytes_s * 1e9)
        return dict(dp=reduce + gather, dp_exposed=reduce_exposed + gather_exposed, optimizer=optimizer)


def _stage_params(spec: ModelSpec, layout: Layout, layers: int, first: bool, last: bool) -> int:
    vocab = spec.padded_vocab(layout.tp) // layout.tp if spec.parallel_embedding else spec.vocab
    return layers * spec.layer_params() // layout.tp + (first + last) * vocab * spec.hidden


def build_stages(spec: ModelSpec, layout: Layout, cluster: Cluster, policies: dict) -> list[_Stage]:
    """Every stage's compute and timed communications."""
    rate = cluster.tflops * 1e12 * cluster.gemm_efficiency
    elem_rate = cluster.hbm_gbytes_s * 1e9 * cluster.elementwise_share  # bytes per second of the non-GEMM passes
    item = (spec.compute_dtype or spec.dtype).itemsize
    spans = {"tp": layout.tp, "dp": layout.tp * layout.dp, "pp": layout.gpus}
    stages, start = [], 0
    counts = layout.stage_layers(spec.layers)
    for s, n in enumerate(counts):
        first, last = s == 0, s == layout.pp - 1
        out_flops = spec.output_flops(layout.tp) / (layout.tp if spec.parallel_embedding else 1) if last else 0.0
        layer_fwd = n * spec.layer_flops() / layout.tp / rate
        layer_elem = spec.layer_elementwise_elements(layout.tp, layout.sequence_parallel)
        edge_elem = spec.edge_elementwise_elements(layout.tp, layout.sequence_parallel, first, last)
        ids = range(start, start + n)
        start += n
        tp = tp_comms(spec, layout, policies["tp"], ids, first=first, last=last)
        casts = {d: sum(_cast_bytes(c, item) for c in tp if c.direction == d) for d in ("forward", "backward")}
        st = _Stage(s, n, layer_fwd + out_flops / rate, layer_fwd,
                    elem_fwd_s=((n * layer_elem[0] + edge_elem[0]) * item + casts["forward"]) / elem_rate,
                    elem_bwd_s=((n * layer_elem[1] + edge_elem[1]) * item + casts["backward"]) / elem_rate)
        st.tp = _aggregate([time_comm(c, cluster, spans["tp"]) for c in tp])
        st.pp = [(time_comm(c, cluster, spans["pp"]), k) for c, k in pp_comms(spec, layout, policies["pp"], s)]
        st.dp = [(time_comm(c, cluster, spans["dp"]), 1)
                 for c in dp_comms(spec, layout, policies["dp"], n, first=first, last=last)]
        st.params = _stage_params(spec, layout, n, first, last)
        stages.append(st)
    return stages


def _cast_bytes(comm: Comm, compute_itemsize: int) -> int:
    """Bytes of the two casts around a TP message sent in another dtype than the layers compute
    in (down before the collective, up after it); 0 when they agree."""
    if comm.dtype.itemsize == compute_itemsize and comm.dtype.is_floating_point:
        return 0
    return 2 * comm.numel * (comm.dtype.itemsize + compute_itemsize)


def _aggregate(timed: list[Timed]) -> list[tuple[Timed, int]]:
    """Identical communications (same collective, direction, size, config, site up to the layer
    index) as one (Timed, count) each, in first-issue order."""
    groups: dict = {}
    for t in timed:
        c = t.comm
        key = (c.collective, c.direction, site_pattern(c.site), c.numel, c.config)
        if key in groups:
            groups[key][1] += 1
        else:
            groups[key] = [t, 1]
    return [(t, n) for t, n in groups.values()]


def compose(spec: ModelSpec, layout: Layout, cluster: Cluster, stages: list[_Stage]) -> tuple[dict, int]:
    """The step's summary (times in ms, bytes per rank) and the index of the critical stage."""
    m, v = layout.micro_batches, layout.virtual_pp
    out = {}
    for which in ("native", "compressed"):
        per = [st.per_micro_batch(layout, which) for st in stages]
        crit = max(range(len(stages)), key=lambda i: per[i]["total"])
        pipeline = (m + (layout.pp - 1) / v) * per[crit]["total"]
        after = [st.after_pipeline(layout, cluster, st.params, which) for st in stages]
        tail = max(a["dp_exposed"] + a["optimizer"] for a in after)
        out[which] = dict(step=pipeline + tail, crit=crit, per=per[crit], pipeline=pipeline,
                          bubble=(layout.pp - 1) / v * per[crit]["total"],
                          dp=max(a["dp"] for a in after), dp_exposed=max(a["dp_exposed"] for a in after),
                          optimizer=max(a["optimizer"] for a in after))
    nat, comp = out["native"], out["compressed"]
    crit = nat["crit"]
    st = stages[crit]
    ms = 1e3

    def total(rows, attr):
        return sum(getattr(t, attr) * n for t, n in rows) * m

    model_flops = 3 * m * layout.dp * sum(
        spec.layer_flops() * s.layers for s in stages) + 3 * m * layout.dp * spec.output_flops(layout.tp)
    summary = {
        "step_ms_native": nat["step"] * ms,
        "step_ms_compressed": comp["step"] * ms,
        "speedup": nat["step"] / comp["step"],
        "compute_ms": m * 3 * st.fwd_s * ms,
        "layer_compute_ms": m * 3 * st.layer_fwd_s * ms,
        "output_compute_ms": m * 3 * (st.fwd_s - st.layer_fwd_s) * ms,
        "elementwise_ms": m * (st.elem_fwd_s + st.elem_bwd_s) * ms,
        "bubble_ms_native": nat["bubble"] * ms,
        "bubble_ms_compressed": comp["bubble"] * ms,
        "tp_ms_native": m * nat["per"]["tp"] * ms,
        "tp_ms_compressed": m * comp["per"]["tp"] * ms,
        "tp_exposed_ms_native": m * nat["per"]["tp_exposed"] * ms,
        "tp_exposed_ms_compressed": m * comp["per"]["tp_exposed"] * ms,
        "pp_ms_native": m * nat["per"]["pp"] * ms,
        "pp_ms_compressed": m * comp["per"]["pp"] * ms,
        "dp_ms_native": nat["dp"] * ms,
        "dp_ms_compressed": comp["dp"] * ms,
        "dp_exposed_ms_native": nat["dp_exposed"] * ms,
        "dp_exposed_ms_compressed": comp["dp_exposed"] * ms,
        "optimizer_ms": nat["optimizer"] * ms,
        "tp_bytes_native": total(st.tp, "native_bytes"),
        "tp_bytes_compressed": total(st.tp, "compressed_bytes"),
        "pp_bytes_native": total(st.pp, "native_bytes"),
        "pp_bytes_compressed": total(st.pp, "compressed_bytes"),
        "dp_bytes_native": sum(t.native_bytes for t, _ in st.dp),
        "dp_bytes_compressed": sum(t.compressed_bytes for t, _ in st.dp),
        "tflops_per_gpu_native": model_flops / layout.gpus / nat["step"] / 1e12,
        "tflops_per_gpu_compressed": model_flops / layout.gpus / comp["step"] / 1e12,
        "critical_stage": crit,
        "gpus": layout.gpus,
    }
    return summary, crit


def break_even_bytes(cluster: Cluster, ranks: int, *, collective: str = "all_reduce",
                     config: CompressionConfig | None = None, spanned: int | None = None,
                     dtype=None, largest: int = 1 << 32) -> int | None:
    """The smallest message (bytes, a power of two) from which compression pays off for every
    larger power of two up to `largest`, by `time_comm`.

    Args:
        cluster: the hardware.
        ranks: processes in the group.
        collective: all_reduce, reduce_scatter, all_gather or send.
        config: the config (default: the default config).
        spanned: consecutive GPUs the group covers (default `ranks`: inside a node when it fits).
        dtype: the message dtype (default bf16).
        largest: the largest message tried.

    Returns:
        The bytes, or None when compression does not pay off at `largest`.
    """
    import torch

    dtype = torch.bfloat16 if dtype is None else dtype
    config = CompressionConfig() if config is None else config
    found = None
    size = 1 << 12
    while size <= largest:
        t = time_comm(Comm("tp", collective, "forward", "", size // dtype.itemsize, dtype, ranks, config), cluster,
                      spanned or ranks)
        if t.compressed_s < t.native_s:
            found = size if found is None else found
        else:
            found = None
        size *= 2
    return found
