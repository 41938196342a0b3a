"""Data sets for HPC training: pack to LMDB/HDF5, stage to node-local storage, read exactly.

* :func:`pack` -- files, arrays or (key, value) pairs -> a sharded LMDB or HDF5 data set.
* :func:`stage` -- copy a packed data set to node-local storage, reading the shared file
  system once per node group (scatter over node leaders, then broadcast within the group).
* :class:`LMDBDataset`, :class:`HDF5Dataset`, :func:`open_dataset` -- torch datasets that
  open lazily in every process and DataLoader worker.
* :class:`DistributedSampler`, :class:`DistributedEvalSampler`, :class:`MetricSums` -- exact
  training and evaluation over the job's ranks.

Importing this package starts nothing and imports torch, h5py and lmdb only when the names
that need them are used. See docs/data.md.
"""
from __future__ import annotations

import importlib

_LAZY = {
    "pack": "hpcddp.data.packing",
    "stage": "hpcddp.data.staging", "StageError": "hpcddp.data.staging",
    "StageResult": "hpcddp.data.staging", "resolve_dest": "hpcddp.data.staging",
    "LMDBDataset": "hpcddp.data.datasets", "HDF5Dataset": "hpcddp.data.datasets",
    "open_dataset": "hpcddp.data.datasets",
    "DistributedSampler": "hpcddp.data.samplers",
    "DistributedEvalSampler": "hpcddp.data.samplers", "padding_mask": "hpcddp.data.samplers",
    "MetricSums": "hpcddp.data.metrics", "reduce_metrics": "hpcddp.data.metrics",
    "Manifest": "hpcddp.data.manifest", "load_manifest": ("hpcddp.data.manifest", "load"),
    "DatasetError": "hpcddp.data.manifest", "NotReadyError": "hpcddp.data.manifest",
}

__all__ = ["DatasetError", "DistributedEvalSampler", "DistributedSampler", "HDF5Dataset",
           "LMDBDataset", "Manifest", "MetricSums", "NotReadyError", "StageError",
           "StageResult", "load_manifest", "open_dataset", "pack", "padding_mask",
           "reduce_metrics", "resolve_dest", "stage"]


def __getattr__(name):
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'hpcddp.data' has no attribute {name!r}")
    module, attr = target if isinstance(target, tuple) else (target, name)
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value
