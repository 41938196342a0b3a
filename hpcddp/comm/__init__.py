"""The MPI layer: start-up, communicators, topology, tensor adaptation.

The only hpcddp package that imports ``mpi4py.MPI``; the others take ``MPI`` from here.
"""
from hpcddp.comm._mpi import MPI
from hpcddp.comm.communicator import Communicator
from hpcddp.comm.output import log, rank_print
from hpcddp.comm.startup import (Runtime, finalize, get_topology, init, is_initialized, runtime,
                                 world)
from hpcddp.comm.topology import NodeGroups, Topology

__all__ = ["MPI", "Communicator", "NodeGroups", "Runtime", "Topology", "finalize",
           "get_topology", "init", "is_initialized", "log", "rank_print", "runtime", "world"]
