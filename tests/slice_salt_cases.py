"""Per-rank body of the slice-salt test (module-level so spawned processes can import it)."""
from __future__ import annotations

import torch
import torch.distributed as dist

import taco_triton as taco

#: elements of one pipeline slice's piece of a chunk (two super-blocks of G = 128)
PIECE = 8192


def slices_round_alike(rank: int, world: int, backend: str) -> dict:
    """A stochastic all_reduce in two pipeline slices whose pieces hold the same values (each
    rank's chunk is [v | v]): the correlation of the output's error between the two slices at the
    same offsets. Independent rounding gives about 0 (within a few 1/sqrt(n)); rounding both
    slices' requantized sums with the same random bits gives a clearly positive one."""
    cfg = taco.CompressionConfig(codec="int8", rounding="stochastic", seed=11)
    gen = torch.Generator().manual_seed(100 + rank)
    v = torch.randn(world, PIECE, generator=gen)         # one piece per chunk, per rank
    x = torch.cat([v, v], dim=1).reshape(-1).contiguous()  # chunk j = [v_j | v_j]: slice 0 and 1 alike
    exact = x.clone()
    dist.all_reduce(exact)
    out = x.clone()
    taco.all_reduce(out, config=cfg, min_bytes=0, pipeline=2, backend=backend)
    err = (out - exact).reshape(world, 2, PIECE)
    e0, e1 = err[:, 0].reshape(-1).double(), err[:, 1].reshape(-1).double()
    corr = float(torch.corrcoef(torch.stack([e0, e1]))[0, 1])
    return {"corr": corr, "n": e0.numel()}
