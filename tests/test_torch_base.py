"""PyTorch's own distributed test base over the compressing process group, as the default group
and as subgroups (`tests/torch_base_cases.py` runs it; its docstring says how).

A test that passes with gloo must pass with the compressing group in both placements; the only
exceptions are named below with their reason, and each must fail for that reason (so a stale
exception shows). `make test` runs SUBSET, which calls every collective and point-to-point
function the test base exercises on gloo, on the default group and on a new group; with
TACO_TEST_TORCH_BASE=all (`make test-thorough`, `make test-torch-base`) every test of the base runs.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from .torch_base_cases import PLACEMENTS

ROOT = Path(__file__).resolve().parents[1]
ALL = os.environ.get("TACO_TEST_TORCH_BASE", "") == "all"

_MONITORED = ("torch's dist.monitored_barrier refuses a group whose backend is not named gloo before calling it; "
              "the group's own monitored_barrier and dist.monitored_barrier(group=g.inner) work")
#: {placement: {test: (reason, text its failure must contain)}}
EXCEPTIONS = {
    "default": {
        "test_get_backend": ("asserts that the default group's backend is named gloo; it is 'taco'", "'taco' != 'gloo'"),
        "test_monitored_barrier_gloo": (_MONITORED, "monitored_barrier is only implemented for GLOO backend"),
        "test_monitored_barrier_gloo_subgroup": (_MONITORED, "monitored_barrier is only implemented for GLOO backend"),
    },
    "subgroups": {
        "test_get_backend": ("asserts that a new group's backend is named gloo; it is 'taco'", "'taco' != 'gloo'"),
        "test_monitored_barrier_gloo_subgroup": (_MONITORED, "monitored_barrier is only implemented for GLOO backend"),
    },
}

#: Every collective and point-to-point call of the test base that gloo runs, on the default group
#: (test_x) and on a group from new_group (test_x_full_group), plus Work futures, group
#: destruction, DDP and the named exceptions.
SUBSET = [
    "test_all_reduce_sum", "test_all_reduce_sum_async", "test_all_reduce_full_group_max",
    "test_all_reduce_complex_unsupported_ops", "test_sparse_all_reduce_sum",
    "test_all_reduce_coalesced_sum", "test_all_reduce_coalesced_full_group_sum",
    "test_all_gather", "test_all_gather_full_group", "test_all_gather_coalesced_simple",
    "test_all_gather_object_subgroup", "test_broadcast", "test_broadcast_full_group",
    "test_reduce_sum", "test_reduce_full_group_max", "test_gather_full_group", "test_gather_checks",
    "test_scatter_full_group", "test_scatter_checks", "test_scatter_object_list", "test_barrier_full_group",
    "test_send_recv", "test_send_recv_with_tag", "test_send_recv_any_source", "test_isend", "test_irecv",
    "test_batch_isend_irecv_gloo_tags", "test_get_future", "test_destroy_group", "test_destroy_full_group",
    "test_get_rank_size_group", "test_DistributedDataParallelCPU", "test_monitored_barrier_gloo_rank_0_timeout",
    *sorted({t for named in EXCEPTIONS.values() for t in named}),
]


def run_placements(only: list[str] | None, timeout_s: float, out_dir: Path) -> dict[str, dict[str, dict]]:
    """{placement: {test: outcome}}, the three placements run side by side (each mostly waits on
    its ranks: a test's processes poll every 0.1 s)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    procs = {}
    for placement in PLACEMENTS:
        out = out_dir / f"{placement}.json"
        cmd = [sys.executable, "-m", "tests.torch_base_cases", placement, "--out", str(out)]
        if only is not None:
            cmd += ["--only", ",".join(only)]
        log = open(out_dir / f"{placement}.log", "w+")
        procs[placement] = (subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), out, log)
    deadline = time.monotonic() + timeout_s
    results = {}
    for placement, (proc, out, log) in procs.items():
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.seek(0)
        text = log.read()
        log.close()
        assert proc.returncode == 0 and out.exists(), f"{placement}: exit code {proc.returncode}\n{text[-5000:]}"
        results[placement] = json.loads(out.read_text())
    return results


def counts(outcomes: dict[str, dict]) -> dict[str, int]:
    found: dict[str, int] = {}
    for o in outcomes.values():
        found[o["outcome"]] = found.get(o["outcome"], 0) + 1
    return found


def test_the_compressing_group_passes_what_gloo_passes(tmp_path):
    """Each placement: every test that passes with gloo passes, except the named ones, which fail
    for their named reason."""
    start = time.monotonic()
    results = run_placements(None if ALL else SUBSET, 1500 if ALL else 600, tmp_path)
    gloo = results["gloo"]
    passing = sorted(t for t, o in gloo.items() if o["outcome"] == "passed")
    summary = {p: counts(r) for p, r in results.items()}
    print(f"torch's distributed test base, {len(gloo)} tests, {time.monotonic() - start:.0f} s: {summary}")
    if ALL:
        assert len(passing) >= 85, summary  # torch 2.13 with gloo on 2 CPU ranks: 90
    else:  # the subset is chosen from what gloo passes
        assert passing == sorted(SUBSET), {t: gloo[t] for t in SUBSET if gloo[t]["outcome"] != "passed"}
    problems = []
    for placement in ("default", "subgroups"):
        named = EXCEPTIONS[placement]
        for test in passing:
            got = results[placement][test]
            if test in named:
                if got["outcome"] != "failed" or named[test][1] not in got["detail"]:
                    problems.append(f"{placement}: {test} is named an exception ({named[test][0]}) but "
                                    f"{got['outcome']}: {got['detail'][-600:]}")
            elif got["outcome"] != "passed":
                problems.append(f"{placement}: {test} passes with gloo but {got['outcome']}:\n{got['detail'][-1500:]}")
    assert not problems, "\n\n".join(problems)
