#!/usr/bin/env python
"""The Triton kernels' output bytes against the torch reference, for every codec, dtype and mode.

For each config (codec x G x Hadamard x scale layout x rounding), input dtype and size this runs
every kernel of the library on the chosen device and the reference (`taco_triton.reference`) on
the CPU with the same input, and compares:

    compress      `compress_triton(x)`              vs `compress_reference(x)`: wire bytes
    decompress    `decompress_triton(wire)`         vs `decompress_reference(wire)`: output values
    reduce        `reduce_triton(bufs)`             vs `reduce_reference(bufs)`: the compressed sum
    reduce_dense  `reduce_triton(bufs, dense_out=)` vs `reduce_reference(bufs, dense_dtype=)`

`wire` is the reference's compression of x, so decompress sees the same bytes on both sides;
`bufs` holds 2, 3 or 4 ranks' reference wire buffers of distinct inputs (P cycles with the
config; the sum is averaged for P = 2 and 4). Inputs hold normal values, an outlier group,
groups of subnormals, zero groups, subnormals mixed into normal groups, values near the dtype's
maximum, and one NaN and one Inf group (regions of 512 elements: whole groups at every G).

Each row reports the differing bytes (wire: split into code and scale bytes; dense outputs:
output bytes), and for the decoded values (wire buffers decoded by the reference on the CPU)
the differing elements and the largest absolute and relative difference. Verdicts:

    identical               every byte equal
    differ (within bound)   bytes differ where the kernel may legitimately differ, and the
                            values are within the bound the project states for that path; or,
                            where identical bytes are expected, the differing bytes decode to
                            equal numbers (+0 against -0: the kernels' reduce sums from +0, the
                            reference from the first rank's term, so -0 on every rank gives -0)
    differ (OUT of bound)   a difference the bound does not allow (or a kernel error)

Bit-identical is expected (a difference in value is OUT of bound) where the kernel does the reference's
FP32 operations in the same order:
  - compress without Hadamard with dual scales, nearest and stochastic rounding (the same
    counter-based random bits on both sides);
  - decompress without Hadamard, and with Hadamard for the integer codes (their transform sums
    integers, exactly);
  - the compressed reduce with dual scales (no transform: decode, sum over ranks in order,
    scale, requantize), and the dense reduce without Hadamard.
Elsewhere a sum runs in another order: the Hadamard transform (on GPUs as tensor-core products
of bf16 pieces, `bounds.U_DOT`), and taco_fp32x2's pre-scale from a sum of squares. There the
bound is: for wire buffers, `bounds.transformed_error_bound` and `bounds.scale_bounds` of the
kernel's bytes (the format's bound on every code and scale, for the input the kernel was
given: x, or for the reduce the ranks' summed decoded values); for dense outputs, the decoder's
summation error per element, 2 gamma_G(U_DOT) of the row's absolute sum plus one rounding into
the output dtype on each side. NaN groups must be NaN on both sides.

(config, dtype) pairs run in a fixed shuffled order, so a run cut short by --time-budget still
spans the codecs, dtypes and modes. In dense outputs a NaN against a NaN counts as equal (its
payload and sign carry no value). Under Triton's interpreter (--device cpu) bf16 inputs have no
subnormals: the interpreter converts bf16 subnormals wrongly.

Usage:
    python bench/gpu_bytes.py                              # CUDA, G in 32,128,256
    python bench/gpu_bytes.py --full                       # every G
    python bench/gpu_bytes.py --device cpu --codecs int8 --dtypes bf16 --group-sizes 32 --sizes 1000
                                                           # Triton's interpreter (slow)
Exit status: 0 when no case is OUT of bound, 1 otherwise (the CSV is written either way), 2 for
bad arguments or an unusable device. Importing this module makes no CUDA call.
"""
from __future__ import annotations

import argparse
import itertools
import math
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from the source tree without installing (bench/gpu_check.sh)
    sys.path.insert(0, str(ROOT))
