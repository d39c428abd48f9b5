"""The wire layout: where each part of a compressed tensor lives in its one uint8 buffer.

The buffer is exactly what goes on the wire, so both ends derive the layout from
(numel, config) alone; nothing about the layout travels with the data.

    dual:         [codes: n_groups*C u8][superblock scales: n_sb f32][group scales: n_groups u8]
    taco_fp32x2:  [codes: n_groups*C u8][pre-scales: n_groups f32][absmax scales: n_groups f32]

C = G * bits / 8 code bytes per group (G for the 8-bit codecs; INT6 packs four codes in three
bytes, INT4 two per byte, so every group starts on a byte). Codes come first so they start
16-byte aligned for vector loads; C is a multiple of 4 for G >= 32, so the FP32 region after them
is 4-byte aligned. The last group is padded to G codes (never the
input): with the Hadamard transform a partial group has G coefficients, so its codes need G bytes.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from .config import SUPERBLOCK_ELEMS, CompressionConfig


@dataclass(frozen=True)
class WireLayout:
    numel: int
    group_size: int
    code_bytes: int  # per group
    n_groups: int
    groups_per_superblock: int
    n_superblocks: int
    scales: str
    codes_offset: int
    scale_a_offset: int  # superblock f32 scales (dual) or per-group pre-scales (taco_fp32x2)
    scale_b_offset: int  # per-group u8 scales (dual) or per-group f32 absmax scales (taco_fp32x2)
    nbytes: int

    @staticmethod
    def of(numel: int, config: CompressionConfig) -> WireLayout:
        """The layout of `numel` elements under `config` (cached: layouts are immutable)."""
        try:
            return _layout_of(numel, config)
        except TypeError:  # an unhashable size (a symbolic one while tracing): built each time
            return WireLayout._build(numel, config)

    @staticmethod
    def _build(numel: int, config: CompressionConfig) -> WireLayout:
        codes, a_bytes, b_bytes = config.wire_regions(numel)  # raises for numel < 0
        g = config.group_size
        n_groups = -(-numel // g)
        gps = SUPERBLOCK_ELEMS // g
        return WireLayout(
            numel=numel,
            group_size=g,
            code_bytes=config.spec.code_bytes(g),
            n_groups=n_groups,
            groups_per_superblock=gps,
            n_superblocks=-(-n_groups // gps),
            scales=config.scales,
            codes_offset=0,
            scale_a_offset=codes,
            scale_b_offset=codes + a_bytes,
            nbytes=codes + a_bytes + b_bytes,
        )

    def split(self, data):
        """Views of (codes u8 [n_groups, code_bytes], scale_a, scale_b) inside a flat uint8 tensor
        (`reference.unpack_codes` turns packed codes into one byte per code)."""
        import torch

        if data.dtype != torch.uint8 or data.dim() != 1 or data.numel() != self.nbytes:
            raise ValueError(
                f"wire buffer must be 1-D uint8 with {self.nbytes} bytes, got {data.dtype} "
                f"shape {tuple(data.shape)}"
            )
        codes = data[: self.scale_a_offset].view(self.n_groups, self.code_bytes)
        a = data[self.scale_a_offset : self.scale_b_offset].view(torch.float32)
        b = data[self.scale_b_offset :]
        if self.scales != "dual":
            b = b.view(torch.float32)
        return codes, a, b


@functools.lru_cache(maxsize=8192)
def _layout_of(numel: int, config: CompressionConfig) -> WireLayout:
    return WireLayout._build(numel, config)
