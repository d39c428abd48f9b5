"""Compile-time performance model of the fused kernels: no GPU needed.

For every kernel variant the launchers can issue (kernel x codec x G x Hadamard x scales x
rounding x input dtype x launch parameters) and every target GPU, Triton's own compiler builds
the kernel exactly as a launch on that GPU would (the launchers' `*_launch` functions give the
arguments, constexprs and options; `ShapedPointer`s stand in for tensors), down to SASS (NVIDIA,
with the ptxas/cuobjdump shipped in the triton wheel) or AMDGCN (AMD). From the binary:

    regs, spill_bytes, smem_bytes   registers per thread (AMD: VGPRs), local-memory stack per
                                    thread (AMD: scratch), static shared memory (AMD: LDS)
    instr_per_elem                  warp- (AMD: wave-) instructions per element: the static
                                    instruction count of the persistent tile loop's body (an
                                    upper bound of its dynamic count: code on a skipped branch
                                    counts too) x warps per program / elements per tile. The
                                    reduce's inner loop over ranks counts RANKS - 1 times (the
                                    first rank's term is computed before it, in the tile loop).
    mma_per_elem, tc_flops_per_elem tensor-core instructions and their flops per element
    occupancy, limiter              resident warps / the SM's maximum, and what limits them
    pct_copy_bw_bound               the model's ceiling on % of copy bandwidth (below)
    slow_calls_per_tile             NVIDIA: calls per tile of the division / square-root slow
                                    path (a subroutine, taken for subnormal, huge or special
                                    operands; the common case skips it, so it is not counted above)
    instr_per_elem_worst,           the same with every slow-path call taken (each adds its
    pct_copy_bw_bound_worst         subroutine's static length); AMD: equal, the slow path is inline

The model. Per element, a kernel needs
    t_mem   = bytes moved / copy bandwidth               (a copy moving the same bytes)
    t_issue = instr_per_elem / (issue rate x SMs x clock)
    t_tc    = tensor-core flops / tensor-core peak of the operand type
and pct_copy_bw_bound = 100 * t_mem / max(t_mem, t_issue, t_tc): an optimistic ceiling (no
stalls, perfect overlap), so real kernels land below it. NVIDIA issues 4 warp-instructions per
clock per SM. AMD CDNA (see `amd_issue_per_elem`): each clock the CU's scheduler turns to one of
its 4 SIMDs and issues at most one instruction per wave of that SIMD and at most one per class
(VALU incl. MFMA, SALU/SMEM, VMEM, LDS, branch), so a SIMD takes one instruction per class every
4 clocks (a wave64 VALU op runs 4 clocks on a SIMD16: one VALU wave-instruction per clock per
CU), and a wave issues one instruction every 4 clocks at most:
    issue per element = max(max over classes of (class instructions per element),
                            instructions per element / waves per SIMD)
(the first term is the limit with enough resident waves, the second that of too few; with one
wave per SIMD every instruction is serial and the sum counts). Per-class columns valu_per_elem,
salu_per_elem, vmem_per_elem, lds_per_elem, branch_per_elem, internal_per_elem (s_waitcnt,
s_nop, s_barrier, ...: no unit, but the wave's turn) and issue_limiter ("VALU", ..., or "waves")
say which term binds. Copy
bandwidth is 90% of the spec-sheet HBM/GDDR bandwidth (a measured H200 device-to-device copy
reached 4.3 TB/s of 4.8). The constants are spec-sheet values of one representative GPU per
target (TARGETS below); they are a model, not a measurement.

The collectives' launches (`--set hotpath`; `hot_launches`): the slotted compress, the tagged
fused reduce and the slotted decompress each pipeline slice of all_reduce, reduce_scatter and
all_gather runs, built by the plan the library builds for the call (`Plan.slice_launches`), with
the parameters the library picks. These launches are short (a slice's piece is a few tiles per
program), so their per-program and per-slot work weighs: each is counted over the whole launch
(`launch_weights`: the natural loops of the control-flow graph, run as many times as the plan's
programs, slots, tiles and ranks make them), and divided by the elements the launch processes;
bytes_per_elem counts what it reads and writes (slots with their tags and padding). Extra
columns: collective, world, message_mib, odd, slots, tiles, slow_tiles (the partial last tiles of
odd-sized pieces that a launch with two paths per tile runs element by element with masks,
`slots.two_paths`; their path is weighed apart from the fast one, `tile_arms`), programs (the grid), launches (one per slice). Floors: `HOT_FLOORS`, and an
odd-sized launch within `ODD_WITHIN` of its aligned twin.

What a collective's row counts (conventions: an upper bound of what runs, never less). Reading
SASS, a CALL to code that never returns is a branch (ptxas ends sm_80 loops with
`@!P4 CALL.REL.NOINC` to the code after them), and a BRA.DIV's fallback for a diverged warp is not
taken (Triton's branches are uniform: warps arrive converged). The fused reduce's work for the
whole launch, which program 0 alone runs (the output slot's tag and padding, the error record;
found by their source lines, `_program0_code`), counts once, its padding loop as many times as the
slot's padding has 1 KiB chunks past the tag's 32 bytes (`reduce_pad_chunks`: none at the plans'
strides). Counted although they may not run: the code outside loops, once in every program; the
loops around a slotted kernel's tags and zero padding (`_slot_io.write_tag`), as many times as the
plan's slots make them, though the padding loop runs no iteration when a slot's padding fits in
the tag's 32 bytes; code on a branch a tile skips (a slow path's call set-up,
the element-wise path where `tile_arms` does not find two paths). Not counted: subroutines (the
slow paths, `slow_calls_per_tile` and the *_worst columns; the shuffles of a diverged warp).

Each collective row is read a second time (`model_misreads`; `check_floors` fails a row that
misses one, whatever `EXCEPTIONS` says): loop_bytes_ratio, the bytes the global loads and stores
inside the tile loop move (width x lanes x warps, times the runs the model gives them, descriptor
reads left out) over the bytes the launch must move, within `LOOP_BYTES` (1.0-1.25x, NVIDIA); desc_in_tile_loop,
the tile loop holds the slot lookup's descriptor loads (slotted kernels); launch_check, empty when
the launches are those the library's own `Call` and plan make for the call (`check_launches`).

Usage:
    python bench/aot.py --set hotpath                 # the collectives' launches, 5 targets
    python bench/aot.py --quick                       # defaults and key variants, 5 targets
    python bench/aot.py --set ci                      # what tests/test_aot.py checks
    python bench/aot.py --set subbyte                 # every INT6/INT4 launch, 4 targets
    python bench/aot.py --targets sm_90 --json out.json --csv out.csv
    python bench/aot.py --quick --targets sm_90 --only kernel=reduce_dense,dtype=fp32   # a few rows
    python bench/aot.py                               # the full table (long: ~3 s per compile)
"""
from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

os.environ.pop("TRITON_INTERPRET", None)  # this tool compiles; the interpreter would only run Python

import torch  # noqa: E402

from taco_triton.config import CODECS, GROUP_SIZES, ROUNDINGS, SCALE_MODES, CompressionConfig  # noqa: E402
from taco_triton.layout import WireLayout  # noqa: E402

KERNELS = ("compress", "decompress", "reduce", "reduce_dense")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
#: Elements the model sizes a launch for (64 Mi: many waves of tiles on every target).
NUMEL = 64 << 20
#: The odd size of the unaligned rows (`--quick` has one per kernel): not a multiple of 16, so
#: Triton's launch specialization knows nothing of its alignment, as for most direct calls.
ODD_NUMEL = NUMEL - 1
#: Ranks summed by the modelled reduce (the smallest TP degree, where its per-element
#: instruction cost weighs most against the bytes it moves). Its loop over ranks runs RANKS - 1
#: times: the first rank's term starts the sum before the loop (`reduce._rank_term`).
RANKS = 2
RANK_LOOP_RUNS = RANKS - 1


@dataclass(frozen=True)
class GPU:
    """One target and the spec-sheet constants of a representative GPU for it."""

    name: str            # representative GPU
    backend: str         # "cuda" | "hip"
    arch: int | str      # compute capability or gfx name
    hbm_tbs: float       # spec memory bandwidth, TB/s
    units: int           # SMs or CUs
    clock_ghz: float     # boost clock
    issue: float         # warp-instructions per clock per SM; AMD: issue turns (one VALU each) per clock per CU
    tc16_tflops: float   # dense bf16/fp16 tensor-core peak
    tf32_tflops: float   # dense tf32 tensor-core peak
    max_warps: int       # resident warps (AMD: waves) per SM (CU)
    regs: int            # 32-bit registers per SM (AMD: VGPRs per SIMD lane)
    smem_kb: int         # shared memory (LDS) per SM (CU) usable by blocks
    max_blocks: int      # resident blocks per SM (CU)

    @property
    def copy_bw(self) -> float:
        return 0.9 * self.hbm_tbs * 1e12

    @property
    def warp(self) -> int:
        return 64 if self.backend == "hip" else 32


TARGETS = {
    "sm_80": GPU("A100-SXM4-80GB", "cuda", 80, 2.039, 108, 1.41, 4, 312, 156, 64, 65536, 164, 32),
    "sm_86": GPU("A10", "cuda", 86, 0.6, 72, 1.695, 4, 125, 62.5, 48, 65536, 100, 16),
    "sm_89": GPU("L40S", "cuda", 89, 0.864, 142, 2.52, 4, 362, 183, 48, 65536, 100, 24),
    "sm_90": GPU("H200-SXM-141GB", "cuda", 90, 4.8, 132, 1.98, 4, 989, 494, 64, 65536, 227, 32),
    "sm_100": GPU("B200", "cuda", 100, 8.0, 148, 1.965, 4, 2250, 1125, 64, 65536, 227, 32),
    "sm_120": GPU("RTX-5090", "cuda", 120, 1.792, 170, 2.41, 4, 209, 105, 48, 65536, 99, 24),
    "gfx942": GPU("MI300X", "hip", "gfx942", 5.3, 304, 2.1, 1, 1307, 654, 32, 512, 64, 32),
    "gfx950": GPU("MI355X", "hip", "gfx950", 8.0, 256, 2.4, 1, 2500, 1250, 32, 512, 160, 32),
}
QUICK_TARGETS = ("sm_80", "sm_89", "sm_90", "sm_100", "gfx942")


@dataclass(frozen=True)
class Variant:
    kernel: str
    config: CompressionConfig
    dtype: str  # input dtype (compress), output dtype (decompress, reduce_dense), "u8" (reduce)
    num_warps: int
    num_stages: int
    numel: int = NUMEL

    def row(self) -> dict:
        c = self.config
        return {"kernel": self.kernel, "codec": c.codec, "group_size": c.group_size, "hadamard": c.hadamard,
                "scales": c.scales, "rounding": c.rounding, "dtype": self.dtype,
                "num_warps": self.num_warps, "num_stages": self.num_stages, "numel": self.numel}


def _kernel_dtypes(kernel: str) -> tuple:
    return ("u8",) if kernel == "reduce" else tuple(DTYPES)


def _uses_rounding(kernel: str) -> bool:
    return kernel in ("compress", "reduce")


def launch_choices(kernel: str, config: CompressionConfig, dtype: torch.dtype, backend: str = "cuda") -> list[dict]:
    """The launch parameters a run can pick on `backend`: the heuristic, then every entry of the
    shipped tuned files. Both reduce rows are the library's one "reduce" launch."""
    from taco_triton.kernels._launch import heuristic

    tuned_kernel = "reduce" if kernel.startswith("reduce") else kernel
    found = [heuristic(tuned_kernel, config, backend)]
    for path in sorted((ROOT / "autotune" / "tuned").glob("*.json")):
        for e in json.loads(path.read_text()).get("entries", {}).values():
            k = e.get("key", {})
            if (k.get("kernel") == tuned_kernel and k.get("codec") == config.codec and k.get("group_size") == config.group_size
                    and k.get("hadamard") == config.hadamard and k.get("scales") == config.scales
                    and k.get("rounding") == config.rounding):
                p = {"num_warps": e["config"]["num_warps"], "num_stages": e["config"]["num_stages"]}
                if p not in found:
                    found.append(p)
    return found