if __name__ == "__main__":  # the interpreter must be chosen before the first triton.jit (importing taco_triton)
    _dev = argparse.ArgumentParser(add_help=False)
    _dev.add_argument("--device", default="cuda")
    if _dev.parse_known_args()[0].device == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from autotune import meta  # noqa: E402
from taco_triton import bounds, reference  # noqa: E402
from taco_triton.compressed import Compressed  # noqa: E402
from taco_triton.config import (  # noqa: E402
    CODECS, GROUP_SIZES, ROUNDINGS, SCALE_MODES, SUPERBLOCK_ELEMS, CompressionConfig)
from taco_triton.env import interpreting  # noqa: E402
from taco_triton.kernels import slots  # noqa: E402
from taco_triton.kernels._tables import SB_PER_TILE  # noqa: E402
from taco_triton.layout import WireLayout  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
KERNELS = ("compress", "decompress", "reduce", "reduce_dense")
DEFAULT_GROUP_SIZES = (32, 128, 256)
TILE = SB_PER_TILE * SUPERBLOCK_ELEMS  # elements per kernel program's tile (8192 for every G)
#: Two tiles, an odd size (an aligned main launch and a one-tile tail), part of one tile.
DEFAULT_SIZES = (2 * TILE, TILE + 37, 1000)
REGION = 512  # elements per input region: whole groups at every G
IDENTICAL, WITHIN, OUT = "identical", "differ (within bound)", "differ (OUT of bound)"
COLUMNS = [
    "kernel", "codec", "dtype", "G", "hadamard", "scales", "rounding", "numel", "ranks", "bytes_total",
    "bytes_differ", "codes_differ", "scales_differ", "elems_differ", "max_abs_diff", "max_rel_diff", "verdict",
    "expect", "note", "seconds", "device", "torch_version", "triton_version", "git_commit", "date",
]


# --------------------------------------------------------------------------- the kernels under test
def gpu_compress(x: torch.Tensor, cfg: CompressionConfig) -> torch.Tensor:
    from taco_triton.kernels.compress import compress_triton

    return compress_triton(x, cfg)


def gpu_decompress(wire: torch.Tensor, numel: int, cfg: CompressionConfig, dtype: torch.dtype) -> torch.Tensor:
    from taco_triton.kernels.decompress import decompress_triton

    return decompress_triton(wire, torch.empty(numel, dtype=dtype, device=wire.device), cfg)


def gpu_reduce(bufs: torch.Tensor, numel: int, cfg: CompressionConfig, scale: float,
               dense_dtype: torch.dtype | None = None) -> torch.Tensor:
    from taco_triton.kernels.reduce import reduce_triton

    if dense_dtype is None:
        return reduce_triton(bufs, numel, cfg, scale)
    return reduce_triton(bufs, numel, cfg, scale, dense_out=torch.empty(numel, dtype=dense_dtype, device=bufs.device))


