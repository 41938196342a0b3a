"""Per-device backends of an hpcddp group: ``cpu:hpcddp,cuda:nccl`` and the like.

torch builds a group from a device map by calling each device's backend creator and
registering what it returns on one ``ProcessGroup``. A creator that returns a
``ProcessGroup`` (hpcddp's must: torch's C++ ``Backend`` has no Python constructor) ends
that loop: torch takes it as the whole group and creates no other device's backend. So the
hpcddp group creates them itself, the first time it is used, from the map torch recorded
for it, and registers each one on itself: ``pg._get_backend(torch.device("cuda"))`` is then
the real ``ProcessGroupNCCL``, and every op whose tensors live on that device goes to it.

Lazily, because torch records the map only after the creator has returned; every rank
makes the backend at the same op (its first op, or its first ``_get_backend``), with the
store torch gave the group, so the backends meet through it as torch's own would.
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from hpcddp.backend import BACKEND_NAME


def device_map(pg) -> dict[str, str]:
    """{device type: backend name} torch recorded for PG (empty while it is being built)."""
    config = dist.distributed_c10d._world.pg_backend_config.get(pg)
    if not config:
        return {}
    pairs = (item.split(":", 1) for item in str(config).split(","))
    return {dev.strip(): name.strip().lower() for dev, name in pairs}


def other_backends(pg, store, timeout: timedelta) -> dict[str, object] | None:
    """{device type: torch Backend} for the devices PG's map gives to another backend, made
    and registered on PG; None while torch has not yet recorded the map (ask again later)."""
    mapping = device_map(pg)
    if not mapping:
        return None
    made = {}
    for device, name in sorted(mapping.items()):
        if name == BACKEND_NAME:
            continue
        backend, kind = _make(name, dist.PrefixStore(f"{device}/{name}/", store), pg.rank(),
                              pg.size(), timeout, _global_ranks(pg))
        pg._register_backend(torch.device(device), kind, backend)
        made[device] = backend
    return made


def _global_ranks(pg) -> list[int]:
    """What torch's creators get as global_ranks_in_group: [] for the world."""
    c10d = dist.distributed_c10d
    if pg is c10d._world.default_pg:
        return []
    return sorted(c10d._world.pg_group_ranks.get(pg, {}))


def _make(name: str, store, rank: int, size: int, timeout: timedelta, ranks: list[int]):
    """A torch Backend named NAME over STORE, as torch's _new_process_group_helper makes it."""
    c10d = dist.distributed_c10d
    kind = dist.ProcessGroup.BackendType
    if name == "nccl":
        if not dist.is_nccl_available():
            raise RuntimeError("hpcddp: the device map names nccl, but this torch has no NCCL "
                               "(a CPU build?): use 'hpcddp' alone, or a CUDA build of torch")
        options = c10d.ProcessGroupNCCL.Options()
        options._timeout = timeout
        backend = c10d.ProcessGroupNCCL(store, rank, size, options)
        backend._set_sequence_number_for_group()
        return backend, kind.NCCL
    if name == "gloo":
        backend = c10d.ProcessGroupGloo(store, rank, size, timeout)
        backend._set_sequence_number_for_group()
        return backend, kind.GLOO
    plugin = dist.Backend._plugins.get(name.upper())
    if plugin is None:
        raise ValueError(f"hpcddp: the device map names backend {name!r}, which torch does not "
                         f"know (known: nccl, gloo, {', '.join(sorted(dist.Backend._plugins))})")
    if not plugin.extended_api:
        return plugin.creator_fn(store, rank, size, timeout), kind.CUSTOM
    opts = c10d._DistributedBackendOptions()
    opts.store, opts.group_rank, opts.group_size, opts.timeout = store, rank, size, timeout
    opts.group_id, opts.global_ranks_in_group = "", ranks
    return plugin.creator_fn(opts, None), kind.CUSTOM