def variants(which: str, backend: str = "cuda") -> list[Variant]:
    """"ci": the default config, INT8 and INT6 at G=32 (each with every launch a run can pick); "quick": the
    default config and its one-field neighbours, plus the default config at an odd size (ODD_NUMEL) per kernel;
    "subbyte": every INT6/INT4 config with dual scales
    (all group sizes, Hadamard on and off, both roundings; bf16, and fp16/fp32 at G=32);
    "full": every combination. Launch parameters: those `backend` ("cuda" or "hip") can pick."""
    out, odd = [], []
    default = CompressionConfig()
    for kernel in KERNELS:
        dtype0 = "u8" if kernel == "reduce" else "bf16"
        if which == "ci":
            pairs = [(default, dtype0), (default.replace(codec="int8"), dtype0),
                     (default.replace(codec="int6", group_size=32), dtype0)]
        elif which == "quick":
            cfgs = {default, default.replace(codec="int8"), default.replace(codec="fp8_e5m2"),
                    default.replace(hadamard=False), default.replace(codec="int8", hadamard=False),
                    *(default.replace(group_size=g) for g in GROUP_SIZES)}
            if _uses_rounding(kernel):
                cfgs.add(default.replace(rounding="stochastic"))
            cfgs.add(default.replace(scales="taco_fp32x2"))
            dtypes = ["u8"] if kernel == "reduce" else ["bf16"]
            extra = [] if kernel == "reduce" else [(default, d) for d in ("fp16", "fp32")]
            pairs = [(c, d) for c in sorted(cfgs, key=str) for d in dtypes] + extra
            p = launch_choices(kernel, default, DTYPES.get(dtype0, torch.uint8), backend)[0]
            odd.append(Variant(kernel, default, dtype0, p["num_warps"], p["num_stages"], ODD_NUMEL))
        elif which == "subbyte":
            roundings = ROUNDINGS if _uses_rounding(kernel) else ("nearest",)
            pairs = [(CompressionConfig(codec=c, group_size=g, hadamard=h, rounding=r), dtype0)
                     for c, g, h, r in itertools.product(("int6", "int4"), GROUP_SIZES, (True, False), roundings)]
            if kernel != "reduce":
                pairs += [(CompressionConfig(codec=c, group_size=32), d) for c in ("int6", "int4") for d in ("fp16", "fp32")]
        else:
            roundings = ROUNDINGS if _uses_rounding(kernel) else ("nearest",)
            pairs = [(CompressionConfig(codec=c, group_size=g, hadamard=h, scales=s, rounding=r), d)
                     for c, g, h, s, r, d in itertools.product(CODECS, GROUP_SIZES, (True, False), SCALE_MODES,
                                                               roundings, _kernel_dtypes(kernel))]
        for cfg, d in pairs:
            for p in launch_choices(kernel, cfg, DTYPES.get(d, torch.uint8), backend):
                out.append(Variant(kernel, cfg, d, p["num_warps"], p["num_stages"]))
    return out + odd


def build_launches(v: Variant, gpu: GPU) -> tuple:
    """The launches the library issues for this variant on this GPU: compress and decompress of a
    size that is not a multiple of 16 run as an aligned main launch plus a one-program tail
    (`taco_triton.kernels._tile.aligned_split`); everything else is one launch."""
    from taco_triton.kernels._launch import ShapedPointer as P, Target

    target = Target(gpu.backend, gpu.arch, gpu.warp)
    params = {"num_warps": v.num_warps, "num_stages": v.num_stages}
    u8, f32 = P(torch.uint8), P(torch.float32)
    scale_b = u8 if v.config.scales == "dual" else f32
    if v.kernel == "compress":
        from taco_triton.kernels.compress import CompressOp

        return CompressOp(v.config, None, target, lambda *_: params).dense_launches(
            P(DTYPES[v.dtype]), u8, f32, scale_b, v.numel)
    if v.kernel == "decompress":
        from taco_triton.kernels.decompress import DecompressOp

        return DecompressOp(v.config, None, target, lambda *_: params).dense_launches(
            u8, f32, scale_b, P(DTYPES[v.dtype]), v.numel)
    return (build_launch(v, gpu),)


def combine(parts: list[tuple[int, dict]]) -> dict:
    """One analysis of launches issued in turn, from (tiles, analysis) per launch: the loop's
    instructions and matrix work per tile are the tile-weighted mean (a partial tail tile counts
    as a whole one, so this slightly overstates the tail); registers, shared memory and occupancy
    are the main (first) launch's; spills and slow-path calls the largest of any launch."""
    if len(parts) == 1:
        return parts[0][1]
    total = sum(n for n, _ in parts)
    out = dict(parts[0][1])
    out["instr_per_tile"] = sum(n * a["instr_per_tile"] for n, a in parts) / total
    out["slow_instr_per_tile"] = sum(n * a["slow_instr_per_tile"] for n, a in parts) / total
    out["mma"] = [(f, w * n / total) for n, a in parts for f, w in a["mma"]]
    if all("classes" in a for _, a in parts):
        out["classes"] = {c: sum(n * a["classes"][c] for n, a in parts) / total for c in parts[0][1]["classes"]}
    out["static_instr"] = sum(a["static_instr"] for _, a in parts)
    out["spill_bytes"] = max(a["spill_bytes"] for _, a in parts)
    out["slow_calls_per_tile"] = max(a["slow_calls_per_tile"] for _, a in parts)
    return out


def build_launch(v: Variant, gpu: GPU):
    """The Launch the library would issue for this variant on this GPU (arguments as ShapedPointers)."""
    from taco_triton.kernels._launch import ShapedPointer as P, Target

    target = Target(gpu.backend, gpu.arch, gpu.warp)
    params = {"num_warps": v.num_warps, "num_stages": v.num_stages}
    cfg, numel = v.config, v.numel
    u8, f32 = P(torch.uint8), P(torch.float32)
    scale_b = u8 if cfg.scales == "dual" else f32
    if v.kernel == "compress":
        from taco_triton.kernels.compress import CompressOp

        return CompressOp(cfg, None, target, lambda *_: params).dense_launches(
            P(DTYPES[v.dtype]), u8, f32, scale_b, numel, split=False)[0]
    if v.kernel == "decompress":
        from taco_triton.kernels.decompress import DecompressOp

        return DecompressOp(cfg, None, target, lambda *_: params).dense_launches(
            u8, f32, scale_b, P(DTYPES[v.dtype]), numel, split=False)[0]
    from taco_triton.kernels import slots
    from taco_triton.kernels.reduce import ReduceOp

    lay = WireLayout.of(numel, cfg)
    stride = slots.round_up(lay.nbytes, slots.ALIGN)  # reduce_triton's rows, 16-byte aligned
    strides = (stride, stride // 4, stride if cfg.scales == "dual" else stride // 4)
    dense = v.kernel == "reduce_dense"
    out = P(DTYPES[v.dtype]) if dense else u8
    o = (out, out, out) if dense else (u8, f32, scale_b)
    return ReduceOp(cfg, None, target, lambda *_: params).rows_launch(u8, f32, scale_b, strides, RANKS, *o, out, numel,
                                                                       1.0, dense)


def compile_launch(launch, gpu: GPU):
    """triton.compile of the launch for `gpu`'s target, through Triton's own argument binder."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    gt = GPUTarget(gpu.backend, gpu.arch, gpu.warp)
    backend = make_backend(gt)
    fn = launch.fn
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kw = dict(launch.meta)
    bound, spec, opts = binder(**launch.args, **kw)
    options, signature, constexprs, attrs = fn._pack_args(backend, kw, bound, spec, opts)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=gt, options=options.__dict__)


_TT_DOT = re.compile(r"= tt\.dot .*?(?:inputPrecision = (\w+).*?)?: tensor<(?:\d+x)+(\w+)>")


def dot_precisions(ttir: str) -> list[tuple[str, str]]:
    """(operand element type, input precision) of every `tt.dot` of a kernel's TTIR. Triton's
    default for FP32 operands on NVIDIA is "tf32" (one pass: operands rounded to 10 mantissa
    bits); the kernels split FP32 operands into three bf16 pieces there (`_common._dot`)."""
    return [(m.group(2), m.group(1) or "ieee") for m in _TT_DOT.finditer(ttir)]


# ------------------------------------------------------------------------------ binary analysis
_SASS_LINE = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_MMA_SHAPE = re.compile(r"(\d+)x(\d+)x(\d+)")
_HMMA_SHAPE = {"16816": (16, 8, 16), "1688": (16, 8, 8), "884": (8, 8, 4), "16832": (16, 8, 32)}


def _sass_op(text: str) -> str:
    """The opcode of one SASS instruction (after its predicate, if any)."""
    parts = text.split()
    return parts[1 if text.startswith("@") and len(parts) > 1 else 0] if parts else ""


def _sass_target(text: str) -> int | None:
    """The address a SASS branch or call goes to (its last operand), or None (an indirect one)."""
    g = re.search(r"0x([0-9a-f]+)\s*$", text)
    return int(g.group(1), 16) if g else None


def _sass_index(addrs: list[int], addr: int | None) -> int | None:
    """The index of the first instruction at or after `addr` (the NOPs the reader leaves out are
    often branch targets), or None past the end."""
    import bisect

    if addr is None:
        return None
    j = bisect.bisect_left(addrs, addr)
    return j if j < len(addrs) and (j or addrs[0] == addr) else None


def _sass_returns(instrs, start: int) -> bool:
    """Whether the code at `start`, a CALL's target, returns: a RET is on some path from it (a
    subroutine: the division and square-root slow paths, the shuffles of a diverged warp). ptxas
    also jumps with a call to code that never returns: on sm_80 a loop can end in
    `@!P4 CALL.REL.NOINC .L_x_14` to the code after the loop, whose paths end in EXIT or branch
    back into the kernel. Calls on the way are taken as returning (their targets not followed)."""
    addrs = [addr for addr, _ in instrs]
    seen, stack = {start}, [start]
    while stack:
        i = stack.pop()
        text = instrs[i][1]
        op = _sass_op(text)
        if op.startswith("RET"):
            return True
        nxt = []
        if not (op in ("BRA", "EXIT") or op.startswith("BRX") or op.startswith("JMX")) or text.startswith("@"):
            nxt.append(i + 1)
        if op.startswith("BRA") and not op.startswith("BRA.DIV"):
            nxt.append(_sass_index(addrs, _sass_target(text)))
        for j in nxt:
            if j is not None and j < len(instrs) and j not in seen:
                seen.add(j)
                stack.append(j)
    return False


def _sass_calls(instrs) -> dict[int, bool]:
    """{index of a CALL: whether its target returns (`_sass_returns`)} for every direct CALL."""
    addrs = [addr for addr, _ in instrs]
    out, returns = {}, {}
    for i, (_, text) in enumerate(instrs):
        if _sass_op(text).startswith("CALL"):
            j = _sass_index(addrs, _sass_target(text))
            if j is not None:
                if j not in returns:
                    returns[j] = _sass_returns(instrs, j)
                out[i] = returns[j]
    return out


def _sass_successors(instrs) -> list[list[int]]:
    """The control-flow successors of each SASS instruction (by index): the next one unless an
    unpredicated branch, EXIT or RET ends the path, and a branch's target (the first instruction
    at or after it: the NOPs `instrs` leaves out are often branch targets).

    A CALL to a subroutine returns: the next instruction (the subroutine, after the kernel's EXIT,
    is counted apart: `_slow_calls`). A CALL to code that does not return (`_sass_returns`; ptxas's
    sm_80 loop exits, `@!P4 CALL.REL.NOINC .L_x_14`) is a branch: its target, and the next
    instruction when predicated. A `BRA.DIV` goes to ptxas's fallback for a warp whose threads
    diverged; Triton's branches are uniform (the whole program takes them), so warps arrive there
    converged and it is not taken: the next instruction only."""
    addrs = [addr for addr, _ in instrs]
    calls = _sass_calls(instrs)
    out = []
    for i, (_, text) in enumerate(instrs):
        predicated = text.startswith("@")
        op = _sass_op(text)
        jump = i in calls and not calls[i]
        succ = []
        if not (op in ("BRA", "EXIT") or op.startswith("RET") or jump) or predicated:
            succ.append(i + 1)
        if (op.startswith("BRA") and not op.startswith("BRA.DIV")) or jump:
            j = _sass_index(addrs, _sass_target(text))
            if j is not None:
                succ.append(j)
        out.append([j for j in succ if j < len(instrs)])
    return out


def _gcn_successors(instrs, labels: dict) -> list[list[int]]:
    """As `_sass_successors`, for AMDGCN (s_branch, s_cbranch_*, s_endpgm, s_setpc_b64)."""
    out = []
    for i, (_, text) in enumerate(instrs):
        op = text.split()[0]
        succ = [] if op in ("s_branch", "s_endpgm", "s_setpc_b64") else [i + 1]
        if op.startswith(("s_branch", "s_cbranch")) and text.split()[-1] in labels:
            succ.append(labels[text.split()[-1]])
        out.append([j for j in succ if j < len(instrs)])
    return out


def _cfg_loops(instrs, succ) -> dict:
    """The natural loops of a kernel's control-flow graph (instruction by instruction): for each
    back edge (an edge to an instruction that dominates its source) the instructions that reach
    it without passing its target, the loop's header; back edges to one header are one loop. Returns {"reached":
    instructions reachable from the entry (subroutines after EXIT are not), "loops": [(header,
    sorted body)]}."""
    n = len(instrs)
    pred = [[] for _ in range(n)]
    for i, ss in enumerate(succ):
        for j in ss:
            pred[j].append(i)
    reached, stack = {0} if n else set(), [0] if n else []
    while stack:
        for j in succ[stack.pop()]:
            if j not in reached:
                reached.add(j)
                stack.append(j)
    # immediate dominators (Cooper, Harvey, Kennedy: iterate in reverse postorder to a fixed point)
    order, seen, stack = [], set(), [(0, iter(succ[0]))] if n else []
    seen.update([0] if n else [])
    while stack:
        node, it = stack[-1]
        nxt = next((j for j in it if j not in seen), None)
        if nxt is None:
            order.append(node)
            stack.pop()
        else:
            seen.add(nxt)
            stack.append((nxt, iter(succ[nxt])))
    rpo = order[::-1]
    pos = {v: i for i, v in enumerate(rpo)}
    idom = {0: 0} if n else {}
    changed = True
    while changed:
        changed = False
        for v in rpo[1:]:
            ps = [q for q in pred[v] if q in idom]
            new = ps[0]
            for q in ps[1:]:
                a, b = q, new
                while a != b:
                    while pos[a] > pos[b]:
                        a = idom[a]
                    while pos[b] > pos[a]:
                        b = idom[b]
                new = a
            if idom.get(v) != new:
                idom[v], changed = new, True

    def dominates(h, v):
        while v != h and v != 0:
            v = idom[v]
        return v == h

    bodies: dict[int, set] = {}
    for i, ss in enumerate(succ):
        for h in ss:
            if i in reached and dominates(h, i):
                body = bodies.setdefault(h, {h})
                stack = [i] if i not in body else []
                body.add(i)
                while stack:
                    for q in pred[stack.pop()]:
                        if q not in body and q in reached:
                            body.add(q)
                            stack.append(q)
    return {"reached": sorted(reached), "loops": [(h, sorted(b)) for h, b in sorted(bodies.items())],
            "idom": idom, "succ": succ}


def _per_tile_instructions(cfg: dict, ranks: int) -> tuple[int, list]:
    """Dynamic estimate per tile of a plain launch, from the natural loops of its control-flow
    graph (`_cfg_loops`, the reading the collectives' model takes): the body of the largest
    outermost loop (the tile loop), the loops inside it counted `ranks` times (`RANK_LOOP_RUNS`:
    the reduce's loop over ranks); without a loop, every reached instruction once. (The former
    reading took a loop to be a branch back to an earlier address and did not know sm_100's
    uniform branch `BRA.U UP1, target`: it missed the reduce's loop over ranks there and counted
    one rank of two.)"""
    bodies = {h: frozenset(b) for h, b in cfg["loops"]}
    if not bodies:
        return len(cfg["reached"]), [(i, 1) for i in cfg["reached"]]
    outer = [h for h in bodies if not any(g != h and bodies[h] < bodies[g] for g in bodies)]
    top = max(outer, key=lambda h: len(bodies[h]))
    weights = dict.fromkeys(bodies[top], 1)
    for h, body in bodies.items():
        if h != top and body < bodies[top]:
            weights.update(dict.fromkeys(body, ranks))
    return sum(weights.values()), sorted(weights.items())


def _mma_flops(text: str, backend: str) -> tuple[int, str] | None:
    """(flops per warp/wave instruction, operand class "16" or "tf32") of an MMA instruction."""
    op = text.split()[0] if not text.startswith("@") else text.split()[1]
    if backend == "cuda":
        if op.startswith("HGMMA"):
            m, n, k = map(int, _MMA_SHAPE.search(op).groups())
            return 2 * m * n * k // 4, "tf32" if "TF32" in op else "16"  # a warpgroup: 4 warps issue it
        if op.startswith("HMMA"):
            shape = op.split(".")[1]
            m, n, k = _HMMA_SHAPE.get(shape, (16, 8, 16))
            return 2 * m * n * k, "tf32" if "TF32" in op else "16"
        if op.startswith(("UTCHMMA", "UTCQMMA", "UTCMMA")):
            return None  # tcgen05 (sm_100): counted as instructions only
        return None
    if op.startswith("v_mfma"):
        m, n, k = map(int, _MMA_SHAPE.search(op).groups())
        return 2 * m * n * k, "tf32" if "xf32" in op or "f32_" in op.split("mfma_f32")[-1][:5] else "16"
    return None


def analyze_cuda(kernel, gpu: GPU) -> dict:
    import triton

    nv = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        res = subprocess.run([str(nv / "cuobjdump"), "-res-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([str(nv / "cuobjdump"), "-sass", f.name], capture_output=True, text=True).stdout
        listing = subprocess.run([str(nv / "nvdisasm"), "-g", "-c", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", res)
    regs, stack, shared, local = map(int, m.groups())
    instrs = []
    for line in sass.splitlines():
        s = _SASS_LINE.match(line)
        if s and not s.group(2).startswith("NOP"):
            instrs.append((int(s.group(1), 16), s.group(2)))
    while instrs and re.match(r"BRA 0x[0-9a-f]+$", instrs[-1][1]) and int(instrs[-1][1].split()[-1], 16) == instrs[-1][0]:
        instrs.pop()  # the trailing self-branch after EXIT

    cfg = _cfg_loops(instrs, _sass_successors(instrs))
    per_tile, weighted = _per_tile_instructions(cfg, RANK_LOOP_RUNS)
    mma = [(_mma_flops(instrs[i][1], "cuda"), w) for i, w in weighted]
    return {"regs": regs, "spill_bytes": stack + local, "smem_bytes": shared + kernel.metadata.shared * 0,
            "smem_dynamic": kernel.metadata.shared, "instr_per_tile": per_tile, "static_instr": len(instrs),
            "mma": [(f, w) for f, w in mma if f is not None], "loops": len(cfg["loops"]),
            **_slow_calls(instrs, weighted), "instrs": instrs, "cfg": cfg,
            **_line_sets(instrs, _sass_lines(listing, instrs))}


def _sass_lines(listing: str, instrs) -> dict[int, tuple[str, int]]:
    """{instruction index: (source file name, line)} from `nvdisasm -g`'s listing (the innermost
    source line of each instruction, that of an inlined helper where it is one)."""
    index = {addr: i for i, (addr, _) in enumerate(instrs)}
    out, here = {}, None
    for line in listing.splitlines():
        f = re.match(r'\s*//## File "(.*)", line (\d+)', line)
        if f:
            here = (Path(f.group(1)).name, int(f.group(2)))
            continue
        s = _SASS_LINE.match(line)
        if s and here is not None and int(s.group(1), 16) in index:
            out[index[int(s.group(1), 16)]] = here
    return out


def _function_lines(fn) -> set[tuple[str, int]]:
    """(file name, line) of every line of a `@triton.jit` function's source."""
    import inspect

    src, first = inspect.getsourcelines(fn.fn)
    return {(Path(inspect.getsourcefile(fn.fn)).name, first + i) for i in range(len(src))}


