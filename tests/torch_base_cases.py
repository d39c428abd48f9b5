"""PyTorch's own distributed test base, run in one placement on 2 CPU ranks; prints what each test did.

    python -m tests.torch_base_cases PLACEMENT --out results.json [--only test_a,test_b]

PyTorch holds its backends to ``DistributedTest._DistTestBase``
(``torch/testing/_internal/distributed/distributed_test.py``, shipped in the wheel), driven with
``BACKEND=gloo WORLD_SIZE=2`` as its ``test_distributed_spawn.py`` drives it. Here the ranks are
forked, not spawned (the former ``test_distributed_fork.py``): a spawned rank re-imports torch and
costs ~20 s per test on 2 cores, a forked one ~0.3 s. The test base decides what to run and skip
from ``BACKEND=gloo`` in every placement; only the groups the tests get differ:

- ``gloo``: the test base as PyTorch runs it (the baseline);
- ``default``: ``dist.init_process_group("taco", pg_options=GroupOptions(inner=<the backend the
  test asked for>))``: the default group, and every group made under it, is a compressing group;
- ``subgroups``: a gloo default group; ``dist.new_group`` (and so ``new_subgroups``) made with
  ``backend="taco"``: compressing groups over new gloo groups.

Every tensor the test base sends is below the default policy's ``min_bytes`` (1 MiB), so every call
is forwarded to the inner group and must behave exactly as gloo's. The outcomes go to ``--out`` as
JSON: {test name: {"outcome": "passed" | "failed" | "skipped", "detail": ..., "seconds": ...}}.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
import unittest

PLACEMENTS = ("gloo", "default", "subgroups")
#: seconds before the test base kills a test's ranks (its default, 300 s, would let a hang eat the suite)
TEST_TIMEOUT_S = 90


def _place(placement: str) -> None:
    """Make this rank's groups compressing ones as `placement` says (run in each forked rank, before
    the test base initializes torch.distributed)."""
    if placement == "gloo":
        return
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from taco_triton.integrations.process_group import BACKEND, GroupOptions

    if placement == "default":
        init = c10d.init_process_group

        def init_process_group(backend=None, *args, pg_options=None, **kwargs):
            return init(BACKEND, *args, pg_options=GroupOptions(inner=backend or "gloo"), **kwargs)

        dist.init_process_group = c10d.init_process_group = init_process_group
    elif placement == "subgroups":
        new_group = c10d.new_group

        def new_group_taco(ranks=None, timeout=None, backend=None, *args, **kwargs):
            if backend in (None, "gloo", dist.Backend.GLOO):
                backend = BACKEND
            return new_group(ranks, timeout, backend, *args, **kwargs)

        dist.new_group = c10d.new_group = new_group_taco


class _Outcomes(unittest.TestResult):
    """Each test's outcome, its error text and its time."""

    def __init__(self):
        super().__init__()
        self.outcomes: dict[str, dict] = {}
        self._start = 0.0

    def startTest(self, test):
        super().startTest(test)
        self._start = time.monotonic()
        print(test._testMethodName, end=" ", flush=True, file=sys.stderr)

    def _put(self, test, outcome: str, detail: str = "") -> None:
        seconds = round(time.monotonic() - self._start, 2)
        self.outcomes[test._testMethodName] = {"outcome": outcome, "detail": detail[-4000:], "seconds": seconds}
        print(outcome, seconds, file=sys.stderr, flush=True)

    def addSuccess(self, test):
        self._put(test, "passed")

    def addFailure(self, test, err):
        self._put(test, "failed", "".join(traceback.format_exception(*err)))

    def addError(self, test, err):
        self._put(test, "failed", "".join(traceback.format_exception(*err)))

    def addSkip(self, test, reason):
        self._put(test, "skipped", str(reason))

    def addExpectedFailure(self, test, err):
        self._put(test, "passed", "expected failure")

    def addUnexpectedSuccess(self, test):
        self._put(test, "failed", "unexpected success")


def run(placement: str, only: list[str] | None = None) -> dict[str, dict]:
    """Run the test base (or the tests named in `only`) in `placement`; {test: outcome}."""
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    os.environ["BACKEND"], os.environ["WORLD_SIZE"] = "gloo", "2"  # read by the test base at import
    import torch.multiprocessing
    from torch.testing._internal import common_distributed
    from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend

    if placement != "gloo":
        import taco_triton  # noqa: F401 - once here, not in every forked rank (~0.2 s of CPU each)
    common_distributed.TIMEOUT_DEFAULT = TEST_TIMEOUT_S
    common_distributed.TIMEOUT_OVERRIDE.clear()

    class TestDistBackendWithFork(TestDistBackend, DistributedTest._DistTestBase):
        def setUp(self):
            super().setUp()
            self._start_processes(torch.multiprocessing.get_context("fork").Process)

        @classmethod
        def _run(cls, rank, test_name, file_name, pipe, **kwargs):
            _place(placement)
            super()._run(rank, test_name, file_name, pipe, **kwargs)

    names = unittest.TestLoader().getTestCaseNames(TestDistBackendWithFork)
    if only is not None:
        unknown = sorted(set(only) - set(names))
        if unknown:
            raise ValueError(f"not tests of the test base: {unknown}")
        names = [n for n in names if n in only]
    result = _Outcomes()
    unittest.TestSuite(TestDistBackendWithFork(n) for n in names).run(result)
    return result.outcomes


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("placement", choices=PLACEMENTS)
    ap.add_argument("--out", required=True, help="JSON file for the outcomes")
    ap.add_argument("--only", default=None, help="comma-separated test names (default: all)")
    args = ap.parse_args(argv)
    outcomes = run(args.placement, args.only.split(",") if args.only else None)
    with open(args.out, "w") as f:
        json.dump(outcomes, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
