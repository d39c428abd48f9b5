"""`Cluster`: the hardware a step runs on, and its presets.

Every preset value is a public vendor specification (not measured by this project):

- `tflops`: peak dense BF16 tensor-core TFLOP/s (without structured sparsity), SXM/OAM parts:
  A100 and A800 312 (NVIDIA A100 datasheet; the A800 is an A100 with NVLink cut to 400 GB/s),
  H100, H800 and H200 989 (NVIDIA H100 / H200 datasheets, 1,979 "with sparsity"), B200 2,250
  (NVIDIA HGX B200 datasheet, 4.5 PFLOP/s with sparsity), MI300X 1,307 (AMD Instinct MI300X
  datasheet).
- `hbm_gbytes_s`: HBM bandwidth: A100 / A800 80 GB 2,039, H100 / H800 3,350, H200 4,800,
  B200 8,000, MI300X 5,300 GB/s.
- `intra_gbytes_s`: GPU-to-GPU bandwidth inside a node, per GPU and direction (half the
  bidirectional figure of the datasheets): NVLink 3 600 GB/s -> 300 (A100), 400 -> 200 (A800,
  H800), NVLink 4 900 -> 450 (H100, H200), NVLink 5 1,800 -> 900 (B200); MI300X 7 Infinity
  Fabric links of 64 GB/s per direction, 448 (a ring uses them only through several rings at once).
- `inter_gbytes_s`: one NIC per GPU at its line rate: InfiniBand HDR 200 Gb/s = 25 GB/s, NDR
  400 Gb/s = 50 GB/s, XDR 800 Gb/s = 100 GB/s; RoCE 100/200/400 GbE likewise (`FABRICS`).

Not from a datasheet, and stated as assumptions: the per-step latencies (`intra_latency_us` 3,
`inter_latency_us` 8: the order of NCCL's per-step ring latency), `gemm_efficiency` 0.6 (large
BF16 GEMMs reach roughly 60-80% of the dense peak; attention kernels less), `codec_share` 0.7
(the share of HBM bandwidth a codec pass reaches: the compile-time model bounds the kernels at
or near 100% of copy bandwidth, a ceiling real kernels land below) and `elementwise_share` 0.7
(the share of HBM bandwidth the non-GEMM passes, norms, residual adds, activations, reach).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..config import CompressionConfig
from ..estimate import HOST_US_PER_LAUNCH
from ..layout import WireLayout

__all__ = ["FABRICS", "GPUS", "Cluster"]

FABRICS = {
    "ib-hdr": 25.0, "ib-ndr": 50.0, "ib-xdr": 100.0,
    "roce-100": 12.5, "roce-200": 25.0, "roce-400": 50.0,
}
"""Inter-node fabrics: GB/s per GPU and direction (one NIC per GPU at line rate; 1 GB = 1e9 bytes)."""

GPUS = {
    # name: (tflops, hbm_gbytes_s, intra_gbytes_s, default fabric)
    "A100": (312.0, 2039.0, 300.0, "ib-hdr"),
    "A800": (312.0, 2039.0, 200.0, "ib-hdr"),
    "H100": (989.0, 3350.0, 450.0, "ib-ndr"),
    "H800": (989.0, 3350.0, 200.0, "ib-ndr"),
    "H200": (989.0, 4800.0, 450.0, "ib-ndr"),
    "B200": (2250.0, 8000.0, 900.0, "ib-ndr"),
    "MI300X": (1307.0, 5300.0, 448.0, "roce-400"),
}
"""GPU presets: (peak dense BF16 TFLOP/s, HBM GB/s, intra-node GB/s per direction, default fabric),
vendor datasheet values (see the module docstring)."""


def _check_positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value != value:
        raise ValueError(f"Cluster.{name} must be a positive number, got {value!r}")


@dataclass(frozen=True)
class Cluster:
    """The hardware of a step: one GPU's compute and memory, and the links between GPUs.

    Args:
        gpu: a name for the GPU (free text; `preset` sets it).
        tflops: peak dense BF16 TFLOP/s of one GPU.
        hbm_gbytes_s: HBM bandwidth of one GPU, GB/s.
        gpus_per_node: GPUs sharing the intra-node fabric.
        intra_gbytes_s: intra-node bandwidth per GPU and direction, GB/s.
        inter_gbytes_s: inter-node bandwidth per GPU and direction, GB/s.
        intra_latency_us: latency per communication step inside a node.
        inter_latency_us: latency per communication step across nodes.
        gemm_efficiency: the share of `tflops` the GEMMs (and attention) reach.
        codec_share: the share of `hbm_gbytes_s` a compress or decompress pass reaches (it reads
            the dense message and writes the compressed one, or the reverse).
        codec_gbytes_s: dense GB/s of one codec pass, measured; None derives it from
            `codec_share` (see `codec_rate`).
        elementwise_share: the share of `hbm_gbytes_s` the non-GEMM passes of the layers
            (norms, residual adds, activations, the loss's softmax) reach.
        host_us_per_launch: host time per codec kernel launch (`taco_triton.estimate`'s).
        fabric: a name for the inter-node fabric (free text).

    Raises:
        ValueError: a rate, share or count that is not positive.
    """

    gpu: str
    tflops: float
    hbm_gbytes_s: float
    gpus_per_node: int = 8
    intra_gbytes_s: float = 450.0
    inter_gbytes_s: float = 50.0
    intra_latency_us: float = 3.0
    inter_latency_us: float = 8.0
    gemm_efficiency: float = 0.6
    codec_share: float = 0.7
    codec_gbytes_s: float | None = None
    elementwise_share: float = 0.7
    host_us_per_launch: float = HOST_US_PER_LAUNCH
    fabric: str = ""

    def __post_init__(self):
        for name in ("tflops", "hbm_gbytes_s", "gpus_per_node", "intra_gbytes_s", "inter_gbytes_s",
                     "gemm_efficiency", "codec_share", "elementwise_share"):
            _check_positive(name, getattr(self, name))
        if self.codec_gbytes_s is not None:
            _check_positive("codec_gbytes_s", self.codec_gbytes_s)
        for name in ("intra_latency_us", "inter_latency_us", "host_us_per_launch"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"Cluster.{name} must be >= 0, got {getattr(self, name)!r}")
        if max(self.gemm_efficiency, self.codec_share, self.elementwise_share) > 1:
            raise ValueError(f"Cluster shares must be <= 1, got gemm_efficiency={self.gemm_efficiency}, "
                             f"codec_share={self.codec_share}, elementwise_share={self.elementwise_share}")

    @classmethod
    def preset(cls, name: str, fabric: str | None = None, **overrides) -> "Cluster":
        """A cluster of `name` GPUs (a key of `GPUS`, any case), 8 per node.

        Args:
            name: the GPU: A100, A800, H100, H800, H200, B200 or MI300X.
            fabric: a key of `FABRICS` (default: the GPU's usual one, `GPUS`).
            **overrides: any field of `Cluster`, replacing the preset's.

        Returns:
            The `Cluster`.

        Raises:
            ValueError: an unknown GPU or fabric, or an override out of range.
            TypeError: an override that is not a field.

        Example:
            >>> c = Cluster.preset("h800", inter_gbytes_s=25)
            >>> c.tflops, c.intra_gbytes_s, c.inter_gbytes_s
            (989.0, 200.0, 25)
        """
        key = {k.lower(): k for k in GPUS}.get(str(name).lower())
        if key is None:
            raise ValueError(f"unknown GPU preset {name!r}; presets: {sorted(GPUS)}")
        tflops, hbm, intra, default_fabric = GPUS[key]
        fabric = default_fabric if fabric is None else fabric
        if fabric not in FABRICS:
            raise ValueError(f"unknown fabric {fabric!r}; fabrics: {sorted(FABRICS)}")
        base = cls(gpu=key, tflops=tflops, hbm_gbytes_s=hbm, intra_gbytes_s=intra,
                   inter_gbytes_s=FABRICS[fabric], fabric=fabric)
        return dataclasses.replace(base, **overrides)

    def codec_rate(self, config: CompressionConfig, itemsize: int = 2) -> float:
        """Dense GB/s of one compress or decompress pass with `config`: `codec_gbytes_s` when
        given, else `codec_share` of HBM bandwidth over the bytes a pass moves per dense byte
        (the dense message plus its compressed form, `WireLayout`).

        Args:
            config: the compression config.
            itemsize: bytes per element of the dense message (bf16: 2).

        Returns:
            GB/s (1e9 bytes) of the dense message per pass.
        """
        if self.codec_gbytes_s is not None:
            return self.codec_gbytes_s
        n = 1 << 24
        moved = 1 + WireLayout.of(n, config).nbytes / (n * itemsize)
        return self.codec_share * self.hbm_gbytes_s / moved

    def link(self, ranks_spanned: int) -> tuple[float, float]:
        """(GB/s per direction, latency in us) of a group whose ranks span `ranks_spanned`
        consecutive GPUs: inside a node when they fit in one, else across nodes.

        Args:
            ranks_spanned: consecutive global ranks the group covers.

        Returns:
            (bandwidth GB/s, latency us).
        """
        if ranks_spanned <= self.gpus_per_node:
            return self.intra_gbytes_s, self.intra_latency_us
        return self.inter_gbytes_s, self.inter_latency_us
