"""Tests of one launch do not see each other's leftovers (tests/rank_hooks.py): after a test
whose ranks issued different collectives on purpose, as the desync tests in mpi_debug.py do,
the next test starts with the cross-rank check's call count of every group equal on its
ranks (apart, the check's sampled verification runs on one rank alone: a hang)."""
import numpy as np
from mpi4py import MPI

from tessera_rt import dist
from tessera_rt.dist.comm import calls


def test_a_test_may_leave_the_ranks_call_counts_apart(world):
    dist.all_reduce(np.ones(2))                      # the world group's check state exists
    for st in calls.GROUPS:
        st.seq += MPI.COMM_WORLD.Get_rank()          # rank r issued r calls more


def test_the_next_test_starts_with_every_groups_call_count_equal_on_its_ranks(world):
    mine = calls.group_seqs()
    every = MPI.COMM_WORLD.allgather(mine)
    for key, n in mine.items():
        counts = {r: seqs[key] for r, seqs in enumerate(every) if key in seqs and r in key[0]}
        assert len(set(counts.values())) == 1, f"group {key}: call counts by rank {counts}"
