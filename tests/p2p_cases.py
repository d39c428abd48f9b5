"""p2p scenarios on 2 gloo ranks (tests/test_p2p.py): rank 0 sends, rank 1 receives."""
from __future__ import annotations

import random

import torch
import torch.distributed as dist

import taco_triton as taco
from taco_triton.collectives import p2p

from .collective_cases import _outcome

STOCHASTIC = taco.CompressionConfig(codec="int4", group_size=32, hadamard=False, rounding="stochastic")


def findings(rank: int, world: int, backend: str) -> dict:
    out = {}
    peer = 1 - rank
    base = taco.CompressionConfig(codec="int8", hadamard=False)
    # 5: ends that disagree (codec, group size, Hadamard, size) raise ValueError, no abort, no garbage
    for name, mine in (("codec", taco.CompressionConfig(codec="fp8_e4m3", hadamard=False)),
                       ("group_size", taco.CompressionConfig(codec="int8", group_size=64, hadamard=False)),
                       ("hadamard", taco.CompressionConfig(codec="int8"))):
        cfg = base if rank == 0 else mine
        x = torch.ones(256, dtype=torch.bfloat16)
        if rank == 0:
            out[name] = _outcome(lambda x=x, cfg=cfg: p2p.isend(x, peer, config=cfg, min_bytes=0, backend=backend).wait())
        else:
            out[name] = _outcome(lambda x=x, cfg=cfg: p2p.irecv(x, peer, config=cfg, min_bytes=0, backend=backend).wait())
    n = 256 if rank == 0 else 384
    x = torch.ones(n, dtype=torch.bfloat16)
    if rank == 0:
        out["size"] = _outcome(lambda: p2p.isend(x, peer, config=base, min_bytes=0, backend=backend).wait())
    else:
        out["size"] = _outcome(lambda: p2p.irecv(x, peer, config=base, min_bytes=0, backend=backend).wait())
    # min_bytes that differ: one end compresses, the other sends natively
    x = torch.ones(384, dtype=torch.bfloat16)
    mb = 0 if rank == 0 else 1 << 30
    if rank == 0:
        out["min_bytes"] = _outcome(lambda: p2p.isend(x, peer, config=base, min_bytes=mb, backend=backend).wait())
    else:
        out["min_bytes"] = _outcome(lambda: p2p.irecv(x, peer, config=base, min_bytes=mb, backend=backend).wait())
    # after agreement, a later divergence of the same size is caught by the message's tag
    agreed = torch.ones(512, dtype=torch.bfloat16)
    if rank == 0:
        p2p.isend(agreed, peer, config=base, min_bytes=0, backend=backend).wait()
        p2p.isend(agreed, peer, config=taco.CompressionConfig(codec="fp8_e4m3", hadamard=False), min_bytes=0,
                  backend=backend, check=False).wait()
    else:
        p2p.irecv(agreed, peer, config=base, min_bytes=0, backend=backend).wait()
        got = torch.empty(512, dtype=torch.bfloat16)
        out["tag"] = _outcome(lambda: p2p.irecv(got, peer, config=base, min_bytes=0, backend=backend,
                                                 check=False).wait())
        out["tag_nan"] = bool(got.float().isnan().all())
    # 9: a non-contiguous receive buffer is refused at call time; the message is still there
    msg = torch.arange(256, dtype=torch.float32).bfloat16()
    if rank == 0:
        p2p.isend(msg, peer, config=base, min_bytes=0, backend=backend).wait()
    else:
        strided = torch.empty(256, 2, dtype=torch.bfloat16)[:, 0]
        out["strided"] = _outcome(lambda: p2p.irecv(strided, peer, config=base, min_bytes=0, backend=backend))
        good = torch.empty(256, dtype=torch.bfloat16)
        p2p.irecv(good, peer, config=base, min_bytes=0, backend=backend).wait()
        out["after_strided"] = float((good.float() - msg.float()).abs().max() / 255)
    # 4: identical sends of a stochastic config give different bytes; their mean error falls
    g = torch.Generator().manual_seed(3)
    y = torch.randn(1024, generator=g).bfloat16()
    if rank == 0:
        wires = [p2p.encode(y, STOCHASTIC, backend) for _ in range(2)]
        out["wires_differ"] = not torch.equal(wires[0], wires[1])
        for _ in range(16):
            p2p.isend(y, peer, config=STOCHASTIC, min_bytes=0, backend=backend).wait()
    else:
        total = torch.zeros(1024, dtype=torch.float64)
        one = None
        for i in range(16):
            r = torch.empty(1024, dtype=torch.bfloat16)
            p2p.irecv(r, peer, config=STOCHASTIC, min_bytes=0, backend=backend).wait()
            total += r.double()
            if i == 0:
                one = float((r.double() - y.double()).norm() / y.double().norm())
        out["err_one"] = one
        out["err_mean16"] = float((total / 16 - y.double()).norm() / y.double().norm())
    dist.barrier()
    return out


def soak(rank: int, world: int, n_ops: int, seed: int, backend: str) -> dict:
    """Random messages (sizes incl. empty and odd, dtypes, configs, either direction, batches
    issued before any wait): each received tensor equals the codec's round trip of what was sent."""
    shared = random.Random(seed)
    configs = [taco.CompressionConfig(codec="fp8_e4m3", hadamard=False), taco.CompressionConfig(codec="int6", group_size=32, hadamard=False),
               taco.CompressionConfig(codec="int8", group_size=64, hadamard=False, scales="taco_fp32x2")]
    checked = 0
    for _ in range(n_ops):
        batch = []
        for _ in range(shared.randint(1, 3)):
            n = shared.choice([0, 1, 7, 129, 4097])
            dtype = shared.choice([torch.bfloat16, torch.float16, torch.float32])
            cfg = shared.choice(configs)
            src = shared.randint(0, 1)
            data = torch.randn(n, generator=torch.Generator().manual_seed(shared.randint(0, 10**6))).to(dtype)
            batch.append((n, dtype, cfg, src, data))
        works = []
        for n, dtype, cfg, src, data in batch:
            if rank == src:
                works.append((p2p.isend(data, 1 - rank, config=cfg, min_bytes=0, backend=backend), None, None))
            else:
                out = torch.empty(n, dtype=dtype)
                works.append((p2p.irecv(out, 1 - rank, config=cfg, min_bytes=0, backend=backend), out, (data, cfg)))
        for w, out, sent in works:
            w.wait()
            if out is not None:
                data, cfg = sent
                want = taco.decompress(taco.compress(data, cfg, backend="torch"), backend="torch") if data.numel() else data
                assert torch.equal(out.view(-1).float(), want.view(-1).float()) or data.numel() == 0, (out, want)
                checked += 1
    dist.barrier()
    return {"checked": checked}


def handshake_counted(rank: int, world: int) -> dict:
    """Two messages of one signature in a `WireStats`: the first one's handshake (a fingerprint
    and a size, 16 bytes, from each end) is counted as fingerprint bytes where the message was
    issued, the payloads as sends by the sender only."""
    cfg = taco.CompressionConfig()
    x = torch.ones(4096, dtype=torch.bfloat16)
    with taco.WireStats() as ws:
        for _ in range(2):
            if rank == 0:
                p2p.isend(x, 1, config=cfg, min_bytes=0).wait()
            else:
                p2p.irecv(x, 0, config=cfg, min_bytes=0).wait()
    return {"fingerprint": ws.fingerprint_bytes, "sends": [c.wire_bytes for c in ws.calls],
            "wire": p2p.wire_like(x, cfg).numel()}
