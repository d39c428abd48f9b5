"""Recorded outputs of the compressed collectives, to hold a refactoring to the same bytes.

Every case runs on P gloo ranks (P = 2 and 3): all_reduce (sum, avg), reduce_scatter, all_gather
and p2p (a ring of messages) x the codec paths (backend "triton" under Triton's interpreter, and
"torch") x configs (FP8 default, INT8, INT6 at G=32, FP8 with stochastic rounding) x pipeline
depth 1 and 3 x a size of whole super-blocks per rank and an odd one x sync / async (p2p: the
`encode` / `decode_into` steps around plain sends, or `isend` / `irecv`); a few more cases add
three-slice pipelines, fp16/fp32 inputs, the agreement exchange and the p2p handshake
(check="always"), and the errors of ranks that disagree or of bad arguments (their messages).

Each case calls the collective twice (the second call takes the steady path) on inputs seeded
by the case's name and rank, with call numbers set from the case's name (they salt stochastic
seeds), so any subset of the cases reruns alone. Per rank and call it keeps a digest of the
output bytes, a digest of every buffer the process group filled on this rank (what it received:
all_to_all and all_gather outputs, p2p receives, fingerprints and handshakes), those buffers'
sizes, and what `WireStats` counted.

    python -m tests.golden_cases              # record every case into tests/data/golden_collectives.json
    python -m tests.golden_cases --worlds 2   # only P = 2 (the other world's records are kept)
    python -m tests.golden_cases --match 'ar_.*-stoch-pipe3'   # only the cases a change meant to alter

`tests/test_bitwise_golden.py` reruns the default selection (`selection()`), or every case with
TACO_TEST_GOLDEN=all, and compares. Recorded under TRITON_INTERPRET=1 on CPU: compiled GPU
kernels are not held to these bytes.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import re
import os
import threading
import zlib
from pathlib import Path

import torch

DATA = Path(__file__).resolve().parent / "data" / "golden_collectives.json"
WORLDS = (2, 3)
SB = 4096  # elements of a super-block

OPS = ("ar_sum", "ar_avg", "rs", "ag", "p2p")
BACKENDS = ("triton", "torch")
CONFIGS = {
    "fp8": {},
    "int8": {"codec": "int8"},
    "int6g32": {"codec": "int6", "group_size": 32},
    "stoch": {"rounding": "stochastic", "seed": 7},
}
PIPELINES = (1, 3)
#: elements per rank's chunk (all_reduce: per super-block-aligned chunk; reduce_scatter: output;
#: all_gather: shard; p2p: message): two super-blocks (pipeline 3 cuts two slices), an odd size
#: (all_reduce's last rank then gets a short chunk, at P = 3 an empty second piece), three
#: super-blocks (three slices)
SIZES = {"aligned": 2 * SB, "odd": SB + SB // 2 + 37, "large": 3 * SB}
MODES = ("sync", "async")


def case_names(world: int) -> list[str]:
    """Every recorded case of `world` ranks, in recording order."""
    names = []
    for op, backend, cfg, size, mode in itertools.product(OPS, BACKENDS, CONFIGS, ("aligned", "odd"), MODES):
        for pipeline in (PIPELINES if op != "p2p" else (1,)):
            names.append(f"P{world}-{op}-{backend}-{cfg}-pipe{pipeline}-{size}-{mode}-bf16")
    for op, backend in itertools.product(OPS[:4], BACKENDS):
        names.append(f"P{world}-{op}-{backend}-fp8-pipe3-large-sync-bf16")
    for backend, dtype in itertools.product(BACKENDS, ("fp16", "fp32")):
        names.append(f"P{world}-ar_sum-{backend}-int8-pipe1-odd-async-{dtype}")
    for backend in BACKENDS:
        names += [f"P{world}-agree-{backend}", f"P{world}-handshake-{backend}", f"P{world}-errors-{backend}"]
    return names


#: What the default test reruns per world (within its time budget): the torch path's every op,
#: the Triton path's (whose interpreted launches cost 0.1-0.3 s each) four at P = 2 and one at
#: P = 3, so that each config, pipeline depth, size and mode has its turn on each path.
SELECTED = {
    2: ["ar_sum-triton-fp8-pipe3-odd-async", "rs-triton-stoch-pipe3-aligned-sync", "ag-triton-int6g32-pipe1-odd-sync",
        "p2p-triton-int8-pipe1-aligned-async",
        "ar_sum-torch-int8-pipe1-aligned-sync", "ar_avg-torch-stoch-pipe3-odd-async",
        "rs-torch-int6g32-pipe1-odd-async", "ag-torch-fp8-pipe3-aligned-sync", "p2p-torch-stoch-pipe1-odd-sync"],
    3: ["ar_avg-triton-int8-pipe3-odd-async",
        "ar_sum-torch-stoch-pipe3-aligned-async", "ar_avg-torch-fp8-pipe1-odd-sync", "rs-torch-int8-pipe3-odd-sync",
        "ag-torch-stoch-pipe1-aligned-async", "p2p-torch-int6g32-pipe1-aligned-async"],
}


def selection(world: int) -> list[str]:
    """The cases the default test reruns: `SELECTED`, the agreement, handshake and error cases
    on the torch path, the errors also on the Triton path at P = 2."""
    out = [f"P{world}-{c}-bf16" for c in SELECTED[world]]
    out += [f"P{world}-agree-torch", f"P{world}-handshake-torch", f"P{world}-errors-torch"]
    return out + ([f"P{world}-errors-triton"] if world == 2 else [])


# ---------------------------------------------------------------------------------- recording
def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()


class _Received:
    """Every tensor the process group was asked to fill on this rank while installed (in the
    order the calls were made, from any thread), digested after the call completed."""

    def __init__(self):
        self.lock = threading.Lock()
        self.buffers: list = []
        self.saved: list = []

    def _wrap(self, owner, name: str, what: str, out_index: int = 0):
        orig = getattr(owner, name)

        def wrapped(*args, **kwargs):
            with self.lock:
                self.buffers.append((what, args[out_index]))
            return orig(*args, **kwargs)

        self.saved.append((owner, name, orig))
        setattr(owner, name, wrapped)

    def __enter__(self):
        import torch.distributed as dist

        from taco_triton.collectives import _pg

        self._wrap(dist, "all_to_all_single", "all_to_all")
        self._wrap(_pg, "_ALL_GATHER", "all_gather")
        self._wrap(dist, "irecv", "recv")
        self._wrap(dist, "recv", "recv")
        return self

    def __exit__(self, *exc):
        for owner, name, orig in reversed(self.saved):
            setattr(owner, name, orig)

    def take(self) -> tuple[str, str]:
        """(digest of every buffer filled since the last take, their sizes), order-free (a p2p
        receive may be posted by a thread)."""
        with self.lock:
            got, self.buffers = self.buffers, []
        entries = sorted(f"{what}:{t.dtype}:{t.numel()}:{_digest(_bytes(t))}" for what, t in got)
        sizes = sorted(f"{what}:{t.numel() * t.element_size()}" for what, t in got)
        return _digest("|".join(entries).encode()), ",".join(sizes)


def _number_calls(n: int) -> None:
    """Start the collectives' and p2p's call numbers (they salt stochastic seeds) at `n`."""
    from taco_triton.state import STATE

    STATE.calls = itertools.count(n)
    STATE.messages_sent = itertools.count(n)


def _stats(ws) -> str:
    calls = [f"{c.kind}:{c.collective}:{c.buffer_bytes}:{c.wire_bytes:g}:{int(c.compressed)}" for c in ws.calls]
    return ",".join(calls + [f"fingerprint:{ws.fingerprint_bytes:g}"])


def _input(name: str, rank: int, call: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}/{rank}/{call}".encode()))
    x = torch.randn(n, generator=g)
    x[::97] *= 50.0  # outliers
    return x.to(dtype)


def _parse(name: str) -> dict:
    _, op, backend, cfg, pipe, size, mode, dtype = name.split("-")
    return dict(op=op, backend=backend, cfg=cfg, pipeline=int(pipe[4:]), size=size, mode=mode,
                dtype={"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype])


def _collective(name: str, rank: int, world: int, call: int, check=False):
    """Issue one call of case `name`; returns (what to wait for or None, the output tensor)."""
    import torch.distributed as dist

    import taco_triton as taco
    from taco_triton.collectives import p2p

    c = _parse(name)
    cfg = taco.CompressionConfig(**CONFIGS[c["cfg"]])
    m, dtype, asynch = SIZES[c["size"]], c["dtype"], c["mode"] == "async"
    kw = dict(min_bytes=0, backend=c["backend"], check=check)
    if c["op"] in ("ar_sum", "ar_avg"):
        n = world * (SB + SB // 2) + 37 if c["size"] == "odd" else world * m
        x = _input(name, rank, call, n, dtype)
        op = "sum" if c["op"] == "ar_sum" else "avg"
        return taco.all_reduce(x, config=cfg, op=op, async_op=asynch, pipeline=c["pipeline"], **kw), x
    if c["op"] == "rs":
        out = torch.empty(m, dtype=dtype)
        inp = _input(name, rank, call, world * m, dtype)
        return taco.reduce_scatter(out, inp, config=cfg, async_op=asynch, pipeline=c["pipeline"], **kw), out
    if c["op"] == "ag":
        out = torch.empty(world * m, dtype=dtype)
        shard = _input(name, rank, call, m, dtype)
        return taco.all_gather(out, shard, config=cfg, async_op=asynch, pipeline=c["pipeline"], **kw), out
    # p2p: a ring, rank r sends to r + 1 and receives from r - 1
    x = _input(name, rank, call, m, dtype)
    into = torch.empty(m, dtype=dtype)
    nxt, prev = (rank + 1) % world, (rank - 1) % world
    if asynch:
        send = p2p.isend(x, nxt, config=cfg, **kw)
        recv = p2p.irecv(into, prev, config=cfg, **kw)
        send.wait()
        recv.wait()
        return None, into
    wire = p2p.encode(x, cfg, c["backend"])
    send = dist.isend(wire, nxt)
    got = p2p.wire_like(into, cfg)
    dist.recv(got, prev)
    send.wait()
    p2p.decode_into(got, into, cfg, c["backend"])
    return None, into


def _outcome(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the message is what is recorded
        return f"{type(e).__name__}: {e}"
    return "ok"


def _errors(name: str, rank: int, world: int) -> dict:
    """The messages of calls that fail: ranks whose configs differ (same wire sizes, check off:
    the tags catch it), and bad arguments (before any byte moves)."""
    import taco_triton as taco
    from taco_triton.collectives import p2p

    backend = name.rsplit("-", 1)[1]
    kw = dict(min_bytes=0, backend=backend, check=False)
    mine = taco.CompressionConfig(seed=rank + 1)  # a different signature, the same wire sizes
    out = {}
    x = _input(name, rank, 0, 600, torch.bfloat16)
    out["tag_sync"] = _outcome(lambda: taco.all_reduce(x, config=mine, **kw))
    out["tag_async"] = _outcome(lambda: taco.all_reduce(x, config=mine, async_op=True, **kw).wait())
    shard = _input(name, rank, 1, 600, torch.bfloat16)
    out["tag_all_gather"] = _outcome(lambda: taco.all_gather(torch.empty(world * 600, dtype=torch.bfloat16), shard,
                                                             config=mine, **kw))
    into = torch.empty(600, dtype=torch.bfloat16)
    nxt, prev = (rank + 1) % world, (rank - 1) % world

    def ring():
        send = p2p.isend(x, nxt, config=mine, **kw)
        try:
            p2p.irecv(into, prev, config=mine, **kw).wait()
        finally:
            send.wait()

    out["tag_p2p"] = _outcome(ring)
    out["check_errors"] = _outcome(taco.check_errors)
    out["agreement"] = _outcome(lambda: taco.all_reduce(x, config=mine, min_bytes=0, backend=backend, check=True))
    out["op"] = _outcome(lambda: taco.all_reduce(x, op="max", **kw))
    out["pipeline"] = _outcome(lambda: taco.all_reduce(x, pipeline=0, **kw))
    out["min_bytes"] = _outcome(lambda: taco.all_reduce(x, min_bytes=-1, backend=backend))
    out["config"] = _outcome(lambda: taco.all_reduce(x, config="fp8", **kw))
    out["rs_sizes"] = _outcome(lambda: taco.reduce_scatter(torch.empty(7, dtype=torch.bfloat16), x, **kw))
    out["ag_dtype"] = _outcome(lambda: taco.all_gather(torch.empty(world * 600), x, **kw))
    out["avg_int"] = _outcome(lambda: taco.all_reduce(torch.arange(6), op="avg", **kw))
    out["overlap"] = _outcome(lambda: taco.all_reduce(torch.zeros(1, dtype=torch.bfloat16).expand(600), **kw))
    out["irecv_strided"] = _outcome(lambda: p2p.irecv(torch.empty(2, 600, dtype=torch.bfloat16).t(), prev,
                                                      config=mine, **kw))
    return out


def run_case(name: str, rank: int, world: int) -> dict:
    """This rank's record of case `name` (see the module docstring)."""
    import taco_triton as taco

    base = zlib.crc32(name.encode()) % 1_000_000 * 10
    _number_calls(base)
    kind = name.split("-")[1]
    if kind == "errors":
        with _Received():
            return _errors(name, rank, world)
    special = kind in ("agree", "handshake")
    if special:  # the exchanges that check=True runs once per signature, run on every call here
        backend = name.rsplit("-", 1)[1]
        name = f"P{world}-{'ar_sum' if kind == 'agree' else 'p2p'}-{backend}-fp8-pipe1-aligned-sync-bf16"
    rec: dict = {"out": [], "wire": [], "sizes": [], "stats": []}
    with _Received() as received:
        for call in range(2):
            with taco.WireStats() as ws:
                if kind == "handshake":
                    work, out = _handshake(name, rank, world, call)
                else:
                    work, out = _collective(name, rank, world, call, check="always" if special else False)
                if work is not None:
                    work.wait()
            rec["out"].append(_digest(_bytes(out)))
            wire, sizes = received.take()
            rec["wire"].append(wire)
            rec["sizes"].append(sizes)
            rec["stats"].append(_stats(ws))
    return rec


