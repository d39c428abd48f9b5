"""Which kernels can be tuned, and how to build a timed problem for each.

`KERNELS` maps a kernel name (the name its wrapper passes to `launch_params`) to a `KernelSpec`
whose `build(numel, dtype, config, device, params)` returns `(fn, nbytes)`: `fn()` launches the
kernel once with `params` on a problem of `numel` elements, and `nbytes` is the logical traffic
of one call (input bytes + output bytes, scales included), from which GB/s is computed.

Adding a kernel is one entry. An entry whose `build` is None reserves a name and makes asking
for it a clear `KernelUnavailable` error (how "reduce" was registered before its kernel existed).

Builders import the Triton kernels lazily (importing this module touches neither Triton nor a
GPU) and keep their input tensors in a one-problem slot, so timing the configs of one problem
allocates once; `release()` frees the slot.
"""
from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable

import torch

from taco_triton.config import SUPERBLOCK_ELEMS, CompressionConfig
from taco_triton.layout import WireLayout

Builder = Callable[[int, torch.dtype, CompressionConfig, torch.device, dict], "tuple[Callable[[], None], int]"]


class KernelUnavailable(NotImplementedError):
    """The kernel name is reserved but its fused kernel does not exist yet."""


@dataclass(frozen=True)
class KernelSpec:
    """How to tune one kernel.

    Attributes:
        build: (numel, dtype, config, device, params) -> (fn, logical bytes per call); None while
            the kernel does not exist.
        pipelined: the kernel loops over loads, so num_stages matters (space rule 1).
        tile_elems: elements one program owns (space rules 2 and 3).
        unavailable: the error to raise while `build` is None.
        launch_dtype: the dtype the kernel's launch always passes to `launch_params` (reduce:
            torch.uint8), which the sweep then uses whatever --dtype says; None: the data dtype.
    """

    build: Builder | None
    pipelined: bool = False
    tile_elems: int = SUPERBLOCK_ELEMS
    unavailable: str = ""
    launch_dtype: torch.dtype | None = None


# One problem's tensors, reused across the configs timed on it (key -> dict of tensors).
_SLOT: dict = {}


def _tensors(key: tuple, make: Callable[[], dict]) -> dict:
    if key not in _SLOT:
        _SLOT.clear()  # one problem at a time: a 1 GiB input must not outlive its sweep
        _SLOT[key] = make()
    return _SLOT[key]


def release() -> None:
    """Free the inputs kept for the last problem."""
    _SLOT.clear()


def _random_input(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # Timing does not depend on values, but realistic (finite, non-zero) ones take the same
    # branches as real traffic; a fixed seed makes reruns launch identical work.
    g = torch.Generator(device=device).manual_seed(0)
    return torch.randn(numel, generator=g, device=device, dtype=torch.float32).to(dtype)


def _build_compress(numel: int, dtype: torch.dtype, config: CompressionConfig, device: torch.device, params: dict):
    from taco_triton.kernels._launch import forced
    from taco_triton.kernels.compress import compress_triton

    layout = WireLayout.of(numel, config)

    def make():
        return {
            "x": _random_input(numel, dtype, device),
            "wire": torch.empty(layout.nbytes, dtype=torch.uint8, device=device),
        }

    t = _tensors(("compress", numel, dtype, config, str(device)), make)
    x, wire = t["x"], t["wire"]

    def fn():
        with forced(params):
            compress_triton(x, config, out=wire)

    return fn, numel * dtype.itemsize + layout.nbytes


def _build_decompress(numel: int, dtype: torch.dtype, config: CompressionConfig, device: torch.device, params: dict):
    from taco_triton.kernels._launch import forced, heuristic
    from taco_triton.kernels.compress import compress_triton
    from taco_triton.kernels.decompress import decompress_triton

    layout = WireLayout.of(numel, config)

    def make():
        # A real wire buffer (valid scales and codes), made with the heuristic so that building a
        # decompress problem never triggers a lookup (or an online tuning) of compress.
        with forced(heuristic("compress", config)):
            wire = compress_triton(_random_input(numel, dtype, device), config)
        return {"wire": wire, "out": torch.empty(numel, dtype=dtype, device=device)}

    t = _tensors(("decompress", numel, dtype, config, str(device)), make)
    wire, out = t["wire"], t["out"]

    def fn():
        with forced(params):
            decompress_triton(wire, out, config)

    return fn, layout.nbytes + numel * dtype.itemsize


#: Ranks whose chunks the timed reduce sums. The reduce's launch passes neither the rank count nor
#: dense-vs-compressed output to `launch_params`, so neither is in the key: one tuned config
#: serves every P. 8 (one node's tensor-parallel degree) with compressed output (all_reduce's
#: step, the one that requantizes) is the problem tuned for.
REDUCE_RANKS = 8


def _build_reduce(numel: int, dtype: torch.dtype, config: CompressionConfig, device: torch.device, params: dict):
    from taco_triton.kernels._launch import forced, heuristic
    from taco_triton.kernels.compress import compress_triton
    from taco_triton.kernels.reduce import reduce_triton

    if dtype != torch.uint8:
        raise ValueError(f"reduce is launched (and keyed) with dtype torch.uint8, got {dtype}")
    layout = WireLayout.of(numel, config)
    stride = -(-layout.nbytes // 4) * 4  # reduce_triton wants 4-byte aligned rows

    def make():
        with forced(heuristic("compress", config)):
            wire = compress_triton(_random_input(numel, torch.bfloat16, device), config)
        bufs = torch.zeros(REDUCE_RANKS, stride, dtype=torch.uint8, device=device)
        bufs[:, : layout.nbytes] = wire  # the same chunk from every rank: timing does not depend on values
        return {"bufs": bufs, "out": torch.empty(layout.nbytes, dtype=torch.uint8, device=device)}

    t = _tensors(("reduce", numel, config, str(device)), make)
    bufs, out = t["bufs"], t["out"]

    def fn():
        with forced(params):
            reduce_triton(bufs, numel, config, 1.0 / REDUCE_RANKS, out=out)

    return fn, (REDUCE_RANKS + 1) * layout.nbytes


KERNELS: dict[str, KernelSpec] = {
    # Persistent kernels: each program loops over tiles of two super-blocks, so num_stages is a
    # real choice (the next tile's loads overlap the current tile's work).
    "compress": KernelSpec(build=_build_compress, pipelined=True, tile_elems=2 * SUPERBLOCK_ELEMS),
    "decompress": KernelSpec(build=_build_decompress, pipelined=True, tile_elems=2 * SUPERBLOCK_ELEMS),
    "reduce": KernelSpec(build=_build_reduce, pipelined=True, tile_elems=2 * SUPERBLOCK_ELEMS,
                         launch_dtype=torch.uint8),
}


def spec(kernel: str, need_builder: bool = True) -> KernelSpec:
    """The spec of `kernel`; ValueError for an unknown name, KernelUnavailable for "reduce" (for now)."""
    try:
        ks = KERNELS[kernel]
    except KeyError:
        raise ValueError(f"unknown kernel {kernel!r}; registered: {sorted(KERNELS)}") from None
    if need_builder and ks.build is None:
        raise KernelUnavailable(ks.unavailable or f"kernel {kernel!r} has no builder")
    return ks
