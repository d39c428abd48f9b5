"""TransformerEngine's Linear layers through a compressing TP group (2 ranks, CUDA).

    torchrun --nproc-per-node 2 bench/te_group_check.py

A column-parallel te.Linear -> GELU -> row-parallel te.Linear, with and without sequence
parallelism, runs one forward and backward twice from the same weights and input: on the plain
TP group and on `taco.compressed_group(tp_group)`. TE communicates itself (all_reduce of the
row-parallel output and of the column-parallel input gradient; with sequence parallelism
all_gather / reduce_scatter along the first dimension), so this shows that its traffic goes
through the compressing group. Printed per case: the calls per site (module names, from
`track_sites`) and how many were compressed, the forward thread's compressed and forwarded bytes
(`WireStats`), and the relative L2 difference of the output and the input gradient against the
plain group.

With two or more GPUs each rank gets its own and the groups use NCCL; with one GPU both ranks
share it over gloo (NCCL refuses two ranks on one device), which carries CUDA tensors through
host memory. Exits 0 with a SKIPPED line when transformer_engine is not importable; exits 1 if
the compressing group compressed nothing or a difference exceeds `MAX_REL`.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

#: A sanity limit, not an error bound: FP8 E4M3 keeps 3 mantissa bits (relative rounding 2^-4 per
#: element); a two-quantization all_reduce stays well below 2^-3 in relative L2 on Gaussian data.
MAX_REL = 2.0**-3
TOKENS, HIDDEN, FFN = 256, 1024, 4096


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _layers(te, group, world, sp, w1, w2, rank):
    fc1 = te.Linear(HIDDEN, FFN, bias=False, tp_group=group, tp_size=world, parallel_mode="column",
                    sequence_parallel=sp, params_dtype=torch.bfloat16, device="cuda")
    fc2 = te.Linear(FFN, HIDDEN, bias=False, tp_group=group, tp_size=world, parallel_mode="row",
                    sequence_parallel=sp, params_dtype=torch.bfloat16, device="cuda")
    s = FFN // world
    with torch.no_grad():
        fc1.weight.copy_(w1[rank * s : (rank + 1) * s])
        fc2.weight.copy_(w2[:, rank * s : (rank + 1) * s])
    return torch.nn.ModuleDict({"fc1": fc1, "fc2": fc2})


def main() -> int:
    try:
        import transformer_engine.pytorch as te
    except Exception as e:  # noqa: BLE001 - any import failure means: no TE here
        print(f"te_group_check: SKIPPED: transformer_engine is not importable ({type(e).__name__}: {e})")
        return 0
    import taco_triton as taco
    from taco_triton.integrations.sites import track_sites
    from taco_triton.parallel import CompressionPolicy

    world = int(os.environ.get("WORLD_SIZE", "1"))
    n_gpu = torch.cuda.device_count()
    if n_gpu == 0 or world < 2:
        print(f"te_group_check: SKIPPED: needs CUDA and 2 ranks (GPUs: {n_gpu}, WORLD_SIZE: {world})")
        return 0
    backend = "nccl" if n_gpu >= world else "gloo"
    dist.init_process_group(backend)
    rank = dist.get_rank()
    torch.cuda.set_device(rank % n_gpu)
    inner = dist.new_group(list(range(world)))
    group = taco.compressed_group(inner, CompressionPolicy(min_bytes=0))
    gen = torch.Generator().manual_seed(0)
    w1 = (torch.randn(FFN, HIDDEN, generator=gen) / HIDDEN**0.5).to(torch.bfloat16)
    w2 = (torch.randn(HIDDEN, FFN, generator=gen) / FFN**0.5).to(torch.bfloat16)
    x_full = torch.randn(TOKENS, HIDDEN, generator=gen).to(torch.bfloat16)
    ok = True
    for sp in (False, True):
        out = {}
        for name, g in (("plain", inner), ("compressed", group)):
            model = _layers(te, g, world, sp, w1, w2, rank)
            x = (x_full.chunk(world)[rank] if sp else x_full).contiguous().cuda().requires_grad_(True)
            with taco.WireStats() as ws, track_sites(model):
                y = model["fc2"](torch.nn.functional.gelu(model["fc1"](x)))
                y.float().square().sum().backward()
            torch.cuda.synchronize()
            out[name] = (y.detach(), x.grad.detach(), ws)
        (y0, g0, _), (y1, g1, ws) = out["plain"], out["compressed"]
        rel_y, rel_g = _rel(y1, y0), _rel(g1, g0)
        # the group's stats see every thread; WireStats only the thread it is open in (on CUDA the
        # backward pass runs in autograd's device thread, so its bytes are not in `ws`)
        sites = {f"{s}|{d}": (st.calls, st.compressed) for (s, d, _), st in sorted(group.stats.items())}
        compressed = sum(c for _, c in sites.values())
        group.stats.clear()
        if rank == 0:
            print(f"te_group_check backend={backend} world={world} sequence_parallel={sp}: "
                  f"compressed calls={compressed} (calls, compressed) by site={sites}; forward thread's wire bytes: "
                  f"compressed {sum(c.wire_bytes for c in ws.calls if c.compressed):.0f}, "
                  f"forwarded {sum(c.wire_bytes for c in ws.calls if not c.compressed):.0f}; "
                  f"rel L2 vs the plain group: output {rel_y:.4f}, input grad {rel_g:.4f}")
        ok &= compressed > 0 and rel_y <= MAX_REL and rel_g <= MAX_REL
    dist.destroy_process_group()
    if rank == 0:
        print("te_group_check:", "OK" if ok else f"FAILED (nothing compressed, or a difference above {MAX_REL})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