# --------------------------------------------------------------------------- inputs
def make_input(numel: int, dtype: torch.dtype, seed: int, subnormals: bool = True) -> torch.Tensor:
    """CPU tensor of `numel` values: normal values with regions of REGION elements (fewer when
    the tensor is small) holding an outlier group, subnormals (unless `subnormals` is False:
    then those regions keep normal values), zeros, subnormals mixed into normal values, values
    near the dtype's maximum, a NaN and an Inf."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=gen, dtype=torch.float64)
    span = REGION if numel >= 9 * REGION else max(1, numel // 9)
    tiny, big = torch.finfo(dtype).tiny, torch.finfo(dtype).max

    def region(k):  # a view of x (empty past its end: a tiny tensor holds the first regions only)
        return x[k * span : (k + 1) * span]

    region(1).mul_(1000.0)                                   # an outlier group
    if subnormals:
        region(2).mul_(tiny / 4)                             # subnormals (a scale below 2^-126 in FP32)
        region(4)[::2].mul_(tiny / 4)                        # subnormals among normal values
    region(3).zero_()                                        # zeros
    if region(5).numel():
        region(5).mul_(big / 4 / region(5).abs().max().clamp_min(1.0))  # near the maximum
    region(6)[span // 2 : span // 2 + 1] = math.nan          # a NaN group
    region(7)[span // 3 : span // 3 + 1] = -math.inf         # an Inf group
    region(8)[1::7].mul_(300.0)                              # outlier elements
    return x.to(dtype)


def rank_buffers(numel: int, cfg: CompressionConfig, dtype: torch.dtype, ranks: int, seed: int,
                 subnormals: bool = True) -> torch.Tensor:
    """[ranks, stride] uint8: the reference's wire buffers of `ranks` distinct inputs (stride a
    multiple of 16, zero padding), as the collectives hand them to the reduce."""
    layout = WireLayout.of(numel, cfg)
    bufs = torch.zeros(ranks, slots.round_up(layout.nbytes, slots.ALIGN), dtype=torch.uint8)
    for p in range(ranks):
        bufs[p, : layout.nbytes] = reference.compress_reference(make_input(numel, dtype, seed + p, subnormals), cfg)
    return bufs


# --------------------------------------------------------------------------- comparison
def expected_identical(kernel: str, cfg: CompressionConfig) -> bool:
    """Where the kernel does the reference's FP32 operations in the same order (module docstring)."""
    if kernel == "compress":
        return not cfg.hadamard and cfg.scales == "dual"
    if kernel == "decompress":
        return not cfg.hadamard or not cfg.spec.is_float
    if kernel == "reduce":
        return cfg.scales == "dual"
    return not cfg.hadamard  # reduce_dense


def value_diff(got: torch.Tensor, want: torch.Tensor) -> dict:
    """Differing elements (by bits; NaN against NaN counts as equal), the largest absolute
    difference (inf where one side is NaN) and relative difference (over the finite non-zero
    reference values), and `unequal`: elements that differ as numbers (+0 against -0 does not)."""
    g, w = got.reshape(-1).double(), want.reshape(-1).double()
    both_nan = g.isnan() & w.isnan()
    bits = {2: torch.int16, 4: torch.int32}[got.element_size()]
    same = (got.reshape(-1).view(bits) == want.reshape(-1).view(bits)) | both_nan
    nan_mismatch = g.isnan() != w.isnan()
    unequal = int(((g != w) & ~both_nan).sum())
    diff = torch.where(both_nan | (g == w), 0.0, (g - w).abs())  # equal infinities differ by 0
    diff = torch.where(nan_mismatch, math.inf, diff)
    ref_ok = torch.isfinite(w) & (w != 0)  # relative to finite non-zero reference values only
    rel = torch.where(ref_ok, diff / torch.where(ref_ok, w.abs(), 1.0), 0.0)
    return dict(elems_differ=int((~same).sum()), max_abs_diff=float(diff.max()) if diff.numel() else 0.0,
                max_rel_diff=float(rel.max()) if rel.numel() else 0.0,
                unequal=unequal)


def u_dot(device: torch.device) -> float:
    """Unit roundoff of the kernels' transform on this device (`bounds.U_DOT`)."""
    return bounds.U_DOT["gpu"] if device.type == "cuda" and not interpreting() else bounds.U_DOT["interpreter"]


