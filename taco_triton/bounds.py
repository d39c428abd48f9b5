"""Worst-case error bounds derived from the code format, for property tests (ours and users').

Everything is computed in float64 from the compressed bytes themselves (codes and the group
scales sigma that compression actually used), so a bound can fail only if the codec is wrong.

Transformed domain, element i of group g (scale sigma_g, super-block scale S):
    |y'_i - y_i| <= sigma_g (r(v_i) + u v_i + 4 u code_max) + delta_i,   v_i = (|y_i| + delta_i) / sigma_g
- r(v): half the code grid spacing at v (FP8: 2^(max(floor(log2 v), emin) - mbits - 1), which is
  the subnormal spacing floor below the normal range; integer codes: 1/2); a whole spacing with
  stochastic rounding.
- 2 u v: the FP32 roundings of 1 / sigma and of y times it; 4 u code_max: saturation slack left by the (at most three)
  FP32 roundings inside sigma.
- delta_i: FP32 error of the transform the compressor computed, gamma_G sum_j |x_j| / (2G) with
  gamma_n = n u_dot / (1 - n u_dot) (one dot of length G, or two Kronecker stages of 16 and G/16),
  plus TINY (2^-140 for products that land in FP32's subnormal range; on GPUs 2^-135 more for
  the bf16 split of FP32 operands, see U_DOT); TACO's pre-scale adds u per element. Zero without Hadamard and pre-scale.
- sigma_g = 0 (all-zero group): the codes are 0 and the bound is |y_i| + delta_i.
Scale quality: amax_g (1 - 4u) - code_max (S 2^-149 + 2^-149) <= sigma_g code_max <= amax_g (1 + 2^-4)(1 + 4u) + code_max (S 2^-18 + 2^-149),
amax_g widened by delta: E4M4 rounds up by at most one step (2^-4 relative, or 2^-18 S below its
normal range); S 2^-149 (dual only): the FP32 ratio of a group's amax to its super-block's is
rounded by up to 2^-150 absolute below FP32's normal range (0 below 2^-150: the group's codes are
0); 2^-149: a scale in FP32's subnormal range is rounded by up to 2^-150 absolute.
Original domain: x' = 2 y' H per group and H / sqrt(G) is orthogonal, so
    ||x' - x||_2 <= 2 sqrt(G) ||B||_2 + decoder roundings + output rounding,
with B the elementwise bound (factor 1 without Hadamard).
"""
from __future__ import annotations

import math

import torch

from . import reference
from .compressed import Compressed
from .layout import WireLayout

U32 = 2.0**-24
"""Unit roundoff of FP32 (round to nearest): the relative error of one FP32 rounding."""
U_DOT = {"interpreter": 2.0**-24, "gpu": 2.0**-21}
"""Unit roundoff of the transform's dot products. Interpreter: IEEE FP32. GPUs: 16-bit operands
(bf16/fp16 inputs, decoded codes) times the +-2^k table are exact products accumulated in FP32;
FP32 operands are split into three bf16 pieces on NVIDIA (exact products, 3G FP32 additions:
gamma_3G(2^-23) < gamma_G(2^-21) even for tensor cores that truncate) and use FP32 matrix
instructions on AMD. 2^-21 bounds every case (it also covers three TF32 passes, 2^-22)."""
TINY = {"interpreter": 2.0**-140, "gpu": 2.0**-140 + 2.0**-135}
"""Absolute error per transformed element besides the relative one: products in FP32's subnormal
range (2^-140), and on GPUs the bf16 split's lowest piece, rounded where it falls below bf16's
subnormal spacing (|x| < 2^-110: at most 2^-134 per input, G inputs times the table's 1/(2G))."""


def _tiny(u_dot: float) -> float:
    return TINY["interpreter"] if u_dot <= U_DOT["interpreter"] else TINY["gpu"]


def _gamma(n: int, u: float) -> float:
    return n * u / (1 - n * u)


def _parts(c: Compressed):
    layout = WireLayout.of(c.numel, c.config)
    codes, a, b = layout.split(c.data.cpu())
    return layout, reference.unpack_codes(codes, c.config.spec.bits), a.double(), b


def group_sigma(c: Compressed) -> torch.Tensor:
    """The FP32 group scales compression used.

    Args:
        c: a compressed tensor.

    Returns:
        float64 [n_groups] (NaN for non-finite groups).
    """
    layout, _, a, b = _parts(c)
    if c.config.scales == "dual":
        sb = a.float().repeat_interleave(layout.groups_per_superblock)[: layout.n_groups]
        return (sb * reference.decode_ue4m4(b)).double()
    return b.double()


def superblock_scale_per_group(c: Compressed) -> torch.Tensor:
    """The super-block scale of each group's super-block ("dual" scales).

    Args:
        c: a compressed tensor with "dual" scales.

    Returns:
        float64 [n_groups]: each group's FP32 super-block scale.
    """
    layout, _, a, _ = _parts(c)
    return a.repeat_interleave(layout.groups_per_superblock)[: layout.n_groups]


