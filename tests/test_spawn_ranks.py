"""`taco_triton.examples.ranks.spawn_ranks`: results by rank, and a dead rank is an error, not a hang."""
import os

import pytest

from taco_triton.examples.ranks import spawn_ranks


def _square(rank, world, port, offset, queue):
    queue.put((rank, rank * rank + offset))


def _rank1_dies(rank, world, port, queue):
    if rank == 1:
        os._exit(3)
    queue.put((rank, "ok"))


def test_results_by_rank():
    assert spawn_ranks(_square, 2, 10) == {0: 10, 1: 11}


def test_a_rank_that_dies_is_named():
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] of 2 exited without a result"):
        spawn_ranks(_rank1_dies, 2, poll_s=0.5)
