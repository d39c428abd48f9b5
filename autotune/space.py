"""The launch-config space of each kernel, and the rules that prune it.

The full space is num_warps in {1, 2, 4, 8, 16} x num_stages in {1, 2, 3, 4} (20 configs). The
tile never changes: a program loops over tiles of two super-blocks, 8192 elements (8192/G rows
of G), so a config only decides how many threads share a tile and how deeply the next tile's
loads are pipelined. Three
rules remove configs that cannot pay off; `--no-prune` in the sweep times the full space anyway,
which is how the rules are checked on a GPU.

1. Stages need a loop. Triton's software pipeliner only stages loads inside `for` loops; a
   kernel without one compiles num_stages = 2, 3, 4 to the same code as 1, which would only
   multiply the sweep time. Today's kernels are persistent (every program loops over tiles), are
   registered with `pipelined=True`, and keep all stages.

2. Every thread must own at least one 16-byte vector of the tile: num_warps * 32 threads *
   (16 / itemsize) elements <= the tile. More warps than that leave threads without a full vector
   (or without any work) and add only scheduling overhead. With today's 8192-element tile this
   bound is 16 warps for the 1-byte codes, so it removes nothing from {1..16}; it is the rule
   that bites for a kernel registered with a smaller tile.

3. No config whose estimated live registers exceed the hardware limit of 255 per thread (they
   would spill to local memory). The estimate counts the values live at the kernel's peak, the
   Hadamard `tl.dot`: the FP32 tile twice (the dot's operand and its accumulator), spread over
   num_warps * 32 threads; the Hadamard table is a tensor-core operand in shared memory. This
   removes 1 and 2 warps (512 and 256 registers/thread). It is an estimate (the compiler can
   reuse registers), so it only removes configs above the hard limit, never "probably slow"
   ones; `bench/aot.py` reports the compiled kernels' real counts.

The heuristic in `taco_triton.kernels._launch` always comes first and is never pruned, so a sweep
or an online tuning can only match or beat the default. Under Triton's interpreter every config
runs the same Python code, so the space collapses to the heuristic alone.
"""
from __future__ import annotations

import itertools

import torch

from taco_triton.config import SUPERBLOCK_ELEMS, CompressionConfig
from taco_triton.kernels import _launch  # imports no Triton code

from . import registry

WARPS = (1, 2, 4, 8, 16)
"""The num_warps values of the space."""
STAGES = (1, 2, 3, 4)
"""The num_stages values of the space."""
VECTOR_BYTES = 16
"""Widest global load/store per thread on NVIDIA GPUs (ld.global.v4.b32), rule 2."""
MAX_REGISTERS_PER_THREAD = 255
"""Hardware limit on every NVIDIA GPU since Kepler, rule 3."""
THREADS_PER_WARP = 32
"""Threads of a warp on NVIDIA GPUs."""


def heuristic(kernel: str, config: CompressionConfig) -> dict:
    """The default the kernels use without a tuned config (taco_triton.kernels._launch.heuristic),
    for the GPU family this torch build drives (a ROCm build: AMD's).

    Args:
        kernel: the kernel's name ("compress", "decompress", ...).
        config: the compression config.

    Returns:
        {"num_warps", "num_stages"}.
    """
    return _launch.heuristic(kernel, config, "hip" if torch.version.hip is not None else "cuda")


def full_space() -> list[dict]:
    """The whole space.

    Returns:
        All 20 configs ({"num_warps", "num_stages"}), fewest warps and stages first.
    """
    return [{"num_warps": w, "num_stages": s} for w, s in itertools.product(WARPS, STAGES)]


def estimated_registers(config: CompressionConfig, num_warps: int, tile_elems: int = SUPERBLOCK_ELEMS) -> int:
    """Rule 3's estimate of 32-bit registers per thread at the kernel's peak: the FP32 tile twice
    (the transform's input and its accumulator). The Hadamard table is a tensor-core operand kept
    in shared memory, so it takes no registers (bench/aot.py measures 128 at 4 warps for G=128).

    Args:
        config: the compression config (the estimate does not depend on it today).
        num_warps: warps sharing the tile.
        tile_elems: elements of the tile.

    Returns:
        Estimated 32-bit registers per thread.
    """
    live = 2 * tile_elems
    threads = num_warps * THREADS_PER_WARP
    return -(-live // threads)


def prune_reason(
    params: dict,
    config: CompressionConfig,
    dtype: torch.dtype,
    *,
    pipelined: bool = False,
    tile_elems: int = SUPERBLOCK_ELEMS,
) -> str | None:
    """Why `params` is pruned for this problem. See the module docstring.

    Args:
        params: {"num_warps", "num_stages"}.
        config: the compression config.
        dtype: the input dtype (rule 2's vector width).
        pipelined: whether the kernel loops, so that stages can pay off (rule 1).
        tile_elems: elements of the kernel's tile.

    Returns:
        The rule that removes `params`, in words, or None to keep it.
    """
    w, s = params["num_warps"], params["num_stages"]
    if s > 1 and not pipelined:
        return "num_stages > 1: the kernel has no loop for the pipeliner to stage"
    per_thread = VECTOR_BYTES // dtype.itemsize
    if w * THREADS_PER_WARP * per_thread > tile_elems:
        return (
            f"{w} warps x 32 threads x {per_thread} elements (one 16-byte vector of {dtype}) "
            f"> the {tile_elems}-element tile"
        )
    regs = estimated_registers(config, w, tile_elems)
    if regs > MAX_REGISTERS_PER_THREAD:
        return f"~{regs} live registers per thread > {MAX_REGISTERS_PER_THREAD} (would spill)"
    return None


def candidates(
    kernel: str,
    config: CompressionConfig,
    dtype: torch.dtype,
    *,
    interpreter: bool,
    prune: bool = True,
) -> list[dict]:
    """The configs to time for `kernel` on (config, dtype): the heuristic first, then the rest.

    Args:
        kernel: a name registered in `autotune.registry.KERNELS`.
        config: the compression config.
        dtype: the input dtype.
        interpreter: True under TRITON_INTERPRET=1, where the space collapses to the heuristic.
        prune: apply the rules of the module docstring (False: the full 20-config space).

    Returns:
        {"num_warps", "num_stages"} dicts, the heuristic first.
    """
    ks = registry.spec(kernel, need_builder=False)
    first = heuristic(kernel, config)
    if interpreter:
        return [first]
    rest = [
        p
        for p in full_space()
        if p != first
        and (not prune or prune_reason(p, config, dtype, pipelined=ks.pipelined, tile_elems=ks.tile_elems) is None)
    ]
    return [first, *rest]


def parse_configs(text: str) -> list[dict]:
    """Parse "4:1,8:1" (num_warps:num_stages pairs) into configs, checked against the full space.

    Args:
        text: comma-separated num_warps:num_stages pairs.

    Returns:
        {"num_warps", "num_stages"} dicts, in the order given.

    Raises:
        ValueError: a pair that is not two integers, one outside the space, or no pair at all.
    """
    out = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        try:
            w, s = (int(v) for v in item.split(":"))
        except ValueError:
            raise ValueError(f"config {item!r} is not 'num_warps:num_stages', e.g. '4:1'") from None
        if w not in WARPS or s not in STAGES:
            raise ValueError(f"config {item!r} is outside the space: num_warps in {WARPS}, num_stages in {STAGES}")
        out.append({"num_warps": w, "num_stages": s})
    if not out:
        raise ValueError(f"no configs in {text!r}")
    return out
