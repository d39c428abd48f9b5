"""What every launch of the fused kernels shares: the target, launch parameters, the launch itself.

- `Target`: what the kernel is compiled for (a CUDA compute capability, an AMD arch, or Triton's
  CPU interpreter). It decides the constexprs that differ between hardware (`target_flags`):
  hardware FP8 conversions exist from sm_89 on, the interpreter needs bit-exact emulations, and
  16-bit transform operands are exact on tensor cores but not in the interpreter's bf16 dot
  (`op16`).
- `launch_params`: (num_warps, num_stages), the one place they are chosen. Lookup order: a
  `forced` block, then the autotune runtime's lookup, registered here by the runtime (shipped
  per-GPU files, the user's cache, online tuning when TACO_AUTOTUNE=online), then the heuristic. The interpreter runs every choice the
  same way, so it answers with the heuristic. `WARP_FLOORS` then raises the warps of launches
  that spill with fewer, whichever source chose them.
- `Launch`: a kernel with its grid, arguments and constexprs, all by parameter name: exactly the
  kernel's parameters (checked when it is built). Each kernel module builds one in a `*_launch`
  function from tensors (or from `ShapedPointer`s), and `Launch.run()` launches it;
  `bench/aot.py` compiles the very same `Launch` for any target without a GPU, so the
  compile-time model never drifts from what runs. `Prepared` turns one into a function of the
  arguments that change between calls, named.
- FMA policy: every kernel is compiled with `enable_fp_fusion=False`, so `a * b + c` rounds twice
  as in `reference.py` on every Triton version (Triton 3.9 fuses by default, 3.10 does not);
  kernels write `tl.fma` where they want one rounding.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
from dataclasses import dataclass

import torch

from ..config import CompressionConfig
from ..env import autotune_mode, interpreting
from ..state import STATE


@dataclass(frozen=True)
class Target:
    """A compilation target: backend "cuda" (arch = compute capability, e.g. 90), "hip" (arch =
    gfx name) or "interpreter"."""

    backend: str
    arch: int | str = 0
    warp_size: int = 32

    @property
    def compiled(self) -> bool:
        return self.backend != "interpreter"

    @property
    def fp8_hw(self) -> bool:
        """OCP FP8 (e4m3fn / e5m2) hardware conversions: NVIDIA sm_89 and newer."""
        return self.backend == "cuda" and int(self.arch) >= 89

    @property
    def cdna(self) -> int:
        """AMD CDNA generation (1: gfx908, 2: gfx90a, 3: gfx94x, 4: gfx95x), 0 for anything else.
        CDNA 3 converts FP8 only in the FNUZ flavours (e4m3fnuz / e5m2fnuz, exponent bias one above
        OCP's); CDNA 4 converts the OCP formats themselves."""
        if self.backend != "hip":
            return 0
        return {"gfx908": 1, "gfx90a": 2}.get(str(self.arch), {"gfx94": 3, "gfx95": 4}.get(str(self.arch)[:5], 0))

    def __str__(self) -> str:
        return f"sm_{self.arch}" if self.backend == "cuda" else str(self.arch or self.backend)


INTERPRETER = Target("interpreter")


@functools.lru_cache(maxsize=16)
def _device_target(index: int, is_hip: bool) -> Target:
    props = torch.cuda.get_device_properties(index)
    if is_hip:
        return Target("hip", props.gcnArchName.split(":")[0], 64)
    return Target("cuda", props.major * 10 + props.minor, 32)


@functools.lru_cache(maxsize=16)
def multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def target_of(device: torch.device) -> Target:
    """The target kernels launched on `device` compile for (queried once per device)."""
    if device.type != "cuda" or interpreting():
        return INTERPRETER
    return _device_target(device.index if device.index is not None else torch.cuda.current_device(),
                          torch.version.hip is not None)


def target_flags(target: Target) -> dict:
    """Constexprs that differ between targets (every kernel declares them all).

    HW: compiled for a GPU (hardware INT8 rounding and bf16 casts; the interpreter's are not
    round-to-nearest-even). FP8_HW: hardware FP8 conversions. DOT_PREC: how dots with FP32
    operands run. "tf32x3" (NVIDIA, whose default for them is one TF32 pass): `_common._dot`
    splits them into three exact bf16 pieces; AMD's matrix cores have FP32 instructions
    ("ieee"), as has the interpreter. KRON: how the G = 256/512 transform's second stage is laid
    out (`_common.hadamard_rows`): batched on sm_90, transposes elsewhere (by bench/aot.py). CDNA:
    the AMD CDNA generation (`Target.cdna`, 0 elsewhere): CDNA 3 has only the FNUZ FP8
    conversions, which the encoder and E4M3 decoder reach OCP codes through
    (`_common.encode_fp8_fnuz`); every CDNA finds a row's largest magnitude with integer max
    instructions (`_common.row_absmax`).
    """
    return {
        "HW": target.compiled,
        "FP8_HW": target.fp8_hw,
        "DOT_PREC": "tf32x3" if target.backend == "cuda" else "ieee",
        "KRON": int(target.backend == "cuda" and int(target.arch) == 90),
        "CDNA": target.cdna,
    }


def row_gather(kernel: str, target: Target, pack_k: int) -> bool:
    """ROW_GATHER of the kernels that quantize a tile (compress, the fused reduce): whether the
    per-row scale work moves to a layout of one row per thread (`_tile.one_thread_per_row`)
    before it runs. Chosen with bench/aot.py (the collectives' launches at P = 2, 16 MiB): it pays
    where the tile's layout spreads a row over several threads and costs a shared-memory round
    trip where it does not. Compress on sm_80 .. sm_90, whose MMA output holds a row in 4 threads:
    sm_90 INT6 at G = 32 0.739 -> 0.546 warp-instructions per element, sm_80 FP8 0.974 -> 0.744;
    not on sm_100 (INT4 0.410 -> 0.457: more instructions with it, the layout not examined) nor
    gfx942 (0.556 -> 0.595). The reduce, whose sums take the layout of the loaded codes: on sm_80 ..
    sm_90 for byte codes (FP8, INT8: sm_90 FP8 0.793 -> 0.682; not on sm_100, where the tagged
    reduce gained, 0.712 -> 0.616, but the plain FP8 reduce at 4 warps spills 8 bytes), not for INT4
    words, which load a row per thread (sm_90 0.772 -> 0.783), nor INT6 words (sm_90 0.939 -> 0.908
    at P = 2, but 2.161 -> 2.177 at P = 8 and 3.790 -> 3.869 at P = 16, where the loop over ranks
    weighs); on AMD for INT6 words alone (gfx942 0.629 -> 0.598 at P = 2; INT8's VALU-bound 80.8 ->
    79.4% of copy bandwidth). The interpreter takes the gather, so the tests run its code; the
    values are the same either way."""
    from ._common import INT4_WORD_CODES, INT6_WORD_CODES  # here: _common imports Triton

    if not target.compiled:
        return True
    cuda = target.backend == "cuda"
    if kernel == "compress":
        return cuda and int(target.arch) < 100
    if kernel == "reduce":
        if cuda:
            return int(target.arch) < 100 and pack_k not in (INT4_WORD_CODES.value, INT6_WORD_CODES.value)
        return pack_k == INT6_WORD_CODES.value
    raise ValueError(f"row_gather: no per-row scale work in kernel {kernel!r}; 'compress' or 'reduce'")


def op16(kernel: str, target: Target, dtype: torch.dtype, config: CompressionConfig) -> bool:
    """OP16 of the kernels with a transform of 16-bit operands: the dot's operands stay 16-bit,
    exact on tensor cores (products with the table's powers of two are exact; they accumulate in
    FP32); the interpreter's bf16 dot is not exact, so it computes in FP32 there. "compress": the
    input in its own dtype `dtype`, if bf16 or fp16 and with dual scales (the single-scale mode
    pre-scales in FP32 first). "decompress": the decoded codes in fp16, exact for every codec,
    whatever the output dtype. (The reduce's operands are its FP32 sums: it has no OP16.)"""
    if kernel == "compress":
        return target.compiled and dtype in (torch.bfloat16, torch.float16) and config.scales == "dual"
    if kernel == "decompress":
        return target.compiled
    raise ValueError(f"op16: no 16-bit transform operands in kernel {kernel!r}; 'compress' or 'decompress'")


#: Warp counts of the sub-byte kernels: (kernel, codec, stochastic, G, Hadamard, warps), the first
#: matching rule wins, None matches anything. Chosen with bench/aot.py over all eight targets
#: (sm_80 .. sm_120, gfx942, gfx950): the count that spills nowhere, the faster one where both
#: are clean. What the other count did is noted per rule.
SUBBYTE_WARPS = (
    ("compress", "int4", True, None, None, 4),    # 8 spill on sm_90 (G=32, no Hadamard)
    ("compress", "int6", True, 512, None, 8),     # 4 spill on sm_100 (Hadamard)
    ("compress", "int6", True, None, None, 4),    # 8 spill on sm_100 (G=64, Hadamard)
    ("decompress", "int6", None, 32, True, 8),    # 4 spill 8 B on sm_120
    ("reduce", "int6", None, None, None, 4),      # 8 no faster anywhere, slower on sm_90
)

#: Minimum warps of a kernel, applied to whatever chose them (a forced block, a tuned entry, the
#: heuristic): (kernel, dual scales, G, warps), None matches anything. "compress_slots" (the
#: collectives' slotted compress) shares "compress"'s tuned entries and heuristic (the tuner
#: times the dense launch; both run the same tile code), but its loop over slots holds more.
WARP_FLOORS = (
    ("compress_slots", False, 256, 8),  # bench/aot.py, sm_90: 4 warps hold 255 registers and spill 64 B (8: 207, none)
)

# Kernel names that look up another's tuned entries and heuristic.
_TUNED_AS = {"compress_slots": "compress", "decompress_slots": "decompress"}

#: Pipeline stages of the collectives' slotted kernels, whatever chose them (a tuned entry, the
#: heuristic; not a forced block). Their launches are short, a few tiles per program (a 16 MiB
#: all_reduce at P = 8: 1024 tiles over 396 programs on sm_90), so a second stage only peels a
#: tile's loads into every program's prologue (and on gfx942 stages them through LDS).
#: bench/aot.py, all_reduce 16 MiB at P = 8, FP8, % of copy bandwidth with 2 stages -> 1: gfx942
#: compress 65 -> 100, decompress 50 -> 78; sm_100 compress 60-80 -> 100 (no spill); sm_90
#: compress 0.47 -> 0.41 and decompress 0.44 -> 0.39 warp-instructions per element.
SLOT_STAGES = {"compress_slots": 1, "decompress_slots": 1}


def heuristic(kernel: str, config: CompressionConfig, backend: str = "cuda") -> dict:
    """A safe default: 4 warps (a 64-row tile is one warpgroup on Hopper), 2 stages (the loads of
    the next tile overlap the current one in the persistent loop). Stochastic rounding carries a
    32-bit random stream and the integer encoder per element: 8 warps halve the registers per
    thread (4 warps spill on sm_80 in the fused reduce, by bench/aot.py). AMD (`backend` "hip"):
    8 waves of 64 lanes, 16 elements of a tile per lane instead of 32: the registers per lane drop
    (e.g. gfx942 decompress at G=128 from 292 to 150 VGPRs) and more waves share a SIMD, which is
    what issues a CU's instruction classes in parallel (bench/aot.py, gfx942: reduce to dense
    75 -> 97%, compress at G=256 53 -> 65%; the fused reduce loses under a point). The sub-byte
    kernels follow `SUBBYTE_WARPS` on every backend."""
    warps = 8 if config.stochastic or backend == "hip" else 4
    for k, codec, stochastic, g, hadamard, w in SUBBYTE_WARPS:
        if (k == kernel and codec == config.codec and stochastic in (None, config.stochastic)
                and g in (None, config.group_size) and hadamard in (None, config.hadamard)):
            warps = w
            break
    return {"num_warps": warps, "num_stages": 2}


# A context variable, not a module global: a forced block in one thread (the tuner timing a
# candidate) must not change the launches of another.
_FORCED: contextvars.ContextVar[dict | None] = contextvars.ContextVar("taco_forced_launch", default=None)


@contextlib.contextmanager
def forced(params: dict):
    """Launch every fused kernel inside this block with `params` ({"num_warps": .., "num_stages": ..})."""
    token = _FORCED.set(dict(params))
    try:
        yield
    finally:
        _FORCED.reset(token)


# The tuned-parameter lookup, (kernel, device, dtype, config, numel) -> params or None. The autotune
# runtime registers it when imported (`import taco_triton` does that): the tuner imports the kernels
# to time them, so the kernels never import the tuner. None registered: the heuristic.
def register_tuned_lookup(lookup) -> None:
    """Make `launch_params` ask `lookup(kernel, device, dtype, config, numel)` on GPUs (None: don't);
    kept in `STATE.tuned_lookup`."""
    STATE.tuned_lookup = lookup


def launch_params(kernel: str, device: torch.device, dtype: torch.dtype, config: CompressionConfig, numel: int,
                  backend: str = "cuda") -> dict:
    """Launch parameters for `kernel` ("compress", "compress_slots", "decompress",
    "decompress_slots", "reduce") on this problem; `backend` ("cuda", "hip"): whose heuristic a
    device that is no GPU gets (the interpreter; bench/aot.py compiling for a target)."""
    base = _TUNED_AS.get(kernel, kernel)
    pinned = _FORCED.get()
    if pinned is not None:
        found = pinned
    elif device.type != "cuda" or interpreting():
        autotune_mode()  # unused here, but a TACO_AUTOTUNE typo raises on every backend, not only on GPUs
        found = heuristic(base, config, backend)
    else:
        lookup = STATE.tuned_lookup
        found = lookup(base, device, dtype, config, numel) if lookup is not None else None
        # a ROCm build of torch drives AMD GPUs only: no device query needed for the backend
        if found is None:
            found = heuristic(base, config, "hip" if torch.version.hip is not None else "cuda")
    if pinned is None and kernel in SLOT_STAGES:
        found = {**found, "num_stages": SLOT_STAGES[kernel]}
    for k, dual, g, warps in WARP_FLOORS:
        if (k == kernel and dual in (None, config.scales == "dual") and g in (None, config.group_size)
                and found.get("num_warps", 4) < warps):
            return {**found, "num_warps": warps}
    return found


@dataclass(frozen=True)
class ShapedPointer:
    """A stand-in for a tensor argument when a launch is only compiled (bench/aot.py): Triton
    reads the element type and the address (16-byte aligned, as the caching allocator gives)."""

    dtype: torch.dtype
    address: int = 1 << 20

    def data_ptr(self) -> int:
        return self.address


#: In the interpreter a small grid still makes programs loop over several tiles (tested that way).
INTERPRETER_PROGRAMS = 3


def _resident_per_sm(compiled, index: int) -> int:
    """Programs of a compiled kernel one SM holds at once (registers, shared memory, threads)."""
    props = torch.cuda.get_device_properties(index)
    threads = compiled.metadata.num_warps * props.warp_size if hasattr(props, "warp_size") else compiled.metadata.num_warps * 32
    smem = compiled.metadata.shared
    try:  # registers are known once the module is loaded on the device
        compiled._init_handles()
        regs = compiled.n_regs or 255
    except (AttributeError, RuntimeError):
        regs = 255  # the worst case: never more programs than can be resident
    limits = [
        getattr(props, "max_threads_per_multi_processor", 2048) // threads,
        getattr(props, "regs_per_multiprocessor", 65536) // max(1, -(-regs * threads // 256) * 256),
    ]
    if smem:
        limits.append(getattr(props, "shared_memory_per_multiprocessor", 101376) // smem)
    return max(1, min(limits))


#: What a launch passes besides the kernel's parameters: Triton's compile options.
LAUNCH_OPTIONS = frozenset({"num_warps", "num_stages", "enable_fp_fusion"})


@functools.cache
def _parameters(py_fn) -> tuple[tuple[str, ...], frozenset[str], frozenset[str], frozenset[str]]:
    """(runtime parameters in order, the same as a set, constexpr parameters, those and the launch
    options: the keys of a launch's meta) of a kernel's function."""
    from triton.runtime.jit import KernelParam  # here: the collectives import this module with the package

    params = [KernelParam(i, p, False, False) for i, p in enumerate(inspect.signature(py_fn).parameters.values())]
    runtime = tuple(p.name for p in params if not p.is_constexpr)
    if [p.name for p in params[: len(runtime)]] != list(runtime):
        raise TypeError(f"{py_fn.__name__}: its runtime parameters must precede its constexprs (`Prepared` passes them by position)")
    constexprs = frozenset(p.name for p in params if p.is_constexpr)
    return runtime, frozenset(runtime), constexprs, constexprs | LAUNCH_OPTIONS


def kernel_parameters(fn) -> tuple[tuple[str, ...], frozenset[str]]:
    """(runtime parameter names in the kernel's order, constexpr parameter names) of a
    `@triton.jit` kernel, compiled (`JITFunction`) or interpreted, by Triton's own rule
    (`KernelParam.is_constexpr`: a parameter annotated `tl.constexpr`)."""
    runtime, _, constexprs, _ = _parameters(fn.fn)
    return runtime, constexprs


def _mismatch(fn, what: str, given, declared) -> str:
    missing, unknown = sorted(set(declared) - set(given)), sorted(set(given) - set(declared))
    return (f"{getattr(fn, '__name__', fn)}: {what} missing {missing}, unknown {unknown}"
            if missing or unknown else "")


@dataclass(frozen=True)
class Launch:
    """One launch of a persistent kernel over `n_tiles` tiles: `fn[grid](*args.values(), **meta)`.

    `args` maps each runtime parameter of the kernel to its value, `meta` each constexpr
    parameter and each launch option (`LAUNCH_OPTIONS`): exactly those, or ValueError naming the
    missing and the unknown. `args` is kept in the kernel's order.

    The grid is as many programs as the GPU keeps resident at once (never more: a program that
    waits for a free SM would start its share of tiles only after another finished all of its
    own); in the interpreter, a few programs that loop over several tiles.
    """

    fn: object
    n_tiles: int
    args: dict
    meta: dict
    device: torch.device | None = None

    def __post_init__(self):
        runtime, runtime_set, _, meta_keys = _parameters(self.fn.fn)
        # comparisons of the keys, no set built: outside `Prepared` a launch is built per call
        in_order = tuple(self.args) == runtime
        if not (in_order or self.args.keys() == runtime_set) or self.meta.keys() != meta_keys:
            problems = [_mismatch(self.fn, "arguments", self.args, runtime),
                        _mismatch(self.fn, "constexprs and options", self.meta, meta_keys)]
            raise ValueError("; ".join(p for p in problems if p))
        if not in_order:  # the builders list them in order: `run` passes them by position
            object.__setattr__(self, "args", {name: self.args[name] for name in runtime})

    def grid(self) -> tuple:
        if self.device is None or self.device.type != "cuda" or interpreting():
            return (max(1, min(self.n_tiles, INTERPRETER_PROGRAMS)),)
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        key = (self.fn, tuple(sorted((k, str(v)) for k, v in self.meta.items())), index)
        per_sm = STATE.resident.get(key)
        if per_sm is None:
            compiled = self.fn.warmup(*self.args.values(), grid=(1,), **self.meta)
            per_sm = STATE.resident[key] = _resident_per_sm(compiled, index)
        return (max(1, min(self.n_tiles, per_sm * multiprocessors(index))),)

    def run(self):
        return self.fn[self.grid()](*self.args.values(), **self.meta)


def launch_meta(target: Target, params: dict, **constexprs) -> dict:
    """A kernel's constexprs plus the target's flags and the launch options."""
    return {**constexprs, **target_flags(target), **params, "enable_fp_fusion": False}


class Prepared:
    """A `Launch` made ready for repeated calls: its grid and meta computed once, its arguments a
    template in which a call replaces only those that change.

    `varying` names them: a tuple of the kernel's parameter names (the call takes them in that
    order, or by name), or a dict from each argument of the call to the kernel parameter(s) it
    fills (one name, or a tuple when one tensor is passed as several pointers, as the fused reduce
    takes a wire row as its codes and both scale regions). ValueError names any parameter the
    kernel does not have, or one filled twice.

    `call(*values)` takes the varying arguments in that order (or by their names).
    A call of a prepared launch costs one Triton launch: no layout, no launch parameters, no grid
    lookup, no argument list built. The call is a function generated once (as `dataclasses`
    generates its methods) whose fixed arguments are bound as defaults, i.e. as locals. It calls
    the kernel's `run(*args, grid=, warmup=False, **meta)` directly, which is what `fn[grid](*args,
    **meta)` calls (Triton's `KernelInterface.__getitem__`), with one packing of the keywords fewer;
    the arguments by position, in the kernel's order.
    """

    __slots__ = ("args", "call", "fn", "grid", "meta", "varying")

    def __init__(self, launch: Launch, varying):
        self.fn, self.grid, self.meta = launch.fn, launch.grid(), launch.meta
        self.args = dict(launch.args)
        fills = dict(varying) if isinstance(varying, dict) else {name: name for name in varying}
        fills = {arg: (params,) if isinstance(params, str) else tuple(params) for arg, params in fills.items()}
        self.varying = tuple(fills)
        runtime, constexprs = kernel_parameters(self.fn)
        filled = [p for params in fills.values() for p in params]
        if not isinstance(varying, dict):
            filled = list(varying)  # a name given twice is an error, not one argument
        unknown = [p for p in filled if p not in self.args]
        bad_names = [a for a in fills if not a.isidentifier() or a.startswith("_")]
        if unknown or len(set(filled)) != len(filled) or bad_names:
            raise ValueError(f"{getattr(self.fn, '__name__', self.fn)}: varying {list(filled)} must be distinct "
                             f"runtime parameters; unknown {unknown} (constexprs {sorted(set(unknown) & constexprs)} are "
                             f"fixed by the launch); call argument names must be identifiers without a leading underscore, "
                             f"not {bad_names}; its "
                             f"runtime parameters: {list(runtime)}")
        source_of = {p: arg for arg, params in fills.items() for p in params}
        fixed = [name for name in runtime if name not in source_of]
        # the kernel's parameter names are identifiers; the fixed ones get a prefix no kernel uses
        params = ", ".join([*self.varying, "*", "_fn=_kernel", "_kw=_run_kw"] + [f"_c_{n}=_args[{n!r}]" for n in fixed])
        passed = ", ".join(source_of.get(n, f"_c_{n}") for n in runtime)
        # `_fn.run` is looked up per call: instrumentation (host_audit) may replace `run` on the class
        source = f"def call({params}):\n    return _fn.run({passed}, **_kw)\n"
        run_kw = {**self.meta, "grid": self.grid, "warmup": False}
        scope = {"_kernel": self.fn, "_run_kw": run_kw, "_args": self.args}
        exec(source, scope)  # noqa: S102 - generated from the kernel's own parameter names only
        self.call = scope["call"]
        # the fixed arguments are bound as defaults now; the template's varying ones (the first
        # call's tensors and wire buffers) would only keep that memory alive
        self.args.update(dict.fromkeys(source_of))

    def __call__(self, *values, **named):
        return self.call(*values, **named)


class FusedOp:
    """What the op of each kernel module shares (`compress.CompressOp`, `decompress.DecompressOp`,
    `reduce.ReduceOp`): the config, the device the launches run on (None: only compiled, for
    bench/aot.py), the compile target (None: the device's) and the launch parameters,
    `params(kernel, dtype, numel)` (None: `launch_params` on the device)."""

    def __init__(self, config: CompressionConfig, device: torch.device | None = None, target: Target | None = None,
                 params=None):
        self.config, self.device = config, device
        self.target = target_of(device) if target is None else target
        self.params = params or (lambda kernel, dtype, numel: launch_params(kernel, device, dtype, config, numel))


def in_order(calls):
    """One function that runs `calls` (prepared launches' `call`s) in order with the same
    arguments: a single launch as itself, or an aligned main launch and its tail
    (`_tile.aligned_split`)."""
    calls = list(calls)
    if len(calls) == 1:
        return calls[0]
    first, second = calls

    def run(*args):
        first(*args)
        second(*args)

    return run