def wire_within_bound(x_orig: torch.Tensor, wire: torch.Tensor, cfg: CompressionConfig, u: float,
                      finite: torch.Tensor) -> tuple[bool, str]:
    """The format's bound on the kernel's wire bytes for the input it quantized (`bounds`):
    every code of a finite group within `transformed_error_bound`, every scale within
    `scale_bounds`; the groups marked non-finite must be those that are not `finite` [n_groups].
    Groups whose values do not fit FP32 in the original domain (a reduced sum near FP32's
    maximum, transformed back) cannot be bounded there and are left out."""
    c = Compressed(wire, x_orig.shape, torch.float32, cfg)
    marked = torch.isfinite(bounds.group_sigma(c))
    if not torch.equal(finite, marked):
        return False, f"{int((finite != marked).sum())} groups' NaN marking differs from the input's"
    y, y_dec, bound = bounds.transformed_error_bound(x_orig, c, u)
    rows = finite & torch.isfinite(reference.to_groups(x_orig, cfg.group_size)).all(dim=1)
    err, b = (y_dec - y).abs()[rows], bound[rows]
    over = err > b
    if bool(over.any()):
        return False, f"{int(over.sum())} codes beyond transformed_error_bound (worst {float((err / b).max()):.3g}x)"
    sigma, lo, hi = bounds.scale_bounds(x_orig, c, u)
    bad = ((sigma < lo) | (sigma > hi))[rows]
    if bool(bad.any()):
        return False, f"{int(bad.sum())} group scales outside scale_bounds"
    return True, ""


def dense_within_bound(got: torch.Tensor, want: torch.Tensor, row_abs: torch.Tensor, g: int, u: float) -> tuple[bool, str]:
    """|got - want| per element within both sides' transform error (gamma_G(u) of the row's
    absolute sum `row_abs` [n_groups], plus the FP32 scale multiply) and one output rounding each."""
    eps = torch.finfo(want.dtype).eps
    gd, wd = got.reshape(-1).double(), want.reshape(-1).double()
    n = gd.numel()
    tol = (2 * (bounds._gamma(g, u) + 2 * bounds.U32) * row_abs.double()).repeat_interleave(g)[:n]
    tol = tol + eps * wd.abs() + eps * torch.finfo(want.dtype).tiny
    nan_mismatch = gd.isnan() != wd.isnan()
    if bool(nan_mismatch.any()):
        return False, f"{int(nan_mismatch.sum())} elements NaN on one side only"
    diff = torch.where(gd.isnan() | (gd == wd), 0.0, (gd - wd).abs())
    over = diff > tol
    if bool(over.any()):
        return False, f"{int(over.sum())} elements beyond the decoder's summation bound (worst {float((diff / tol)[over].max()):.3g}x)"
    return True, ""


def transformed_sum(bufs: torch.Tensor, numel: int, cfg: CompressionConfig, scale: float) -> torch.Tensor:
    """The ranks' decoded values summed in FP32 (rank order) times `scale`: the transformed-domain
    values the reduce requantizes, from `reference.load_codes` and `group_factors` [n_groups, G]."""
    nbytes = WireLayout.of(numel, cfg).nbytes
    acc = None
    for p in range(bufs.shape[0]):
        vals, sigma, pre = reference.load_codes(bufs[p, :nbytes], numel, cfg)
        term = vals * reference.group_factors(sigma, pre)[:, None]
        acc = term if acc is None else acc + term
    return acc * scale if scale != 1.0 else acc


def wire_row(got: torch.Tensor, want: torch.Tensor, numel: int, cfg: CompressionConfig) -> dict:
    """Byte counts of two wire buffers, split into code and scale bytes, and their decoded values' difference."""
    layout = WireLayout.of(numel, cfg)
    differ = got != want
    codes = int(differ[: layout.scale_a_offset].sum())
    row = dict(bytes_total=layout.nbytes, bytes_differ=int(differ.sum()), codes_differ=codes,
               scales_differ=int(differ.sum()) - codes, elems_differ=0, max_abs_diff=0.0, max_rel_diff=0.0)
    if row["bytes_differ"]:
        row.update(value_diff(reference.decompress_reference(got, numel, cfg),
                              reference.decompress_reference(want, numel, cfg)))
    return row


def dense_row(got: torch.Tensor, want: torch.Tensor) -> dict:
    """Byte counts of two dense outputs (a NaN against a NaN counts as equal: NaN payload and sign
    carry no value, and the kernels and torch's casts write different ones) and their difference."""
    nan = (got.isnan() & want.isnan()).reshape(-1, 1).expand(-1, got.element_size()).reshape(-1)
    differ = (got.reshape(-1).view(torch.uint8) != want.reshape(-1).view(torch.uint8)) & ~nan
    return dict(bytes_total=differ.numel(), bytes_differ=int(differ.sum()), **value_diff(got, want))


