"""Compress/decompress registered as torch ops, dispatching to the Triton kernels or the reference.

Registered with `torch.library.custom_op` and fake (meta) implementations, so they compose with
`torch.compile(fullgraph=True)`: the wire size is a pure function of (numel, config), which is
all the fake implementation needs. The config travels as plain fields because custom ops take
only primitive arguments.

Why `custom_op` and not `torch.library.triton_op` (which lets Inductor trace into the kernels):
a `triton_op` body must be traceable, PyTorch operators and `wrap_triton(kernel)[grid](...)` only,
and ours is not: a launch's grid is as many programs as stay resident on the GPU (`Launch.grid`
compiles the kernel and reads its registers), its Hadamard tables are made once and kept, and a
repeated call goes through a prepared launch. Inductor would gain nothing to fuse either: each op
reads its input once and writes a wire buffer that a process group consumes. What a `triton_op`
could save is the dispatcher's overhead per call; the eager path (`compress_eager`) already
skips it.
"""
from __future__ import annotations

import functools
import importlib.util
import math

import torch

from . import alloc, env, reference
from .config import CompressionConfig
from .layout import WireLayout
from .state import STATE

BACKENDS = ("auto", "triton", "torch")


@functools.lru_cache(maxsize=1)
def _triton_available() -> bool:
    # find_spec, not import: a CPU user may still set TRITON_INTERPRET after importing taco_triton,
    # and Triton reads it when a function is decorated (its own library when it is imported)
    return importlib.util.find_spec("triton") is not None


