"""What the collectives keep between calls (`taco_triton.state`) and the order their driver runs
a call's stages in (`collectives._driver.order`): pure host logic, no process group."""
import itertools

import pytest

from taco_triton.collectives._driver import order
from taco_triton.state import Cache, State


@pytest.mark.parametrize("n_stages", [1, 2, 3, 4])
@pytest.mark.parametrize("n_slices", [1, 2, 3, 5])
def test_the_pipeline_runs_every_step_once_and_overlaps_slices(n_slices, n_stages):
    """Each (stage, slice) once; a slice's stages in order; and slice k+1 enters a stage (issuing
    its communication) before slice k moves on to the next, which waits for slice k's."""
    steps = order(n_slices, n_stages)
    assert sorted(steps) == sorted(itertools.product(range(n_stages), range(n_slices)))
    at = {s: i for i, s in enumerate(steps)}
    for stage, k in steps:
        if stage:
            assert at[(stage - 1, k)] < at[(stage, k)]
            if k + 1 < n_slices:
                assert at[(stage - 1, k + 1)] < at[(stage, k)]


def test_a_cache_forgets_the_oldest_entry_of_a_full_share_only():
    cache, a, b = Cache(bound=2), object(), object()
    for i in range(3):
        cache.put(("a", i), i, a)
    cache.put(("b", 0), 0, b)
    cache.put(("a", 1), "again", a)  # a key already there: replaced, nothing forgotten
    assert not cache.has(("a", 0)) and cache.get(("a", 1)) == "again" and cache.has(("a", 2))
    assert cache.get(("b", 0)) == 0 and len(cache) == 3


def test_ranks_forget_a_groups_entries_alike_whatever_else_they_do():
    """Two ranks share group g; one also runs many calls on another group h. Both add the same
    agreements of g in the same order, so both still hold, and have forgotten, the same ones
    (a bound over all groups would have forgotten g's entries on the busy rank only)."""
    g, h = object(), object()
    quiet, busy = Cache(bound=3), Cache(bound=3)
    for i in range(5):
        quiet.put(("g", i), None, g)
        busy.put(("g", i), None, g)
        for j in range(4):
            busy.put(("h", i, j), None, h)
    assert [i for i in range(5) if quiet.has(("g", i))] == [i for i in range(5) if busy.has(("g", i))] == [2, 3, 4]


def test_a_destroyed_groups_share_is_dropped_with_the_next_new_share():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    state = State()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    group = dist.distributed_c10d._get_default_group()
    state.plans.put("plan", 1, group)
    assert state.holds(group) == ["plans", "groups"]
    dist.destroy_process_group()
    assert state.plans.has("plan")  # a plain group tells no one: kept until a new share is made
    state.fingerprints.put("fingerprint", 2)
    assert not state.plans.has("plan") and state.fingerprints.get("fingerprint") == 2 and state.holds(group) == []


def test_fifty_groups_made_used_and_destroyed_leave_no_threads_and_no_entries():
    """Each group gets a worker thread (async calls on CPU), a plan, an agreement and a p2p
    handshake; once destroyed, the next new signature forgets all of it."""
    from .dist_utils import run_ranks
    from .group_lifetime_cases import fifty_groups

    for report in run_ranks(fifty_groups, 2, timeout_s=300, pg_timeout_s=60):
        assert report["used"] == 50, report  # each group did hold state
        assert report["threads"] == [] and report["held"] == [] and report["groups"] == 1, report


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_pipeline_slices_of_one_all_reduce_round_with_independent_bits(backend):
    """The fused reduce's stochastic seed is salted with the slice too: two slices holding the
    same values get independent requantization noise (the seed salted only by rank and call gave
    both slices the same random bits at the same offsets: a correlation of 0.29 here, 35 standard errors)."""
    from .dist_utils import run_ranks
    from .slice_salt_cases import slices_round_alike

    for report in run_ranks(slices_round_alike, 2, backend, timeout_s=600, pg_timeout_s=120):
        assert abs(report["corr"]) < 5 / report["n"] ** 0.5, report  # 5 standard errors of a zero correlation
