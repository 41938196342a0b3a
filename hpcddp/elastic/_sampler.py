"""ElasticBatchSampler: one epoch order for the whole job, dealt again when ranks are lost.

The epoch is a fixed sequence ``P`` (a permutation of the data set by ``seed + epoch``, as
torch's DistributedSampler draws it), cut to whole global batches: ``P[:S * B]`` with
``S = len(dataset) // B``. Step s trains on ``P[s*B:(s+1)*B]``, rank r of N taking positions
``r, r + N, ...`` of that chunk: exactly the batches DistributedSampler + DataLoader(drop_last)
give on N ranks, so a healthy elastic run trains on the same samples in the same order.

After a failure the survivors agree on the position reached (the end of the last step whose
optimizer update survives) and :meth:`repartition` deals what is left of the epoch,
``P[pos:S * B]``, over the M survivors in chunks of B (the last chunk keeps any remainder;
chunk sizes that M does not divide give local batches differing by one). Every sample of the
epoch is then trained on exactly once, whatever failed where.
"""
from __future__ import annotations

from typing import Iterator

import torch


class ElasticBatchSampler(torch.utils.data.Sampler):
    """Per-step index lists for this rank (pass as ``DataLoader(batch_sampler=...)``).

    Args:
        dataset_len: samples in the data set (or the data set itself).
        global_batch: samples per step, all ranks together (kept after a failure).
        num_replicas, rank: this job's world (default: hpcddp's).
        shuffle, seed: as torch's DistributedSampler; call :meth:`set_epoch` every epoch
            (:class:`hpcddp.elastic.State` does).
    """

    def __init__(self, dataset_len, global_batch: int, num_replicas: int | None = None,
                 rank: int | None = None, *, shuffle: bool = True, seed: int = 0):
        n = dataset_len if isinstance(dataset_len, int) else len(dataset_len)
        if not isinstance(global_batch, int) or global_batch < 1:
            raise ValueError(f"ElasticBatchSampler: global_batch must be a positive int "
                             f"(samples per step, all ranks together), got {global_batch!r}")
        if num_replicas is None or rank is None:
            from hpcddp.comm import world
            w = world()
            num_replicas = w.size if num_replicas is None else num_replicas
            rank = w.rank if rank is None else rank
        if global_batch < num_replicas:
            raise ValueError(f"ElasticBatchSampler: global_batch={global_batch} is smaller than "
                             f"the {num_replicas} ranks: every rank needs a sample per step")
        self.n, self.global_batch = n, global_batch
        self.num_replicas, self.rank = num_replicas, rank
        self.shuffle, self.seed = bool(shuffle), int(seed)
        self.epoch = 0
        self.steps_per_epoch = n // global_batch
        self.epoch_samples = self.steps_per_epoch * global_batch
        self.start = 0                 # position in the epoch's order where __iter__ starts
        self._order = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.start, self._order = int(epoch), 0, None

    def order(self) -> list[int]:
        """The epoch's global sequence of sample indices (the same on every rank)."""
        if self._order is None:
            if self.shuffle:
                g = torch.Generator()
                g.manual_seed(self.seed + self.epoch)
                idx = torch.randperm(self.n, generator=g).tolist()
            else:
                idx = list(range(self.n))
            self._order = idx[:self.epoch_samples]
        return self._order

    def chunks(self, start: int | None = None) -> list[tuple[int, int]]:
        """[a, c) positions of the steps from START to the end of the epoch."""
        pos = self.start if start is None else start
        end, b = self.epoch_samples, self.global_batch
        out = []
        while pos < end:
            c = min(pos + b, end)
            if end - c < self.num_replicas:    # a tail too small to give every rank a sample
                c = end
            out.append((pos, c))
            pos = c
        return out

    def local(self, chunk: tuple[int, int]) -> list[int]:
        """This rank's indices of one step."""
        a, c = chunk
        return self.order()[a + self.rank:c:self.num_replicas]

    def repartition(self, num_replicas: int, rank: int, start: int) -> None:
        """Deal the rest of the epoch, from position START, over NUM_REPLICAS ranks."""
        if not 0 <= rank < num_replicas:
            raise ValueError(f"repartition: rank={rank} is out of range for num_replicas="
                             f"{num_replicas}")
        self.num_replicas, self.rank, self.start = num_replicas, rank, int(start)

    def __iter__(self) -> Iterator[list[int]]:
        for chunk in self.chunks():
            yield self.local(chunk)

    def __len__(self) -> int:
        return len(self.chunks())
