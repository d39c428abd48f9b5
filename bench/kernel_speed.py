#!/usr/bin/env python
"""Benchmark of the fused compress/decompress kernels against torch eager, torch.compile and a copy.

For every input size and config this measures, side by side and in one run:

    triton   the fused kernels (`compress_triton(x, cfg, out=...)`, `decompress_triton(data, out, cfg)`)
    eager    the torch reference (`reference.compress_reference` / `decompress_reference`)
    compile  `torch.compile(dynamic=True)` of that reference; if that fails at a size, dynamic=False
             is tried, and a failure of both is recorded in the row (`note`), not fatal
    copy     `dst.copy_(src)` of the input's bytes: the memory-bandwidth roofline
    bare     the least a torch compress can do (`bare_pipeline`: rows of G in FP32 @ H, row absmax,
             divide, cast to the code dtype; no padding, scales or edge cases): the yardstick of
             the reference on CPU. `speedup_vs_bare` of a compress or decompress row is the bare
             pipeline's median time over that row's, both moving the same logical bytes

"Logical GB/s" counts the bytes a kernel must move at least: compress reads numel*itemsize and
writes the wire buffer (codes + scales); decompress the reverse; copy reads and writes the input
bytes (2 * bytes). `pct_of_copy` and the speedups are computed from timings of the same run.

Timing: on CUDA `triton.testing.do_bench` (L2 flushed before every call) -> median, p20, p80; on
CPU `time.perf_counter` over repeats after a warm-up. CPU timings (and Triton's interpreter in
particular) say nothing about GPU performance; they exist so the script can be checked anywhere.

Every implementation's output is checked against the reference once before it is timed (column
`valid`): without Hadamard the wire bytes must be identical; with it, decompressed outputs must
agree closely (compress: differing codes at most two grid positions apart and rare; decompress:
within two output-dtype ulps). See `check_compress` / `check_decompress`.

Usage:
    python bench/kernel_speed.py                         # CUDA: 1 MiB .. 1 GiB of bf16, default config
    python bench/kernel_speed.py --codec int8            # INT8 codes
    python bench/kernel_speed.py --group-size 256        # G = 256
    python bench/kernel_speed.py --variants              # default, int8 and G=256 in one CSV
    python bench/kernel_speed.py --quick   # CPU smoke run (tiny sizes; the Triton column in the interpreter)
    python bench/kernel_speed.py --device cpu --impls eager,bare,copy --sizes 8M   # the CPU backend

Exit status: 0; 1 when no size was benchmarked (e.g. --time-budget spent first); 2 for bad
arguments or an unusable --device or --csv (one line on stderr, before any timing); 3 if a
Triton kernel's output failed validation (the CSV is written anyway).
Importing this module makes no CUDA call.
"""
from __future__ import annotations

import argparse
import datetime
import logging
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from the source tree without installing (bench/gpu_check.sh)
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from taco_triton import env, reference  # noqa: E402
from taco_triton.config import CODECS, GROUP_SIZES, CompressionConfig  # noqa: E402
from taco_triton.layout import WireLayout  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
IMPLS = ("triton", "eager", "compile", "copy", "bare")
COMPILE_DYNAMIC = {"true": True, "false": False, "auto": None}
KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
CUDA_SIZES = [MIB, 4 * MIB, 16 * MIB, 64 * MIB, 256 * MIB, GIB]
CUDA_QUICK_SIZES = [MIB, 16 * MIB, 256 * MIB]
CPU_SIZES = [64 * KIB, 256 * KIB]
CPU_QUICK_SIZES = [64 * KIB]
COLUMNS = [
    "kernel", "impl", "config", "dtype", "numel", "bytes", "median_ms", "p20_ms", "p80_ms",
    "logical_gbps", "pct_of_copy", "speedup_vs_eager", "speedup_vs_compile", "device",
    "torch_version", "triton_version", "git_commit", "date",
    # extras
    "valid", "note", "input_bytes", "wire_bytes", "shape", "compile_s", "n_samples", "timer",
    "platform", "git_dirty", "compile_dynamic", "speedup_vs_bare", "model_pct_bound",
]
CPU_BANNER = """
##############################################################################################
##                                                                                          ##
##   CPU RUN: THESE TIMINGS ARE NOT GPU PERFORMANCE.                                        ##
##   The Triton column (if any) runs in Triton's CPU interpreter (TRITON_INTERPRET=1),      ##
##   which is orders of magnitude slower than compiled kernels. Use this only to check     ##
##   that the benchmark runs and validates. Real numbers: run it on a CUDA GPU.            ##
##                                                                                          ##
##############################################################################################
"""


# --------------------------------------------------------------------------- small helpers
interpreting = env.interpreting