def _handshake(name: str, rank: int, world: int, call: int):
    import taco_triton as taco
    from taco_triton.collectives import p2p

    backend = name.split("-")[2]
    cfg = taco.CompressionConfig()
    x = _input(name, rank, call, SIZES["aligned"], torch.bfloat16)
    into = torch.empty_like(x)
    kw = dict(min_bytes=0, backend=backend, check="always")
    send = p2p.isend(x, (rank + 1) % world, config=cfg, **kw)
    p2p.irecv(into, (rank - 1) % world, config=cfg, **kw).wait()
    send.wait()
    return None, into


def run_cases(rank: int, world: int, names: list[str]) -> dict:
    """The records of `names` on this rank (a module-level body for `run_ranks`)."""
    return {name: run_case(name, rank, world) for name in names}


# ------------------------------------------------------------------------------------ the file
def load() -> dict:
    """{case name: [record of rank 0, rank 1, ...]}."""
    return json.loads(DATA.read_text())["cases"]


def record(worlds=WORLDS, match: str | None = None) -> None:
    """Record every case of `worlds` (with `match`, a regular expression, only the cases whose
    names it finds: after a deliberate change of some bytes, the others stay as recorded)."""
    from tests import golden_cases  # by its module name, also when run as __main__ (spawned ranks import it)
    from tests.dist_utils import run_ranks

    doc = json.loads(DATA.read_text()) if DATA.exists() else {"cases": {}}
    for world in worlds:
        names = [n for n in case_names(world) if match is None or re.search(match, n)]
        per_rank = run_ranks(golden_cases.run_cases, world, names, timeout_s=4 * 3600, pg_timeout_s=600)
        for name in names:
            doc["cases"][name] = [per_rank[r][name] for r in range(world)]
    doc["made_by"] = "python -m tests.golden_cases (TRITON_INTERPRET=1, gloo on CPU)"
    doc["torch"] = torch.__version__
    DATA.parent.mkdir(parents=True, exist_ok=True)
    DATA.write_text(json.dumps(doc, indent=0, sort_keys=True) + "\n")


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="record the collectives' golden outputs")
    ap.add_argument("--worlds", default="2,3", help="world sizes to record (default 2,3)")
    ap.add_argument("--match", help="record only the cases whose names this regular expression finds")
    args = ap.parse_args(argv)
    os.environ["TRITON_INTERPRET"] = "1"  # inherited by the spawned ranks, as the test suite sets them
    os.environ["TACO_TRITON_POISON_ALLOC"] = "1"
    record([int(w) for w in args.worlds.split(",")], args.match)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
