"""Every op on hpcddp Communicators: the direct API (no torch.distributed dispatch).

Signatures follow torch.distributed, with ``group`` an hpcddp Communicator (None: the world).
"""
from hpcddp.collectives.alltoall import all_to_all, all_to_all_single
from hpcddp.collectives.gather import (all_gather, all_gather_into_tensor, broadcast, gather,
                                       scatter)
from hpcddp.collectives.objects import (all_gather_object, broadcast_object,
                                        broadcast_object_list, gather_object,
                                        scatter_object_list)
from hpcddp.collectives.p2p import irecv, isend, recv, send
from hpcddp.collectives.reduce import all_reduce, reduce, reduce_scatter, reduce_scatter_tensor
from hpcddp.collectives.sync import BarrierTimeout, barrier, monitored_barrier
from hpcddp.collectives.work import Work

# torch 2.13's names for the flat forms (it warns on every call of the old ones)
all_gather_single = all_gather_into_tensor
reduce_scatter_single = reduce_scatter_tensor

__all__ = ["BarrierTimeout", "Work", "all_gather", "all_gather_into_tensor", "all_gather_object",
           "all_gather_single", "all_reduce", "all_to_all", "all_to_all_single", "barrier", "broadcast",
           "broadcast_object", "broadcast_object_list", "gather", "gather_object", "irecv",
           "isend", "monitored_barrier", "recv", "reduce", "reduce_scatter",
           "reduce_scatter_single", "reduce_scatter_tensor", "scatter", "scatter_object_list", "send"]
