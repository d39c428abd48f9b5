"""`Compressed`: a compressed tensor, and its self-describing byte form for storage/transport."""
from __future__ import annotations

import struct
import zlib
from typing import NamedTuple

import torch

from .config import CODECS, ROUNDINGS, SCALE_MODES, SUPERBLOCK_ELEMS, CompressionConfig
from .kernels import slots
from .layout import WireLayout
from .reference import unpack_codes

_MAGIC = b"TACO"
_VERSION = 1
# magic, version, codec, group_size, hadamard, scales, rounding, seed, dtype, superblock, ndim
_FIXED = struct.Struct("<4sBBHBBBIBIB")
_DIM = struct.Struct("<q")
_LEN = struct.Struct("<Q")
_CRC = struct.Struct("<I")
_MAX_NDIM = 16
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_MAX_STRIDE = 2**63 - 1  # the product of a shape's non-zero dims is a stride: it must fit int64
#: Codes compress never writes (it saturates): FP8 NaN (E4M3) or Inf/NaN (E5M2), the most
#: negative integer code (-128, -32, -8: the integer codecs are symmetric). Codes one byte each.
_IMPOSSIBLE_CODES = {
    "fp8_e4m3": lambda c: (c & 0x7F) == 0x7F,
    "fp8_e5m2": lambda c: (c & 0x7C) == 0x7C,
    "int8": lambda c: c == 0x80,
    "int6": lambda c: c == 0xE0,
    "int4": lambda c: c == 0xF8,
}