def exact_transform(x: torch.Tensor, c: Compressed):
    """The exact transform of `x` as `c`'s config computes it, in float64.

    Args:
        x: the tensor `c` was compressed from.
        c: its compressed form (its config and, for "taco_fp32x2", its pre-scales).

    Returns:
        (y, groups): exact transformed values and the (pre-scaled) groups they came from,
        float64 [n_groups, G].
    """
    cfg = c.config
    g = cfg.group_size
    _, _, a, _ = _parts(c)
    groups = reference.to_groups(x.cpu(), g).double()
    if cfg.scales == "taco_fp32x2":
        groups = groups * a[:, None]
    y = reference.hadamard_forward(groups) if cfg.hadamard else groups
    return y, groups


def transformed_error_bound(x: torch.Tensor, c: Compressed, u_dot: float = U_DOT["interpreter"]):
    """The elementwise error bound in the transformed domain (the module docstring's B).

    Args:
        x: the tensor `c` was compressed from.
        c: its compressed form.
        u_dot: unit roundoff of the transform's dot products (`U_DOT`).

    Returns:
        (y, y', B): exact y, decoded y' and the elementwise bound B, all float64 [n_groups, G].
        Rows of non-finite groups are NaN in y' and B.
    """
    cfg, spec = c.config, c.config.spec
    g = cfg.group_size
    _, codes, _, _ = _parts(c)
    y, groups = exact_transform(x, c)
    sigma = group_sigma(c)[:, None]
    y_dec = reference.decode_codes(codes, spec).double() * sigma
    taco = cfg.scales == "taco_fp32x2"
    if cfg.hadamard:
        rowsum = groups.abs().sum(dim=1, keepdim=True) / (2 * g)
        delta = (_gamma(g, u_dot) + (U32 if taco else 0.0)) * rowsum + _tiny(u_dot)
    else:
        delta = (U32 if taco else 0.0) * y.abs()
    delta = delta.expand_as(y)
    v = (y.abs() + delta) / sigma
    grid = spec.half_ulp(v) * (2.0 if cfg.stochastic else 1.0)
    bound = sigma * (grid + 2 * U32 * v + 4 * U32 * spec.code_max) + delta
    bound = torch.where(sigma > 0, bound, y.abs() + delta)
    return y, y_dec, bound


def scale_bounds(x: torch.Tensor, c: Compressed, u_dot: float = U_DOT["interpreter"]):
    """The group scales compression chose and the range the format allows them.

    Args:
        x: the tensor `c` was compressed from.
        c: its compressed form.
        u_dot: unit roundoff of the transform's dot products (`U_DOT`).

    Returns:
        (sigma, lower, upper), float64 [n_groups].
    """
    cfg, spec = c.config, c.config.spec
    y, groups = exact_transform(x, c)
    if cfg.hadamard:
        slack = _gamma(cfg.group_size, u_dot) * groups.abs().sum(dim=1) / (2 * cfg.group_size) + _tiny(u_dot)
    else:
        slack = torch.zeros(y.shape[0], dtype=torch.float64)
    if cfg.scales == "taco_fp32x2":
        slack = slack + U32 * y.abs().amax(dim=1)
    amax = y.abs().amax(dim=1)
    lower = (amax - slack) * (1 - 4 * U32) / spec.code_max - 2.0**-149  # subnormal sigma: absolute rounding
    upper = (amax + slack) * (1 + 4 * U32) / spec.code_max + 2.0**-149
    if cfg.scales == "dual":
        lower = lower - superblock_scale_per_group(c) * 2.0**-149  # a subnormal (or zero) amax / sb_amax
        upper = upper * (1 + 2.0**-4) + superblock_scale_per_group(c) * 2.0**-18
    return group_sigma(c), lower, upper


def l2_error_bound(x: torch.Tensor, c: Compressed, out_dtype: torch.dtype, u_dot: float = U_DOT["interpreter"]) -> float:
    """Bound on ||decompress(c) - x||_2 over the finite groups.

    Args:
        x: the tensor `c` was compressed from.
        c: its compressed form.
        out_dtype: the dtype decompress writes (its rounding is part of the bound).
        u_dot: unit roundoff of the transform's dot products (`U_DOT`).

    Returns:
        The bound, a float.
    """
    cfg = c.config
    g = cfg.group_size
    _, y_dec, bound = transformed_error_bound(x, c, u_dot)
    ok = torch.isfinite(bound).all(dim=1)
    if cfg.scales == "taco_fp32x2":  # the transformed domain carries TACO's pre-scale
        bound = bound / _parts(c)[2][:, None]
    core = (2 * math.sqrt(g) if cfg.hadamard else 1.0) * float(bound[ok].norm())
    # decoder: FP32 transform of the codes (gamma_G of the row's absolute sum), one scale
    # multiply (u) by the group's factor, which for taco_fp32x2 is sigma / pre rounded once (u);
    # then one rounding into out_dtype.
    if cfg.hadamard:
        x_dec = reference.hadamard_inverse(y_dec[ok])
        work = 2 * y_dec[ok].abs().sum(dim=1, keepdim=True) * (_gamma(g, u_dot) + 2 * U32)
    else:
        x_dec = y_dec[ok]
        work = x_dec.abs() * 2 * U32
    if cfg.scales == "taco_fp32x2":
        pre = _parts(c)[2][ok][:, None]
        x_dec, work = x_dec / pre, work / pre
    u_out = torch.finfo(out_dtype).eps / 2
    work = float(work.expand_as(x_dec).norm())
    return core + work + u_out * (float(x_dec.norm()) + core + work)