def _desc_loads(instrs, lines: dict) -> dict:
    """The global loads (indices) of a slotted kernel that read its slots' descriptors, by their
    source lines (`lines`: index -> (file name, line)): {"all": those of the kernel's own body and of
    its descriptor helpers (`_slot_io.slot_of`, `_slot_io.dense_piece`), "tile": the slot lookup's
    (`slot_of`), which every tile makes}. The body's loads are all of one descriptor field (one
    address for the whole warp, from cache: not traffic the launch must move); its data moves in
    the tile helpers. By lines of whole functions, not of one statement: the compilers often give
    a load the line of a neighbouring statement."""
    from taco_triton.kernels import _slot_io, compress, decompress

    body = (_function_lines(compress._compress_slots_kernel) | _function_lines(decompress._decompress_slots_kernel)
            | _function_lines(_slot_io.dense_piece))
    lookup = _function_lines(_slot_io.slot_of)
    loads = {i: loc for i, loc in lines.items() if _global_access(instrs[i][1])}
    return {"all": sorted(i for i, loc in loads.items() if loc in body | lookup),
            "tile": sorted(i for i, loc in loads.items() if loc in lookup)}


def _program0_code(lines: dict) -> list[int]:
    """The instructions (indices) of the fused reduce's work for the whole launch, which program 0
    alone runs (`reduce._reduce_kernel`: `if pid == 0`): the output slot's tag and padding
    (`_slot_io.write_tag`) and the error record (`_slot_io.record_error`), by their source lines
    (`lines`: index -> (file name, line)). Instructions the compiler moved out of the branch keep
    other lines and count in every program."""
    from taco_triton.kernels import _slot_io

    once = _function_lines(_slot_io.write_tag) | _function_lines(_slot_io.record_error)
    return sorted(i for i, loc in lines.items() if loc in once)


def _line_sets(instrs, lines: dict) -> dict:
    """What the model reads from the instructions' source lines: the descriptor loads
    (`_desc_loads`) and the reduce's program-0 code (`_program0_code`)."""
    return {"desc_loads": _desc_loads(instrs, lines), "program0": _program0_code(lines)}


_AMD_WIDTH = {"dword": 4, "dwordx2": 8, "dwordx3": 12, "dwordx4": 16, "b32": 4, "b64": 8, "b96": 12, "b128": 16}


def access_bytes(text: str, lanes: int) -> int:
    """Bytes one warp- (wave-) instruction that loads or stores global memory moves with every lane
    active (`lanes` of them), from its width (SASS: LDG.E.128 16 B a thread, .64 8, .U16/.S16 2,
    .U8/.S8 1, else 4; AMDGCN: dwordx4 16, ..., short 2, byte 1); 0 for any other instruction."""
    if not _global_access(text):
        return 0
    op = text.split()[1 if text.startswith("@") else 0]
    if op[:3] in ("LDG", "STG"):
        parts = set(op.split("."))
        size = (32 if "256" in parts else 16 if "128" in parts else 8 if "64" in parts else
                2 if parts & {"U16", "S16"} else 1 if parts & {"U8", "S8"} else 4)
        return size * lanes
    width = op.split("_", 2)[2] if op.count("_") >= 2 else ""
    width = width.removesuffix("_d16_hi").removesuffix("_d16")
    size = _AMD_WIDTH.get(width) or (2 if "short" in width or width.endswith("16") else 1 if "byte" in width or
                                     width.endswith("8") else 4)
    return size * lanes


_CALL = re.compile(r"(?:^|\s)CALL\.REL(?:\.NOINC)?\s+(?:`\()?\.?[A-Za-z_$.0-9]*\)?\s*0x([0-9a-f]+)")


def _slow_calls(instrs, weighted) -> dict:
    """The slow paths the tile loop calls (CALL.REL to a subroutine after the kernel's EXIT: FP32
    division and square root for subnormal, huge or special operands): call sites per tile and
    the instructions per tile if every call is taken (`instr_per_tile_worst`), each callee's static
    length (an upper bound of any path through it) added per call. A call to code that does not
    return is a jump (`_sass_successors`), not a slow path."""
    index = {addr: i for i, (addr, _) in enumerate(instrs)}
    returns = _sass_calls(instrs)
    calls, extra = 0, 0
    for i, w in weighted:
        m = _CALL.search(instrs[i][1])
        if not m or int(m.group(1), 16) not in index or not returns.get(i, True):
            continue
        start = index[int(m.group(1), 16)]
        end = next((j for j in range(start, len(instrs)) if instrs[j][1].split()[0].lstrip("@!P0123456789 ").startswith("RET")
                    or re.search(r"(^|\s)RET", instrs[j][1])), len(instrs) - 1)
        calls += w
        extra += w * (end - start + 1)
    return {"slow_calls_per_tile": calls, "slow_instr_per_tile": extra}


def analyze_hip(kernel, gpu: GPU) -> dict:
    asm = kernel.asm["amdgcn"]

    def meta(key, default=0):
        m = re.search(rf"\.{key}:\s+(\d+)", asm)
        return int(m.group(1)) if m else default

    vgpr = meta("vgpr_count")
    agpr = meta("agpr_count")
    scratch = meta("private_segment_fixed_size")
    lds = meta("group_segment_fixed_size")
    body = asm.split(".Lfunc_end")[0]
    instrs, labels, files, lines, here = [], {}, {}, {}, None
    for line in body.splitlines():
        # a label often carries a comment ("; %loop_header"): without it the label is not seen, the
        # loop's back-edge has no target, and the loop body is missed
        t = line.split(";", 1)[0].strip()
        if re.match(r"^\.?L?[A-Za-z0-9_$.]+:$", t) and not t.startswith(".amdhsa"):
            labels[t[:-1]] = len(instrs)
            continue
        f = re.match(r'\.file\s+(\d+)\s+"[^"]*"\s+"([^"]+)"', t)
        if f:
            files[f.group(1)] = Path(f.group(2)).name
        loc = re.match(r"\.loc\s+(\d+)\s+(\d+)", t)
        if loc:  # the source line of the instructions that follow (the innermost, as nvdisasm's)
            here = (files.get(loc.group(1), ""), int(loc.group(2)))
        if re.match(r"^[sv]_|^(global|buffer|ds|flat|scratch)_", t):
            if here is not None:
                lines[len(instrs)] = here
            instrs.append((len(instrs), t))

    cfg = _cfg_loops(instrs, _gcn_successors(instrs, labels))
    per_tile, weighted = _per_tile_instructions(cfg, RANK_LOOP_RUNS)
    mma = [(_mma_flops(instrs[i][1], "hip"), w) for i, w in weighted]
    classes = dict.fromkeys(AMD_CLASSES, 0)
    for i, w in weighted:
        classes[amd_class(instrs[i][1])] += w
    # AMD's division and square root are inline sequences (no subroutine): already counted
    return {"regs": vgpr + agpr, "spill_bytes": scratch, "smem_bytes": lds, "smem_dynamic": kernel.metadata.shared,
            "instr_per_tile": per_tile, "static_instr": len(instrs),
            "mma": [(f, w) for f, w in mma if f is not None], "loops": len(cfg["loops"]),
            "slow_calls_per_tile": 0, "slow_instr_per_tile": 0, "classes": classes, "instrs": instrs,
            "cfg": cfg, **_line_sets(instrs, lines)}