def parse_size(s: str) -> int:
    """'64K' -> 65536, '1M' -> 1 MiB, '1G' -> 1 GiB, '4096' -> 4096 (bytes of input)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgKMG]?)(?:i?[bB])?\s*", s)
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {s!r}: use e.g. 64K, 1M, 256M, 1G or a byte count")
    mult = {"": 1, "k": KIB, "m": MIB, "g": GIB}[m.group(2).lower()]
    return int(float(m.group(1)) * mult)


def parse_config(s: str) -> CompressionConfig:
    """'int8' / 'int8:256' / 'fp8_e4m3:128:nohadamard' -> CompressionConfig."""
    parts = [t.strip() for t in s.split(":")]
    try:
        cfg = CompressionConfig(codec=parts[0])
        for t in parts[1:]:
            if t.isdigit():
                cfg = cfg.replace(group_size=int(t))
            elif t in ("nohadamard", "nohad"):
                cfg = cfg.replace(hadamard=False)
            elif t in ("hadamard", "had"):
                cfg = cfg.replace(hadamard=True)
            else:
                raise ValueError(f"unknown part {t!r}")
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"bad --config {s!r} (CODEC[:G][:nohadamard]): {e}") from None
    return cfg


def fmt_size(nbytes: int) -> str:
    for unit, mult in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if nbytes >= mult and nbytes % mult == 0:
            return f"{nbytes // mult} {unit}"
    return f"{nbytes} B"


def config_name(cfg: CompressionConfig) -> str:
    name = f"{cfg.codec}/G{cfg.group_size}/{'hadamard' if cfg.hadamard else 'nohadamard'}"
    if cfg.scales != "dual":
        name += f"/{cfg.scales}"
    if cfg.rounding != "nearest":
        name += f"/{cfg.rounding}"
    return name


def git_info() -> tuple[str, str]:
    """(short commit, dirty flag) of the source tree; ('unknown', 'unknown') outside a git checkout."""
    env_commit = os.environ.get("TACO_GIT_COMMIT")
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        )
        if commit.returncode != 0:
            return env_commit or "unknown", "unknown"
        dirty = subprocess.run(
            ["git", "diff", "--quiet", "HEAD", "--"], cwd=ROOT, capture_output=True, timeout=10
        )
        return env_commit or commit.stdout.strip(), {0: "no", 1: "yes"}.get(dirty.returncode, "unknown")
    except (OSError, subprocess.SubprocessError):
        return env_commit or "unknown", "unknown"


def triton_version() -> str:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return "not installed"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine() or 'unknown'})"


def slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", s).strip("-") or "unknown"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def quiet_dynamo() -> None:
    """Raise the recompile limits (one compiled function serves several sizes and configs, and hitting
    the limit silently falls back to eager) and silence dynamo's graph-break chatter."""
    try:
        import torch._dynamo

        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, 64)
        if hasattr(torch._dynamo.config, "accumulated_recompile_limit"):
            torch._dynamo.config.accumulated_recompile_limit = 1024
        torch._logging.set_logs(dynamo=logging.ERROR, graph_breaks=False, recompiles=False)
    except Exception:  # noqa: BLE001 - cosmetic only
        pass
    import warnings

    warnings.filterwarnings("ignore", message=".*lru_cache.*")


def graph_breaks() -> int:
    try:
        from torch._dynamo.utils import counters

        return int(sum(counters["graph_break"].values()))
    except Exception:  # noqa: BLE001
        return -1


# --------------------------------------------------------------------------- timing
def time_cuda(fn, rep_ms: float) -> tuple[float, float, float, int]:
    """(median, p20, p80) ms by triton's do_bench (flushes L2 before each call)."""
    from triton.testing import do_bench

    # do_bench runs `rep_ms / estimate` timed calls: make slow implementations get >= ~8 samples.
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    est = max(start.elapsed_time(end), 1e-3)
    rep = min(max(rep_ms, 8 * est), 4000.0)
    med, p20, p80 = do_bench(fn, warmup=25, rep=rep, quantiles=[0.5, 0.2, 0.8], return_mode="median")
    return med, p20, p80, max(1, int(rep / est))


def time_cpu(fn, budget_s: float, min_reps: int, max_reps: int) -> tuple[float, float, float, int]:
    """(median, p20, p80) ms by time.perf_counter after one warm-up call."""
    t0 = time.perf_counter()
    fn()  # warm-up
    est = max(time.perf_counter() - t0, 1e-6)
    n = int(min(max(budget_s / est, min_reps), max_reps))
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    q = statistics.quantiles(times, n=10, method="inclusive") if len(times) > 1 else [times[0]] * 9
    return statistics.median(times), q[1], q[7], n


# --------------------------------------------------------------------------- validation
def _code_step(cfg: CompressionConfig) -> float:
    """The largest spacing of the code grid (32 for E4M3, 8192 for E5M2, 1 for INT8), in code units."""
    spec = cfg.spec
    return float(2 * spec.half_ulp(torch.tensor([spec.code_max]))[0])


