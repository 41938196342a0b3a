"""A deliberately failing MPI test: rank 1 fails while rank 0 waits in a barrier.

Without abort-on-failure (tests/mpi/conftest.py) rank 0 would wait forever.
"""
import pytest
from mpi4py import MPI


@pytest.mark.mpi(min_size=2)
def test_rank1_fails_while_rank0_waits():
    comm = MPI.COMM_WORLD
    if comm.Get_rank() == 1:
        assert 1 + 1 == 3, "deliberate failure on rank 1"
    comm.Barrier()
