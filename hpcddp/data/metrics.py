"""Exact distributed metrics: every sample counted once (torch issue 25162).

Averaging per-rank means is wrong twice over when N is not divisible by the world size: the
ranks hold different numbers of samples, and torch's ``DistributedSampler`` pads by repeating
samples. Sum per sample on each rank (keeping a count), drop padding repeats, reduce the sums
and counts once over MPI, and divide at the end::

    sums = MetricSums()
    for x, y in loader:                                   # DistributedEvalSampler: no padding
        out = model(x)
        sums.add("loss", loss_fn(out, y, reduction="sum"), len(y))
        sums.add("correct", (out.argmax(1) == y).sum(), len(y))
    result = sums.reduce()            # {"loss": mean loss, "correct": accuracy}, on every rank
    sums.counts["loss"]               # == len(dataset)

A rank with no samples (fewer samples than ranks) still calls ``reduce``; names are agreed
across ranks first, so ranks need not have seen the same metric names.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np


def _scalar(v) -> float:
    if hasattr(v, "detach"):  # torch tensor
        v = v.detach()
        if v.numel() != 1:
            return float(v.double().sum().item())
        return float(v.item())
    a = np.asarray(v, dtype=np.float64)
    return float(a.sum())


class MetricSums:
    """Running per-rank sums and sample counts of named metrics."""

    def __init__(self):
        self.sums: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.means: dict[str, float] = {}

    def add(self, name: str, value_sum, count: int) -> None:
        """Add ``value_sum`` (the sum over ``count`` samples; a number or a tensor) to ``name``."""
        if not isinstance(name, str):
            raise TypeError(f"MetricSums.add: name must be a str, got {type(name).__name__}")
        count = int(count)
        if count < 0:
            raise ValueError(f"MetricSums.add: count={count} for {name!r}; expected >= 0")
        self.sums[name] = self.sums.get(name, 0.0) + _scalar(value_sum)
        self.counts[name] = self.counts.get(name, 0) + count

    def add_samples(self, name: str, values, mask=None) -> None:
        """Add per-sample ``values``; ``mask`` (bool per sample) drops padding repeats."""
        v = values.detach().double().cpu().numpy() if hasattr(values, "detach") else np.asarray(values, dtype=np.float64)
        v = v.reshape(-1)
        if mask is not None:
            m = np.asarray(mask.cpu().numpy() if hasattr(mask, "cpu") else mask, dtype=bool).reshape(-1)
            if m.shape != v.shape:
                raise ValueError(f"MetricSums.add_samples: mask has {m.size} entries, values "
                                 f"{v.size} ({name!r})")
            v = v[m]
        self.add(name, float(v.sum()), v.size)

    def reduce(self, comm=None) -> dict[str, float]:
        """Sum over all ranks (collective: every rank of ``comm`` calls it) and return the means.

        ``comm``: a hpcddp Communicator or mpi4py communicator; default hpcddp's world.
        Afterwards ``sums``/``counts`` hold the global totals and ``means`` the result (a
        metric with count 0 has mean nan).
        """
        self.sums, self.counts = reduce_sums(self.sums, self.counts, comm)
        self.means = {k: (self.sums[k] / self.counts[k] if self.counts[k] else float("nan"))
                      for k in self.sums}
        return dict(self.means)


def reduce_sums(sums: Mapping[str, float], counts: Mapping[str, int], comm=None
                ) -> tuple[dict[str, float], dict[str, int]]:
    """Global totals of per-rank ``sums`` and ``counts`` (collective over ``comm``)."""
    from hpcddp.comm import MPI
    from hpcddp.data._comm import mpi_comm
    c = mpi_comm(comm)
    names = sorted(set(sums) | set(counts))
    all_names = sorted(set().union(*c.allgather(names)))
    buf = np.zeros(2 * len(all_names), dtype=np.float64)
    for i, k in enumerate(all_names):
        buf[2 * i] = float(sums.get(k, 0.0))
        buf[2 * i + 1] = float(counts.get(k, 0))
    out = np.empty_like(buf)
    c.Allreduce(buf, out, op=MPI.SUM)
    return ({k: float(out[2 * i]) for i, k in enumerate(all_names)},
            {k: int(round(out[2 * i + 1])) for i, k in enumerate(all_names)})


def reduce_metrics(sums: Mapping[str, float], counts: Mapping[str, int] | int, comm=None
                   ) -> dict[str, float]:
    """Means of per-rank metric ``sums`` over the whole job, each sample counted once.

    ``counts``: samples behind each sum (one int for all). Collective over ``comm``.
    """
    if isinstance(counts, int):
        counts = {k: counts for k in sums}
    m = MetricSums()
    for k in sums:
        m.add(k, sums[k], counts.get(k, 0))
    return m.reduce(comm)
