"""A script that started MPI itself through mpi4py before hpcddp.init()."""
from mpi4py import MPI  # initialises MPI (mpi4py's default)

import hpcddp

assert MPI.Is_initialized()
rt = hpcddp.init()
assert not rt.we_initialized, "hpcddp must not re-initialise MPI"
assert rt.world.size == MPI.COMM_WORLD.Get_size()
print(f"ok {rt.world.rank} {rt.thread_level}", flush=True)
