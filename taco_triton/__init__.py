"""taco-triton: fused Triton kernels that compress tensor-parallel communication (TACO).

    >>> import torch, taco_triton as taco
    >>> x = torch.randn(64, 384, dtype=torch.bfloat16)
    >>> c = taco.compress(x)            # ~half the bytes of bf16 on the wire
    >>> round(c.ratio, 3)
    1.983
    >>> taco.decompress(c).shape        # same shape, dtype, device as x
    torch.Size([64, 384])

Importing this package touches no GPU and does not require one.
"""
from .calibrate import CalibrationResult, calibrate
from .codec import compress, decompress
from .collectives import WireStats, all_gather, all_reduce, reduce_scatter
from .collectives.compressed import check_errors
from .compressed import Compressed
from .config import CODEC_SPECS, CodecSpec, CompressionConfig
from .estimate import Estimate, estimate
# registers the torch.distributed backend "taco" (dist.init_process_group("taco"), dist.new_group(backend="taco"))
from .integrations.process_group import GroupOptions, compressed_group
from .policy import CompressionPolicy

# The autotune runtime registers its lookup of tuned launch parameters with the kernels (they
# never import the tuner, which imports them to time them).
import autotune.runtime  # noqa: F401

__all__ = [
    "CODEC_SPECS",
    "CalibrationResult",
    "CodecSpec",
    "Compressed",
    "CompressionConfig",
    "CompressionPolicy",
    "Estimate",
    "GroupOptions",
    "WireStats",
    "all_gather",
    "all_reduce",
    "calibrate",
    "check_errors",
    "compress",
    "compressed_group",
    "decompress",
    "estimate",
    "reduce_scatter",
]


__version__ = "0.1.0"  # the package version (pyproject.toml reads it from here)
