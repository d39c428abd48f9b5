"""A process that ran our collectives on gloo exits with status 0, even when its process group
outlives `destroy_process_group` (as DTensor's caches make it).

Without the exit handler in `taco_triton.collectives._pg.guard_exit`, a gloo worker thread could
still be waiting for the GIL to drop an op's tensors when the interpreter finalized: Python then
ended that thread inside a C++ destructor and the process aborted with SIGABRT ("terminate called
without an active exception"). The script below makes that likely: a switch interval of 5 s keeps
the main thread from handing the GIL over while it runs Python. Without the handler, 4 of 12 runs
of it aborted on a 2-core machine, so the 8 runs here all pass by chance with probability about
(2/3)^8, 4%; with it, 30 of 30 ran clean.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from taco_triton.examples.ranks import free_port

ROOT = Path(__file__).resolve().parents[1]
RUNS = 8

SCRIPT = """
import sys, torch, torch.distributed as dist
import taco_triton as taco
sys.setswitchinterval(5.0)
dist.init_process_group("gloo")
keep = dist.distributed_c10d._get_default_group()   # outlives destroy_process_group, as under DTensor
for _ in range(3):
    taco.all_reduce(torch.randn(4096), min_bytes=0)   # compressed: gloo all_to_all + all_gather
dist.destroy_process_group()
"""


def _run_two_ranks(script: Path) -> list[tuple[int, str]]:
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.pop("TRITON_INTERPRET", None)   # CPU tensors run the torch codec; no kernels involved
    procs = [subprocess.Popen([sys.executable, str(script)], env=dict(env, RANK=str(r)), text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(2)]
    out = []
    for p in procs:
        try:
            text = p.communicate(timeout=120)[0]
        except subprocess.TimeoutExpired:
            p.kill()
            text = p.communicate()[0] + "\n(killed after 120 s)"
        out.append((p.returncode, text))
    return out


def test_ranks_exit_cleanly_when_the_process_group_outlives_destroy(tmp_path):
    script = tmp_path / "exit_case.py"
    script.write_text(SCRIPT)
    for i in range(RUNS):
        ranks = _run_two_ranks(script)
        assert [rc for rc, _ in ranks] == [0, 0], f"run {i}:\n" + "\n".join(
            f"rank {r} exited {rc}:\n{text[-2000:]}" for r, (rc, text) in enumerate(ranks))
