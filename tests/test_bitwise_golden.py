"""The compressed collectives against outputs recorded before the collectives were restructured:
the same output bytes, the same bytes received from the process group, the same `WireStats`
counts and the same error messages, bit for bit (see `tests/golden_cases.py`).

The default run takes a rotation of the cases that keeps to a small time budget; every recorded
case with TACO_TEST_GOLDEN=all (`make test-thorough`).
"""
import os

import pytest

from . import golden_cases as golden
from .dist_utils import run_ranks

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="recorded under Triton's interpreter; compiled kernels may round differently")


@pytest.mark.parametrize("world", golden.WORLDS, ids=lambda w: f"P{w}")
def test_outputs_and_wire_bytes_match_the_recording(world):
    recorded = golden.load()
    names = golden.case_names(world) if os.environ.get("TACO_TEST_GOLDEN") == "all" else golden.selection(world)
    assert set(names) <= set(recorded), sorted(set(names) - set(recorded))
    per_rank = run_ranks(golden.run_cases, world, names, timeout_s=3 * 3600, pg_timeout_s=300)
    differ = [f"{name} rank {r}: {key}: recorded {recorded[name][r][key]!r}, got {got[name][key]!r}"
              for name in names for r, got in enumerate(per_rank) for key in recorded[name][r]
              if got[name][key] != recorded[name][r][key]]
    assert not differ, "\n".join(differ)
