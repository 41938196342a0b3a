"""torchrun's variables for every rank an MPI launcher started. Pure reading, no MPI, no torch.

A training script written for torchrun reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and
``LOCAL_WORLD_SIZE`` from the environment, often before ``init_process_group``
(``torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))``). mpirun and srun export their own
names instead (``OMPI_COMM_WORLD_RANK``, ``SLURM_PROCID``, ``PMI_RANK``...).
:func:`export` translates: it asks :func:`hpcddp.launch.detect` (the launcher tables and their
precedence) where this process sits and sets torchrun's names to the same values.

When, so that a script that reads them before anything else finds them:

1. at interpreter start: the wheel installs ``hpcddp-start.pth``, whose one line
   imports the top-level ``_hpcddp_start``; that returns at once unless one of an
   MPI launcher's variables is set (:data:`LAUNCHER_MARKERS`), and then runs :func:`export`
   from this module without importing hpcddp's package;
2. at ``import hpcddp`` (for an installation without the .pth: ``PYTHONPATH``, a copied tree);
3. after MPI started (:func:`export_after_start`): the values only MPI knows (Open MPI puts
   no node index in the environment, PMIx alone no size) fill what is still missing.

Rules, and why:

- A variable already set is never changed: the user's (or a wrapper's) value wins. ``RANK``
  and ``WORLD_SIZE`` are set together or not at all, so a partial pair the user exported
  keeps the one-line warning of :func:`hpcddp.launch.check_world`; a value that contradicts
  the launcher still fails there, with its fix.
- Values hpcddp set are listed in ``HPCDDP_TORCH_VARS_SET`` with the launcher's identity of
  the process they were set for (``openmpi:2/4``). A process that inherits them from another
  job's rank (a rank that runs mpirun itself) sees another identity and replaces them,
  instead of reading them as the user's.
- Nothing is set for a singleton (no launcher: ``python train.py``; its
  ``init_process_group`` still runs as a world of one), under torchrun (it sets its own), or
  beside torch's env:// variables alone (they are the launcher then).
- ``MASTER_ADDR``/``MASTER_PORT`` are not set: under an MPI launcher hpcddp bootstraps
  torch's store through MPI (rank 0 opens it on a free port and broadcasts the address);
  a guessed fixed port would collide between jobs sharing a node.
- ``HPCDDP_TORCH_VARS=0`` turns all of this off.
- Any error (contradictory launcher variables, a bad ``HPCDDP_*`` value) sets nothing and is
  left for ``hpcddp.init``, which raises it with its fix.
"""
from __future__ import annotations

import os
from typing import Mapping, MutableMapping, Optional

#: torchrun's names, in the order torchrun documents them, and the LaunchInfo field of each.
FIELDS = (("RANK", "rank"), ("WORLD_SIZE", "size"), ("LOCAL_RANK", "local_rank"),
          ("LOCAL_WORLD_SIZE", "local_size"), ("GROUP_RANK", "node_rank"),
          ("GROUP_WORLD_SIZE", "num_nodes"))
NAMES = tuple(name for name, _ in FIELDS)
#: Where hpcddp records what it set, and for which process (detect() does not read those).
MARKER = "HPCDDP_TORCH_VARS_SET"
#: One variable of each MPI launcher or wire-up protocol: the .pth's cheap test. Any one set
#: means detect() may find a launcher; none set means it cannot (torchrun is not an MPI one).
LAUNCHER_MARKERS = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID",
                    "PALS_RANKID", "MV2_COMM_WORLD_RANK")
_NOT_OURS = ("torchrun", "torch-env")


def _identity(info) -> str:
    return f"{info.launcher}:{info.rank}/{info.size if info.size is not None else '?'}"


def _isset(env: Mapping[str, str], name: str) -> bool:
    return bool(str(env.get(name, "")).strip())


def plan(env: Mapping[str, str], known: Optional[Mapping[str, int]] = None) -> dict:
    """What to change in ``env``: ``{name: value}`` to set, ``{name: None}`` to remove (the
    marker included); ``{}`` when nothing changes. Pure.

    Names listed in the marker were set by an earlier export (in this process, its parent, or
    another job's rank) and count as unset; the rest of ``env`` is what the user set. ``known``
    fills fields the launcher does not give (after MPI start). Raises what
    :func:`hpcddp.launch.detect` raises, and :class:`hpcddp.settings.SettingsError`.
    """
    from hpcddp import settings
    from hpcddp.launch.env import detect
    old = set(str(env.get(MARKER, "")).partition("@")[0].split(",")) & set(NAMES)
    mine = {k: v for k, v in env.items() if k not in old and k != MARKER}
    if not settings.read(mine).torch_vars:   # raises on a bad HPCDDP_* value, as init would
        return {}
    info = detect(mine)
    if info is None or info.launcher in _NOT_OURS:
        return {}
    values = {name: getattr(info, field) for name, field in FIELDS}
    for name, value in (known or {}).items():
        if values.get(name) is None:
            values[name] = value
    free = [n for n in NAMES if not _isset(mine, n) and values[n] is not None]
    if not {"RANK", "WORLD_SIZE"} <= set(free):
        free = [n for n in free if n not in ("RANK", "WORLD_SIZE")]   # the pair, or neither
    target = {n: str(values[n]) for n in free}
    marker = f"{','.join(target)}@{_identity(info)}" if target else None
    changes = {n: v for n, v in target.items() if env.get(n) != v}
    changes.update({n: None for n in old - set(target)})
    if env.get(MARKER) != marker:
        changes[MARKER] = marker
    return changes


def _apply(env: MutableMapping[str, str], changes: dict) -> dict:
    for name, value in changes.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return changes


def export(env: Optional[MutableMapping[str, str]] = None) -> dict:
    """Set torchrun's variables in ``env`` (default ``os.environ``) from the launcher's;
    return the changes (``None``: removed). Never raises: a problem is left for
    ``hpcddp.init`` to report with its fix."""
    env = os.environ if env is None else env
    if not any(n in env for n in LAUNCHER_MARKERS):
        return {}
    try:
        return _apply(env, plan(env))
    except Exception:   # noqa: BLE001 - start-up must never break on this; init reports it
        return {}


def export_after_start(launch, rank: int, size: int, local_rank: int, local_size: int,
                       node: int, num_nodes: int,
                       env: Optional[MutableMapping[str, str]] = None) -> dict:
    """After MPI started: fill what the launcher's variables did not give (Open MPI's node
    index, PMIx's size) from MPI's world and topology. ``launch`` is detect()'s answer: nothing
    is set for a singleton (``None``) or under torchrun. Call on every rank. Never raises."""
    env = os.environ if env is None else env
    if launch is None or launch.launcher in _NOT_OURS:
        return {}
    known = {"RANK": rank, "WORLD_SIZE": size, "LOCAL_RANK": local_rank,
             "LOCAL_WORLD_SIZE": local_size, "GROUP_RANK": node, "GROUP_WORLD_SIZE": num_nodes}
    try:
        return _apply(env, plan(env, known))
    except Exception:   # noqa: BLE001
        return {}