# --------------------------------------------------------------------------- one case
def run_case(kernel: str, cfg: CompressionConfig, dtype: torch.dtype, numel: int, ranks: int, seed: int,
             device: torch.device) -> dict:
    """One row: run the kernel on `device` and the reference on the CPU, compare, judge."""
    u = u_dot(device)
    # Triton's interpreter converts bf16 subnormals wrongly (7.6e-39 loads as 3.5e-39): on CPU the
    # bf16 inputs keep normal values where the subnormals would be
    subnormals = not (interpreting() and dtype == torch.bfloat16)
    scale = 1.0 / ranks if ranks % 2 == 0 else 1.0  # "avg" for P = 2, 4 (exact), "sum" for 3
    if kernel == "compress":
        x = make_input(numel, dtype, seed, subnormals)
        got = gpu_compress(x.to(device), cfg).cpu()
        row = wire_row(got, reference.compress_reference(x, cfg), numel, cfg)
        finite = torch.isfinite(reference.to_groups(x, cfg.group_size)).all(dim=1)
        check = lambda: wire_within_bound(x, got, cfg, u, finite)  # noqa: E731
    elif kernel == "decompress":
        wire = reference.compress_reference(make_input(numel, dtype, seed, subnormals), cfg)
        got = gpu_decompress(wire.to(device), numel, cfg, dtype).cpu()
        want = reference.decompress_reference(wire, numel, cfg, dtype)
        row = dense_row(got, want)

        def check():
            vals, sigma, pre = reference.load_codes(wire, numel, cfg)
            row_abs = 2 * vals.double().abs().sum(dim=1) * reference.group_factors(sigma, pre).double().abs()
            return dense_within_bound(got, want, row_abs, cfg.group_size, u)
    else:
        bufs = rank_buffers(numel, cfg, dtype, ranks, seed, subnormals)
        dense = dtype if kernel == "reduce_dense" else None
        got = gpu_reduce(bufs.to(device), numel, cfg, scale, dense).cpu()
        want = reference.reduce_reference(bufs, numel, cfg, scale, dense)
        acc = transformed_sum(bufs, numel, cfg, scale)
        if dense is None:
            row = wire_row(got, want, numel, cfg)
            # the input the reduce quantized, in the original domain (bounds transform it again); all
            # n_groups * G values: a partial last group's padding is not zero after the inverse transform
            x_sum = (reference.hadamard_inverse(acc.double()) if cfg.hadamard else acc).reshape(-1)
            finite = torch.isfinite(acc).all(dim=1)
            check = lambda: wire_within_bound(x_sum.float(), got, cfg, u, finite)  # noqa: E731
        else:
            row = dense_row(got, want)
            check = lambda: dense_within_bound(got, want, 2 * acc.double().abs().sum(dim=1), cfg.group_size, u)  # noqa: E731
    expect = expected_identical(kernel, cfg)
    row["expect"] = "identical" if expect else "within bound"
    if row["bytes_differ"] == 0:
        row["verdict"] = IDENTICAL
    elif expect and row["unequal"] == 0:  # e.g. a sum that starts from +0 where the reference's starts from -0
        row["verdict"], row["note"] = WITHIN, "values equal: the differing bytes decode to equal numbers (+0 and -0)"
    elif expect:
        row["verdict"], row["note"] = OUT, "bit-identical expected: same FP32 operations as the reference"
    else:
        ok, why = check()
        row["verdict"], row["note"] = (WITHIN, "") if ok else (OUT, why)
    row.pop("unequal", None)
    return row


# --------------------------------------------------------------------------- the run
def configs(args) -> list[CompressionConfig]:
    return [CompressionConfig(codec=c, group_size=g, hadamard=h, scales=s, rounding=r, seed=args.seed + 11)
            for c, g, h, s, r in itertools.product(args.codecs, args.group_sizes, args.hadamard, args.scales,
                                                   args.roundings)]