def _output_sigma(wire: torch.Tensor, numel: int, cfg: CompressionConfig) -> torch.Tensor:
    """Per-group factor from code units to output units (the effective group scale)."""
    layout = WireLayout.of(numel, cfg)
    _, a, b = layout.split(wire)
    if cfg.scales == "dual":
        sb = a.repeat_interleave(layout.groups_per_superblock)[: layout.n_groups]
        return sb * reference.decode_ue4m4(b)
    return b / a  # taco_fp32x2: y / pre-scale


def _grouped(v: torch.Tensor, g: int) -> torch.Tensor:
    v = v.reshape(-1)
    pad = -v.numel() % g
    return torch.nn.functional.pad(v, (0, pad)).view(-1, g)


def _code_position(codes: torch.Tensor, cfg: CompressionConfig) -> torch.Tensor:
    """Each u8 code's position on its (monotonic) grid: adjacent representable values differ by 1."""
    if not cfg.spec.is_float:
        return codes.view(torch.int8).to(torch.int32)
    c = codes.to(torch.int32)
    return torch.where(c >= 128, -(c & 0x7F), c)  # sign-magnitude; +0 and -0 are both 0


def check_compress(wire: torch.Tensor, wire_ref: torch.Tensor, numel: int, cfg: CompressionConfig,
                   max_code_frac: float = 1e-3):
    """(ok, message) for a wire buffer against the reference's.

    Without Hadamard the bytes must be identical. With it the kernel's transform sums in another
    order than the reference's matmul, so a value that lands (almost) on a rounding boundary may
    round the other way. Accepted: in groups whose scales are identical, codes at most two grid
    positions apart; in groups whose scales differ, decompressed values within two of the largest
    code steps; and at most `max_code_frac` of all codes different (boundary cases are rare; a
    systematic rounding bug changes far more).
    """
    if wire.dtype != torch.uint8 or wire.shape != wire_ref.shape:
        return False, f"FAIL: wire {wire.dtype} {tuple(wire.shape)} != reference {tuple(wire_ref.shape)}"
    layout = WireLayout.of(numel, cfg)
    n_diff = int((wire != wire_ref).sum())
    if n_diff == 0:
        return True, "exact"
    if not cfg.hadamard:
        return False, f"FAIL: {n_diff} of {wire.numel()} wire bytes differ (bit-exact without Hadamard)"
    codes, a, b = layout.split(wire)
    codes_ref, a_ref, b_ref = layout.split(wire_ref)
    n_codes = int((codes != codes_ref).sum())
    n_scale = n_diff - n_codes

    def same_bits(u, v):
        return u.view(torch.int32) == v.view(torch.int32) if u.dtype == torch.float32 else u == v

    if cfg.scales == "dual":
        same = same_bits(b, b_ref) & same_bits(a, a_ref).repeat_interleave(layout.groups_per_superblock)[
            : layout.n_groups]
    else:
        same = same_bits(a, a_ref) & same_bits(b, b_ref)
    dist = (_code_position(codes, cfg) - _code_position(codes_ref, cfg)).abs().amax(dim=1)
    worst_dist = int(dist[same].max()) if bool(same.any()) else 0

    worst_steps = 0.0
    if not bool(same.all()):
        got = reference.decompress_reference(wire, numel, cfg, torch.float32)
        ref = reference.decompress_reference(wire_ref, numel, cfg, torch.float32)
        # One code off by one step moves every element of its group by 2*sigma*step (the inverse
        # transform is 2 * y @ H with +-1 entries).
        step = 2.0 * _output_sigma(wire_ref, numel, cfg).abs() * _code_step(cfg)
        err = (_grouped(got, cfg.group_size) - _grouped(ref, cfg.group_size)).abs()
        err = torch.nan_to_num(err, nan=math.inf).amax(dim=1)
        zero_step = torch.where(err > 0, math.inf, 0.0)
        steps = torch.where(step > 0, err / torch.where(step > 0, step, 1.0), zero_step)
        worst_steps = float(steps[~same].max())
    limit = max(8, int(max_code_frac * codes.numel()))
    ok = worst_dist <= 2 and worst_steps <= 2.0 + 1e-3 and n_codes <= limit
    msg = f"{n_codes} of {codes.numel()} codes differ (limit {limit}), by <= {worst_dist} grid steps; "
    msg += f"{n_scale} scale bytes differ"
    if n_scale:
        msg += f", those groups within {worst_steps:.3g} code steps"

    return ok, ("ok (" + msg + ")") if ok else ("FAIL: " + msg)


