"""What every launch of the fused kernels shares: the target, launch parameters, the launch itself.

- `Target`: what the kernel is compiled for (a CUDA compute capability, an AMD arch, or Triton's
  CPU interpreter). It decides the constexprs that differ between hardware (`target_flags`):
  hardware FP8 conversions exist from sm_89 on, the interpreter needs bit-exact emulations, and
  16-bit transform operands are exact on tensor cores but not in the interpreter's bf16 dot.
- `launch_params`: (num_warps, num_stages), the one place they are chosen. Lookup order: a
  `forced` block, then the autotune runtime's lookup, registered here by the runtime (shipped
  per-GPU files, the user's cache, online tuning when TACO_AUTOTUNE=online), then the heuristic. The interpreter runs every choice the
  same way, so it answers with the heuristic.
- `Launch`: a kernel with its grid, arguments and constexprs. Each kernel module builds one in a
  `*_launch` function from tensors (or from `ShapedPointer`s), and `Launch.run()` launches it;
  `bench/aot.py` compiles the very same `Launch` for any target without a GPU, so the
  compile-time model never drifts from what runs.
- FMA policy: every kernel is compiled with `enable_fp_fusion=False`, so `a * b + c` rounds twice
  as in `reference.py` on every Triton version (Triton 3.9 fuses by default, 3.10 does not);
  kernels write `tl.fma` where they want one rounding.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
from dataclasses import dataclass, field

import torch

from ..config import CompressionConfig
from ..env import autotune_mode, interpreting


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


def target_flags(target: Target, dtype: torch.dtype) -> dict:
    """Constexprs that differ between targets.

    HW: compiled for a GPU (hardware INT8 rounding and bf16 casts; the interpreter's are not
    round-to-nearest-even). FP8_HW: hardware FP8 conversions. OP16: the transform's operands stay
    in the input's 16-bit dtype (exact on tensor cores; the interpreter's bf16 dot is not, so it
    computes in FP32 there). DOT_PREC: how dots with FP32 operands run. "tf32x3" (NVIDIA, whose
    default for them is one TF32 pass): `_common._dot` splits them into three exact bf16 pieces;
    AMD's matrix cores have FP32 instructions ("ieee"), as has the interpreter. KRON: how the
    G = 256/512 transform's second stage is laid out (`_common.hadamard_rows`): batched on sm_90,
    transposes elsewhere (by bench/aot.py). CDNA: the AMD
    CDNA generation (`Target.cdna`, 0 elsewhere): CDNA 3 has only the FNUZ FP8 conversions, which
    the encoder and E4M3 decoder reach OCP codes through (`_common.encode_fp8_fnuz`); every CDNA
    finds a row's largest magnitude with integer max instructions (`_common.row_absmax`).
    """
    return {
        "HW": target.compiled,
        "FP8_HW": target.fp8_hw,
        "OP16": target.compiled and dtype in (torch.bfloat16, torch.float16),
        "DOT_PREC": "tf32x3" if target.backend == "cuda" else "ieee",
        "KRON": int(target.backend == "cuda" and int(target.arch) == 90),
        "CDNA": target.cdna,
    }


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
_tuned_lookup = None


def register_tuned_lookup(lookup) -> None:
    """Make `launch_params` ask `lookup(kernel, device, dtype, config, numel)` on GPUs (None: don't)."""
    global _tuned_lookup
    _tuned_lookup = lookup


def launch_params(kernel: str, device: torch.device, dtype: torch.dtype, config: CompressionConfig, numel: int) -> dict:
    """Launch parameters for `kernel` ("compress", "decompress", ...) on this problem."""
    pinned = _FORCED.get()
    if pinned is not None:
        return pinned
    if device.type != "cuda" or interpreting():
        autotune_mode()  # unused here, but a TACO_AUTOTUNE typo raises on every backend, not only on GPUs
        return heuristic(kernel, config)
    found = _tuned_lookup(kernel, device, dtype, config, numel) if _tuned_lookup is not None else None
    # a ROCm build of torch drives AMD GPUs only: no device query needed for the backend
    return found if found is not None else heuristic(kernel, config, "hip" if torch.version.hip is not None else "cuda")


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
# (kernel, constexprs and options, device index) -> programs that stay resident on one SM.
_RESIDENT: dict = {}


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


@dataclass(frozen=True)
class Launch:
    """One launch of a persistent kernel over `n_tiles` tiles: `fn[grid](*args, **meta)`.

    The grid is as many programs as the GPU keeps resident at once (never more: a program that
    waits for a free SM would start its share of tiles only after another finished all of its
    own); in the interpreter, a few programs that loop over several tiles.
    """

    fn: object
    n_tiles: int
    args: tuple
    meta: dict = field(default_factory=dict)
    device: torch.device | None = None

    def grid(self) -> tuple:
        if self.device is None or self.device.type != "cuda" or interpreting():
            return (max(1, min(self.n_tiles, INTERPRETER_PROGRAMS)),)
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        key = (self.fn, tuple(sorted((k, str(v)) for k, v in self.meta.items())), index)
        per_sm = _RESIDENT.get(key)
        if per_sm is None:
            compiled = self.fn.warmup(*self.args, grid=(1,), **self.meta)
            per_sm = _RESIDENT[key] = _resident_per_sm(compiled, index)
        return (max(1, min(self.n_tiles, per_sm * multiprocessors(index))),)

    def run(self):
        return self.fn[self.grid()](*self.args, **self.meta)


def launch_meta(target: Target, dtype: torch.dtype, params: dict, **constexprs) -> dict:
    """Constexprs plus the target's flags and the launch options every kernel uses."""
    return {**constexprs, **target_flags(target, dtype), **params, "enable_fp_fusion": False}


class Prepared:
    """A `Launch` made ready for repeated calls: its grid and meta computed once, its arguments a
    template in which a call replaces only those that change (`varying` positions).

    A call of a prepared launch costs one Triton launch: no layout, no launch parameters, no grid
    lookup, no argument list built. The call is a function generated once (as `dataclasses`
    generates its methods) whose fixed arguments are bound as defaults, i.e. as locals. It calls
    the kernel's `run(*args, grid=, warmup=False, **meta)` directly, which is what `fn[grid](*args,
    **meta)` calls (Triton's `KernelInterface.__getitem__`), with one packing of the keywords fewer.
    """

    __slots__ = ("args", "call", "fn", "grid", "launcher", "meta", "varying")

    def __init__(self, launch: Launch, varying: tuple[int, ...]):
        self.fn, self.grid, self.meta = launch.fn, launch.grid(), launch.meta
        self.launcher = launch.fn[self.grid]  # Triton's launch bound to the grid, made once
        self.args, self.varying = list(launch.args), tuple(varying)
        if any(not 0 <= i < len(self.args) for i in self.varying) or len(set(self.varying)) != len(self.varying):
            raise ValueError(f"varying positions {varying} must be distinct indices of {len(self.args)} arguments")
        names = [f"v{self.varying.index(i)}" if i in self.varying else f"c{i}" for i in range(len(self.args))]
        fixed = [f"c{i}=_args[{i}]" for i in range(len(self.args)) if i not in self.varying]
        params = ", ".join([f"v{j}" for j in range(len(self.varying))] + ["*", "_fn=_kernel", "_kw=_run_kw"] + fixed)
        # `_fn.run` is looked up per call: instrumentation (host_audit) may replace `run` on the class
        source = f"def call({params}):\n    return _fn.run({', '.join(names)}, **_kw)\n"
        run_kw = {**self.meta, "grid": self.grid, "warmup": False}
        scope = {"_kernel": self.fn, "_run_kw": run_kw, "_args": self.args}
        exec(source, scope)  # noqa: S102 - generated from integer positions only
        self.call = scope["call"]

    def __call__(self, *values):
        return self.call(*values)
