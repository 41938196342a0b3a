"""Samplers: a DistributedSampler that can keep to node-local data, and an exact evaluation one.

:class:`DistributedSampler` gives exactly what ``torch.utils.data.DistributedSampler`` gives
(same permutation for a seed and epoch, same padding, same ``drop_last``) when every sample
is readable on every node. On a partition-mode staged copy (each node of a group holds only
some shards) it draws each rank's samples from its own node's shards instead, with the same
number of samples per rank as the plain sampler, so every rank runs the same number of steps.

:class:`DistributedEvalSampler` never pads: the ranks' index lists are disjoint and together
hold every sample exactly once (some ranks get one fewer, or none). Combine the per-rank sums
with :func:`hpcddp.data.metrics.reduce_metrics` for metrics where each sample counts once
(torch issue 25162: the padded sampler counts some samples twice).

Neither sampler communicates: ranks, nodes and the staged layout come from arguments,
``hpcddp.comm`` (when MPI is running) or the launcher's environment.
"""
from __future__ import annotations

import math
from typing import Iterator, Sequence

import numpy as np
import torch


def _world_position(num_replicas, rank, who):
    if num_replicas is None or rank is None:
        from hpcddp.data import _comm
        pos = _comm.world_position()
        if pos is None:
            raise ValueError(f"{who}: num_replicas and rank are needed outside an MPI job (pass "
                             f"them, or start the job with mpirun/srun)")
        r, n = pos
        num_replicas = n if num_replicas is None else num_replicas
        rank = r if rank is None else rank
    if not isinstance(num_replicas, int) or num_replicas < 1:
        raise ValueError(f"{who}: num_replicas must be a positive int, got {num_replicas!r}")
    if not isinstance(rank, int) or not 0 <= rank < num_replicas:
        raise ValueError(f"{who}: rank={rank!r} is out of range for num_replicas={num_replicas} "
                         f"(valid: 0..{num_replicas - 1})")
    return num_replicas, rank


def _node_position(local_rank, local_size, who):
    if local_rank is None or local_size is None:
        from hpcddp.data import _comm
        pos = _comm.node_position()
        if pos is None:
            raise ValueError(f"{who}: the data set is a partition-mode staged copy, which needs "
                             f"this rank's place on its node: pass local_rank and local_size, "
                             f"or call hpcddp.init() first")
        lr, ls = pos
        local_rank = lr if local_rank is None else local_rank
        local_size = ls if local_size is None else local_size
    if not isinstance(local_size, int) or local_size < 1 or not 0 <= local_rank < local_size:
        raise ValueError(f"{who}: local_rank={local_rank!r} is out of range for "
                         f"local_size={local_size!r}")
    return local_rank, local_size


def _auto_local(dataset, local_indices):
    if isinstance(local_indices, str):
        if local_indices != "auto":
            raise ValueError(f"local_indices must be 'auto', None or a sequence of ints, got "
                             f"{local_indices!r}")
        local_indices = getattr(dataset, "local_indices", None)
    if local_indices is None:
        return None
    return np.asarray(local_indices, dtype=np.int64)


class DistributedSampler(torch.utils.data.Sampler):
    """``torch.utils.data.DistributedSampler``, optionally restricted to node-local indices.

    Args:
        dataset: anything with ``len()``; an :class:`~hpcddp.data.LMDBDataset` or
            :class:`~hpcddp.data.HDF5Dataset` on a partition-mode staged copy also tells
            the sampler which indices are on this node.
        num_replicas, rank: default: hpcddp's world (if MPI runs) or the launcher's variables.
        shuffle, seed, drop_last: as in torch; call :meth:`set_epoch` every epoch.
        local_indices: ``"auto"`` (take ``dataset.local_indices``), ``None`` (every index is
            readable here), or the sorted global indices held by this rank's node.
        local_rank, local_size: this rank's place on its node (partition mode only); default
            from hpcddp's topology.

    Every rank yields ``num_samples`` indices per epoch (``ceil(N / num_replicas)``, or
    ``floor`` with ``drop_last``), in plain and node-local modes alike. In node-local mode
    the node's indices are shuffled with ``seed + epoch``, dealt to its ranks, and wrapped or
    cut so each rank gets ``num_samples``: a node holding less than its share repeats some
    samples in an epoch, one holding more skips some (different ones each epoch).
    """

    def __init__(self, dataset, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False, *,
                 local_indices: str | Sequence[int] | None = "auto",
                 local_rank: int | None = None, local_size: int | None = None):
        who = "DistributedSampler"
        self.num_replicas, self.rank = _world_position(num_replicas, rank, who)
        self.dataset = dataset
        self.shuffle, self.seed, self.drop_last = bool(shuffle), int(seed), bool(drop_last)
        self.epoch = 0
        n = len(dataset)
        if self.drop_last and n % self.num_replicas != 0:
            self.num_samples = math.ceil((n - self.num_replicas) / self.num_replicas)
        else:
            self.num_samples = math.ceil(n / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas
        self.local_indices = _auto_local(dataset, local_indices)
        if self.local_indices is not None:
            self.local_rank, self.local_size = _node_position(local_rank, local_size, who)
            if len(self.local_indices) == 0 and self.num_samples > 0:
                raise ValueError(
                    f"{who}: this node holds no samples of the data set (partition mode with "
                    f"more nodes per group than shards?); re-pack with more, smaller shards "
                    f"(--shard-size), stage with a smaller --group-nodes, or use replicate mode")

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch: the permutation is a function of ``seed + epoch``."""
        self.epoch = int(epoch)

    def _generator(self) -> torch.Generator:
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return g

    def indices(self) -> list[int]:
        """This rank's indices for the current epoch."""
        if self.local_indices is not None:
            return self._local()
        n = len(self.dataset)
        if self.shuffle:
            idx = torch.randperm(n, generator=self._generator()).tolist()
        else:
            idx = list(range(n))
        if not self.drop_last:
            pad = self.total_size - len(idx)
            if pad <= len(idx):
                idx += idx[:pad]
            elif idx:
                idx += (idx * math.ceil(pad / len(idx)))[:pad]
        else:
            idx = idx[:self.total_size]
        return idx[self.rank:self.total_size:self.num_replicas]

    def _local(self) -> list[int]:
        pool = self.local_indices
        if self.num_samples == 0:
            return []
        if self.shuffle:
            order = torch.randperm(len(pool), generator=self._generator()).numpy()
            pool = pool[order]
        need = self.num_samples * self.local_size
        if len(pool) < need:
            pool = np.resize(pool, need)  # wraps around
        mine = pool[:need][self.local_rank::self.local_size]
        return mine.tolist()

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices())

    def padding_mask(self) -> np.ndarray:
        """True for this rank's positions that hold a real sample, False for padding repeats.

        Plain mode only (node-local mode wraps by design). Use it to drop the repeats of
        ``drop_last=False`` padding from per-sample metrics: position k of rank r is position
        ``r + k * num_replicas`` of the padded list, a repeat when that is >= len(dataset).
        """
        return padding_mask(len(self.dataset), self.num_replicas, self.rank, self.drop_last)