def _choices(allowed, convert=str):
    def parse(s: str):
        vals = [convert(t.strip()) for t in s.split(",") if t.strip()]
        bad = [v for v in vals if v not in allowed]
        if bad or not vals:
            raise argparse.ArgumentTypeError(f"{s!r}: choose from {list(allowed)}")
        return list(dict.fromkeys(vals))
    return parse


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="where the kernels run: cuda (default, compiled) or cpu (Triton's interpreter)")
    p.add_argument("--full", action="store_true", help=f"every group size {list(GROUP_SIZES)} (default {list(DEFAULT_GROUP_SIZES)})")
    p.add_argument("--codecs", type=_choices(CODECS), default=list(CODECS), help="comma-separated codecs (default: all)")
    p.add_argument("--dtypes", type=_choices(DTYPES), default=list(DTYPES), help="comma-separated input dtypes (default: all)")
    p.add_argument("--group-sizes", type=_choices(GROUP_SIZES, int), default=None,
                   help="comma-separated group sizes (default 32,128,256; --full: all)")
    p.add_argument("--hadamard", type=_choices(("on", "off")), default=["off", "on"], help="on, off or both (default)")
    p.add_argument("--scales", type=_choices(SCALE_MODES), default=list(SCALE_MODES), help="scale layouts (default: both)")
    p.add_argument("--roundings", type=_choices(ROUNDINGS), default=list(ROUNDINGS), help="roundings (default: both)")
    p.add_argument("--kernels", type=_choices(KERNELS), default=list(KERNELS), help=f"subset of {','.join(KERNELS)}")
    p.add_argument("--sizes", type=lambda s: [int(t) for t in s.split(",") if t.strip()], default=list(DEFAULT_SIZES),
                   help="comma-separated element counts (default 16384,8229,1000: two tiles, one tile + 37, part of one)")
    p.add_argument("--seed", type=int, default=0, help="seed of the inputs (default 0)")
    p.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="start no new case after SECONDS (the CSV holds the cases run; the rest are counted)")
    p.add_argument("--csv", default=None, help="output CSV (default bench/results/bytes_vs_reference_<device>_<date>.csv)")
    args = p.parse_args(argv)
    args.hadamard = [h == "on" for h in args.hadamard]
    if args.group_sizes is None:
        args.group_sizes = list(GROUP_SIZES) if args.full else list(DEFAULT_GROUP_SIZES)
    if not args.sizes or min(args.sizes) < 1:
        p.error(f"--sizes must be positive element counts, got {args.sizes}")
    if args.time_budget is not None and not (math.isfinite(args.time_budget) and args.time_budget > 0):
        p.error(f"--time-budget must be a positive number of seconds, got {args.time_budget}")
    return args


def print_summary(df, not_run: int) -> None:
    import pandas as pd

    print(f"\n{len(df)} cases run" + (f", {not_run} not run (--time-budget)" if not_run else ""))
    if not len(df):
        return
    with pd.option_context("display.width", 200, "display.max_rows", 1000):
        print(df.groupby(["kernel", "verdict"]).size().unstack(fill_value=0).to_string())
        within = df[df["verdict"] == WITHIN]
        if len(within):
            print(f"\nwithin bound: {int(within['codes_differ'].fillna(0).sum())} code bytes and "
                  f"{int(within['scales_differ'].fillna(0).sum())} scale bytes of wire buffers, "
                  f"{int(within['elems_differ'].sum())} elements differ over {len(within)} cases")
        out = df[df["verdict"] == OUT]
        print(f"\nOUT of bound: {len(out)} cases" + (":" if len(out) else ""))
        cols = ["kernel", "codec", "dtype", "G", "hadamard", "scales", "rounding", "numel", "ranks", "bytes_differ",
                "elems_differ", "max_abs_diff", "note"]
        if len(out):
            print(out[cols].to_string(index=False))


