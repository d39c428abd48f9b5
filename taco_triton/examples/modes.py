"""The compression modes the training examples compare, each as a `CompressionPolicy`.

none (native bf16 collectives), fp8 (the default config: E4M3, G=128, Hadamard), int8 (INT8,
G=128, Hadamard), int6 (INT6, G=32, Hadamard: 2.56x fewer bytes than bf16), int4 (INT4, G=32,
Hadamard: 3.76x) in both directions, int4-fwd / int4-bwd (INT4 in the forward or the backward
collectives only, the other direction native bf16), auto (the policy calibrates every site on
the first `calibrate_steps` steps, then freezes the plan). `progress` is how the examples log a
step.
"""
from __future__ import annotations

import math

import torch

import taco_triton as taco
from taco_triton.parallel import CompressionPolicy

MODES = ("none", "fp8", "int8", "int6", "int4", "int4-fwd", "int4-bwd", "auto")


def make_policy(mode: str, args) -> CompressionPolicy:
    """The policy of `mode` (one of `MODES`) with `args.min_bytes` (and, for auto,
    `args.calibrate_steps` and `args.plan`). Every mode communicates bf16 (the baseline is bf16,
    never fp32).

    Raises:
        ValueError: an unknown mode.
    """
    common = dict(min_bytes=args.min_bytes, comm_dtype=torch.bfloat16)
    if mode == "none":
        return CompressionPolicy(default=None, **common)
    if mode == "fp8":
        return CompressionPolicy(default=taco.CompressionConfig(), **common)
    if mode == "int8":
        return CompressionPolicy(default=taco.CompressionConfig(codec="int8"), **common)
    if mode == "int6":
        return CompressionPolicy(default=taco.CompressionConfig(codec="int6", group_size=32), **common)
    if mode in ("int4", "int4-fwd", "int4-bwd"):  # G=32, as int6 (the sub-byte codes need small groups: see Choosing a config)
        return CompressionPolicy(default=taco.CompressionConfig(codec="int4", group_size=32),
                                 forward=mode != "int4-bwd", backward=mode != "int4-fwd", **common)
    if mode == "auto":
        return CompressionPolicy(calibrate_steps=args.calibrate_steps, plan=args.plan, **common)
    raise ValueError(f"--compress modes are {MODES}, got {mode!r}")


def progress(prefix: str, row: dict, extra: str = "") -> str:
    """One logged step: `prefix`, the step, the train loss, the validation loss only where the step
    evaluated it (rows of other steps hold NaN there), then `extra`.

        >>> progress("[fp8]", {"step": 3, "train_loss": 2.5, "val_loss": float("nan")}, "wire 1.00 MiB")
        '  [fp8] step    3  train 2.5000  wire 1.00 MiB'
    """
    val = "" if math.isnan(row["val_loss"]) else f"  val {row['val_loss']:.4f}"
    return f"  {prefix} step {row['step']:4d}  train {row['train_loss']:.4f}{val}" + (f"  {extra}" if extra else "")
