"""Time the launches the compressed collectives run, on one GPU, against a copy and the model.

A collective runs per pipeline slice a slotted compress (every rank's piece into its slot, tags
and padding), the tagged fused reduce (all_reduce: to a compressed slot; reduce_scatter: to the
dense output) and a slotted decompress (all_reduce, all_gather). One GPU cannot run the
collective between ranks, but it can run each launch exactly as rank 0 of a P-rank group builds
it (`collectives._plan.Plan.slice_launches`, the plan bench/aot.py models): the received buffers
are filled from this rank's own slots, each slot carrying the tag the plan expects, so the tag
checks pass and every launch takes its normal path.

Per launch kind (the slices' launches summed) it writes: the median time, logical GB/s (the bytes
the launch reads and writes over its time), a device copy's time for the same bytes measured in
the same run, `pct_of_copy` (copy time / launch time) and the compile-time model's bound for the
same launch on this GPU's target (`model_pct_bound`, from bench/results/aot_hotpath.csv; empty
where the table has no such row), and `tags_ok` (no launch recorded a tag mismatch). CSV rows
carry machine, commit and date.

Usage:
    python bench/hotpath_speed.py --csv out.csv                      # every call of the table, on cuda
    python bench/hotpath_speed.py --worlds 8 --mib 16 --codecs fp8_e4m3 --time-budget 60
    TRITON_INTERPRET=1 python bench/hotpath_speed.py --device cpu --mib 0.0625 --worlds 2   # a smoke run
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


def _aot():
    """bench/aot.py, for its plan of a call and its byte counts (importing it drops
    TRITON_INTERPRET, which a CPU run needs: it is put back)."""
    interpret = os.environ.get("TRITON_INTERPRET")
    spec = importlib.util.spec_from_file_location("taco_bench_aot", ROOT / "bench" / "aot.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    if interpret is not None:
        os.environ["TRITON_INTERPRET"] = interpret
    return mod


def _put(buf: torch.Tensor, at: int, tag: int) -> None:
    from taco_triton.kernels import slots

    buf[at : at + slots.TAG_BYTES] = torch.tensor(list(slots.tag_bytes(tag)), dtype=torch.uint8, device=buf.device)


def prepared(aot, hv, device: torch.device) -> list[dict]:
    """The call's launches on `device` with buffers that pass their tag checks: per slice the
    compress (run once to fill the send buffer), the reduce over P copies of this rank's slot,
    the decompress over P copies of the reduced (or sent) slot, each slot with its own tag."""
    from taco_triton.collectives._plan import Buffers
    from taco_triton.kernels import slots
    from taco_triton.kernels._launch import launch_params, target_of

    plan, src, dst = aot.hot_plan(hv, device)
    src.copy_(torch.randn(src.numel(), device=device).to(src.dtype))
    err = torch.zeros(slots.ERR_FIELDS, dtype=torch.int64, device=device)
    tables = torch.tensor(plan.table_rows(), dtype=torch.int64).to(device)
    counts = aot.hot_launches(hv, aot.TARGETS["sm_90"])  # elements and bytes (no device needed)

    def params(kernel, dtype, numel):
        return launch_params(kernel, device, dtype, plan.config, numel)

    out = []
    err.zero_()
    for k, sl in enumerate(plan.slices):
        b = Buffers(plan, k)
        compress, reduce, decompress = plan.slice_launches(k, src, dst, b, tables[k], err, target_of(device), params)
        compress.run()
        send, mine = plan.sends[k], plan.rank
        if b.rows is not None:  # every rank's slot for this rank: this rank's own, P times
            off, stride = send.offsets[mine], sl.strides[mine]
            b.rows.copy_(b.send[off : off + stride].expand(plan.p, stride))
        if reduce is not None:
            reduce.run()
        gathered = plan.gathers[k]
        if decompress is not None:
            one = b.own if b.own is not None else b.send[: sl.slot]
            rows = b.gathered.view(plan.p, sl.slot)
            rows.copy_(one[: sl.slot].expand(plan.p, sl.slot))
            for j, (lay, tag) in enumerate(zip(gathered.layouts, gathered.tags)):
                _put(rows[j], lay.nbytes, tag)
        for launch in (compress, reduce, decompress):
            if launch is not None:
                c = counts[len(out)]
                out.append({**c, "launch": launch, "slice": k, "err": err})
    return out


def main(argv=None) -> int:
    aot = _aot()
    from autotune import meta
    from taco_triton.config import CompressionConfig

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--collectives", default=",".join(aot.COLLECTIVES))
    ap.add_argument("--worlds", default=",".join(map(str, aot.HOT_WORLDS)))
    ap.add_argument("--mib", default=",".join(map(str, aot.HOT_MIB)), help="message sizes, MiB of bf16 (floats allowed)")
    ap.add_argument("--codecs", default="fp8_e4m3,int8")
    ap.add_argument("--odd", default="0,1", help="0: aligned sizes, 1: one element short per rank")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--time-budget", type=float, default=None, help="stop starting new calls after this many seconds")
    ap.add_argument("--model", type=Path, default=ROOT / "bench" / "results" / "aot_hotpath.csv")
    ap.add_argument("--csv", type=Path, default=None)
    args = ap.parse_args(argv)
    import pandas as pd

    device = torch.device(args.device)
    target = (f"sm_{''.join(map(str, torch.cuda.get_device_capability(device)))}" if device.type == "cuda" else "")
    model = pd.read_csv(args.model) if args.model.exists() else pd.DataFrame()
    name, capability = meta.device_identity(device)
    t0, rows = time.monotonic(), []
    calls = [aot.HotVariant(c, int(w), float(m) if "." in m else int(m), bool(int(o)), CompressionConfig(codec=k))
             for k in args.codecs.split(",") for c in args.collectives.split(",") for w in args.worlds.split(",")
             for m in args.mib.split(",") for o in args.odd.split(",")]
    for hv in calls:
        if args.time_budget is not None and time.monotonic() - t0 > args.time_budget:
            print(f"time budget spent: {len(calls) - calls.index(hv)} calls not timed")
            break
        launches = prepared(aot, hv, device)
        for kernel in dict.fromkeys(x["kernel"] for x in launches):
            mine = [x for x in launches if x["kernel"] == kernel]
            nbytes = sum(x["bytes"] for x in mine)
            t = meta.measure(lambda mine=mine: [x["launch"].run() for x in mine], device, args.repeats)
            a = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
            c = meta.measure(lambda a=a, b=torch.empty_like(a): b.copy_(a), device, args.repeats)
            tags_ok = int(mine[0]["err"][0]) == 0  # no launch found a tag it did not expect
            m = model[(model.get("target") == target) & (model.get("kernel") == kernel)
                      & (model.get("collective") == hv.collective) & (model.get("world") == hv.world)
                      & (model.get("message_mib") == hv.mib) & (model.get("odd") == hv.odd)
                      & (model.get("codec") == hv.config.codec)] if len(model) else model
            rows.append({**hv.row(), "kernel": kernel, "launches": len(mine), "elements": sum(x["elements"] for x in mine),
                         "bytes": nbytes, "tags_ok": tags_ok, "median_ms": t["median_ms"], "timer": t["timer"],
                         "logical_gbps": nbytes / t["median_ms"] / 1e6, "copy_ms": c["median_ms"],
                         "pct_of_copy": 100.0 * c["median_ms"] / t["median_ms"],
                         "model_pct_bound": float(m["pct_copy_bw_bound"].iloc[0]) if len(m) else None,
                         "device": name, "capability": capability, "machine": os.uname().nodename,
                         "git_commit": meta.git_commit(), "date": meta.utc_now()})
            r = rows[-1]
            print(f"{hv.collective} P={hv.world} {hv.mib} MiB odd={hv.odd} {hv.config.codec} {kernel}: "
                  f"{r['median_ms']:.3f} ms, {r['logical_gbps']:.1f} GB/s, {r['pct_of_copy']:.1f}% of copy "
                  f"(model {r['model_pct_bound']})")
    if args.csv:
        pd.DataFrame(rows).to_csv(args.csv, index=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