def main(argv=None) -> int:
    import pandas as pd

    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda, but torch.cuda.is_available() is False (use --device cpu for the interpreter)",
              file=sys.stderr)
        return 2
    if device.type == "cpu" and not interpreting():
        print("error: --device cpu runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1 before "
              "taco_triton is imported", file=sys.stderr)
        return 2
    if device.type == "cuda" and interpreting():
        print("WARNING: TRITON_INTERPRET is set: the kernels run in Triton's interpreter, not compiled for the GPU")
    name = meta.device_identity(device)[0]
    prov = dict(device=name, torch_version=meta.torch_version(), triton_version=meta.triton_version(),
                git_commit=meta.git_commit(), date=meta.utc_now())
    path = Path(args.csv) if args.csv else ROOT / "bench" / "results" / (
        f"bytes_vs_reference_{name.replace(' ', '-')}_{prov['date'][:10]}.csv")
    try:  # an unwritable --csv fails here, before any kernel runs
        path.parent.mkdir(parents=True, exist_ok=True)
        pd.DataFrame(columns=COLUMNS).to_csv(path, index=False)
    except OSError as exc:
        print(f"error: cannot write --csv {path}: {exc}", file=sys.stderr)
        return 2
    # (config, dtype) units in a fixed shuffled order, so that a run cut short by --time-budget still
    # spans the codecs, dtypes and modes; P cycles 2, 3, 4 over the units
    units = list(itertools.product(configs(args), args.dtypes))
    random.Random(args.seed).shuffle(units)
    cases = [(cfg, dtype, numel, kernel, 2 + u % 3) for u, (cfg, dtype) in enumerate(units)
             for numel in args.sizes for kernel in args.kernels]
    print(f"device {name} | torch {prov['torch_version']} | triton {prov['triton_version']} | git {prov['git_commit']} "
          f"| {prov['date']} | U_DOT {u_dot(device):.3g}\n{len(cases)} cases -> {path}", flush=True)
    rows, t_start, last = [], time.perf_counter(), 0.0
    for i, (cfg, dtype, numel, kernel, ranks) in enumerate(cases):
        if args.time_budget is not None and time.perf_counter() - t_start + 2 * last > args.time_budget:
            print(f"stopping: --time-budget {args.time_budget:g} s; {len(cases) - i} cases not run", flush=True)
            break
        t0 = time.perf_counter()
        ranks = ranks if kernel.startswith("reduce") else 1
        base = dict(kernel=kernel, codec=cfg.codec, dtype=dtype, G=cfg.group_size, hadamard=cfg.hadamard,
                    scales=cfg.scales, rounding=cfg.rounding, numel=numel, ranks=ranks)
        try:
            row = run_case(kernel, cfg, DTYPES[dtype], numel, ranks, args.seed, device)
        except Exception as exc:  # noqa: BLE001 - a kernel that raises is a finding, recorded
            row = dict(verdict=OUT, expect="", note=f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}")
        last = time.perf_counter() - t0
        rows.append({**base, **row, "seconds": round(last, 3), **prov})
        if row["verdict"] != IDENTICAL:
            print(f"  {kernel} {cfg.codec} {dtype} G{cfg.group_size} H={cfg.hadamard} {cfg.scales} {cfg.rounding} "
                  f"n={numel}: {row['verdict']} {row.get('note', '')}", flush=True)
        if (i + 1) % (len(args.sizes) * len(args.kernels)) == 0:  # after each (config, dtype): survives a kill
            pd.DataFrame(rows).reindex(columns=COLUMNS).to_csv(path, index=False)
    df = pd.DataFrame(rows).reindex(columns=COLUMNS)
    df.to_csv(path, index=False)
    print_summary(df, len(cases) - len(rows))
    print(f"\nwrote {path} ({len(df)} rows)")
    return 1 if (df["verdict"] == OUT).any() else 0


if __name__ == "__main__":
    sys.exit(main())