#: The instruction classes of AMD's CU scheduler, each issued to its own unit (AMD, ROCm Compute
#: Profiler, "Pipeline descriptions", section Scheduler: per clock the scheduler considers one
#: SIMD, round-robin, and issues up to one instruction per wave of it and up to one per category,
#: VALU, VMEM, SALU/SMEM, LDS, branch; MFMA instructions issue through the VALU). "internal":
#: instructions handled in the instruction buffer without a unit (the same page, after the GCN
#: crash course: s_nop, s_waitcnt, s_barrier, s_setprio, s_sleep), which still take a wave's turn.
AMD_CLASSES = ("valu", "salu", "vmem", "lds", "branch", "internal")
_AMD_INTERNAL = re.compile(r"s_(nop|waitcnt\w*|barrier|setprio|sleep|sethalt|trap|icache_inv|ttracedata)\b")


def amd_class(text: str) -> str:
    """The scheduler class of one AMDGCN instruction (its text, mnemonic first)."""
    op = text.split()[0]
    if op.startswith("v_"):
        return "valu"  # v_mfma, v_accvgpr_* and v_pk_* included: one VALU issue each
    if op.startswith(("global_", "buffer_", "flat_", "scratch_")):
        return "vmem"
    if op.startswith("ds_"):
        return "lds"
    if op.startswith(("s_branch", "s_cbranch", "s_setpc", "s_swappc")):
        return "branch"
    if _AMD_INTERNAL.match(op):
        return "internal"
    return "salu"  # scalar ALU and scalar memory share one issue port


def amd_issue_per_elem(per_class: dict, occupancy: float, gpu: GPU) -> tuple[float, str]:
    """(issue cost per element in VALU-instruction clocks of one CU, what binds it) on AMD CDNA.

    Each SIMD is offered one issue turn every 4 clocks; in a turn it issues at most one instruction
    per class and one per wave (`AMD_CLASSES` gives the source). Over a tile the turns needed are
    at least every class's count and the whole count over the resident waves per SIMD; a CU runs
    one turn per clock over its 4 SIMDs. per_class: wave-instructions per element by class.

    One VALU wave-instruction per clock per CU is the rate AMD states for MI300X (ROCm docs, "AMD
    Instinct MI300 series microarchitecture", peak-performance table, per CU and clock with one
    SIMD instruction submitted each clock: vector FP64 128 FLOPs = 64 lanes x FMA; vector FP32 256
    = the packed v_pk_fma_f32, two values per lane). So a packed instruction costs one issue like
    any other and does the work of two; the compiler's v_pk_* count as one instruction here.
    """
    waves_per_simd = max(occupancy * gpu.max_warps / 4, 1e-9)
    simds_busy = min(waves_per_simd, 1.0)  # fewer than 4 resident waves leave SIMDs idle
    terms = {c.upper(): n / simds_busy for c, n in per_class.items() if c != "internal"}
    terms["waves"] = sum(per_class.values()) / waves_per_simd
    limiter = max(terms, key=terms.get)
    return terms[limiter], limiter