class Compressed(NamedTuple):
    """A compressed tensor.

    Attributes:
        data: 1-D contiguous uint8 tensor on the input's device: exactly the bytes sent on the wire
            (layout in `taco_triton.layout`).
        shape: shape of the original tensor.
        dtype: dtype of the original tensor (decompress returns this dtype).
        config: the `CompressionConfig` it was compressed with.
    """

    data: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype
    config: CompressionConfig

    @property
    def nbytes(self) -> int:
        """Bytes on the wire (codes and all scales)."""
        return self.data.numel()

    @property
    def numel(self) -> int:
        """Elements of the original tensor."""
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def ratio(self) -> float:
        """Compression ratio against the same tensor sent as bf16 (2 bytes per element)."""
        return 2 * self.numel / self.nbytes if self.nbytes else float("nan")

    def to_bytes(self) -> bytes:
        """Serialise to self-describing bytes (the format is in docs/format-stability.md).

        Returns:
            Header (format, config, dtype, shape), payload and a CRC32.
        """
        c = self.config
        head = _FIXED.pack(
            _MAGIC, _VERSION, CODECS.index(c.codec), c.group_size, int(c.hadamard),
            SCALE_MODES.index(c.scales), ROUNDINGS.index(c.rounding), c.seed,
            _DTYPES.index(self.dtype), SUPERBLOCK_ELEMS, len(self.shape),
        )
        head += b"".join(_DIM.pack(d) for d in self.shape) + _LEN.pack(self.nbytes)
        body = head + self.data.cpu().numpy().tobytes()
        return body + _CRC.pack(zlib.crc32(body))

    @classmethod
    def from_bytes(cls, blob, device=None) -> "Compressed":
        """Parse `to_bytes` output.

        Args:
            blob: the bytes (any buffer: bytes, bytearray, memoryview, a numpy array).
            device: where to put `data` (default: CPU).

        Returns:
            The `Compressed`, validated (`validate`).

        Raises:
            ValueError: truncated, corrupted or foreign bytes (naming what is wrong).
        """
        mv = memoryview(blob).cast("B")
        n = len(mv)
        if n < _FIXED.size:
            raise ValueError(f"truncated taco_triton buffer: {n} bytes, header needs {_FIXED.size}")
        magic, version, codec, g, had, scales, rnd, seed, dt, sb, ndim = _FIXED.unpack_from(mv, 0)
        if magic != _MAGIC:
            raise ValueError(f"not a taco_triton buffer: magic {bytes(magic)!r}, expected {_MAGIC!r}")
        if version != _VERSION:
            raise ValueError(f"unsupported taco_triton format version {version} (this build reads {_VERSION})")
        if ndim > _MAX_NDIM:
            raise ValueError(f"corrupt header: ndim={ndim} > {_MAX_NDIM}")
        head_len = _FIXED.size + ndim * _DIM.size + _LEN.size
        if n < head_len + _CRC.size:
            raise ValueError(f"truncated taco_triton buffer: {n} bytes, header needs {head_len + _CRC.size}")
        (payload_len,) = _LEN.unpack_from(mv, head_len - _LEN.size)
        if n != head_len + payload_len + _CRC.size:
            raise ValueError(
                f"truncated or padded taco_triton buffer: {n} bytes, header says "
                f"{head_len + payload_len + _CRC.size}"
            )
        (crc,) = _CRC.unpack_from(mv, n - _CRC.size)
        if zlib.crc32(mv[: n - _CRC.size]) != crc:
            raise ValueError("taco_triton buffer failed its CRC32 check: the bytes are corrupted")
        shape = tuple(_DIM.unpack_from(mv, _FIXED.size + i * _DIM.size)[0] for i in range(ndim))
        try:
            if sb != SUPERBLOCK_ELEMS:
                raise ValueError(f"super-block of {sb} elements (this build uses {SUPERBLOCK_ELEMS})")
            if min(shape, default=0) < 0 or had > 1 or dt >= len(_DTYPES):
                raise ValueError(f"shape {shape}, hadamard {had}, dtype id {dt}")
            extent = 1
            for d in shape:
                extent *= max(d, 1)
            if extent > _MAX_STRIDE:
                raise ValueError(f"shape {shape}: the product of its non-zero dims exceeds 2**63 - 1")
            config = CompressionConfig(CODECS[codec], g, bool(had), SCALE_MODES[scales], ROUNDINGS[rnd], seed)
        except (IndexError, ValueError) as e:
            raise ValueError(f"corrupt taco_triton header: {e}") from None
        numel = 1
        for d in shape:
            numel *= d
        expected = WireLayout.of(numel, config).nbytes
        if payload_len != expected:
            raise ValueError(f"corrupt taco_triton header: payload {payload_len} bytes, shape {shape} needs {expected}")
        payload = bytearray(mv[head_len : head_len + payload_len])
        data = torch.frombuffer(payload, dtype=torch.uint8) if payload else torch.empty(0, dtype=torch.uint8)
        out = cls(data, torch.Size(shape), _DTYPES[dt], config)
        out.validate()
        return out.to(device) if device is not None else out

    def to(self, device) -> "Compressed":
        """A copy with `data` on another device.

        Args:
            device: the target device.

        Returns:
            The same compressed tensor, its bytes on `device`.
        """
        return self._replace(data=self.data.to(device))

    def aligned(self) -> "Compressed":
        """This `Compressed`, with `data` copied into fresh storage if it is not a contiguous
        1-D tensor starting 16-byte aligned (a slice cut from a receive buffer at an odd offset
        cannot be viewed as FP32 scales).

        Returns:
            `self`, or a copy with aligned, contiguous `data`.
        """
        d = self.data
        if torch.compiler.is_compiling():  # traced graphs hold tensors the compiler allocated (aligned)
            return self
        if d.dim() == 1 and d.is_contiguous() and d.data_ptr() % slots.ALIGN == 0:
            return self
        return self._replace(data=d.clone(memory_format=torch.contiguous_format))

    def validate(self) -> None:
        """Check the buffer is one compress can produce: its size, its scales and its codes.
        Misaligned or strided `data` is checked on an aligned copy.

        Raises:
            ValueError: `data` is not 1-D uint8, or holds codes or scales compress never writes
                (naming how many, and the first).
        """
        if not isinstance(self.data, torch.Tensor) or self.data.dtype != torch.uint8 or self.data.dim() != 1:
            raise ValueError(f"Compressed.data must be a 1-D uint8 tensor, got {getattr(self.data, 'dtype', type(self.data))} "
                             f"with shape {tuple(getattr(self.data, 'shape', ()))}")
        layout = WireLayout.of(self.numel, self.config)
        codes, a, b = layout.split(self.aligned().data)
        codes = unpack_codes(codes, self.config.spec.bits)
        bad_codes = _IMPOSSIBLE_CODES[self.config.codec](codes)
        if bool(bad_codes.any()):
            first = int(bad_codes.reshape(-1).nonzero()[0, 0])
            raise ValueError(
                f"invalid codes in taco_triton buffer: {int(bad_codes.sum())} {self.config.codec} codes compress "
                f"never writes, the first 0x{int(codes.reshape(-1)[first]):02x} at element {first}"
            )
        if self.config.scales == "dual":
            bad_sb = ~(torch.isfinite(a) & (a >= 0))
            bad_g = (b > 240) & (b != 255)
        else:
            bad_sb = ~(torch.isfinite(a) & (a > 0))
            bad_g = ~((b >= 0) | b.isnan())
        if bool(bad_sb.any()) or bool(bad_g.any()):
            raise ValueError(
                f"invalid scales in taco_triton buffer: {int(bad_sb.sum())} bad FP32 scales, "
                f"{int(bad_g.sum())} bad group scales"
            )
