"""The user-facing codec: `compress`, `decompress`, with input validation."""
from __future__ import annotations

import torch

from . import alloc, ops
from .compressed import Compressed
from .config import INPUT_DTYPES, CompressionConfig
from .layout import WireLayout
from .state import STATE

def _default_config() -> CompressionConfig:
    if STATE.codec_default is None:
        STATE.codec_default = CompressionConfig()
    return STATE.codec_default


def _fields(c: CompressionConfig) -> tuple:
    return (c.codec, c.group_size, c.hadamard, c.scales, c.rounding, c.seed)


def compress(
    x: torch.Tensor, config: CompressionConfig | None = None, *, backend: str = "auto",
    check_finite: bool = False,
) -> Compressed:
    """Compress a tensor to about half its bf16 size.

    Args:
        x: bf16, fp16 or fp32 tensor of any shape (non-contiguous inputs are copied first).
        config: `CompressionConfig`; None means the default (FP8 E4M3, G=128, Hadamard, dual).
        backend: "auto" (Triton on CUDA tensors, the torch reference elsewhere), "triton" (also
            on CPU tensors under TRITON_INTERPRET=1) or "torch".
        check_finite: raise ValueError if any element is NaN/Inf. Otherwise a group holding one
            decompresses to all-NaN (other groups are unaffected), so overflow checks of AMP
            loss scalers still fire downstream.

    Returns:
        `Compressed` whose `.data` (1-D uint8, on x's device) is exactly what goes on the wire:
        `numel` code bytes (rounded up to whole groups) plus the scales.

    Raises:
        TypeError: `x` is not a tensor, or not bf16/fp16/fp32; `config` is not a CompressionConfig.
        ValueError: `config.enabled` is False; with `check_finite`, a group holds NaN/Inf.

    Example:
        >>> x = torch.randn(4, 384, dtype=torch.bfloat16)
        >>> c = compress(x)
        >>> c.nbytes, round(c.ratio, 3)
        (1552, 1.979)
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"compress expects a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(f"compress supports bfloat16, float16 and float32 tensors, got {x.dtype}")
    config = _default_config() if config is None else config
    if not isinstance(config, CompressionConfig):
        raise TypeError(f"config must be a CompressionConfig or None, got {type(config).__name__}")
    if not config.enabled:
        raise ValueError("compress got a config with enabled=False: there is nothing to compress with it")
    if torch.compiler.is_compiling():  # the registered op: what torch.compile traces
        data = ops.compress_op(x.contiguous(), *_fields(config), backend)
    else:  # eager: the same work without the dispatch layers only tracing needs
        data = ops.compress_eager(x.contiguous(), config, backend)
    c = Compressed(data, x.shape, x.dtype, config)
    if check_finite:
        _raise_if_nonfinite(c)
    return c


def _raise_if_nonfinite(c: Compressed) -> None:
    layout = WireLayout.of(c.numel, c.config)
    _, _, b = layout.split(c.data)
    bad = (b == 255) if c.config.scales == "dual" else b.isnan()
    n_bad = int(bad.sum())
    if n_bad:
        first = int(bad.nonzero()[0, 0]) * c.config.group_size
        raise ValueError(
            f"compress(check_finite=True): {n_bad} group(s) of {c.config.group_size} hold NaN/Inf; "
            f"the first starts at flat element {first} of a tensor of shape {tuple(c.shape)}"
        )


def decompress(c: Compressed, *, out: torch.Tensor | None = None, backend: str = "auto") -> torch.Tensor:
    """Decompress to a tensor of the original shape, dtype and device.

    Args:
        c: a `Compressed` (from `compress` or `Compressed.from_bytes`).
        out: optional tensor to write into: same number of elements as the original, any of
            bf16/fp16/fp32, on c.data's device. It is returned.
        backend: as in `compress`.

    Values beyond the output dtype's finite range saturate to its largest finite value; groups
    that held NaN/Inf come back as NaN.

    Returns:
        The decompressed tensor (`out` when given).

    Raises:
        TypeError: `c` is not a `Compressed`.
        ValueError: `c.data` is not 1-D uint8 of the size its shape and config need; `out` has
            the wrong number of elements, dtype or device.
    """
    if not isinstance(c, Compressed):
        raise TypeError(f"decompress expects a Compressed, got {type(c).__name__}")
    numel = c.numel
    compiling = torch.compiler.is_compiling()
    expected = WireLayout.of(numel, c.config).nbytes if compiling else ops.wire_nbytes(numel, c.config)
    if c.data.dtype != torch.uint8 or c.data.dim() != 1 or c.data.numel() != expected:
        raise ValueError(
            f"Compressed.data must be 1-D uint8 with {expected} bytes for shape {tuple(c.shape)}, got "
            f"{c.data.dtype} with shape {tuple(c.data.shape)}"
        )
    c = c.aligned()  # odd-offset or strided data: copied, so its FP32 scales can be viewed
    if not compiling:  # eager: no dispatch layers, launch state prepared once
        if out is None:
            data = c.data
            return ops.decompress_eager(data, alloc.empty(numel, c.dtype, data.device), c.config,
                                        backend).view(c.shape)
        _check_out(c, out)
        if out.is_contiguous():
            ops.decompress_eager(c.data, out.view(-1), c.config, backend)
        else:
            out.copy_(ops.decompress_eager(c.data, alloc.empty(c.numel, out.dtype, out.device), c.config,
                                           backend).view(out.shape))
        return out
    if out is None:
        return ops.decompress_op(c.data, c.numel, c.dtype, *_fields(c.config), backend).view(c.shape)
    _check_out(c, out)
    if out.is_contiguous():
        ops.decompress_into_op(c.data, out, *_fields(c.config), backend)
    else:
        out.copy_(ops.decompress_op(c.data, c.numel, out.dtype, *_fields(c.config), backend).view(out.shape))
    return out


def _check_out(c: Compressed, out) -> None:
    if out.numel() != c.numel or out.dtype not in INPUT_DTYPES or out.device != c.data.device:
        raise ValueError(
            f"out must have {c.numel} elements, a dtype in bf16/fp16/fp32 and device {c.data.device}; "
            f"got {out.numel()} elements, {out.dtype}, {out.device}"
        )