def padding_mask(num_samples_total: int, num_replicas: int, rank: int,
                 drop_last: bool = False) -> np.ndarray:
    """Which positions of a torch ``DistributedSampler``'s per-rank list are not padding.

    Works for ``torch.utils.data.DistributedSampler`` too: ``padding_mask(len(ds),
    sampler.num_replicas, sampler.rank, sampler.drop_last)``.
    """
    n = int(num_samples_total)
    if drop_last and n % num_replicas != 0:
        per = math.ceil((n - num_replicas) / num_replicas)
    else:
        per = math.ceil(n / num_replicas)
    pos = rank + np.arange(per, dtype=np.int64) * num_replicas
    return pos < n


def _blocks(n: int, parts: int, i: int) -> tuple[int, int]:
    """[lo, hi) of part i when n items are cut into ``parts`` contiguous blocks (sizes differ by <= 1)."""
    base, extra = divmod(n, parts)
    lo = i * base + min(i, extra)
    return lo, lo + base + (1 if i < extra else 0)


class DistributedEvalSampler(torch.utils.data.Sampler):
    """Evaluation without padding: every sample exactly once across all ranks, in order.

    Rank r gets a contiguous block of indices (block sizes differ by at most one; a rank can
    get none when there are fewer samples than ranks). Ranks then run different numbers of
    batches: do not call collectives per batch inside the evaluation loop (reduce once at
    the end with :func:`hpcddp.data.reduce_metrics`), or wrap DDP evaluation in
    ``torch.distributed.algorithms.Join``.

    On a partition-mode staged copy (``dataset.stage_info`` has ``mode == "partition"``), each
    sample is evaluated on one node that holds it: shard s belongs to node group
    ``s % num_groups``, and within the group to the node that staged it; that node's ranks
    split its samples in contiguous blocks.
    """

    def __init__(self, dataset, num_replicas: int | None = None, rank: int | None = None, *,
                 owned_indices: str | Sequence[int] | None = "auto",
                 local_rank: int | None = None, local_size: int | None = None):
        who = "DistributedEvalSampler"
        self.num_replicas, self.rank = _world_position(num_replicas, rank, who)
        self.dataset = dataset
        owned = owned_indices
        if isinstance(owned, str):
            if owned != "auto":
                raise ValueError(f"{who}: owned_indices must be 'auto', None or a sequence of "
                                 f"ints, got {owned!r}")
            owned = _partition_owned(dataset)
        if owned is None:
            lo, hi = _blocks(len(dataset), self.num_replicas, self.rank)
            self._indices = list(range(lo, hi))
        else:
            owned = np.asarray(owned, dtype=np.int64)
            lr, ls = _node_position(local_rank, local_size, who)
            lo, hi = _blocks(len(owned), ls, lr)
            self._indices = owned[lo:hi].tolist()

    def __len__(self) -> int:
        return len(self._indices)

    def __iter__(self) -> Iterator[int]:
        return iter(self._indices)

    def set_epoch(self, epoch: int) -> None:
        """Accepted for symmetry with the training sampler; the order never changes."""


def _partition_owned(dataset) -> np.ndarray | None:
    info = getattr(dataset, "stage_info", None)
    if not info or info.get("mode") != "partition" or getattr(dataset, "local_shards", None) is None:
        return None
    groups = int(info.get("num_groups", 1))
    group = int(info.get("group", 0))
    shards = [s for s in dataset.local_shards if s % groups == group]
    return np.asarray(dataset.manifest.indices_of(shards), dtype=np.int64)