def occupancy(gpu: GPU, warps: int, regs: int, smem: int) -> tuple[float, str]:
    """Resident warps / maximum, and the resource that limits them (registers, shared memory, warps, blocks)."""
    if gpu.backend == "cuda":
        per_warp = -(-max(regs, 1) * 32 // 256) * 256
        by_regs = (gpu.regs // per_warp) // warps
    else:  # VGPRs per lane of a SIMD; a block's waves spread over the CU's 4 SIMDs
        waves_per_simd = min(8, gpu.regs // max(8, -(-max(regs, 1) // 8) * 8))
        by_regs = (waves_per_simd * 4) // warps
    by_smem = (gpu.smem_kb * 1024) // smem if smem else 10**9
    by_warps = gpu.max_warps // warps
    limits = {"registers": by_regs, "shared memory": by_smem, "warps": by_warps, "blocks": gpu.max_blocks}
    limiter = min(limits, key=limits.get)
    blocks = max(0, limits[limiter])
    return blocks * warps / gpu.max_warps, limiter


def bytes_per_elem(v: Variant) -> float:
    wire = WireLayout.of(v.numel, v.config).nbytes / v.numel
    if v.kernel == "reduce":
        return (RANKS + 1) * wire
    if v.kernel == "reduce_dense":
        return RANKS * wire + DTYPES[v.dtype].itemsize
    return wire + DTYPES[v.dtype].itemsize


def model(v: Variant, gpu: GPU, a: dict) -> dict:
    return model_of(a, v.num_warps, bytes_per_elem(v), gpu)


def model_of(a: dict, num_warps: int, bytes_per_element: float, gpu: GPU) -> dict:
    """The model's columns from an analysis `a` (counts per tile of 8192 elements)."""
    tile = 2 * 4096  # elements per loop iteration (taco_triton.kernels._tables.SB_PER_TILE super-blocks)
    instr = a["instr_per_tile"] * num_warps / tile
    flops16 = sum(f * w for (f, cls), w in a["mma"] if cls == "16") * num_warps / tile
    flops32 = sum(f * w for (f, cls), w in a["mma"] if cls == "tf32") * num_warps / tile
    n_mma = sum(w for _, w in a["mma"]) * num_warps / tile
    t_mem = bytes_per_element / gpu.copy_bw
    occ, limiter = occupancy(gpu, num_warps, a["regs"], a["smem_bytes"] + a["smem_dynamic"])
    extra = {}
    issued = instr
    if "classes" in a:  # AMD: the classes issue in parallel (amd_issue_per_elem)
        per_class = {c: n * num_warps / tile for c, n in a["classes"].items()}
        issued, extra["issue_limiter"] = amd_issue_per_elem(per_class, occ, gpu)
        extra.update({f"{c}_per_elem": round(n, 4) for c, n in per_class.items()})
    t_issue = issued / (gpu.issue * gpu.units * gpu.clock_ghz * 1e9)
    t_tc = flops16 / (gpu.tc16_tflops * 1e12) + flops32 / (gpu.tf32_tflops * 1e12)
    bound = 100.0 * t_mem / max(t_mem, t_issue, t_tc)
    instr_worst = (a["instr_per_tile"] + a["slow_instr_per_tile"]) * num_warps / tile
    # AMD has no slow-path calls (instr_worst == instr): its worst case is its issue bound
    t_worst = (issued if "classes" in a else instr_worst) / (gpu.issue * gpu.units * gpu.clock_ghz * 1e9)
    return {"instr_per_elem": round(instr, 4), "mma_per_elem": round(n_mma, 5),
            "tc_flops_per_elem": round(flops16 + flops32, 1), "occupancy": round(occ, 3), "occupancy_limiter": limiter,
            "bytes_per_elem": round(bytes_per_element, 4), "pct_copy_bw_bound": round(bound, 1),
            "bound_by": "memory" if bound >= 99.95 else ("issue" if t_issue >= t_tc else "tensor cores"),
            "slow_calls_per_tile": a["slow_calls_per_tile"], "instr_per_elem_worst": round(instr_worst, 4),
            "pct_copy_bw_bound_worst": round(100.0 * t_mem / max(t_mem, t_worst, t_tc), 1), **extra}


def evaluate(v: Variant, target: str) -> dict:
    gpu = TARGETS[target]
    row = {**v.row(), "target": target, "gpu_model": gpu.name, "ok": False, "error": ""}
    try:
        parts = []
        for launch in build_launches(v, gpu):
            k = compile_launch(launch, gpu)
            parts.append((launch.n_tiles, analyze_cuda(k, gpu) if gpu.backend == "cuda" else analyze_hip(k, gpu)))
        a = combine(parts)
    except Exception as e:  # the exact error is the result: the innermost cause says what failed
        row["error"] = _error_text(e)
        return row
    row.update(ok=True, regs=a["regs"], spill_bytes=a["spill_bytes"], smem_bytes=a["smem_bytes"] + a["smem_dynamic"],
               static_instr=a["static_instr"], launches=len(parts), **model(v, gpu, a))
    return row


def _error_text(e: BaseException) -> str:
    """The innermost cause of a failed compile, one line: what failed."""
    while e.__cause__ is not None or e.__context__ is not None:
        e = e.__cause__ or e.__context__
    msg = [m for m in str(e).strip().splitlines() if m.strip()]
    return f"{type(e).__name__}: {msg[-1] if msg else ''}"[:400]


def _evaluate_star(args):
    return evaluate(*args)


def select(vs: list[Variant], only: str | None = None, numel: int | None = None) -> list[Variant]:
    """The variants whose row matches every `field=value` of `only` (comma-separated; the value as
    the table prints it, e.g. "kernel=reduce_dense,dtype=fp32,group_size=128"), resized to `numel`."""
    import dataclasses

    if only:
        want = dict(kv.split("=", 1) for kv in only.split(","))
        unknown = set(want) - set(Variant(KERNELS[0], CompressionConfig(), "bf16", 4, 2).row())
        if unknown:
            raise ValueError(f"--only names unknown fields {sorted(unknown)}")
        vs = [v for v in vs if all(str(v.row()[k]) == val for k, val in want.items())]
    if numel is not None:
        vs = list(dict.fromkeys(dataclasses.replace(v, numel=numel) for v in vs))
    return vs


# ------------------------------------------------------------------------------ the collectives' launches
#: The collectives whose launches `--set hotpath` models, and what each runs per pipeline slice.
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")
HOT_WORLDS = (2, 4, 8, 16)
HOT_MIB = (16, 64)
#: The reduced set `tests/test_aot.py` compiles in CI (every launch kind, aligned and odd, FP8,
#: INT8, INT6 and INT4; the full sets are `--set hotpath` and `--set hotpath-subbyte`).
HOT_CI = {"worlds": (8,), "mib": (16,), "targets": ("sm_90", "sm_80")}
#: The least % of copy bandwidth every launch of the collectives is to reach by this model.
HOT_FLOORS = {"sm_90": 95.0, "sm_100": 85.0, "sm_80": 80.0, "sm_89": 80.0, "gfx942": 80.0}


@dataclass(frozen=True)
class HotVariant:
    """One collective call: `mib` MiB of bf16 message (all_reduce's tensor, reduce_scatter's input,
    all_gather's output), P = `world` ranks, the "auto" pipeline; `odd`: each rank's share one
    element short of its aligned size (not a multiple of 16)."""

    collective: str
    world: int
    mib: float
    odd: bool
    config: CompressionConfig
    dtype: str = "bf16"

    def row(self) -> dict:
        c = self.config
        return {"collective": self.collective, "world": self.world, "message_mib": self.mib, "odd": self.odd,
                "codec": c.codec, "group_size": c.group_size, "hadamard": c.hadamard, "scales": c.scales,
                "rounding": c.rounding, "dtype": self.dtype}


def hot_variants(which: str) -> list[HotVariant]:
    """The collective calls of a set: "hotpath" (every collective, P = 2, 4, 8, 16, 16 and 64 MiB,
    aligned and odd, FP8 and INT8), "subbyte" (the same calls with INT6 and INT4 at G = 32;
    "hotpath-subbyte" the same), "ci" (`HOT_CI` of both), else none."""
    default = CompressionConfig()
    worlds, mib = HOT_WORLDS, HOT_MIB
    eight = (default, default.replace(codec="int8"))
    sub = (default.replace(codec="int6", group_size=32), default.replace(codec="int4", group_size=32))
    if which == "hotpath-p2p":  # a p2p message: one slot each way, whatever the group's size
        return [HotVariant("p2p", 2, m, odd, cfg) for cfg in eight + sub for m in mib for odd in (False, True)]
    if which == "ci":
        worlds, mib = HOT_CI["worlds"], HOT_CI["mib"]
    elif which not in ("hotpath", "subbyte", "hotpath-subbyte"):
        return []
    configs = eight + sub if which == "ci" else sub if which in ("subbyte", "hotpath-subbyte") else eight
    return [HotVariant(c, w, m, odd, cfg) for cfg in configs for c in COLLECTIVES for w in worlds for m in mib
            for odd in (False, True)]


def library_call(hv: HotVariant, device: torch.device = torch.device("meta")):
    """The library's own `Call` for this call (`collectives._call.Call`: its path, its pipeline depth
    from the call's largest tensor, its signature and fingerprint), made as `taco_triton.<collective>`
    makes it on rank 0 of a group of `hv.world` ranks, with the call's tensors as a caller passes them
    (uninitialised; all_reduce's tensor, else (output, input)) and its shape (`collectives._shapes`).

    Returns:
        (call, shape, tensors).

    Raises:
        RuntimeError: a process group already exists in this process. The group here is torch's
            fake process group (sizes and ranks, no communication), made for the call and destroyed.
    """
    import contextlib
    import unittest.mock

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from taco_triton import ops
    from taco_triton.collectives import _call, _shapes

    if dist.is_initialized():
        raise RuntimeError("bench/aot.py makes its own (fake) process group to build a call; one exists already")
    dt = DTYPES[hv.dtype]
    n = int(hv.mib * (1 << 20)) // dt.itemsize
    if hv.collective == "p2p":  # the message's plan as `p2p` builds it (`p2p._MessageCall`, `_shapes.Message`)
        from taco_triton.collectives import p2p

        x = torch.empty(n - hv.odd, dtype=dt, device=device)
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=hv.world)
        try:
            return p2p._MessageCall(x, hv.config, "triton"), _shapes.MESSAGE_SHAPE, (x, x)
        finally:
            dist.destroy_process_group()
    shape = {"all_reduce": _shapes.ALL_REDUCE_SHAPE, "reduce_scatter": _shapes.REDUCE_SCATTER_SHAPE,
             "all_gather": _shapes.ALL_GATHER_SHAPE}[hv.collective]
    if hv.collective == "all_reduce":
        tensors = (torch.empty(n - hv.odd, dtype=dt, device=device),)
    else:
        m = n // hv.world - hv.odd  # one rank's shard
        big, small = torch.empty(m * hv.world, dtype=dt, device=device), torch.empty(m, dtype=dt, device=device)
        tensors = (small, big) if hv.collective == "reduce_scatter" else (big, small)
    # the tensors stand on the meta device for a GPU's: backend="triton" resolves as on a GPU (the
    # library's resolver would ask for the interpreter, which this process must not switch on)
    on_gpu = (unittest.mock.patch.object(ops, "resolve_backend", lambda backend, dev: "triton")
              if device.type != "cuda" else contextlib.nullcontext())
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=hv.world)
    try:
        shape.check(tensors, None)
        with on_gpu:
            call = _call.Call(hv.collective, tensors, None, hv.config, "sum", None, "auto", "triton", None)
    finally:
        dist.destroy_process_group()
    if not call.compress:
        raise ValueError(f"{hv}: the library sends this call uncompressed")
    return call, shape, tensors


def hot_plan(hv: HotVariant, device: torch.device = torch.device("meta")):
    """The plan the library builds for this call on rank 0 (`collectives._plan.Plan`, from the
    library's `Call`: `library_call`; on the meta device by default: shapes and descriptor rows, no
    memory) and the call's flat input and output (uninitialised)."""
    from taco_triton.collectives import _plan

    call, shape, tensors = library_call(hv, device)
    src, dst, _ = shape.flats(tensors)
    chunks, chunk_numel = shape.chunks(src, dst, call.p)
    return _plan.Plan(call, shape, chunks, device, chunk_numel), src, dst


HOT_KERNELS = ("compress_slots", "reduce_tagged", "decompress_slots")


def hot_launches(hv: HotVariant, gpu: GPU) -> list[dict]:
    """Every launch of the call, per slice, as the plan builds it (`Plan.slice_launches`), with
    the launch parameters the library picks on `gpu`'s backend: dicts of kernel ("compress_slots",
    "reduce_tagged", "reduce_tagged_dense", "decompress_slots"), slice, launch, and what the model
    amortizes over (slots, tiles, elements, bytes moved; `slow_tiles`: the tiles a launch runs
    element-wise where it has two paths, `slots.slow_tiles` or a dense reduce's last, else None)."""
    from taco_triton.collectives._plan import Buffers
    from taco_triton.kernels import slots
    from taco_triton.kernels._launch import Target, launch_params

    plan, src, dst = hot_plan(hv)
    target = Target(gpu.backend, gpu.arch, gpu.warp)
    err = torch.empty(slots.ERR_FIELDS, dtype=torch.int64, device=plan.device)
    rows = plan.table_rows()
    tables = torch.tensor(rows, dtype=torch.int64).to(plan.device)
    item = DTYPES[hv.dtype].itemsize

    def params(kernel, dtype, numel):  # the library's choice without a tuned file, on gpu's backend
        return launch_params(kernel, plan.device, dtype, plan.config, numel, gpu.backend)

    out = []
    for k, sl in enumerate(plan.slices):
        b = Buffers(plan, k)
        built = plan.slice_launches(k, src, dst, b, tables[k], err, target, params)
        send, gathered = plan.sends[k], plan.gathers[k]
        n_send = sum(lay.numel for lay in send.layouts)
        out.append({"kernel": "compress_slots", "slice": k, "launch": built[0], "slots": len(send.pieces),
                    "elements": n_send, "bytes": n_send * item + b.send.numel()})
        if built[1] is not None:
            lay, dense = sl.lays[plan.rank], plan.shape.dense_reduce
            wrote = lay.numel * item if dense else sl.slot
            out.append({"kernel": "reduce_tagged_dense" if dense else "reduce_tagged", "slice": k, "launch": built[1],
                        "slots": plan.p, "elements": lay.numel, "bytes": plan.p * sl.strides[plan.rank] + wrote})
        if built[2] is not None:
            n_recv = sum(lay.numel for lay in gathered.layouts)
            out.append({"kernel": "decompress_slots", "slice": k, "launch": built[2], "slots": len(gathered.pieces),
                        "elements": n_recv, "bytes": b.gathered.numel() + n_recv * item})
    for x in out:
        x["tiles"] = x["launch"].n_tiles
        side = {"compress_slots": 0, "decompress_slots": 1}.get(x["kernel"])
        if side is not None:
            x["slow_tiles"] = (slots.slow_tiles(rows[x["slice"]][side]) if x["launch"].meta.get("TWO_PATHS")
                               else None)
        else:  # a dense reduce of an odd size: its last tile stores element by element
            x["slow_tiles"] = 1 if x["launch"].meta.get("SPLIT") else None
    return out


def compile_key(launch, gpu: GPU) -> tuple:
    """What Triton compiles for this launch on `gpu` (its specialization): equal keys, one binary."""
    from triton.compiler import make_backend
    from triton.backends.compiler import GPUTarget
    from triton.runtime.jit import create_function_from_signature

    gt = GPUTarget(gpu.backend, gpu.arch, gpu.warp)
    backend = make_backend(gt)
    fn = launch.fn
    kw = dict(launch.meta)
    bound, spec, opts = create_function_from_signature(fn.signature, fn.params, backend)(**launch.args, **kw)
    options, signature, constexprs, attrs = fn._pack_args(backend, kw, bound, spec, opts)
    return (fn.__name__, gpu.backend, str(gpu.arch), repr(sorted(signature.items())), repr(sorted(constexprs.items())),
            repr(sorted(attrs.items())), repr(sorted(options.__dict__.items())))


def _global_access(text: str) -> bool:
    """Whether an instruction (SASS or AMDGCN) loads or stores global memory."""
    op = text.split()[1 if text.startswith("@") else 0] if text.split() else ""
    return op.startswith(("LDG", "STG", "global_load", "global_store", "buffer_load", "buffer_store"))


def tile_arms(a: dict, body: frozenset, header: int) -> tuple[set, set] | None:
    """(fast path, element-wise path with masks) of the tile loop whose `body` and `header` are given, in a
    slotted kernel compiled for any alignment (each tile runs one of two paths, `slots.fast_tiles`):
    the two largest pieces of code of the loop that do not run in every iteration, each the code a
    branch's side dominates (the two sides of one branch on NVIDIA; AMD's structurizer makes them
    two one-sided branches in turn), leaving out any that holds an inner loop (the fused reduce's
    loop over ranks, which AMD guards by a branch). The element-wise path with masks is the one with
    more global loads and stores (`slots.VECTOR_PATH`: a 16-byte vector access is one instruction
    where eight 2-byte ones are eight), or with as many, the one with more instructions
    (`slots.WHOLE_PATH`: the same element-wise accesses, without the masks' tests). None when the
    loop has no two such pieces or they differ in neither."""
    cfg, instrs = a["cfg"], a["instrs"]
    idom, succ = cfg.get("idom"), cfg.get("succ")
    if idom is None:
        return None
    latches = [i for i in body if header in succ[i]]

    def dominates(x, v):
        while v != x and v != 0:
            v = idom[v]
        return v == x

    always = {i for i in body if all(dominates(i, q) for q in latches)}
    nested = {i for h, b in cfg["loops"] if h != header and set(b) < body for i in b}
    sides = {q for b in always for q in succ[b] if q in body and q not in always and idom.get(q) == b}
    pieces = [p for p in ({i for i in body - always if dominates(q, i)} for q in sides) if not p & nested]
    pieces = sorted(pieces, key=len, reverse=True)[:2]
    if len(pieces) < 2:
        return None
    def cost(p):
        return sum(_global_access(instrs[i][1]) for i in p), len(p)

    fast, slow = sorted(pieces, key=cost)
    return None if cost(fast) == cost(slow) else (fast, slow)


def loop_nest(a: dict, kernel: str) -> dict | None:
    """The loops of a compiled launch's control-flow graph (`_cfg_loops`) nested by their bodies, and
    which of them the model takes for the launch's main nest (`launch_weights`): {"bodies": header ->
    body, "parents": header -> the loop around it or None, "tile": the tile loop, "slot": a loop over
    slots around it or None, "rank": the reduce's loop over ranks inside it or None}; None when the
    code has no loop."""
    bodies = {h: frozenset(b) for h, b in a["cfg"]["loops"]}
    if not bodies:
        return None

    def parent(h):
        outer = [g for g in bodies if g != h and bodies[h] < bodies[g]]
        return min(outer, key=lambda g: len(bodies[g])) if outer else None

    parents = {h: parent(h) for h in bodies}
    children = {h: [c for c in bodies if parents[c] == h] for h in bodies}
    size = {h: len(b) for h, b in bodies.items()}
    top = max((h for h in bodies if parents[h] is None), key=size.get)
    out = {"bodies": bodies, "parents": parents, "tile": top, "slot": None, "rank": None}
    if kernel.startswith("reduce"):
        if children[top]:
            out["rank"] = max(children[top], key=size.get)
    else:
        inner = max(children[top], key=size.get, default=None)
        if inner is not None and size[inner] * 2 >= size[top]:
            out["slot"], out["tile"] = top, inner
    return out


def launch_weights(a: dict, kernel: str, programs: int, tiles: int, slots: int, ranks: int,
                   slow_tiles: int | None = None, pad_chunks: int | None = None) -> list[tuple[int, float]]:
    """(instruction index, times it runs in the whole launch) for a compiled launch: the model of
    one launch of a collective, its per-program and per-slot work counted, not only its tile loop.

    Loops are the natural loops of the control-flow graph (`_cfg_loops`), nested by their bodies.
    The main nest is the largest outermost loop: in the fused reduce the tile loop with the rank
    loop (its largest inner loop) inside; in a slotted kernel either a loop over slots with the
    tile loop inside (when an inner loop holds most of it) or the tile loop itself. Its loops run:
    slots, `programs * slots` times (every program walks every slot); tiles, `tiles` times in all;
    ranks, `tiles * (ranks - 1)` times (the first rank's term is computed before the loop, in the
    tile loop's body: `reduce._rank_term`). Any other loop runs, in the reduce (checking the ranks' tags in
    every program; the output's padding, an upper bound), `ranks` times per run of what encloses
    it; in a slotted kernel (a slot's tag and padding, one program per slot) `slots` times in all.
    Code outside loops runs once per program; code no path from the entry reaches (slow-path subroutines: their
    calls are counted apart) never. With `slow_tiles` (a slotted kernel compiled for any alignment,
    `slots.slow_tiles` of its descriptor rows; a dense reduce of an odd size, its last tile), the
    tile loop's two paths (`tile_arms`) run `tiles - slow_tiles` and `slow_tiles` times. Other code on a skipped branch counts, as in the
    plain model. With `pad_chunks` (the fused reduce: the chunks of 1 KiB its output slot's padding
    loop writes, `reduce_pad_chunks`), the code of program 0 alone (`_program0_code`: the output's tag
    and padding, the error record) runs once, its padding loop `pad_chunks` times."""
    cfg = a["cfg"]
    n = len(a["instrs"])
    reached = set(cfg["reached"])
    nest = loop_nest(a, kernel)
    if nest is None:
        return [(i, float(programs if i in reached else 0)) for i in range(n)]
    bodies, parents, tile_loop = nest["bodies"], nest["parents"], nest["tile"]
    size = {h: len(b) for h, b in bodies.items()}
    runs = {tile_loop: tiles}
    if nest["slot"] is not None:
        runs[nest["slot"]] = programs * slots
    if nest["rank"] is not None:
        runs[nest["rank"]] = tiles * (ranks - 1)

    def times(h):
        if h not in runs:
            if not kernel.startswith("reduce"):
                runs[h] = slots  # a slot's tag and padding: one program per slot
            else:  # the tag check over ranks, in every program (padding: an upper bound)
                runs[h] = (programs if parents[h] is None else times(parents[h])) * ranks
        return runs[h]

    innermost = [None] * n
    for h in sorted(bodies, key=size.get, reverse=True):  # inner loops overwrite outer ones
        for i in bodies[h]:
            innermost[i] = h
    out = [(i, 0.0 if i not in reached else float(programs if h is None else times(h))) for i, h in enumerate(innermost)]
    if pad_chunks is not None and kernel.startswith("reduce"):
        once = set(a.get("program0", ()))
        main = {tile_loop, nest["rank"]}  # never the tile nest's code, whatever its lines say
        out = [(i, w if i not in once or w == 0 or innermost[i] in main
                else float(pad_chunks if innermost[i] is not None else 1)) for i, w in out]
    arms = tile_arms(a, bodies[tile_loop], tile_loop) if slow_tiles is not None and tile_loop is not None else None
    if arms is not None:
        fast, slow = arms
        out = [(i, float(tiles - slow_tiles) if i in fast else float(slow_tiles) if i in slow else w)
               for i, w in out]
    return out


def reduce_pad_chunks(launch) -> int:
    """The iterations of the fused reduce's padding loop (`_slot_io.write_tag`: 1 KiB a chunk past the
    tag's 32 bytes, up to the slot's end) in this launch: 0 where the slot's padding fits in those
    32 bytes (every stride the plans make at these sizes), 0 for the dense output (no tag)."""
    args = launch.args
    if launch.meta.get("DENSE") or not launch.meta.get("TAGGED"):
        return 0
    return max(0, -(-(args["tag_end"] - args["tag_pos"] - 32) // 1024))


def weigh(a: dict, weights: list[tuple[int, float]], per: float) -> dict:
    """`a` with its counts per tile recomputed from instruction weights of a whole launch, `per`
    tiles' worth of elements (`TILE`) in it: instructions, matrix work, AMD classes, slow calls."""
    out = dict(a)
    instrs = a["instrs"]
    out["instr_per_tile"] = sum(w for _, w in weights) / per
    mma = [(_mma_flops(instrs[i][1], "cuda" if "classes" not in a else "hip"), w / per) for i, w in weights]
    out["mma"] = [(f, w) for f, w in mma if f is not None]
    if "classes" in a:
        classes = dict.fromkeys(AMD_CLASSES, 0.0)
        for i, w in weights:
            classes[amd_class(instrs[i][1])] += w / per
        out["classes"] = classes
    else:
        slow = _slow_calls(instrs, [(i, w / per) for i, w in weights])
        out.update(slow)
    return out


#: The model's second reading of each launch (`model_misreads`): the bytes the global loads and
#: stores inside the tile loop it counts move (each access's width x lanes x warps, times the runs
#: the model gives it) over the bytes the launch must move, within these bounds. A loop taken for
#: the wrong one (the loop over ranks, a tag's padding), or a tile loop cut short, moves a fraction
#: (sm_80's tagged reduce read with every CALL returning: 0.39x). Above 1: the lanes a partial tile
#: masks off and the scales several lanes load from one address, counted once per lane (FP8/INT8
#: 1.02-1.17x on NVIDIA; INT4's tagged reduce of pieces that are no whole tiles, whose scales load
#: in narrower pieces, up to 1.23x).
LOOP_BYTES = (1.0, 1.25)


def loop_bytes(a: dict, weights: list[tuple[int, float]], kernel: str, num_warps: int, lanes: int) -> float:
    """The bytes the global loads and stores of the launch's tile loop (`loop_nest`, its inner
    loops included) move over the whole launch, by `weights` (`launch_weights`); descriptor reads
    (`_desc_loads`) left out."""
    nest = loop_nest(a, kernel)
    if nest is None:
        return 0.0
    body, instrs = nest["bodies"][nest["tile"]] - set(a.get("desc_loads", {}).get("all", ())), a["instrs"]
    return sum(w * access_bytes(instrs[i][1], lanes) for i, w in weights if i in body) * num_warps


def desc_in_tile_loop(a: dict, kernel: str) -> bool | None:
    """Whether the tile loop the model takes (`loop_nest`) holds the descriptor loads every tile
    makes (`_desc_loads`: its slot lookup); None for a launch without them (the reduce)."""
    loads = set(a.get("desc_loads", {}).get("tile", ()))
    if kernel.startswith("reduce") or not loads:
        return None
    nest = loop_nest(a, kernel)
    return nest is not None and loads <= nest["bodies"][nest["tile"]]


_STEP_KERNEL = {"compress": "compress_slots", "decompress": "decompress_slots"}


def check_launches(hv: HotVariant, launches: list[dict]) -> list[str]:
    """What differs between the launches the model counts for a call (`hot_launches`) and those the
    library makes for it: the library's `Call` (`library_call`) cut into its slices
    (`collectives._plan.pieces`), each running its shape's stages in order (compress, the reduce or
    dense reduce, decompress), the slices' compress covering the call's input, a decompress its
    output, the reduce this rank's chunk. Returns the differences ([] when none)."""
    from taco_triton.collectives import _plan

    call, shape, tensors = library_call(hv)
    src, dst, _ = shape.flats(tensors)
    chunks, _ = shape.chunks(src, dst, call.p)
    n_slices = len(_plan.pieces(chunks, call.depth))
    reduce = "reduce_tagged_dense" if shape.dense_reduce else "reduce_tagged"
    kinds = [_STEP_KERNEL.get(st.op, reduce) for st in shape.stages]
    want = [(k, kind) for k in range(n_slices) for kind in kinds]
    got = [(x["slice"], x["kernel"]) for x in launches]
    problems = []
    if got != want:
        problems.append(f"the model counts {len(got)} launches {got[:6]}, the library makes {len(want)} {want[:6]} "
                        f"({n_slices} slices of depth {call.depth})")
    a, b = chunks[call.rank]
    for kind, n in (("compress_slots", src.numel()), (reduce, b - a), ("decompress_slots", dst.numel())):
        have = sum(x["elements"] for x in launches if x["kernel"] == kind)
        if kind in kinds and have != n:
            problems.append(f"{kind}: the launches cover {have} elements, the call {n}")
    return problems


def model_misreads(row: dict) -> list[str]:
    """The model's cross-checks that a collective's row fails (`hot_rows`' columns): its tile loop's
    loads and stores move `LOOP_BYTES` of what the launch must move (loop_bytes_ratio), its tile loop
    holds the descriptor loads (desc_in_tile_loop), its launches are the library's (launch_check)."""
    out = []
    ratio = row.get("loop_bytes_ratio")
    # NVIDIA only: AMD's waves load a group's scale in all 64 lanes from one address, which a width x
    # lanes reading counts 64 times (gfx942: 1.1-1.3x)
    nvidia = row.get("target") in TARGETS and TARGETS[row["target"]].backend == "cuda"
    if nvidia and ratio is not None and ratio == ratio and not LOOP_BYTES[0] <= ratio <= LOOP_BYTES[1]:
        out.append(f"the tile loop's loads and stores move {ratio}x the bytes the launch must move "
                   f"(not {LOOP_BYTES[0]}-{LOOP_BYTES[1]}x): the loop is misread")
    if _field(row, "desc_in_tile_loop") == "False":
        out.append("the tile loop does not hold the slot lookup's descriptor loads: the loop is misread")
    if _field(row, "launch_check"):
        out.append(f"launches: {row['launch_check']}")
    return out


TILE = 2 * 4096  # elements per tile (taco_triton.kernels._tables.SB_PER_TILE super-blocks)


def programs_of(gpu: GPU, launch, a: dict) -> int:
    """The grid the library launches (`Launch.grid`): as many programs as stay resident, at most one per tile."""
    occ, _ = occupancy(gpu, launch.meta["num_warps"], a["regs"], a["smem_bytes"] + a["smem_dynamic"])
    per_sm = max(1, round(occ * gpu.max_warps / launch.meta["num_warps"]))
    return max(1, min(launch.n_tiles, per_sm * gpu.units))


def hot_rows(hv: HotVariant, target: str, analyses: dict) -> list[dict]:
    """One row per launch kind of the call (its slices' launches summed): the model over the
    whole launch. `analyses`: compile_key -> analysis (or an error string)."""
    gpu = TARGETS[target]
    rows = {}
    launches = hot_launches(hv, gpu)
    launch_check = "; ".join(check_launches(hv, launches))
    for x in launches:
        launch, kernel = x["launch"], x["kernel"]
        r = rows.setdefault(kernel, {"parts": [], "error": ""})
        a = analyses[compile_key(launch, gpu)]
        if isinstance(a, str):
            r["error"] = a
            continue
        progs = programs_of(gpu, launch, a)
        w = launch_weights(a, kernel, progs, x["tiles"], x["slots"], hv.world, x["slow_tiles"],
                           reduce_pad_chunks(launch) if kernel.startswith("reduce") else None)
        r["parts"].append((x, a, w, progs))
    out = []
    for kernel, r in rows.items():
        p0 = r["parts"][0][0]["launch"].meta if r["parts"] else {}
        row = {**hv.row(), "kernel": kernel, "target": target, "gpu_model": gpu.name,
               "num_warps": p0.get("num_warps"), "num_stages": p0.get("num_stages"), "ok": not r["error"],
               "error": r["error"]}
        if r["error"]:
            out.append(row)
            continue
        elements = sum(x["elements"] for x, *_ in r["parts"])
        nbytes = sum(x["bytes"] for x, *_ in r["parts"])
        moved = sum(loop_bytes(a, ws, kernel, x["launch"].meta["num_warps"], gpu.warp) for x, a, ws, _ in r["parts"])
        desc = [desc_in_tile_loop(a, kernel) for _, a, *_ in r["parts"]]
        per = max(elements, 1) / TILE
        # the slices' launches in turn: their weights add; registers etc. are the first launch's
        a0 = r["parts"][0][1]
        merged = [(i, w) for _, a, ws, _ in r["parts"] for i, w in ws] if all(a is a0 for _, a, *_ in r["parts"]) else None
        if merged is not None:
            a = weigh(a0, merged, per)
        else:  # different binaries per slice: their counts per tile add, each over the whole
            parts = [weigh(a, ws, per) for _, a, ws, _ in r["parts"]]
            a = dict(parts[0])
            a["instr_per_tile"] = sum(q["instr_per_tile"] for q in parts)
            a["slow_instr_per_tile"] = sum(q["slow_instr_per_tile"] for q in parts)
            a["slow_calls_per_tile"] = sum(q["slow_calls_per_tile"] for q in parts)
            a["mma"] = [m for q in parts for m in q["mma"]]
            if "classes" in a:
                a["classes"] = {c: sum(q["classes"][c] for q in parts) for c in a["classes"]}
            a["spill_bytes"] = max(q["spill_bytes"] for q in parts)
        row.update(ok=True, regs=a["regs"], spill_bytes=a["spill_bytes"], smem_bytes=a["smem_bytes"] + a["smem_dynamic"],
                   static_instr=a["static_instr"], launches=len(r["parts"]), numel=elements,
                   slots=sum(x["slots"] for x, *_ in r["parts"]), tiles=sum(x["tiles"] for x, *_ in r["parts"]),
                   slow_tiles=sum(x["slow_tiles"] or 0 for x, *_ in r["parts"]),
                   programs=max(q for *_, q in r["parts"]),
                   **model_of(a, p0["num_warps"], nbytes / max(elements, 1), gpu),
                   loop_bytes_ratio=round(moved / max(nbytes, 1), 3),
                   desc_in_tile_loop=None if desc[0] is None else all(desc), launch_check=launch_check)
        out.append(row)
    return out


def _compile_analyze(args) -> tuple:
    """(key, analysis or error string) of one launch of a call, compiled in a worker."""
    hv, target, index = args
    gpu = TARGETS[target]
    launch = hot_launches(hv, gpu)[index]["launch"]
    key = compile_key(launch, gpu)
    try:
        k = compile_launch(launch, gpu)
        return key, analyze_cuda(k, gpu) if gpu.backend == "cuda" else analyze_hip(k, gpu)
    except Exception as e:
        return key, _error_text(e)


def run_hot(hvs: list[HotVariant], targets: list[str], jobs: int) -> list[dict]:
    """The rows of `hvs` on `targets`: each distinct binary compiled once (`compile_key`)."""
    todo, seen = [], set()
    for t in targets:
        for hv in hvs:
            for i, x in enumerate(hot_launches(hv, TARGETS[t])):
                key = compile_key(x["launch"], TARGETS[t])
                if key not in seen:
                    seen.add(key)
                    todo.append((hv, t, i))
    if jobs <= 1:
        analyses = dict(map(_compile_analyze, todo))
    else:
        with concurrent.futures.ProcessPoolExecutor(jobs) as ex:
            analyses = dict(ex.map(_compile_analyze, todo))
    return [r for t in targets for hv in hvs for r in hot_rows(hv, t, analyses)]


# ------------------------------------------------------------------------------ floors
#: The least % of copy bandwidth (pct_copy_bw_bound) every launch of `--quick` and `--set subbyte`
#: is to reach by this model, per target.
FLOORS = {"sm_90": 85.0, "sm_100": 85.0, "sm_80": 70.0, "sm_89": 70.0, "gfx942": 70.0}

#: The launches known to stay below their floor (or to spill registers), and why: (fields the row
#: must match, as `--only` writes them; the reason). README's table of exceptions is these entries
#: with their figures (`--floors`). `check_floors` fails a launch below its floor that no entry
#: names, a spilling one that no entry names with a reason that speaks of the spill, and an
#: excepted one that got slower than the committed table says.
EXCEPTIONS: tuple[tuple[dict, str], ...] = (
    ({"target": "sm_90", "kernel": "compress", "codec": "int4", "group_size": 256, "hadamard": True,
      "rounding": "stochastic"},
     "spills 16 B at 255 registers: the random stream and the integer encoder on top of the two-dot transform, "
     "at 4 warps. 8 warps spill nothing (168 registers) but take more instructions on sm_80, sm_90 and sm_100 "
     "(sm_90: 1.634 -> 1.668 warp-instructions per element; sm_80 53.6 -> 50.8%, sm_100 26.4 -> 24.0%), so the "
     "warp count (`SUBBYTE_WARPS`) stays 4; below its floor as every stochastic launch, next entry"),
    ({"rounding": "stochastic"},
     "32 counter-based random bits per element (a MurmurHash3 finaliser: 8 integer instructions) and the exact "
     "integer-bit encoder (about 20) where round-to-nearest takes one conversion: 2.5-4x the instructions"),
    ({"kernel": "compress", "group_size": 256, "hadamard": True},
     "the 256-point transform in two dots: the first dot's FP32 sums are split into three bf16 pieces for an "
     "exact second dot and moved between the two dots' register layouts (warp shuffles, byte permutes)"),
    ({"kernel": "compress", "group_size": 512, "hadamard": True}, "as G=256: the two-dot transform"),
    ({"target": "sm_89", "kernel": "reduce_dense", "group_size": 256, "hadamard": True, "codec": "fp8_e4m3"},
     "spills 8 B at 168 registers: the first rank's term before the loop over ranks is a second copy of the decode "
     "in the tile loop, beside the two-dot inverse transform (before that term: 174 registers, no spill); at 100% "
     "of copy bandwidth"),
    ({"kernel": "reduce_dense", "group_size": 256, "hadamard": True},
     "as compress G=256, on FP32 sums of the ranks (three bf16 pieces in both dots)"),
    ({"kernel": "reduce_dense", "group_size": 512, "hadamard": True}, "as G=256"),
    ({"kernel": "reduce", "codec": "int6"},
     "every rank's packed codes decoded, multiplied and added (4 instructions per code and rank: read into FP32 by "
     "a LOP3 and an FADD on NVIDIA, `_field_f32`) and the sum's codes packed again, against a wire of 0.75 B per "
     "element"),
    ({"kernel": "reduce", "codec": "int4"}, "as INT6, against a wire of 0.5 B per element"),
    ({"target": "sm_100", "kernel": "compress"},
     "a group's scale work (correctly rounded divisions, the E4M4 code) repeated in every thread that "
     "holds part of the row (8 rows per thread: a third of the loop at G=32), against B200's 8 TB/s"),
    ({"target": "sm_100", "kernel": "reduce"},
     "about 1,190 warp-instructions per tile at P = 2 against B200's 8 TB/s: two ranks' codes decoded, multiplied "
     "and added (266 each: FP8 through the hardware conversion to half pairs, INT8 through the quarter-rate integer "
     "conversion) and the requantization (about 660: two multiplies per element, the 2^64 factor of tiny groups "
     "applied to every element so that no branch is needed, then the reciprocal; the select that zeroes "
     "non-finite groups; the encoder). The table before put these at 97.5-100%: its loop reading did not know "
     "sm_100's uniform branch (BRA.U) and counted one rank of two"),
    ({"target": "sm_100", "kernel": "reduce_dense"},
     "as sm_100's reduce, with the inverse transform of the FP32 sums (three bf16 passes) in place of the "
     "requantization; the odd size's two store paths, each converting the tile to its own store layout, add more "
     "(FP8: 0.805 warp-instructions per element against 0.695 aligned). The table before counted one rank of two"),
    ({"target": "sm_100", "kernel": "decompress", "group_size": 256, "hadamard": True},
     "the 256-point inverse transform in two dots, as the compress's, against B200's 8 TB/s. The table before "
     "(85-100%) left the codes' load and decode out of the tile loop: its reading took a later branch target for "
     "the loop's start (INT4: 290 of 1,216 warp-instructions per tile)"),
    ({"target": "sm_100", "kernel": "decompress", "group_size": 512, "hadamard": True}, "as G = 256"),
    ({"target": "sm_80", "kernel": "reduce_dense", "codec": "int6", "group_size": 64, "hadamard": False},
     "spills 8 B: the first rank's term before the loop over ranks is a second copy of the INT6 decode in the "
     "tile loop, where ptxas holds the kernel at 128 registers"),
    ({"target": "sm_120", "kernel": "reduce", "codec": "fp8_e4m3"},
     "spills 40 B: the first rank's term before the loop over ranks is a second copy of the E4M3 decode in the "
     "tile loop, where ptxas holds the kernel at 128 registers (INT8, which spilled 8 B before, no longer does)"),
    ({"target": "sm_80", "kernel": "reduce", "scales": "taco_fp32x2"},
     "spills 16 B: TACO's layout divides each group's scale by its pre-scale in every rank's term (a correctly "
     "rounded division, `load_scales`), and with the first rank's term before the loop over ranks the tile loop "
     "holds two copies of it, where ptxas holds the kernel at 168 registers"),
    ({"target": "sm_80", "kernel": "compress", "scales": "taco_fp32x2"},
     "tensor-core bound: TACO's pre-scaled input is FP32, and an exact transform of it is three bf16 passes "
     "(768 flops per element; A100's 312 TFLOPS cap it at 68%)"),
    ({"target": "sm_80", "kernel": "reduce_dense", "codec": "int4", "group_size": 128},
     "INT4 codes decoded in the layout of the register-operand MMA, where each warp holds all rows"),
    ({"kernel": "compress", "dtype": "fp32", "target": "sm_80"},
     "spills: FP32 input on mma.sync targets, where every warp holds the whole A operand in three bf16 pieces; "
     "the dot by 32-column chunks leaves 48-88 B (one dot: 1240 B)"),
    ({"kernel": "compress", "dtype": "fp32", "target": "sm_89"}, "spills: as sm_80 FP32 input"),
    # the collectives' launches (`--set hotpath`, floors `HOT_FLOORS`)
    # INT6 and INT4 (`--set hotpath-subbyte`): the sub-byte entries first, as they name every target
    ({"kernel": "reduce_tagged", "codec": "int4", "target": "sm_80", "world": 2},
     "at P = 2 the sum's requantization dominates: of 1,227 warp-instructions per tile (80% allows 1,193), the loop "
     "over ranks runs once (341), the first rank's decode about 200, the scales about 310 (each row's absmax, 62 FMNMX "
     "for a thread's two rows, the super-block's across threads, the correctly rounded divisions, the E4M4 codes) and "
     "the codes about 275 (the multiply by the 2^64 factor of tiny groups and by the reciprocal, the magic-number "
     "rounding and a funnel shift into the word per code). What it would take: 34 fewer per tile, e.g. the 2^64 "
     "multiply (64) behind a tile-wide test that no group is below 2^-126, a branch the model would have to know "
     "is not taken"),
    ({"kernel": "reduce_tagged", "codec": "int4"},
     "every rank's packed codes decoded in the loop over ranks, 4 instructions per code: a LOP3 and an FADD read it "
     "into FP32 (`_field_f32`), then the multiply by its row's factor and the add (sm_90: 256 of 338 warp-instructions "
     "per rank and tile; the group factors' decode, the loads and pointers 82) against 0.53 wire bytes per element and "
     "rank, for which 95% of H200's copy bandwidth allows about 229 per rank and tile at P = 16 (the sum's "
     "requantization takes the rest). What it would take: about 2.3 instructions per code with the 82 around them. The "
     "multiply and the add round apart, as the reference's sum does; one rounding per rank (a fused multiply-add: a "
     "change to the format's sum, whose CPU reference would need an exact FMA) gives 3 per code, 274 per rank and "
     "tile, still above (sm_100's paired FP32 instructions, FMUL2 and FADD2, already make it 2.5 there)"),
    ({"kernel": "reduce_tagged", "codec": "int6"},
     "as INT4: 4 instructions per code (read into FP32, multiply, add) and the 12 word loads of a thread's rows, each "
     "row its own 64-bit address (sm_90: 357 warp-instructions per rank and tile) against 0.78 wire bytes per element "
     "and rank (P = 16 allows about 348 at 95%: 93.1%)"),
    ({"kernel": "reduce_tagged_dense", "codec": "int4"},
     "as the INT4 tagged reduce, plus the inverse transform of the FP32 sums"),
    ({"kernel": "reduce_tagged_dense", "codec": "int6", "target": "sm_100"},
     "as the INT6 tagged reduce, plus the inverse transform of the FP32 sums, against B200's 8 TB/s"),
    ({"kernel": "decompress_slots", "codec": "int6", "target": "sm_100"},
     "one tile per program (1,024 tiles for 512 programs a slice at 16 MiB), so each program's set-up weighs a "
     "tile's work: 165 of 665 warp-instructions per tile, 79 of them allocating and releasing the tensor memory "
     "of tcgen05's MMA, against B200's 8 TB/s; odd sizes also as the entry for sm_100's odd decompress"),
    ({"kernel": "compress_slots", "odd": True, "collective": "all_reduce", "target": "sm_100", "codec": "int4"},
     "93-95% of the aligned size: the last piece's two load paths per tile (the vector one unpacks its loads into "
     "the element-wise one's form, whose offsets and masks every tile computes) make the tile loop 799 "
     "warp-instructions against 673 (P = 8, 16 MiB), against B200's 8 TB/s"),
    ({"kernel": "reduce_tagged_dense", "target": "sm_89", "codec": "int6", "odd": True},
     "spills 8 B at P = 4 and 8 of the odd 64 MiB call, whose whole-tile slices are a specialization of their own: "
     "ptxas holds this kernel at 168 registers on sm_89 in every call, and the first rank's term before the loop "
     "over ranks (`reduce._rank_term`, 0.90x the instructions) is one more copy of the decode in the tile loop. "
     "What it would take: a register budget per launch (Triton's maxnreg), which the launches do not pass"),
    # FP8 and INT8
    ({"kernel": "reduce_tagged", "target": "sm_100"},
     "P = 2..8: one tile per program and slice (a rank's piece of a 16 MiB slice is 256 tiles at P = 2), so each "
     "program's fixed work (set-up, 64-bit row pointers, each rank's tag) is paid per tile, against B200's 8 TB/s "
     "(P = 2, 16 MiB; the per-row work once per row would give FP8 0.616 warp-instructions per element, 79%, INT8 "
     "0.649, 75%, but sm_100's reduce keeps the tile's layout: the gather makes the plain FP8 reduce spill 8 B)"),
    ({"kernel": "reduce_tagged_dense", "target": "sm_100"},
     "as the tagged reduce on sm_100, plus the inverse transform of the FP32 sums (three bf16 passes)"),
    ({"kernel": "reduce_tagged", "target": "gfx942"},
     "as sm_100's per-program work at small P; every rank's FP8 codes decoded through the FNUZ conversions (the plain "
     "fused reduce is at 81% on gfx942 too); INT8 is at 75-100%"),
    ({"kernel": "reduce_tagged_dense", "target": "gfx942"}, "as the tagged reduce on gfx942, with the FP32 inverse "
     "transform"),
    ({"kernel": "compress_slots", "odd": True, "collective": "reduce_scatter"},
     "an odd shard size m: rank r's piece of the input starts at element r * m, so P - 1 of the P pieces start "
     "off a multiple of 16 elements and their tiles load element by element, the whole ones without masks "
     "(`slots.WHOLE_PATH`): a 2-byte load and its address per element where a 16-byte vector takes 8 elements. "
     "Below 95% of the aligned figure: at 64 MiB only (sm_100 FP8 and INT8, gfx942 INT6 and INT4), seven "
     "pipeline slices of about one tile per program, each program's set-up paid per tile (sm_100 FP8 at P = 8: "
     "0.536 warp-instructions per element against 0.417 aligned, 0.480 at 16 MiB; gfx942 INT4 0.596 against "
     "0.496). The caller's tensor fixes these addresses, no wire format moves them"),
    ({"kernel": "decompress_slots", "odd": True, "collective": "all_gather"},
     "as reduce_scatter's compress, for the output: rank r's piece of the gathered tensor starts at r * m; "
     "below 95% of the aligned figure on gfx942 at 64 MiB (INT6 and INT4, 94-95% of it), whose decompress "
     "keeps 2-D offsets for its whole tiles (`slots.kernel_paths`: one run per tile took 7-13% more instructions "
     "there)"),
    ({"kernel": "compress_slots", "odd": True, "collective": "all_gather"},
     "one piece, aligned, an odd size: the whole tiles load 16-byte vectors, but the loaded tile is one value "
     "after the two load paths, so the vector path unpacks its loads into the element-wise path's form (sm_80: "
     "50 byte permutes in a 1,926-instruction tile) and gfx942 holds 164 VGPRs against 130 (fewer waves)"),
    ({"kernel": "decompress_slots", "odd": True, "collective": "all_reduce", "target": "sm_100"},
     "the two store paths each convert the tile to their own store layout and the element-wise path's "
     "offsets and masks are computed in every tile: INT8 1,060 against 831 instructions per tile"),
    ({"kernel": "decompress_slots", "target": "gfx942", "collective": "all_reduce"},
     "the all_reduce's overflow test (a magnitude test and a select per element, VALU) on top of the decode; "
     "all_gather's decompress, which has none, is at 80-81% with FP8 and 98-100% with INT8"),
)


def _field(row: dict, k: str) -> str:
    """A row's field as the table prints it; a field the row does not have (a plain launch's
    collective, read back from CSV as NaN) is ""."""
    v = row.get(k)
    return "" if v is None or (isinstance(v, float) and v != v) else str(v)


def _matches(row: dict, fields: dict) -> bool:
    return all(_field(row, k) == str(v) for k, v in fields.items())


_KEY = ("kernel", "target", "codec", "group_size", "hadamard", "scales", "rounding", "dtype", "num_warps", "num_stages",
        "numel", "collective", "world", "message_mib", "odd")


def _key(row: dict) -> tuple:
    return tuple(_field(row, k) for k in _KEY)


def _floor(row: dict) -> float | None:
    return (HOT_FLOORS if _field(row, "collective") else FLOORS).get(row["target"])


#: A launch of an odd-sized call reaches at least this share of the % of copy bandwidth of the same
#: launch at the aligned size (the collectives' rows; `check_floors`).
ODD_WITHIN = 0.95


def _odd_short(row: dict, rows_by_key: dict) -> float | None:
    """The aligned twin's % of copy bandwidth when `row` is an odd-sized collective launch that
    misses `ODD_WITHIN` of it, else None."""
    if _field(row, "odd") != "True":
        return None
    twin = rows_by_key.get(_twin_key({**row, "odd": False}))
    if twin is None or not twin["ok"] or row["pct_copy_bw_bound"] >= ODD_WITHIN * twin["pct_copy_bw_bound"]:
        return None
    return twin["pct_copy_bw_bound"]


def _twin_key(row: dict) -> tuple:
    return tuple(_field(row, k) for k in _KEY if k != "numel")


def check_floors(rows: list[dict], baseline: list[dict] | None = None) -> list[str]:
    """What is wrong with `rows` against `FLOORS`: a launch that did not compile, spilled
    registers, or is below its target's floor without an `EXCEPTIONS` entry; with `baseline`
    (the committed table's rows), an excepted launch that is now slower than the baseline says.
    An odd-sized collective launch below `ODD_WITHIN` of its aligned twin in `rows` is held to
    the same: an entry names it, and it is no slower than the baseline."""
    base = {_key(r): r for r in baseline or ()}
    twins = {_twin_key(r): r for r in rows if _field(r, "odd") == "False"}
    problems = []
    for r in rows:
        name = "/".join(x for x in _key(r)[:9] + _key(r)[11:] if x)
        if not r["ok"]:
            problems.append(f"{name}: did not compile: {r['error']}")
            continue
        problems += [f"{name}: {m}" for m in model_misreads(r)]  # no EXCEPTIONS entry excuses these
        excepted = any(_matches(r, fields) for fields, _ in EXCEPTIONS)
        if r["spill_bytes"] and not any(_matches(r, fields) and "spill" in why for fields, why in EXCEPTIONS):
            problems.append(f"{name}: spills {r['spill_bytes']} B and no EXCEPTIONS entry that names it gives a spill's "
                            "reason")
        floor = _floor(r)
        aligned = _odd_short(r, twins)
        if (floor is None or r["pct_copy_bw_bound"] >= floor) and aligned is None:
            continue
        if not excepted and floor is not None and r["pct_copy_bw_bound"] < floor:
            problems.append(f"{name}: {r['pct_copy_bw_bound']}% < floor {floor}% and no EXCEPTIONS entry names it")
        if not excepted and aligned is not None:
            problems.append(f"{name}: {r['pct_copy_bw_bound']}% < {ODD_WITHIN:.0%} of the aligned size's {aligned}% "
                            "and no EXCEPTIONS entry names it")
        b = base.get(_key(r))
        if b is not None and r["pct_copy_bw_bound"] < b["pct_copy_bw_bound"]:
            problems.append(f"{name}: {r['pct_copy_bw_bound']}% < {b['pct_copy_bw_bound']}% of the committed table")
    return problems


def exceptions_table(rows: list[dict]) -> str:
    """README's table: each `EXCEPTIONS` entry with the launches of `rows` below their floor or
    spilling (or, odd-sized, below `ODD_WITHIN` of the aligned size) that it is the first entry to
    name (count, lowest and highest % of copy bandwidth, largest spill) and its reason."""
    lines = ["| launches | below the floor or spilling | % of copy bandwidth | spill | why |", "|---|---|---|---|---|"]
    twins = {_twin_key(r): r for r in rows if _field(r, "odd") == "False"}
    short = [r for r in rows if r["ok"] and (r["pct_copy_bw_bound"] < (_floor(r) or 0) or r["spill_bytes"]
                                             or _odd_short(r, twins) is not None)]
    for i, (fields, why) in enumerate(EXCEPTIONS):
        hit = [r for r in short if _matches(r, fields) and not any(_matches(r, f) for f, _ in EXCEPTIONS[:i])]
        if not hit:
            continue
        pct = [r["pct_copy_bw_bound"] for r in hit]
        spill = max(r["spill_bytes"] for r in hit)
        what = ", ".join(f"{k}={v}" for k, v in fields.items())
        lines.append(f"| {what} | {len(hit)} | {min(pct):.1f} - {max(pct):.1f} | {f'{spill} B' if spill else '-'} | {why} |")
    return "\n".join(lines)


#: The columns of `summary_table`: the collectives' launches, in the order a call runs them.
SUMMARY_KERNELS = (("compress", "compress_slots"), ("reduce, compressed out", "reduce_tagged"),
                   ("reduce, dense out", "reduce_tagged_dense"), ("decompress", "decompress_slots"))


def summary_table(rows: list[dict]) -> str:
    """The docs' table of the collectives' launches in `rows`: per target and codec, each launch's %
    of copy bandwidth over every collective, P and message size, at aligned / odd sizes, as the
    range lowest (rounded down) - highest (rounded up), one figure where they meet."""
    import math

    def span(xs):
        if not xs:
            return "-"
        lo, hi = math.floor(min(xs)), math.ceil(max(xs))
        return f"{lo}" if lo == hi else f"{lo}-{hi}"

    hot = [r for r in rows if r["ok"] and _field(r, "collective")]
    lines = ["| target | codec | " + " | ".join(name for name, _ in SUMMARY_KERNELS) + " |",
             "|---|---|" + "---|" * len(SUMMARY_KERNELS)]
    for t in dict.fromkeys(r["target"] for r in hot):
        for c in dict.fromkeys(r["codec"] for r in hot if r["target"] == t):
            cells = []
            for _, k in SUMMARY_KERNELS:
                mine = [r for r in hot if (r["target"], r["codec"], r["kernel"]) == (t, c, k)]
                pct = {odd: [r["pct_copy_bw_bound"] for r in mine if _field(r, "odd") == str(odd)] for odd in (False, True)}
                cells.append(f"{span(pct[False])} / {span(pct[True])}")
            lines.append(f"| {t} | {c.upper().replace('FP8_', 'FP8 ')} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run(which: str, targets: list[str], jobs: int, only: str | None = None, numel: int | None = None) -> list[dict]:
    """The rows of a set: the plain launches (none in "hotpath" and "hotpath-subbyte"), then the collectives' launches
    (`hot_variants`; in "ci" on `HOT_CI["targets"]` only)."""
    rows = []
    if not which.startswith("hotpath"):
        work = [(v, t) for t in targets for v in select(variants(which, TARGETS[t].backend), only, numel)]
        if jobs <= 1:
            rows = [evaluate(v, t) for v, t in work]
        else:
            with concurrent.futures.ProcessPoolExecutor(jobs) as ex:
                rows = list(ex.map(_evaluate_star, work, chunksize=4))
    hvs = hot_variants(which)
    if only:
        want = dict(kv.split("=", 1) for kv in only.split(","))
        hvs = [hv for hv in hvs if all(str(hv.row().get(k, v)) == v for k, v in want.items())]
    hot_targets = [t for t in targets if which != "ci" or t in HOT_CI["targets"]]
    return rows + run_hot(hvs, hot_targets, jobs) if hvs and hot_targets else rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--set", dest="which",
                    choices=("ci", "quick", "subbyte", "hotpath", "hotpath-subbyte", "hotpath-p2p", "full"),
                    default="full",
                    help="ci: default, INT8 and INT6 G=32 configs (and the collectives' launches of HOT_CI); quick: the "
                         "default and its one-field neighbours; subbyte: every INT6/INT4 config (and the collectives' "
                         "INT6/INT4 launches); hotpath: the collectives' launches; hotpath-subbyte: their INT6/INT4 launches alone; "
                         "hotpath-p2p: a p2p message's two launches (FP8, INT8, INT6, INT4); "
                         "full: all")
    ap.add_argument("--quick", dest="which", action="store_const", const="quick", help="same as --set quick")
    ap.add_argument("--targets", default=None,
                    help=f"comma-separated targets of {sorted(TARGETS)} (default: all for the full set, else {','.join(QUICK_TARGETS)})")
    ap.add_argument("--only", default=None,
                    help="keep the variants whose row matches every field=value given, comma-separated "
                         "(e.g. kernel=reduce_dense,dtype=fp32,group_size=128)")
    ap.add_argument("--numel", type=int, default=None, help=f"elements per launch (default {NUMEL}; odd rows {ODD_NUMEL})")
    ap.add_argument("--json", type=Path, help="write every row as a JSON list")
    ap.add_argument("--csv", type=Path, help="write every row as CSV (with machine, commit and date columns)")
    ap.add_argument("--check", type=Path, metavar="CSV",
                    help="exit 1 if a launch did not compile, spilled, or is below its FLOORS entry without an "
                         "EXCEPTIONS entry or slower than in this committed table")
    ap.add_argument("--floors", action="store_true", help="print the table of EXCEPTIONS with their figures (Markdown)")
    ap.add_argument("--summary", action="store_true",
                    help="print the collectives' launches' %% of copy bandwidth per target and codec (Markdown)")
    ap.add_argument("--from-csv", type=Path, metavar="CSV",
                    help="read the rows from this table (bench/aot.py --csv) instead of compiling: for --floors, "
                         "--summary and --check")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiler processes in parallel")
    args = ap.parse_args(argv)
    targets = args.targets.split(",") if args.targets else list(TARGETS if args.which == "full" else QUICK_TARGETS)
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        ap.error(f"unknown targets {unknown}; known: {sorted(TARGETS)}")
    import pandas as pd

    from autotune import meta

    if args.from_csv:
        df = pd.read_csv(args.from_csv)
    else:
        # the commit being compiled, read before the (long) run: edits made meanwhile are not in it
        commit, started = meta.git_commit(), meta.utc_now()
        df = pd.DataFrame(run(args.which, targets, args.jobs, args.only, args.numel))
        df["triton"] = meta.triton_version()
        df["commit"] = commit
        df["date"] = started
    if args.json:
        args.json.write_text(json.dumps(json.loads(df.to_json(orient="records")), indent=1))
    if args.csv:
        df.to_csv(args.csv, index=False)
    cols = ["kernel", "target", "collective", "world", "message_mib", "odd", "codec", "group_size", "hadamard", "scales",
            "rounding", "dtype", "num_warps", "numel", "ok", "regs", "spill_bytes", "instr_per_elem", "pct_copy_bw_bound",
            "bound_by", "pct_copy_bw_bound_worst"]
    if not args.from_csv:
        with pd.option_context("display.width", 200, "display.max_rows", 400):
            print(df[[c for c in cols if c in df]].to_string(index=False))
    failed = df[~df["ok"]]
    if len(failed):
        print(f"\n{len(failed)} variants did not compile:")
        for _, r in failed.iterrows():
            print(f"  {r['kernel']} {r['target']} {r['codec']} G{r['group_size']}: {r['error']}")
    records = json.loads(df.to_json(orient="records"))
    if args.summary:
        print("\n" + summary_table(records))
    if args.floors:
        print("\n" + exceptions_table(records))
    if args.check:
        problems = check_floors(records, json.loads(pd.read_csv(args.check).to_json(orient="records")))
        print(f"\nfloors: {len(problems)} problems" + "".join(f"\n  {p}" for p in problems))
        return 1 if problems else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
