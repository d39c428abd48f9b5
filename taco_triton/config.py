"""Compression configuration and the constants of each code format.

`CompressionConfig` is what users pass around; `CodecSpec` holds the numeric facts of a code
format (largest code, mantissa bits, smallest normal exponent) that the reference, the Triton
kernels and the error bounds in the tests all read from one place.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

#: Appended, never reordered: `Compressed.to_bytes` stores a codec as its index here.
CODECS = ("fp8_e4m3", "fp8_e5m2", "int8", "int6", "int4")
GROUP_SIZES = (32, 64, 128, 256, 512)
SCALE_MODES = ("dual", "taco_fp32x2")
ROUNDINGS = ("nearest", "stochastic")
INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

#: Elements per super-block in the "dual" layout: one FP32 scale per super-block, one 8-bit
#: scale per group. A super-block is also the work unit of one kernel program, which is what lets
#: compression run in a single pass over the input (no separate tensor-wide amax pass).
SUPERBLOCK_ELEMS = 4096


@dataclass(frozen=True)
class CodecSpec:
    """Numeric facts of one code format.

    Attributes:
        name: codec name as used in `CompressionConfig.codec`.
        code_max: largest finite code magnitude (448 for E4M3, 57344 for E5M2, 127 for INT8,
            31 for INT6, 7 for INT4: symmetric, the most negative two's complement code unused).
        mbits: explicit mantissa bits (0 for int8, where codes are plain integers).
        emin: exponent of the smallest normal (floating codecs only).
        torch_dtype: the torch dtype whose round-to-nearest-even cast the codes must equal.
        is_float: floating-point (FP8) or integer codes.
        bits: bits per code on the wire. Integer codes under 8 bits are packed (INT6: four codes
            in three bytes, INT4: two per byte, low bits first); unpacked they are the int8
            of the same value, so everything but the wire's code bytes is shared with INT8.
    """

    name: str
    code_max: float
    mbits: int
    emin: int
    torch_dtype: torch.dtype
    is_float: bool
    bits: int = 8

    def code_bytes(self, group_size: int) -> int:
        """Wire bytes of one group's codes.

        Args:
            group_size: elements per group G.

        Returns:
            G x bits / 8 (whole bytes for every G >= 32).
        """
        return group_size * self.bits // 8

    def half_ulp(self, v: torch.Tensor) -> torch.Tensor:
        """Half the spacing of the code grid at magnitude |v| (v in code units, float64 result).

        This is the worst-case round-to-nearest error of one code, the basis of every error bound.

        Args:
            v: magnitudes in code units (any float dtype).

        Returns:
            float64 tensor of v's shape.
        """
        v = v.abs().double()
        if not self.is_float:
            return torch.full_like(v, 0.5)
        e = torch.floor(torch.log2(v.clamp_min(2.0**self.emin)))
        return torch.exp2(e - self.mbits - 1)

    @property
    def relative_rounding(self) -> float:
        """Largest relative rounding error of a group's largest code: 2^-(mbits+1) for normal
        floating codes; for integer codes half a step at the smallest code the group maximum can
        get, code_max / (1 + 2^-4) (the 8-bit group scale rounds up by less than 2^-4)."""
        if self.is_float:
            return 2.0 ** -(self.mbits + 1)
        return 0.5 * (1 + 2.0**-4) / self.code_max


CODEC_SPECS = {
    "fp8_e4m3": CodecSpec("fp8_e4m3", 448.0, 3, -6, torch.float8_e4m3fn, True),
    "fp8_e5m2": CodecSpec("fp8_e5m2", 57344.0, 2, -14, torch.float8_e5m2, True),
    "int8": CodecSpec("int8", 127.0, 0, 0, torch.int8, False),
    "int6": CodecSpec("int6", 31.0, 0, 0, torch.int8, False, bits=6),
    "int4": CodecSpec("int4", 7.0, 0, 0, torch.int8, False, bits=4),
}
"""The `CodecSpec` of each codec, by `CompressionConfig.codec` name."""


def _check_choice(field: str, value, allowed) -> None:
    # exact types: 128.0, True or a tensor compare equal to an allowed value but are not one
    if type(value) is not type(allowed[0]) or value not in allowed:
        raise ValueError(
            f"CompressionConfig.{field}={value!r} ({type(value).__name__}) is not supported; allowed: {list(allowed)}"
        )


@dataclass(frozen=True)
class CompressionConfig:
    """How a tensor is compressed. Frozen and hashable, so it can key caches and plans.

    Args:
        codec: "fp8_e4m3" (default, TACO's choice), "fp8_e5m2", or symmetric integer codes
            "int8", "int6" (0.78 bytes per element at G=32, 2.56x fewer than bf16) or "int4"
            (0.53 bytes per element at G=32, 3.76x); the sub-byte codes are packed on the wire.
        group_size: elements per quantization group G: 32, 64, 128 (default), 256 or 512.
            Groups are contiguous runs of the flattened tensor (for a row-major [tokens, hidden]
            tensor: G consecutive hidden values of one token).
        hadamard: apply a normalised block Walsh-Hadamard transform of size G before quantizing.
        scales: "dual" (default): one FP32 scale per super-block of 4096 elements times one
            8-bit (unsigned E4M4) scale per group, <= 1 byte of metadata per group.
            "taco_fp32x2": TACO's released layout, an RMS pre-scale and an absmax scale stored as
            two FP32 per group (8 bytes per group).
        rounding: "nearest" (round half to even) or "stochastic" (unbiased; for gradients).
        seed: seed of the counter-based random stream used by stochastic rounding. `compress`
            uses it as given; the collectives and p2p salt it with the rank and the call (in CUDA
            graph replays also with a counter each replay advances on the device), so their
            rounding noise is independent across ranks, calls and replays.
        enabled: False turns compression off where a config is consumed by the collectives (they
            then run the native collective); `compress` refuses a disabled config.

    Raises:
        ValueError: a field outside its allowed values (naming the field, the value and what is
            allowed).

    Example:
        >>> cfg = CompressionConfig(codec="int8", group_size=64)
        >>> cfg.bytes_per_element(4096)
        1.0166015625
    """

    codec: str = "fp8_e4m3"
    group_size: int = 128
    hadamard: bool = True
    scales: str = "dual"
    rounding: str = "nearest"
    seed: int = 0
    enabled: bool = True

    def __post_init__(self) -> None:
        _check_choice("codec", self.codec, CODECS)
        _check_choice("group_size", self.group_size, GROUP_SIZES)
        _check_choice("scales", self.scales, SCALE_MODES)
        _check_choice("rounding", self.rounding, ROUNDINGS)
        if not isinstance(self.hadamard, bool):
            raise ValueError(f"CompressionConfig.hadamard must be a bool, got {self.hadamard!r}")
        if not isinstance(self.enabled, bool):
            raise ValueError(f"CompressionConfig.enabled must be a bool, got {self.enabled!r}")
        if type(self.seed) is not int or not 0 <= self.seed < 2**31:
            raise ValueError(
                f"CompressionConfig.seed must be an int in [0, 2**31), got {self.seed!r} ({type(self.seed).__name__})"
            )

    @property
    def spec(self) -> CodecSpec:
        """The codec's `CodecSpec`."""
        return CODEC_SPECS[self.codec]

    @property
    def stochastic(self) -> bool:
        """Whether rounding is stochastic."""
        return self.rounding == "stochastic"

    def replace(self, **changes) -> "CompressionConfig":
        """A copy with some fields changed (validated again).

        Args:
            **changes: field names and their new values.

        Returns:
            The new config.
        """
        return dataclasses.replace(self, **changes)

    def wire_regions(self, numel: int) -> tuple[int, int, int]:
        """Bytes of the three wire regions of `numel` elements: (codes, scale_a, scale_b).

        Codes are `code_bytes` per group, the last group padded to G; "dual" stores one FP32
        per super-block and one byte per group, "taco_fp32x2" two FP32 per group. Where the
        regions sit is `taco_triton.layout.WireLayout`'s business; this is only their sizes.

        Args:
            numel: elements of the tensor, >= 0.

        Returns:
            (codes, scale_a, scale_b) in bytes.

        Raises:
            ValueError: numel is negative.
        """
        if numel < 0:
            raise ValueError(f"numel must be >= 0, got {numel}")
        n_groups = -(-numel // self.group_size)
        codes = n_groups * self.spec.code_bytes(self.group_size)
        if self.scales == "dual":
            n_superblocks = -(-n_groups // (SUPERBLOCK_ELEMS // self.group_size))
            return codes, 4 * n_superblocks, n_groups
        return codes, 4 * n_groups, 4 * n_groups

    def bytes_per_element(self, numel: int = 1 << 20) -> float:
        """Wire bytes per input element for a tensor of `numel` elements (metadata included).

        Args:
            numel: elements of the tensor (default 1 Mi: the rate on whole super-blocks).

        Returns:
            The sum of `wire_regions(numel)` over `numel` (over 1 for an empty tensor).
        """
        return sum(self.wire_regions(numel)) / max(numel, 1)

    def to_dict(self) -> dict:
        """The fields as a dict (JSON-serialisable; `from_dict` reads it back).

        Returns:
            {field name: value}.
        """
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "CompressionConfig":
        """The config a `to_dict` dict describes (missing fields take their defaults).

        Args:
            d: {field name: value}.

        Returns:
            The config, validated.

        Raises:
            ValueError: a key that is not a field, or a value outside its allowed ones.
        """
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown CompressionConfig fields: {sorted(unknown)}")
        return cls(**d)
