"""World ranks after a grow-back: read through the grown world's group and numbering.

A replacement rank (hpcddp.comm.spawn) has an MPI_COMM_WORLD of its own; once the world is
merged and split by start-up rank, every process reads world ranks from that world's group
(communicator.set_world_numbering). Checked here on a singleton MPI: COMM_SELF's only
process numbered 5 is world rank 5 for any communicator holding it, and a process outside
the numbering's world is MPI.UNDEFINED.
"""
from hpcddp.comm._mpi import MPI
from hpcddp.comm import communicator as c


def test_world_ranks_follow_the_numbering():
    world = MPI.COMM_WORLD.Dup()
    try:
        c.set_world_numbering(world, [5])
        dup = MPI.COMM_SELF.Dup()
        assert c.translate_to_world(dup) == [5]
        assert c.Communicator(dup, "x").world_ranks == (5,)
        empty = MPI.Group.Excl(world.Get_group(), [0])
        assert c.translate_group_to_world(empty) == []
        dup.Free()
    finally:
        c.set_world_numbering(MPI.COMM_WORLD, range(MPI.COMM_WORLD.Get_size()))
        world.Free()
    assert c.translate_to_world(MPI.COMM_SELF) == [0]
