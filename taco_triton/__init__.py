"""taco-triton: fused Triton kernels that compress tensor-parallel communication (TACO).

    >>> import taco_triton as taco
    >>> c = taco.compress(x)            # ~half the bytes of bf16 on the wire
    >>> y = taco.decompress(c)          # same shape, dtype, device as x

Importing this package touches no GPU and does not require one.
"""
from .calibrate import CalibrationResult, calibrate
from .codec import compress, decompress
from .compressed import Compressed
from .config import CODEC_SPECS, CodecSpec, CompressionConfig

__all__ = [
    "CODEC_SPECS",
    "CalibrationResult",
    "CodecSpec",
    "Compressed",
    "CompressionConfig",
    "calibrate",
    "compress",
    "decompress",
]
__version__ = "0.1.0"
