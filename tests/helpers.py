"""Shared test helpers: devices, input generators, readable ids."""
from __future__ import annotations

import importlib.util
import itertools
import os
import sys
from pathlib import Path

import torch

import taco_triton as taco
from taco_triton.bounds import U_DOT

DEVICE = os.environ.get("TACO_TEST_DEVICE", "cpu")
ON_GPU = DEVICE == "cuda"
U_DOT_HERE = U_DOT["gpu"] if ON_GPU else U_DOT["interpreter"]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CODEC_SHORT = {"fp8_e4m3": "e4m3", "fp8_e5m2": "e5m2", "int8": "int8", "int6": "int6", "int4": "int4"}


def cfg_id(cfg: taco.CompressionConfig) -> str:
    parts = [CODEC_SHORT[cfg.codec], f"G{cfg.group_size}", "H" if cfg.hadamard else "noH"]
    if cfg.scales != "dual":
        parts.append("fp32x2")
    if cfg.stochastic:
        parts.append("SR")
    return "-".join(parts)


#: Group sizes the sub-byte codecs run at in the per-config tests: one single-dot and one
#: Kronecker transform. Their packing is the same code at every G and the rest is INT8's path,
#: tested at every G; this keeps the suite's added time small.
SUB_BYTE_GROUP_SIZES = (32, 512)


def all_configs(**fixed):
    """Every 8-bit codec x group size x Hadamard, and the sub-byte codecs at SUB_BYTE_GROUP_SIZES
    (other fields from `fixed`)."""
    return [
        taco.CompressionConfig(codec=c, group_size=g, hadamard=h, **fixed)
        for c, g, h in itertools.product(taco.config.CODECS, taco.config.GROUP_SIZES, (False, True))
        if taco.config.CODEC_SPECS[c].bits == 8 or g in SUB_BYTE_GROUP_SIZES
    ]


def make_input(kind: str, shape, dtype: torch.dtype, seed: int = 0, magnitude: float = 1.0) -> torch.Tensor:
    """Test tensors with the shapes of TP traffic: dense, near-zero, heavy tails, outliers, zero groups."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    if kind == "heavy":  # Student-t with 2 degrees of freedom: infinite variance tails
        chi = torch.randn((2, *shape), generator=g, dtype=torch.float64).pow(2).sum(0) / 2
        x = x / chi.sqrt().clamp_min(1e-3)
    elif kind == "outliers":  # a few hidden channels hundreds of times larger, as in real TP activations
        cols = torch.randint(0, shape[-1], (max(1, shape[-1] // 64),), generator=g)
        x[..., cols] *= 400.0
    elif kind == "zero_groups":
        flat = x.view(-1)
        flat[: min(flat.numel(), 96)] = 0.0
        flat[flat.numel() // 2 :] = 0.0
    elif kind == "near_zero":
        x = x * 1e-3
    big = torch.finfo(dtype).max
    x = x / x.abs().max().clamp_min(1e-300) * min(magnitude, big)
    return x.clamp(-big, big).to(dtype).to(DEVICE)


def load_script(path: Path, name: str | None = None):
    """A script outside the package (bench/, notebooks/) imported as a module, registered in
    sys.modules (its dataclasses look their module up there)."""
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod
