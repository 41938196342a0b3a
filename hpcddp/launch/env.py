"""Where am I in the job? Launcher environment tables, read without MPI and without torch.

Every launcher tells the processes it starts who they are through environment variables.
Each launcher is one :class:`Table` below (data: which variable gives which quantity), and
:func:`detect` reads them all, picks the launcher that started this process, checks the
variables, and returns a :class:`LaunchInfo`.

Precedence, innermost launcher first (the order of ``TABLES``), and why:

1. ``torchrun``: it forks its workers itself, so whatever started torchrun (srun, mpirun) is
   outside it and describes the *agents*, one per node: ``SLURM_PROCID`` is then the node
   index, not the worker's rank. Recognised by ``TORCHELASTIC_*``, which only torchrun sets.
2. ``openmpi``, ``mvapich``, ``pals``, ``hydra``: the MPI process managers. When they run in
   a Slurm job, srun (or the batch step) started their daemons (``prted``,
   ``hydra_pmi_proxy``) or mpirun itself, so the ``SLURM_*`` variables the ranks inherit
   describe those daemons: Slurm is outside and is not compared with them. Two of these
   are never nested in practice, so if several are present they must agree.
3. ``slurm``: srun starting the ranks directly (``--mpi=pmix``, ``--mpi=pmi2``). Only an srun
   step counts: an ``sbatch``/``salloc`` shell has ``SLURM_JOB_ID`` and the allocation's
   variables (and, in a batch script, ``SLURM_PROCID=0`` for the batch step) but it is not
   a launched rank; srun always sets ``SLURM_STEP_NUM_TASKS``, the batch shell never does.
4. ``torch-env``: ``RANK``/``WORLD_SIZE`` without ``TORCHELASTIC_*`` (torch's ``env://``
   convention, set by hand, by a wrapper script, or by launchers such as DeepSpeed's). It
   names the launcher only when no MPI launcher is present (or a wire-up protocol alone is,
   and both ``RANK`` and ``WORLD_SIZE`` are set). Beside an MPI launcher, that launcher is in
   charge and torch's variables (with ``LOCAL_RANK``/``LOCAL_WORLD_SIZE``) are *strays*,
   kept in ``LaunchInfo.stray``: each one must equal the launcher's value (a ``RANK``
   exported before mpirun is inherited by every rank and would silently give every rank the
   same number), but they may be partial (PyTorch's own test tooling exports ``WORLD_SIZE``
   alone); :func:`check_world` turns a partial set into a one-line warning.
5. ``pmi``, ``pmix``: wire-up protocols, not launchers. ``PMI_RANK``/``PMI_SIZE`` come from
   Hydra, PALS (Cray PMI) or ``srun --mpi=pmi2``; ``PMIX_RANK`` from Open MPI's mpirun
   (PRRTE) or ``srun --mpi=pmix``. They name the launcher only when nothing else is present,
   and otherwise must agree with the launcher that set them. An MPI process manager sets
   only its own protocol, so the other one is outside it: ``PMI_RANK`` under Open MPI's
   mpirun was inherited from the ``srun --mpi=pmi2`` step that started its daemons.

Everything that is not outside the chosen launcher must agree with it on every quantity both
give (rank, size, local rank and size, node index and count), or :class:`LaunchEnvError` says
which variables disagree. Once MPI has started, :func:`check_world` compares the launcher with
MPI's world (:class:`LaunchWorldError` when MPI did not connect to it, or when torchrun, which
cannot start MPI ranks, started the processes). ``HPCDDP_LAUNCHER=<name>`` reads one table
only and skips the comparison, for nestings these rules do not foresee;
``HPCDDP_LAUNCHER=none`` makes :func:`detect` return ``None``.
"""
from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional

from hpcddp import settings
from hpcddp.launch.hostlist import expand_hostlist

_INTEGER = re.compile(r"[+-]?[0-9]+")

#: Environment variable that forces one launcher's table (or ``none``).
LAUNCHER_OVERRIDE = "HPCDDP_LAUNCHER"


class LaunchEnvError(ValueError):
    """The launcher's variables are partial or contradict each other."""


class LaunchWorldError(RuntimeError):
    """MPI's world is not the one the launcher started (checked after MPI started)."""


@dataclass(frozen=True)
class LaunchInfo:
    """This process's place in the job, as its launcher describes it.

    ``rank``/``size`` are world rank and size; ``local_rank``/``local_size`` within this node;
    ``node_rank``/``num_nodes`` this node's index and the node count; ``hosts`` the node
    names in node order (Slurm only). A field is ``None`` when the launcher does not put that
    quantity in the environment (Open MPI gives no node index, PMIx alone gives no size);
    MPI itself (``hpcddp.comm``) knows them after start-up.

    Added fields take no part in ``==``, so ``LaunchInfo(...)`` literals written with the
    first eight fields still compare equal: ``pmi`` is the wire-up protocol seen (``"pmix"``,
    ``"pmi"`` or ``None``), ``outer`` the launchers found outside this one (``("slurm",)``
    for mpirun inside a Slurm job), ``variables`` every launcher variable read, as sorted
    ``(name, value)`` pairs; ``stray`` torch's ``env://`` variables set beside an MPI
    launcher, which :func:`detect` found equal to that launcher's values, as ``(name, value)``
    pairs in table order (``(("WORLD_SIZE", 2),)``).
    """
    launcher: str
    rank: int
    size: Optional[int]
    local_rank: Optional[int] = None
    local_size: Optional[int] = None
    node_rank: Optional[int] = None
    num_nodes: Optional[int] = None
    hosts: Optional[tuple] = None
    pmi: Optional[str] = field(default=None, compare=False)
    outer: tuple = field(default=(), compare=False)
    variables: tuple = field(default=(), compare=False, repr=False)
    stray: tuple = field(default=(), compare=False, repr=False)

    @property
    def host(self) -> Optional[str]:
        """This node's name from the launcher's node list, or ``None``."""
        if self.hosts is None or self.node_rank is None or self.node_rank >= len(self.hosts):
            return None
        return self.hosts[self.node_rank]


# Quantities a table can give. The integer ones become LaunchInfo fields as they are;
# "nodelist" and "tasks_per_node" are parsed and turned into hosts and local_size.
INT_FIELDS = ("rank", "size", "local_rank", "local_size", "node_rank", "num_nodes")


@dataclass(frozen=True)
class Table:
    """One launcher's variables.

    ``fields`` maps a quantity to the variables that give it, most specific first (the first
    one set wins). ``markers``: any of them set means this launcher's variables are present.
    ``needs_size``: a launched process without a size is partial (False where the launcher
    does not export one). ``tier`` orders nesting: ``fork`` (torchrun) is inside ``pm``
    (mpirun-like process managers), which are inside ``scheduler`` (srun). ``present``, when
    given, decides presence instead of ``markers`` (Slurm's batch-shell rule).
    """
    name: str
    title: str
    fields: Mapping[str, tuple]
    markers: tuple
    tier: str
    needs_size: bool = True
    protocol: Optional[str] = None
    present: Optional[Callable[[Mapping[str, str]], bool]] = None

    @property
    def variables(self) -> tuple:
        seen: list[str] = []
        for names in self.fields.values():
            seen.extend(n for n in names if n not in seen)
        seen.extend(n for n in self.markers if n not in seen)
        return tuple(seen)


def _slurm_step(env: Mapping[str, str]) -> bool:
    # srun sets SLURM_STEP_NUM_TASKS for every step; a batch script or salloc shell has
    # SLURM_JOB_ID without it (and a batch script even has SLURM_PROCID=0). Without
    # SLURM_JOB_ID (an environment written by hand) SLURM_PROCID alone decides.
    if not _isset(env, "SLURM_PROCID") and not _isset(env, "SLURM_LOCALID"):
        return False
    return _isset(env, "SLURM_STEP_NUM_TASKS") or not _isset(env, "SLURM_JOB_ID")


TORCHRUN = Table(
    "torchrun", "torchrun",
    {"rank": ("RANK",), "size": ("WORLD_SIZE",), "local_rank": ("LOCAL_RANK",),
     "local_size": ("LOCAL_WORLD_SIZE",),
     # GROUP_* count torchrun agents, one per node.
     "node_rank": ("GROUP_RANK",), "num_nodes": ("GROUP_WORLD_SIZE",)},
    markers=("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS"),
    tier="fork")

OPENMPI = Table(
    "openmpi", "Open MPI (mpirun)",
    # OMPI_COMM_WORLD_NODE_RANK is deliberately absent: despite its name it is this process's
    # rank among all processes on the node *across jobs* (a local rank), not the node index.
    {"rank": ("OMPI_COMM_WORLD_RANK",), "size": ("OMPI_COMM_WORLD_SIZE",),
     "local_rank": ("OMPI_COMM_WORLD_LOCAL_RANK",),
     "local_size": ("OMPI_COMM_WORLD_LOCAL_SIZE",)},
    markers=("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
             "OMPI_COMM_WORLD_LOCAL_SIZE"),
    tier="pm", protocol="pmix")

MVAPICH = Table(
    "mvapich", "MVAPICH",
    {"rank": ("MV2_COMM_WORLD_RANK",), "size": ("MV2_COMM_WORLD_SIZE",),
     "local_rank": ("MV2_COMM_WORLD_LOCAL_RANK",), "local_size": ("MV2_COMM_WORLD_LOCAL_SIZE",)},
    markers=("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK",
             "MV2_COMM_WORLD_LOCAL_SIZE"),
    tier="pm", protocol="pmi")

PALS = Table(
    "pals", "Cray PALS",
    # PALS has no size variable of its own; it exports Cray PMI's PMI_SIZE beside its own.
    {"rank": ("PALS_RANKID",), "size": ("PMI_SIZE",), "local_rank": ("PALS_LOCAL_RANKID",),
     "local_size": ("PALS_LOCAL_SIZE",), "node_rank": ("PALS_NODEID",)},
    markers=("PALS_RANKID", "PALS_LOCAL_RANKID", "PALS_NODEID", "PALS_LOCAL_SIZE", "PALS_APID"),
    tier="pm", needs_size=False, protocol="pmi")

HYDRA = Table(
    "hydra", "Hydra (MPICH/Intel MPI mpiexec)",
    {"rank": ("PMI_RANK",), "size": ("PMI_SIZE",), "local_rank": ("MPI_LOCALRANKID",),
     "local_size": ("MPI_LOCALNRANKS",)},
    # PMI_RANK alone is the generic PMI table: only Hydra adds MPI_LOCAL*.
    markers=("MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    tier="pm", protocol="pmi")

SLURM = Table(
    "slurm", "Slurm (srun)",
    # Step variables first: srun overwrites SLURM_NTASKS/NNODES/NODELIST for the step unless
    # --preserve-env, and SLURM_JOB_NODELIST always describes the whole allocation.
    {"rank": ("SLURM_PROCID",), "size": ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"),
     "local_rank": ("SLURM_LOCALID",), "node_rank": ("SLURM_NODEID",),
     "num_nodes": ("SLURM_STEP_NUM_NODES", "SLURM_NNODES"),
     "nodelist": ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"),
     "tasks_per_node": ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")},
    markers=("SLURM_PROCID", "SLURM_LOCALID", "SLURM_STEP_NUM_TASKS"),
    tier="scheduler", present=_slurm_step)

TORCH_ENV = Table(
    "torch-env", "torch env:// (RANK, WORLD_SIZE)",
    {"rank": ("RANK",), "size": ("WORLD_SIZE",), "local_rank": ("LOCAL_RANK",),
     "local_size": ("LOCAL_WORLD_SIZE",)},
    # LOCAL_RANK alone does not count: wrapper scripts export it to pick a GPU.
    markers=("RANK", "WORLD_SIZE"),
    tier="env")

PMI = Table(
    "pmi", "PMI",
    {"rank": ("PMI_RANK",), "size": ("PMI_SIZE",), "local_rank": ("PMI_LOCAL_RANK",),
     "local_size": ("PMI_LOCAL_SIZE",)},
    markers=("PMI_RANK", "PMI_SIZE", "PMI_LOCAL_RANK", "PMI_LOCAL_SIZE"),
    tier="protocol", protocol="pmi")

PMIX = Table(
    "pmix", "PMIx",
    # PMIx puts only the rank in the environment; size, local rank and the rest are in the
    # PMIx server's key-value store, which MPI_Init reads.
    {"rank": ("PMIX_RANK",)},
    markers=("PMIX_RANK",),
    tier="protocol", needs_size=False, protocol="pmix")

#: Every table, innermost launcher first: the order in which ``detect`` picks one.
TABLES = (TORCHRUN, OPENMPI, MVAPICH, PALS, HYDRA, SLURM, TORCH_ENV, PMI, PMIX)
#: Launcher names ``detect`` can report (``LaunchInfo.launcher``).
LAUNCHERS = tuple(t.name for t in TABLES)
_BY_NAME = {t.name: t for t in TABLES}
#: Tiers whose process manager is MPI's own: beside them, torch's variables are strays.
MPI_TIERS = ("pm", "scheduler", "protocol")


# --------------------------------------------------------------------------- reading

def _isset(env: Mapping[str, str], name: str) -> bool:
    # An empty value (``export RANK=``) is how shells clear a variable: treat it as unset.
    return bool(str(env.get(name, "")).strip())


def _seen(env: Mapping[str, str], names) -> str:
    shown = [f"{n}={env[n]}" for n in names if _isset(env, n)]
    return ", ".join(shown) if shown else "none"


def _error(problem: str, env: Mapping[str, str], names, expected: str,
           fix: str = "") -> LaunchEnvError:
    text = f"detect: {problem}; variables seen: {_seen(env, names)}; expected {expected}"
    if fix:
        text += f". {fix}"
    return LaunchEnvError(text)


def parse_tasks_per_node(text: str) -> list[int]:
    """Slurm's compressed task counts: ``'2(x3),1'`` -> ``[2, 2, 2, 1]``.

    Raises ValueError naming the input when it is not that form.
    """
    counts: list[int] = []
    for item in str(text).split(","):
        item = item.strip()
        count, _, repeat = item.partition("(x")
        try:
            n = int(count)
            times = int(repeat[:-1]) if repeat else 1
            if (repeat and not repeat.endswith(")")) or n < 0 or times < 1:
                raise ValueError
        except ValueError:
            raise ValueError(f"parse_tasks_per_node: cannot parse {text!r}: item {item!r} is not "
                             f"'N' or 'N(xM)' (expected e.g. '2(x3),1')") from None
        counts.extend([n] * times)
    return counts


@dataclass
class _Reading:
    """What one table found: values, and the variable each value came from."""
    table: Table
    values: dict
    source: dict

    def describe(self, env: Mapping[str, str]) -> str:
        what = ", ".join(f"{k.replace('_', ' ')} {self.values[k]}" for k in INT_FIELDS
                         if self.values.get(k) is not None)
        return f"{self.table.title} says {what} ({_seen(env, self.source.values())})"


def _read(table: Table, env: Mapping[str, str], partial: bool = False) -> _Reading:
    """Read and check one table's variables (they are known to be present).

    ``partial``: a missing rank or size is no error (torch's variables beside an MPI launcher).
    """
    names = table.variables
    values: dict = {}
    source: dict = {}
    for key, candidates in table.fields.items():
        name = next((n for n in candidates if _isset(env, n)), None)
        if name is None:
            continue
        raw = str(env[name]).strip()
        if key == "nodelist":
            try:
                values[key] = tuple(expand_hostlist(raw))
            except ValueError as exc:
                raise _error(f"{name} is not a valid Slurm hostlist ({exc})", env, names,
                             "a hostlist such as 'gpu[001-004],cpu07'") from None
        elif key == "tasks_per_node":
            try:
                values[key] = parse_tasks_per_node(raw)
            except ValueError as exc:
                raise _error(f"{name} is not a valid task count list ({exc})", env, names,
                             "a list such as '2(x3),1'") from None
        else:
            if not _INTEGER.fullmatch(raw):   # int() would also take '1_000' and '٣'
                raise _error(f"{name}={env[name]!r} is not an integer", env, names,
                             f"a non-negative integer from {table.title}")
            number = int(raw)
            if number < 0:
                raise _error(f"{name}={number} is negative", env, names,
                             f"a non-negative integer from {table.title}")
            values[key] = number
        source[key] = name

    def var(key: str) -> str:
        return source.get(key) or table.fields[key][0]

    title = table.title
    if "rank" not in values and not partial:
        given = list(source.values()) or [n for n in table.markers if _isset(env, n)]
        raise _error(f"{title} variables are partial: {', '.join(given)} set but "
                     f"{var('rank')} is not", env, names,
                     f"{var('rank')} whenever {title} variables are set",
                     "A launcher always sets them together: check for a wrapper script or "
                     "an export that set or removed one of them")
    if table.needs_size and "size" not in values and not partial:
        raise _error(f"{title} variables are partial: {var('rank')} set but "
                     f"{' or '.join(table.fields['size'])} is not", env, names,
                     f"the world size whenever {var('rank')} is set",
                     "A launcher always sets them together: check for a wrapper script or "
                     "an export that set or removed one of them")

    v = values
    for count in ("size", "local_size", "num_nodes"):
        if v.get(count) == 0:
            raise _error(f"{title} variables are invalid: {var(count)}=0", env, names,
                         f"a {count.replace('_', ' ')} of at least 1")
    for lo, hi, what in (("rank", "size", "rank < size"),
                         ("local_rank", "local_size", "local rank < local size"),
                         ("node_rank", "num_nodes", "node index < node count")):
        if v.get(lo) is not None and v.get(hi) is not None and v[lo] >= v[hi]:
            raise _error(f"{title} variables contradict each other: {var(lo)}={v[lo]} is not "
                         f"below {var(hi)}={v[hi]}", env, names, f"0 <= {what}")
    for small, what in (("local_size", "local size"), ("num_nodes", "node count")):
        if v.get(small) is not None and v.get("size") is not None and v[small] > v["size"]:
            raise _error(f"{title} variables contradict each other: {var(small)}={v[small]} "
                         f"exceeds {var('size')}={v['size']}", env, names,
                         f"a {what} no larger than the world size")

    if table is SLURM:
        _slurm_layout(values, source, env, names)
    return _Reading(table, values, source)


def _slurm_layout(values: dict, source: dict, env: Mapping[str, str], names) -> None:
    """Turn Slurm's node list and task counts into hosts and local_size, checked.

    The step's own variables must match the step (an error otherwise). The job-wide
    fallbacks (SLURM_JOB_NODELIST, SLURM_TASKS_PER_NODE without srun overwriting them)
    may describe a larger allocation: used only when they fit the step, dropped otherwise.
    """
    nodes = values.get("num_nodes")
    hosts = values.pop("nodelist", None)
    if hosts is not None:
        step_level = source["nodelist"] == "SLURM_STEP_NODELIST"
        if nodes is not None and len(hosts) != nodes:
            if step_level:
                raise _error(f"{source['nodelist']} names {len(hosts)} nodes but "
                             f"{source['num_nodes']}={nodes}", env, names,
                             "one name per node of the step")
            hosts = None
        values["hosts"] = hosts
    counts = values.pop("tasks_per_node", None)
    if counts is not None:
        step_level = source["tasks_per_node"] == "SLURM_STEP_TASKS_PER_NODE"
        size = values.get("size")
        fits = ((nodes is None or len(counts) == nodes) and (size is None or sum(counts) == size)
                and (values.get("node_rank") is None or values["node_rank"] < len(counts)))
        if not fits:
            if step_level:
                raise _error(f"{source['tasks_per_node']}={env[source['tasks_per_node']]} "
                             f"counts {sum(counts)} tasks on {len(counts)} nodes, but the step "
                             f"has {size} tasks on {nodes} nodes", env, names,
                             "one count per node of the step, summing to its number of tasks")
        elif values.get("node_rank") is not None:
            local = counts[values["node_rank"]]
            values["local_size"] = local
            source["local_size"] = source["tasks_per_node"]
            if values.get("local_rank") is not None and values["local_rank"] >= local:
                raise _error(f"SLURM_LOCALID={values['local_rank']} is not below the "
                             f"{local} tasks {source['tasks_per_node']} gives node "
                             f"{values['node_rank']}", env, names, "0 <= local rank < local size")
    source.pop("tasks_per_node", None)
    if "nodelist" in source:
        source["hosts"] = source.pop("nodelist")


def _present(table: Table, env: Mapping[str, str]) -> bool:
    if table.present is not None:
        return table.present(env)
    return any(_isset(env, n) for n in table.markers)


def _must_agree(inner: Table, other: Table) -> bool:
    """Whether ``other``'s variables describe the same processes as ``inner``'s."""
    if inner.tier == "fork":
        return False   # torchrun's workers inherit the variables of whatever started torchrun
    if inner.tier == "pm" and other.tier == "scheduler":
        return False   # srun started mpirun's daemons; SLURM_* describe them, not the ranks
    if inner.tier == "pm" and other.tier == "protocol":
        # mpirun sets its own protocol's variables; the other protocol's were inherited from
        # the srun step that started its daemons (srun --mpi=pmi2 under Open MPI's mpirun).
        return other.protocol == inner.protocol
    return True


def _strays(found: list, env: Mapping[str, str]) -> bool:
    """Whether torch's variables are set beside an MPI launcher that is in charge of them.

    Not under torchrun (they are its own), nor when they are complete beside a wire-up
    protocol alone (then they name the launcher: step 4 of the precedence). ``LOCAL_RANK``
    alone does not make them present (TORCH_ENV's markers), here as anywhere.
    """
    if TORCH_ENV not in found:
        return False
    launchers = [t for t in found if t is not TORCH_ENV]
    if not launchers or launchers[0].tier not in MPI_TIERS:
        return False
    complete = _isset(env, "RANK") and _isset(env, "WORLD_SIZE")
    return launchers[0].tier != "protocol" or not complete


def _check_strays(inner: _Reading, others: list, stray: _Reading,
                  env: Mapping[str, str]) -> None:
    """Refuse a stray torch variable whose value is not the MPI launcher's."""
    says, where = dict(inner.values), dict(inner.source)
    for other in others:   # a quantity the launcher lacks, from what must agree with it
        if _must_agree(inner.table, other.table):
            for key, value in other.values.items():
                if key not in says:
                    says[key], where[key] = value, other.source[key]
    wrong = [k for k in INT_FIELDS if k in stray.values and says.get(k) is not None
             and stray.values[k] != says[k]]
    if not wrong:
        return
    title, name = inner.table.title, inner.table.name
    given = [f"{stray.source[k]}={stray.values[k]}" for k in wrong]
    truth = [f"{k.replace('_', ' ')} {says[k]} ({where[k]}={env[where[k]]})" for k in wrong]
    unset = " ".join(stray.source[k] for k in wrong)
    raise _error(
        f"{' and '.join(given)} contradict{'s' if len(wrong) == 1 else ''} {title}, which "
        f"started this process: it says {' and '.join(truth)}",
        env, list(inner.table.variables) + list(TORCH_ENV.variables),
        " and ".join(f"{stray.source[k]}={says[k]}" for k in wrong) + ", or unset",
        f"torch's env:// variables exported before mpirun or srun are inherited by every rank: "
        f"`unset {unset}` before starting the job (hpcddp takes rank and size from MPI), or "
        f"set {LAUNCHER_OVERRIDE}={name} to read only {title}'s variables")


def _info(reading: _Reading, others: list, env: Mapping[str, str],
          stray: Optional[_Reading] = None) -> LaunchInfo:
    v = reading.values
    pmi = reading.table.protocol
    for other in others:   # the protocol actually set for this process beats the default
        if other.table.tier == "protocol" and _must_agree(reading.table, other.table):
            pmi = other.table.protocol
            break
    outer = tuple(r.table.name for r in others if not _must_agree(reading.table, r.table))
    used = set(reading.source.values())
    for r in others:
        used.update(r.source.values())
        used.update(n for n in r.table.markers if _isset(env, n))
    used.update(n for n in reading.table.markers if _isset(env, n))
    strays = ()
    if stray is not None:
        used.update(stray.source.values())
        strays = tuple((stray.source[k], stray.values[k]) for k in INT_FIELDS
                       if k in stray.values)
    return LaunchInfo(
        launcher=reading.table.name, rank=v["rank"], size=v.get("size"),
        local_rank=v.get("local_rank"), local_size=v.get("local_size"),
        node_rank=v.get("node_rank"), num_nodes=v.get("num_nodes"), hosts=v.get("hosts"),
        pmi=pmi, outer=outer,
        variables=tuple(sorted((n, str(env[n])) for n in used if _isset(env, n))),
        stray=strays)


#: Where hpcddp.launch.torchrun_env lists the torchrun variables it set ("NAMES@identity").
TORCH_VARS_MARKER = "HPCDDP_TORCH_VARS_SET"


def _set_by_hpcddp(env: Mapping[str, str]) -> set:
    text = str(env.get(TORCH_VARS_MARKER, ""))
    if not text:
        return set()
    return set(text.partition("@")[0].split(",")) & set(TORCH_ENV.variables)


def detect(env: Mapping[str, str] | None = None) -> Optional[LaunchInfo]:
    """Which launcher started this process, and where the process sits in the job.

    Reads ``env`` (default ``os.environ``); pure: no MPI, no torch, callable before MPI starts
    and from any process. Returns ``None`` when no launcher's variables are present (a
    singleton, or a Slurm batch script's shell). Raises :class:`LaunchEnvError`, naming the
    variables seen and what was expected, when a launcher's variables are partial (a local
    rank without a rank), malformed (not an integer, negative), contradictory (rank >= size),
    or when two launchers that describe the same processes disagree. torch's ``env://``
    variables beside an MPI launcher may be partial but must not contradict it
    (``LaunchInfo.stray``); those hpcddp set itself (listed in ``HPCDDP_TORCH_VARS_SET``:
    :mod:`hpcddp.launch.torchrun_env`) are not read. The module docstring gives the
    precedence rules; ``HPCDDP_LAUNCHER`` overrides them.
    """
    env = os.environ if env is None else env
    ours = _set_by_hpcddp(env)
    if ours:   # torchrun's variables hpcddp set (torchrun_env.py) are not the user's strays
        env = {k: v for k, v in env.items() if k not in ours}
    forced = (settings.get() if env is os.environ else settings.read(env)).launcher.lower()
    if forced:
        if forced == "none":
            return None
        table = _BY_NAME.get(forced)
        if table is None:
            raise LaunchEnvError(
                f"detect: {LAUNCHER_OVERRIDE}={env[LAUNCHER_OVERRIDE]!r} is not a launcher; "
                f"expected one of: {', '.join(LAUNCHERS)}, none")
        if not any(_isset(env, n) for n in table.variables):
            raise LaunchEnvError(
                f"detect: {LAUNCHER_OVERRIDE}={forced} but none of {table.title}'s variables "
                f"({', '.join(table.variables)}) is set; expected that launcher to have "
                f"started this process")
        return _info(_read(table, env), [], env)

    found = [t for t in TABLES if _present(t, env)]
    if TORCHRUN in found and TORCH_ENV in found:
        found.remove(TORCH_ENV)   # the same RANK/WORLD_SIZE, already read as torchrun's
    stray = None
    if _strays(found, env):
        found = [t for t in found if t is not TORCH_ENV]
        stray = _read(TORCH_ENV, env, partial=True)
    if not found:
        return None
    readings = [_read(t, env) for t in found]
    inner, others = readings[0], readings[1:]
    for other in others:
        if not _must_agree(inner.table, other.table):
            continue
        for key in INT_FIELDS:
            a, b = inner.values.get(key), other.values.get(key)
            if a is not None and b is not None and a != b:
                raise _error(
                    f"two launchers disagree about this process's {key.replace('_', ' ')}: "
                    f"{inner.describe(env)}, but {other.describe(env)}",
                    env, list(inner.table.variables) + list(other.table.variables),
                    "the same values from every launcher that started this process",
                    f"If one set of variables was exported by hand or by a job script before "
                    f"the launcher started, unset it; or set {LAUNCHER_OVERRIDE}=<one of "
                    f"{', '.join(LAUNCHERS)}> to read one launcher only")
    if stray is not None:
        _check_strays(inner, others, stray, env)
    return _info(inner, others, env, stray)


# --------------------------------------------------------------------------- against MPI

def ft_setting(name: str, env=None) -> bool:
    """Whether Open MPI's ULFM parameter ``mpi_ft_NAME`` is set true in the environment."""
    value = (os.environ if env is None else env).get(f"OMPI_MCA_mpi_ft_{name}", "")
    return value.strip().lower() in ("1", "true", "yes", "on")


def fault_tolerant_job(env=None) -> bool:
    """Whether this job runs with ULFM on (Open MPI's ``mpirun --with-ft ulfm`` sets it)."""
    return ft_setting("enable", env)


def spans_nodes(info: Optional[LaunchInfo]) -> bool:
    """Whether the launcher's variables say the job runs on several nodes (before MPI starts:
    more nodes than one, or fewer ranks on this node than in the job)."""
    if info is None:
        return False
    if info.num_nodes is not None:
        return info.num_nodes > 1
    return bool(info.local_size and info.size and info.local_size < info.size)


def _commands(n: int, argv) -> list:
    """What to run instead of torchrun: this program under mpirun, srun and ``hpcddp run``."""
    argv = list(argv or ())
    if not argv or argv[0] in ("", "-c", "-m") or argv[0].startswith("-"):
        argv = ["script.py"]   # python -c/-m: no script path to repeat
    if argv[0].endswith(".py"):
        program, script = ["python", *argv], argv
    else:   # a console script (`hpcddp run train.py` is one): run it as it is
        program, script = [os.path.basename(argv[0]), *argv[1:]], None
    commands = [f"mpirun -n {n} {shlex.join(program)}",
                f"srun --mpi=pmix -n {n} {shlex.join(program)}"]
    if script is not None:
        commands.append(f"mpirun -n {n} hpcddp run {shlex.join(script)}")
    return commands


def check_world(info: Optional[LaunchInfo], rank: int, size: int, argv=()) -> Optional[str]:
    """After MPI started: is MPI's world the one the launcher described? Pure.

    ``info`` is :func:`detect`'s answer, ``rank``/``size`` MPI's ``COMM_WORLD`` rank and size,
    ``argv`` the program's ``sys.argv`` (quoted in the torchrun error). Called on every rank by
    ``hpcddp.init`` right after MPI started. Raises :class:`LaunchWorldError` when

    - torchrun started the processes and MPI's world is not torchrun's: torchrun forks
      workers that are not MPI processes, so each is a world of one. The message says so in
      its first words, and what to run instead;
    - the launcher's size is not MPI's (an MPI that did not connect to the launcher: N
      singletons);
    - a stray torch variable names another rank or size than MPI's (the comparison
      :func:`detect` could not make where the launcher exports no size, PMIx alone).

    Returns the warning for a *partial* stray set (``WORLD_SIZE`` without ``RANK`` or the
    reverse) that agrees with MPI, else ``None``: one line, for rank 0 to print (a stray
    variable is inherited by every rank alike, so one line says it for all of them).
    A complete ``RANK``/``WORLD_SIZE`` pair (which a wrapper script derives from the
    launcher's) is silent, and ``LOCAL_RANK`` alone (exported to pick a GPU) is not read.
    """
    if info is None:
        return None
    if info.launcher == "torchrun" and (info.size, info.rank) != (size, rank):
        raise LaunchWorldError(_torchrun_error(info, rank, size, argv))
    if info.size not in (None, size):
        # the classic: `srun --mpi=pmi2` with an MPI built for PMIx gives N singletons
        raise LaunchWorldError(
            f"init: the launcher ({info.launcher}) started {info.size} ranks but MPI sees a "
            f"world of {size}: MPI did not connect to the launcher. Under Slurm use "
            f"`srun --mpi=pmix` (see `srun --mpi=list`), or start with mpirun "
            f"(docs/launching.md)")
    stray = dict(info.stray)
    mpi = {"RANK": rank, "WORLD_SIZE": size}
    wrong = [name for name in mpi if name in stray and stray[name] != mpi[name]]
    if wrong:
        raise LaunchWorldError(
            f"init: {' and '.join(f'{n}={stray[n]}' for n in wrong)} "
            f"contradict{'s' if len(wrong) == 1 else ''} MPI's rank {rank} of {size}; "
            f"expected {' and '.join(f'{n}={mpi[n]}' for n in wrong)}, or unset. torch's "
            f"env:// variables exported before mpirun or srun are inherited by every rank: "
            f"`unset {' '.join(wrong)}` before starting the job (hpcddp takes rank and size "
            f"from MPI)")
    if sum(name in stray for name in mpi) != 1:
        return None   # none, or a complete pair that agrees: nothing to say
    return _stray_warning(info)


def _torchrun_error(info: LaunchInfo, rank: int, size: int, argv) -> str:
    commands = _commands(info.size, argv)
    also = (f", or `{commands[2]}`, which also aborts the whole job when one rank raises"
            if len(commands) > 2 else "")
    return (f"torchrun cannot start MPI ranks: run `{commands[0]}` instead (or "
            f"`{commands[1]}` under Slurm{also}). torchrun started this process as rank "
            f"{info.rank} of {info.size} (RANK={info.rank}, WORLD_SIZE={info.size}), but its "
            f"workers are not MPI processes: MPI sees rank {rank} of a world of {size}, and "
            f"hpcddp's collectives run over MPI (docs/launching.md)")


def _stray_warning(info: LaunchInfo) -> str:
    names = [name for name, _ in info.stray]
    missing = "WORLD_SIZE" if "RANK" in names else "RANK"
    listing = ", ".join(f"{name}={value}" for name, value in info.stray)
    one = len(names) == 1
    return (f"{listing} {'is' if one else 'are'} set without {missing} (torch env:// "
            f"variable{'' if one else 's'} inherited from the shell that started the job?); "
            f"{'it agrees' if one else 'they agree'} with {_BY_NAME[info.launcher].title}, "
            f"which is in charge: rank and size come from MPI. `unset {' '.join(names)}` "
            f"silences this warning")