def resolve_backend(backend: str, device: torch.device) -> str:
    """The backend that will actually run: "triton" or "torch".

    "auto" runs the Triton kernels on CUDA tensors and the torch reference elsewhere. "triton" on a
    CPU tensor needs Triton's interpreter: TRITON_INTERPRET=1 in the environment before taco_triton's
    kernels are first imported, which the first Triton launch does (`import taco_triton` imports
    neither Triton nor its kernels). If another package imported Triton first, Triton's own library is
    rebuilt for the interpreter (`env.prepare_interpreter`).

    Raises:
        ValueError: an unknown backend.
        RuntimeError: "triton" without the triton package, on a CPU tensor without TRITON_INTERPRET=1,
            or with taco_triton's kernels already built for a GPU in this process.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not supported; allowed: {list(BACKENDS)}")
    if backend == "torch":
        return "torch"
    if backend == "auto":
        return "triton" if device.type == "cuda" and _triton_available() else "torch"
    if not _triton_available():
        raise RuntimeError("backend='triton' needs the triton package, which is not installed")
    if device.type != "cuda":
        if not env.interpreting():
            raise RuntimeError(
                f"backend='triton' on a {device.type} tensor needs Triton's interpreter: set "
                "TRITON_INTERPRET=1 (taco_triton.env.use_interpreter_on_cpu) before the first Triton launch, "
                "or use backend='auto'/'torch'"
            )
        env.prepare_interpreter()  # another package may have imported Triton first
    return "triton"


def _config(codec, group_size, hadamard, scales, rounding, seed) -> CompressionConfig:
    return CompressionConfig(codec, group_size, hadamard, scales, rounding, seed)


@torch.library.custom_op("taco_triton::compress", mutates_args=())
def compress_op(
    x: torch.Tensor, codec: str, group_size: int, hadamard: bool, scales: str, rounding: str,
    seed: int, backend: str,
) -> torch.Tensor:
    """Wire buffer (1-D uint8) of a contiguous tensor; see `taco_triton.compress`."""
    cfg = _config(codec, group_size, hadamard, scales, rounding, seed)
    if resolve_backend(backend, x.device) == "triton":
        from .kernels.compress import compress_triton

        return compress_triton(x, cfg)
    return reference.compress_reference(x, cfg)


@compress_op.register_fake
def _(x, codec, group_size, hadamard, scales, rounding, seed, backend):
    nbytes = WireLayout.of(x.numel(), _config(codec, group_size, hadamard, scales, rounding, seed)).nbytes
    return x.new_empty(nbytes, dtype=torch.uint8)


@torch.library.custom_op("taco_triton::decompress", mutates_args=())
def decompress_op(
    data: torch.Tensor, numel: int, dtype: torch.dtype, codec: str, group_size: int,
    hadamard: bool, scales: str, rounding: str, seed: int, backend: str,
) -> torch.Tensor:
    """Flat tensor of `numel` elements of `dtype` from a wire buffer; see `taco_triton.decompress`."""
    cfg = _config(codec, group_size, hadamard, scales, rounding, seed)
    if resolve_backend(backend, data.device) == "triton":
        from .kernels.decompress import decompress_triton

        return decompress_triton(data, alloc.empty(numel, dtype, data.device), cfg)
    return reference.decompress_reference(data, numel, cfg, dtype)


@decompress_op.register_fake
def _(data, numel, dtype, codec, group_size, hadamard, scales, rounding, seed, backend):
    return data.new_empty(numel, dtype=dtype)


@torch.library.custom_op("taco_triton::decompress_into", mutates_args=("out",))
def decompress_into_op(
    data: torch.Tensor, out: torch.Tensor, codec: str, group_size: int, hadamard: bool,
    scales: str, rounding: str, seed: int, backend: str,
) -> None:
    """Decompress into the contiguous tensor `out`; see `taco_triton.decompress`."""
    cfg = _config(codec, group_size, hadamard, scales, rounding, seed)
    if resolve_backend(backend, data.device) == "triton":
        from .kernels.decompress import decompress_triton

        decompress_triton(data, out, cfg)
    else:
        out.view(-1).copy_(reference.decompress_reference(data, out.numel(), cfg, out.dtype))


@decompress_into_op.register_fake
def _(data, out, codec, group_size, hadamard, scales, rounding, seed, backend):
    return None


# ----------------------------------------------------------------------------- collective helpers
# Plain dispatchers (not torch ops) for the collectives: they write into preallocated slices of
# send/receive buffers instead of allocating.
def compress_into(x: torch.Tensor, config: CompressionConfig, out: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """Compress contiguous `x` into `out` (1-D uint8 of exactly the wire size)."""
    if resolve_backend(backend, x.device) == "triton":
        from .kernels.compress import compress_triton

        return compress_triton(x, config, out=out)
    out.copy_(reference.compress_reference(x, config))
    return out


def decompress_into(
    data: torch.Tensor, out: torch.Tensor, config: CompressionConfig, backend: str = "auto", *, inf_above: float = math.inf
) -> torch.Tensor:
    """Decompress a wire buffer into contiguous `out` (`inf_above`: see `reference.saturate_cast`)."""
    if resolve_backend(backend, data.device) == "triton":
        from .kernels.decompress import decompress_triton

        return decompress_triton(data, out, config, inf_above)
    out.view(-1).copy_(reference.decompress_reference(data, out.numel(), config, out.dtype, inf_above))
    return out


def reduce_into(
    bufs: torch.Tensor, numel: int, config: CompressionConfig, scale: float, *, out: torch.Tensor | None = None,
    dense_out: torch.Tensor | None = None, backend: str = "auto", inf_above: float = math.inf,
) -> torch.Tensor:
    """Sum P ranks' wire buffers of one chunk ([P, stride] uint8): compressed into `out` or dense into
    `dense_out` (`inf_above`: see `reference.saturate_cast`)."""
    if resolve_backend(backend, bufs.device) == "triton":
        from .kernels.reduce import reduce_triton

        return reduce_triton(bufs, numel, config, scale, out=out, dense_out=dense_out, inf_above=inf_above)
    if dense_out is not None:
        dense_out.view(-1).copy_(reference.reduce_reference(bufs, numel, config, scale, dense_out.dtype, inf_above))
        return dense_out
    data = reference.reduce_reference(bufs, numel, config, scale)
    return data if out is None else out.copy_(data)


# ----------------------------------------------------------------------------- eager fast path
# `taco_triton.compress` / `decompress` outside torch.compile: the same work as the registered
# ops without their dispatch layers (which only tracing needs), with everything but the data
# prepared once per (numel, config, dtype, device, backend): layout, launch parameters, grid,
# constexprs, Hadamard tables. A steady-state call is an allocation, three views and one launch.
# Kept in `STATE.eager` (cleared whole past `STATE.EAGER_BOUND`) and `STATE.backends`.


def _backend_of(backend: str, device: torch.device) -> str:
    key = (backend, device.type)
    got = STATE.backends.get(key)
    if got is None:
        got = resolve_backend(backend, device)
        if backend == "auto":  # "triton" on CPU depends on TRITON_INTERPRET at call time: not cached
            STATE.backends[key] = got
    return got


# Keys hold id(config), not the config (hashing a frozen dataclass hashes all its fields on every
# call); the entry keeps the config itself alive, so its id cannot be reused by another object.
def _remember(key, config, prep):
    if len(STATE.eager) >= STATE.EAGER_BOUND:
        STATE.eager.clear()
    STATE.eager[key] = (config, prep)
    return prep


def wire_nbytes(numel: int, config: CompressionConfig) -> int:
    """`WireLayout.of(numel, config).nbytes`, remembered per (numel, config object)."""
    key = ("nbytes", numel, id(config))
    entry = STATE.eager.get(key)
    if entry is None:
        return _remember(key, config, WireLayout.of(numel, config).nbytes)
    return entry[1]


def compress_eager(x: torch.Tensor, config: CompressionConfig, backend: str = "auto") -> torch.Tensor:
    """The wire buffer of contiguous `x` (what `compress_op` returns), without dispatch layers."""
    key = ("compress", x.numel(), id(config), x.dtype, x.device, backend)
    entry = STATE.eager.get(key)
    if entry is None:
        return _remember(key, config, _prepare_compress(x, config, backend))(x)
    return entry[1](x)


def _prepare_compress(x: torch.Tensor, config: CompressionConfig, backend: str):
    if _backend_of(backend, x.device) != "triton":
        return lambda x: reference.compress_reference(x, config)
    from .kernels.compress import CompressOp

    layout = WireLayout.of(x.numel(), config)
    nbytes, device = layout.nbytes, x.device
    if layout.n_groups == 0:
        return lambda x: alloc.empty(nbytes, torch.uint8, device)
    data = alloc.empty(nbytes, torch.uint8, device)
    codes, a, b = layout.split(data)
    launch = CompressOp(config, device).dense(x, codes, a, b, x.numel())
    a0, b0 = layout.scale_a_offset, layout.scale_b_offset
    b_f32 = config.scales != "dual"

    # The codes argument is the wire buffer itself: the codes view starts at its first byte with
    # its dtype, and a kernel sees only the pointer (one slice and one view fewer per call).
    def run(x):
        data = alloc.empty(nbytes, torch.uint8, device)
        b = data[b0:]
        launch(x, data, data[a0:b0].view(torch.float32), b.view(torch.float32) if b_f32 else b)
        return data

    return run


def decompress_eager(data: torch.Tensor, out: torch.Tensor, config: CompressionConfig, backend: str = "auto",
                     inf_above: float = math.inf) -> torch.Tensor:
    """Decompress a 16-byte-aligned wire buffer into contiguous `out`, without dispatch layers."""
    key = ("decompress", out.numel(), id(config), out.dtype, out.device, backend, inf_above)
    entry = STATE.eager.get(key)
    if entry is None:
        _remember(key, config, _prepare_decompress(data, out, config, backend, inf_above))(data, out)
    else:
        entry[1](data, out)
    return out


def _prepare_decompress(data, out, config: CompressionConfig, backend: str, inf_above: float):
    if _backend_of(backend, data.device) != "triton":
        def ref(data, out):
            out.view(-1).copy_(reference.decompress_reference(data, out.numel(), config, out.dtype, inf_above))
        return ref
    from .kernels.decompress import DecompressOp

    layout = WireLayout.of(out.numel(), config)
    if layout.n_groups == 0:
        return lambda data, out: None
    codes, a, b = layout.split(data)
    device = out.device
    launch = DecompressOp(config, device).dense(codes, a, b, out, out.numel(), inf_above)
    a0, b0 = layout.scale_a_offset, layout.scale_b_offset
    b_f32 = config.scales != "dual"

    def run(data, out):  # codes: the buffer itself, as in `_prepare_compress`
        b = data[b0:]
        launch(data, data[a0:b0].view(torch.float32), b.view(torch.float32) if b_f32 else b, out)

    return run