def check_decompress(out: torch.Tensor, out_ref: torch.Tensor, cfg: CompressionConfig):
    """(ok, message) for a decompressed tensor against the reference's (same wire input)."""
    if out.dtype != out_ref.dtype or out.numel() != out_ref.numel():
        return False, f"FAIL: output {out.dtype} {out.numel()} != reference {out_ref.dtype} {out_ref.numel()}"
    a, r = out.reshape(-1), out_ref.reshape(-1)
    if torch.equal(a.view(torch.uint8), r.view(torch.uint8)):
        return True, "exact"
    af, rf = a.float(), r.float()
    nan_mismatch = int((af.isnan() != rf.isnan()).sum())
    diff = torch.nan_to_num((af - rf).abs(), nan=0.0)
    n_diff = int((diff > 0).sum()) + nan_mismatch
    if not cfg.hadamard or nan_mismatch:
        return False, f"FAIL: {n_diff} of {a.numel()} outputs differ (bit-exact without Hadamard)"
    # The kernel's transform (tf32x3 dots on GPU) and the reference's FP32 matmul sum in different
    # orders: allow two ulps of the output dtype, plus 1e-5 of the group's largest magnitude.
    eps = torch.finfo(out.dtype).eps
    mag = _grouped(rf.abs().nan_to_num(0.0), cfg.group_size)
    tol = (2 * eps * mag + 1e-5 * mag.amax(dim=1, keepdim=True)).reshape(-1)[: a.numel()]
    worst = float((diff / tol.clamp_min(1e-30)).max())
    ok = worst <= 1.0
    msg = f"{n_diff} of {a.numel()} outputs differ; max {worst:.3g} of tolerance"
    return ok, ("ok (" + msg + ")") if ok else ("FAIL: " + msg)


def bare_pipeline(x: torch.Tensor, cfg: CompressionConfig) -> torch.Tensor:
    """`x.float().view(-1, G) @ H`, row absmax, divide, cast to the codes' dtype (whole groups only)."""
    g = cfg.group_size
    rows = x.reshape(-1)[: x.numel() // g * g].float().view(-1, g)
    y = rows @ reference.hadamard_matrix(g, device=x.device) if cfg.hadamard else rows
    return (y / y.abs().amax(dim=1, keepdim=True)).to(cfg.spec.torch_dtype)


# --------------------------------------------------------------------------- the benchmark
class Bench:
    def __init__(self, args, device: torch.device):
        self.args = args
        self.device = device
        self.dtype = DTYPES[args.dtype]
        self.impls = [i for i in IMPLS if i in args.impls]
        self.triton_ok, self.triton_note = self._triton_available()
        self.compiled: dict = {}  # (kernel, cfg) -> compiled fn
        self.triton_failed = False
        commit, dirty = git_info()
        self.meta = {
            "device": device_name(device),
            "torch_version": torch.__version__,
            "triton_version": triton_version(),
            "git_commit": commit,
            "git_dirty": dirty,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "platform": "cuda" if device.type == "cuda" else ("cpu-interpreter" if interpreting() else "cpu"),
            "compile_dynamic": args.compile_dynamic,
            "timer": "do_bench(L2 flushed)" if device.type == "cuda" else "perf_counter",
        }

    def _triton_available(self) -> tuple[bool, str]:
        if "triton" not in self.impls:
            return False, "not selected"
        try:
            import triton  # noqa: F401
        except ImportError:
            return False, "skipped: triton is not installed"
        if self.device.type == "cpu" and not interpreting():
            return False, "skipped: Triton on CPU needs TRITON_INTERPRET=1 (set before Triton is imported)"
        return True, ""

    # ---------------------------------------------------------------- timing dispatch
    def time(self, fn):
        sync(self.device)
        if self.device.type == "cuda":
            return time_cuda(fn, rep_ms=50.0 if self.args.quick else 100.0)
        budget, min_reps = (1.0, 3) if self.args.quick else (3.0, 5)
        return time_cpu(fn, budget_s=budget, min_reps=min_reps, max_reps=200)

    def compiled_fn(self, kernel: str, cfg: CompressionConfig, dynamic: str | None = None):
        """`torch.compile` of the reference, one per (kernel, config, dynamic) so that the chosen
        `dynamic` mode is what runs (a failed compile is not cached: it may depend on the size)."""
        dynamic = dynamic or self.args.compile_dynamic
        key = (kernel, cfg, dynamic)
        if key not in self.compiled:
            fn = reference.compress_reference if kernel == "compress" else reference.decompress_reference
            self.compiled[key] = torch.compile(fn, dynamic=COMPILE_DYNAMIC[dynamic])
        return self.compiled[key]

    # ---------------------------------------------------------------- one size, one config
    def run_size(self, cfg: CompressionConfig, nbytes: int) -> list[dict]:
        dev, dtype, hidden = self.device, self.dtype, self.args.hidden
        itemsize = torch.empty((), dtype=dtype).element_size()
        numel = nbytes // itemsize
        shape = (numel // hidden, hidden) if numel % hidden == 0 and numel >= hidden else (numel,)
        gen = torch.Generator(device=dev).manual_seed(self.args.seed)
        x = torch.randn(shape, generator=gen, device=dev, dtype=torch.float32).to(dtype)
        layout = WireLayout.of(numel, cfg)
        wire_bytes = layout.nbytes
        in_bytes = numel * itemsize
        base = dict(config=config_name(cfg), dtype=str(dtype).replace("torch.", ""), numel=numel,
                    input_bytes=in_bytes, wire_bytes=wire_bytes, shape="x".join(map(str, shape)), **self.meta)
        rows: list[dict] = []

        def row(kernel, impl, moved, timing=None, valid="", note="", compile_s=float("nan")):
            med, p20, p80, n = timing if timing else (float("nan"),) * 3 + (0,)
            gbps = moved / (med * 1e-3) / 1e9 if timing else float("nan")
            rows.append(dict(base, kernel=kernel, impl=impl, bytes=moved, median_ms=med, p20_ms=p20,
                             p80_ms=p80, logical_gbps=gbps, valid=valid, note=note, compile_s=compile_s,
                             n_samples=n))

        def measure(kernel, impl, moved, first, timed, check, fallback=None, prefix=""):
            """Run `first` once (validation, JIT/compile warm-up), check it, then time `timed`.

            If the first call raises and `fallback` is given, fallback() -> (first, timed, note) is
            measured instead (used for torch.compile(dynamic=True) -> dynamic=False).
            """
            compile_s, note, phase = float("nan"), "", "first call"
            try:
                gb0 = graph_breaks()
                t0 = time.perf_counter()
                result = first()
                sync(dev)
                phase = "check"
                if impl == "compile":
                    compile_s = time.perf_counter() - t0
                    nb = graph_breaks() - gb0
                    note = f"{nb} graph breaks on first call" if nb > 0 else ""
                ok, valid = check(result) if check else (True, "n/a" if impl == "copy" else "reference")
                del result
                if impl == "triton" and not ok:
                    self.triton_failed = True
                phase = "timing"
                timing = self.time(timed)
            except Exception as e:  # noqa: BLE001 - record and continue
                text = str(e).strip()
                msg = f"{phase}: {type(e).__name__}: {text.splitlines()[0][:300] if text else ''}"
                if self.args.verbose:
                    traceback.print_exc()
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
                oom = isinstance(e, torch.OutOfMemoryError)
                if fallback is not None and phase == "first call" and not oom:
                    first2, timed2, label = fallback()
                    print(f"  {kernel}/{impl} {fmt_size(nbytes)}: {msg[:160]} -> retrying with {label}",
                          flush=True)
                    measure(kernel, impl, moved, first2, timed2, check,
                            prefix=f"{label} (default failed: {msg})")
                    return
                if impl == "triton":
                    self.triton_failed = True
                row(kernel, impl, moved, valid="error", note="; ".join(s for s in (prefix, msg) if s),
                    compile_s=compile_s)
                return
            extra = self.triton_note if impl == "triton" else ""
            row(kernel, impl, moved, timing, valid=valid,
                note="; ".join(s for s in (prefix, note, extra) if s), compile_s=compile_s)

        def static_fallback(kernel, call):
            """For a failed torch.compile(dynamic=true/auto): the same with dynamic=False."""
            if self.args.compile_dynamic == "false":
                return None

            def make():
                f = self.compiled_fn(kernel, cfg, "false")
                return (lambda: call(f)), (lambda: call(f)), "torch.compile(dynamic=False)"
            return make

        # ---- copy: the roofline
        if "copy" in self.impls:
            dst = torch.empty_like(x)
            measure("copy", "copy", 2 * in_bytes, lambda: dst.copy_(x), lambda: dst.copy_(x), None)
            del dst

        # ---- compress
        wire_ref = reference.compress_reference(x, cfg)
        moved = in_bytes + wire_bytes
        ccheck = lambda w: check_compress(w, wire_ref, numel, cfg)  # noqa: E731
        for impl in self.impls:
            if impl == "triton":
                if not self.triton_ok:
                    row("compress", impl, moved, valid="skipped", note=self.triton_note)
                    continue
                from taco_triton.kernels.compress import compress_triton

                buf = torch.empty(wire_bytes, dtype=torch.uint8, device=dev)
                measure("compress", impl, moved, lambda: compress_triton(x, cfg).clone(),
                        lambda: compress_triton(x, cfg, out=buf), ccheck)
                del buf
            elif impl == "eager":
                fn = lambda: reference.compress_reference(x, cfg)  # noqa: E731
                measure("compress", impl, moved, fn, fn, None)
            elif impl == "bare":
                fn = lambda: bare_pipeline(x, cfg)  # noqa: E731
                measure("compress", impl, moved, fn, fn, None)
            elif impl == "compile":
                cfn = self.compiled_fn("compress", cfg)
                call = lambda f: f(x, cfg)  # noqa: E731
                measure("compress", impl, moved, lambda: call(cfn), lambda: call(cfn), ccheck,
                        fallback=static_fallback("compress", call))

        # ---- decompress (all implementations read the reference's wire buffer)
        out_ref = reference.decompress_reference(wire_ref, numel, cfg, dtype)
        dcheck = lambda y: check_decompress(y, out_ref, cfg)  # noqa: E731
        for impl in self.impls:
            if impl == "triton":
                if not self.triton_ok:
                    row("decompress", impl, moved, valid="skipped", note=self.triton_note)
                    continue
                from taco_triton.kernels.decompress import decompress_triton

                out = torch.empty(numel, dtype=dtype, device=dev)
                measure("decompress", impl, moved,
                        lambda: decompress_triton(wire_ref, torch.empty(numel, dtype=dtype, device=dev), cfg),
                        lambda: decompress_triton(wire_ref, out, cfg), dcheck)
                del out
            elif impl == "eager":
                fn = lambda: reference.decompress_reference(wire_ref, numel, cfg, dtype)  # noqa: E731
                measure("decompress", impl, moved, fn, fn, None)
            elif impl == "compile":
                cfn = self.compiled_fn("decompress", cfg)
                call = lambda f: f(wire_ref, numel, cfg, dtype)  # noqa: E731
                measure("decompress", impl, moved, lambda: call(cfn), lambda: call(cfn), dcheck,
                        fallback=static_fallback("decompress", call))

        x = wire_ref = out_ref = None  # free this problem's tensors (the lambdas above are done with them)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            for r in rows:  # the compile-time model's ceiling beside each measured Triton figure
                if r["impl"] == "triton":
                    r["model_pct_bound"] = model_bound(r["kernel"], cfg, dtype, dev)
        return add_ratios(rows)


_MODEL: dict = {}


def model_bound(kernel: str, cfg: CompressionConfig, dtype: torch.dtype, device: torch.device) -> float:
    """bench/aot.py's bound on % of copy bandwidth for this launch on this GPU's target (NaN if
    the model has no target for it). A model with spec-sheet constants, not a measurement."""
    key = (kernel, cfg, dtype, device.index)
    if key not in _MODEL:
        import aot

        major, minor = torch.cuda.get_device_capability(device)
        target = f"sm_{major}{minor}"
        if target not in aot.TARGETS:
            return float("nan")
        from taco_triton.kernels._launch import heuristic

        p = heuristic(kernel, cfg)
        name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
        row = aot.evaluate(aot.Variant(kernel, cfg, name, p["num_warps"], p["num_stages"]), target)
        _MODEL[key] = row.get("pct_copy_bw_bound", float("nan")) if row["ok"] else float("nan")
    return _MODEL[key]


def add_ratios(rows: list[dict]) -> list[dict]:
    """pct_of_copy and speedups, from the rows of one (config, size) measured in the same run."""
    def med(kernel, impl):
        for r in rows:
            if r["kernel"] == kernel and r["impl"] == impl:
                return r["median_ms"]
        return float("nan")

    copy_gbps = next((r["logical_gbps"] for r in rows if r["impl"] == "copy"), float("nan"))
    for r in rows:
        r["pct_of_copy"] = 100.0 * r["logical_gbps"] / copy_gbps if copy_gbps == copy_gbps else float("nan")
        if r["kernel"] == "copy":
            r["speedup_vs_eager"] = r["speedup_vs_compile"] = r["speedup_vs_bare"] = float("nan")
            continue
        r["speedup_vs_bare"] = med("compress", "bare") / r["median_ms"]
        r["speedup_vs_eager"] = med(r["kernel"], "eager") / r["median_ms"]
        r["speedup_vs_compile"] = med(r["kernel"], "compile") / r["median_ms"]
    return rows


# --------------------------------------------------------------------------- output
def print_table(df) -> None:
    show = df.assign(size=[fmt_size(int(b)) for b in df["input_bytes"]])
    cols = ["config", "size", "kernel", "impl", "median_ms", "p20_ms", "p80_ms", "logical_gbps",
            "pct_of_copy", "model_pct_bound", "speedup_vs_eager", "speedup_vs_compile", "speedup_vs_bare", "valid"]
    cols = [c for c in cols if c in df and (c != "model_pct_bound" or df[c].notna().any())]
    fmt = {
        "median_ms": "{:.4g}".format, "p20_ms": "{:.4g}".format, "p80_ms": "{:.4g}".format,
        "logical_gbps": "{:.4g}".format, "pct_of_copy": "{:.1f}".format, "model_pct_bound": "{:.1f}".format,
        "speedup_vs_eager": "{:.2f}x".format, "speedup_vs_compile": "{:.2f}x".format,
        "speedup_vs_bare": "{:.2f}x".format,
    }
    with __import__("pandas").option_context("display.width", 250, "display.max_colwidth", 70,
                                             "display.max_rows", 10000):
        print(show[cols].to_string(index=False, formatters=fmt, na_rep="-"))
    notes = df[(df["note"] != "") & df["note"].notna()][["config", "input_bytes", "kernel", "impl", "note"]]
    if len(notes):
        print("\nnotes:")
        for r in notes.itertuples():
            print(f"  {r.config} {fmt_size(int(r.input_bytes))} {r.kernel}/{r.impl}: {r.note}")


def default_csv_path(meta: dict, tag: str) -> Path:
    dev = slug(meta["device"].replace("cpu (", "cpu-").rstrip(")"))
    stamp = meta["date"].replace("-", "").replace(":", "").replace("+0000", "Z")[:15] + "Z"
    name = f"kernels_{dev}_{stamp}" + (f"_{slug(tag)}" if tag else "") + ".csv"
    return ROOT / "bench" / "results" / name


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--sizes", type=lambda s: [parse_size(t) for t in s.split(",") if t.strip()],
                   help="comma-separated input sizes in bytes of --dtype, e.g. 1M,16M,1G (KiB/MiB/GiB). "
                        "Default: CUDA 1M,4M,16M,64M,256M,1G; CPU 64K,256K")
    p.add_argument("--quick", action="store_true",
                   help="fewer sizes and shorter timing (CUDA 1M,16M,256M; CPU 64K)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16",
                   help="input/output dtype (default bf16)")
    p.add_argument("--codec", choices=CODECS, default="fp8_e4m3", help="code format (default fp8_e4m3)")
    p.add_argument("--group-size", type=int, choices=GROUP_SIZES, default=128, help="elements per group G (default 128)")
    p.add_argument("--no-hadamard", action="store_true", help="disable the Hadamard transform")
    p.add_argument("--variants", action="store_true",
                   help="three configs in one CSV: the chosen one, with --codec int8, with --group-size 256")
    p.add_argument("--config", action="append", type=parse_config, metavar="CODEC[:G][:nohadamard]",
                   help="a config to benchmark (repeatable; replaces --codec/--group-size/--no-hadamard), "
                        "e.g. --config int8:128 --config fp8_e4m3:256")
    p.add_argument("--time-budget", type=float, default=None, metavar="S",
                   help="start no new size after S seconds (the CSV is rewritten after every size anyway)")
    p.add_argument("--impls", default=",".join(IMPLS),
                   help=f"comma-separated subset of {','.join(IMPLS)} (default: all)")
    p.add_argument("--compile-dynamic", choices=sorted(COMPILE_DYNAMIC), default="true",
                   help="torch.compile(dynamic=...) of the reference: true (default: one compile serves all "
                        "sizes), false (one compile per size), auto (torch's default: static, then dynamic)")
    p.add_argument("--hidden", type=int, default=4096,
                   help="row length of the [tokens, hidden] input (default 4096)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="auto (default): cuda when torch sees a GPU, else cpu")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    p.add_argument("--csv", default=None,
                   help="output CSV path, or a directory to put the default name in "
                        "(default: bench/results/kernels_<device>_<date>[_<tag>].csv)")
    p.add_argument("--tag", default="", help="suffix for the default CSV name")
    p.add_argument("--print-env", action="store_true", help="print versions, device and git commit, and exit")
    p.add_argument("--verbose", action="store_true", help="print tracebacks of failing implementations")
    args = p.parse_args(argv)
    raw_impls, args.impls = args.impls, [s.strip() for s in args.impls.split(",") if s.strip()]
    bad = set(args.impls) - set(IMPLS)
    if bad:
        p.error(f"unknown --impls {sorted(bad)}; choose from {list(IMPLS)}")
    if not args.impls:
        p.error(f"--impls {raw_impls!r} names no implementation; choose from {list(IMPLS)}")
    if args.sizes is not None:
        itemsize = DTYPES[args.dtype].itemsize
        if not args.sizes:
            p.error("--sizes names no size; use e.g. 1M,16M")
        small = [s for s in args.sizes if s < itemsize]
        if small:
            p.error(f"--sizes {small} hold no {args.dtype} element (each size is bytes of input, >= {itemsize})")
    if args.hidden < 1:
        p.error(f"--hidden must be >= 1, got {args.hidden}")
    if args.time_budget is not None and not (math.isfinite(args.time_budget) and args.time_budget > 0):
        p.error(f"--time-budget must be a positive number of seconds, got {args.time_budget}")
    return args


def print_env() -> None:
    """Versions, CUDA device and git commit (bench/gpu_check.sh records these in env.txt)."""
    from importlib import metadata

    print("python", sys.version.replace("\n", " "), "|", platform.platform())
    for dist in ("torch", "triton", "pandas", "numpy", "pytest", "pytest-timeout", "hypothesis"):
        try:
            print(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            print(f"{dist} MISSING")
    print("cuda available:", torch.cuda.is_available(), "| torch.version.cuda:", torch.version.cuda)
    if torch.cuda.is_available():
        prop = torch.cuda.get_device_properties(0)
        print(f"device: {prop.name} | capability {torch.cuda.get_device_capability(0)} | "
              f"SMs {prop.multi_processor_count} | memory {prop.total_memory / GIB:.1f} GiB")
    commit, dirty = git_info()
    print(f"git commit: {commit} (dirty: {dirty}) | TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r}")


def main(argv=None) -> int:
    import pandas as pd

    args = parse_args(argv)
    if args.print_env:
        print_env()
        return 0
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    env.use_interpreter_on_cpu(device.type)  # the Triton column on CPU: Triton's interpreter
    sizes = args.sizes or (
        (CUDA_QUICK_SIZES if args.quick else CUDA_SIZES) if device.type == "cuda"
        else (CPU_QUICK_SIZES if args.quick else CPU_SIZES)
    )
    base = CompressionConfig(codec=args.codec, group_size=args.group_size, hadamard=not args.no_hadamard)
    configs = list(dict.fromkeys(args.config)) if args.config else [base]
    if args.variants:
        for v in (configs[0].replace(codec="int8"), configs[0].replace(group_size=256)):
            if v not in configs:
                configs.append(v)

    quiet_dynamo()
    bench = Bench(args, device)
    meta = bench.meta
    if device.type == "cpu":
        print(CPU_BANNER)
    elif interpreting():
        print("WARNING: TRITON_INTERPRET is set on a CUDA machine: Triton runs in its interpreter.\n")
    print(f"device: {meta['device']} | torch {meta['torch_version']} | triton {meta['triton_version']} | "
          f"git {meta['git_commit']} (dirty: {meta['git_dirty']}) | {meta['date']}")
    print(f"configs: {', '.join(config_name(c) for c in configs)} | dtype {args.dtype} | "
          f"sizes: {', '.join(fmt_size(s) for s in sizes)} | impls: {', '.join(bench.impls)} | "
          f"timer: {meta['timer']}")
    if device.type == "cuda":
        print(f"torch.get_float32_matmul_precision() = {torch.get_float32_matmul_precision()!r} "
              "(precision of the reference's FP32 Hadamard matmul)")
    if bench.triton_note.startswith("skipped"):
        print(f"NOTE: triton {bench.triton_note}")
    print(flush=True)

    if args.csv is None:
        path = default_csv_path(meta, args.tag)
    elif args.csv.endswith(os.sep) or Path(args.csv).is_dir():
        path = Path(args.csv) / default_csv_path(meta, args.tag).name
    else:
        path = Path(args.csv)
    try:  # an unwritable --csv fails here, before the timing, not after it
        path.parent.mkdir(parents=True, exist_ok=True)
        pd.DataFrame(columns=COLUMNS).to_csv(path, index=False)
    except OSError as exc:
        print(f"error: cannot write --csv {path}: {type(exc).__name__}: {exc.strerror or exc}", file=sys.stderr)
        return 2

    def frame():
        df = pd.DataFrame(rows)
        if not len(df):
            return pd.DataFrame(columns=COLUMNS)
        return df.reindex(columns=COLUMNS + [c for c in df.columns if c not in COLUMNS])

    rows: list[dict] = []
    t_start, last, stopped = time.perf_counter(), 0.0, False
    for cfg in configs:
        for nbytes in sizes:
            elapsed = time.perf_counter() - t_start
            if args.time_budget is not None and elapsed + 2 * last > args.time_budget:
                print(f"  stopping: --time-budget {args.time_budget:.0f} s would be exceeded "
                      f"({elapsed:.0f} s spent, last size took {last:.0f} s); skipped "
                      f"{config_name(cfg)} {fmt_size(nbytes)} and the rest", flush=True)
                stopped = True
                break
            t0 = time.perf_counter()
            try:
                rows += bench.run_size(cfg, nbytes)
            except torch.OutOfMemoryError as e:
                print(f"  {config_name(cfg)} {fmt_size(nbytes)}: out of memory, skipped ({e})", flush=True)
                torch.cuda.empty_cache()
                continue
            last = time.perf_counter() - t0
            frame().to_csv(path, index=False)  # partial results survive a kill
            print(f"  done {config_name(cfg)} {fmt_size(nbytes)} in {last:.1f} s", flush=True)
        if stopped:
            break
    print(f"\nbenchmark finished in {time.perf_counter() - t_start:.1f} s\n")

    df = frame()
    print_table(df)
    df.to_csv(path, index=False)
    print(f"\nwrote {path} ({len(df)} rows)")
    if device.type == "cpu":
        print("(CPU run: the timings in this CSV are NOT GPU performance)")
    if bench.triton_failed:
        print("\nERROR: a Triton kernel failed validation or raised; see the 'valid' and 'note' columns.")
        return 3
    if not rows:
        print("error: nothing was benchmarked" + (" (--time-budget spent)" if stopped else ""), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
