"""Every ``HPCDDP_*`` environment variable, declared once: its type, default and what it does.

The process reads them once, at the first :func:`get` (every layer asks this module, none
reads ``os.environ`` for its own variables), into one frozen :class:`Settings` whose
attributes are the variables' names without the prefix, lower case::

    from hpcddp import settings
    settings.get().timeout          # HPCDDP_TIMEOUT, in seconds (None: no watchdog)
    settings.get().shm_allreduce    # HPCDDP_SHM_ALLREDUCE: "0", "auto" or "force"

A bad value raises :class:`SettingsError` naming the variable, the value and what is
accepted, on the rank that reads it, before any message. :func:`table` makes the table of
docs/settings.md (tests/unit/test_settings.py keeps that page equal to it). Set a variable alike on every rank: the paths it chooses must be the same everywhere.

This module is at the bottom of the layer map: it imports nothing of hpcddp, MPI or torch,
so ``hpcddp.launch`` can use it too.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Mapping

PREFIX = "HPCDDP_"
DEFAULT_TIMEOUT = 600.0
_OFF = ("0", "off", "none", "false", "no")
_ON = ("1", "on", "true", "yes")


class SettingsError(ValueError):
    """An HPCDDP_* variable has a value it cannot take."""


# -- parsers: text (stripped, never empty: unset and empty take the default) -> value -----------

def seconds_or_off(name: str, text: str):
    """Seconds >= 0; 0 or off: None (disabled)."""
    if text.lower() in _OFF:
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise SettingsError(f"{name}={text!r}: expected a number of seconds >= 0 "
                            f"(or 'off' to disable)")
    return value or None


def timeout_from(raw) -> float | None:
    """A timeout given as seconds, a timedelta or text ('off', '0': None, no timeout)."""
    if raw is None:
        return None
    if hasattr(raw, "total_seconds"):
        raw = raw.total_seconds()
    if isinstance(raw, (int, float)):
        if not raw >= 0:
            raise SettingsError(f"timeout={raw!r}: expected seconds >= 0 (0 disables the "
                                f"watchdog)")
        return float(raw) or None
    return seconds_or_off("HPCDDP_TIMEOUT", str(raw).strip())


def _seconds(name: str, text: str) -> float:
    value = seconds_or_off(name, text)
    if value is None and text.lower() in _OFF[1:]:
        raise SettingsError(f"{name}={text!r}: expected a number of seconds >= 0")
    return value or 0.0


def _flag(name: str, text: str) -> bool:
    low = text.lower()
    if low in _ON:
        return True
    if low in _OFF:
        return False
    raise SettingsError(f"{name}={text!r}: expected 1 or 0")


def _abort_mode(name: str, text: str) -> str:
    """Abort on exception: on (1), off (0) or auto."""
    low = text.lower()
    if low in _ON:
        return "on"
    if low in _OFF:
        return "off"
    if low == "auto":
        return "auto"
    raise SettingsError(f"{name}={text!r}: expected auto, 1 (on) or 0 (off)")


def _path_mode(name: str, text: str) -> str:
    """A node-local path's switch: 0 never; auto (or 1) where measured faster; force always."""
    low = text.lower()
    mode = "auto" if low == "1" else low
    if mode not in ("0", "auto", "force"):
        raise SettingsError(f"{name}={text!r}: expected 0, 1, auto or force")
    return mode


def _whole(minimum: int, what: str) -> Callable[[str, str], int]:
    def parse(name: str, text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise SettingsError(f"{name}={text!r}: expected {what}")
        return value
    return parse


_positive_int = _whole(1, "a positive integer")
_bytes = _whole(0, "a whole number of bytes >= 0")
_count = _whole(0, "a whole number >= 0")


def _choice(*values: str) -> Callable[[str, str], str]:
    def parse(name: str, text: str) -> str:
        low = text.lower()
        if low not in values:
            raise SettingsError(f"{name}={text!r}: expected {'one of ' if len(values) > 2 else ''}"
                                f"{', '.join(values[:-1])} or {values[-1]}")
        return low
    parse.__doc__ = " | ".join(values)
    return parse


def _words(name: str, text: str) -> frozenset:
    """A comma or space separated list of words; 0 or off: none."""
    if text.lower() in _OFF:
        return frozenset()
    return frozenset(w for w in re.split(r"[,\s]+", text.lower()) if w)


def _host_port(name: str, text: str) -> str:
    host, sep, port = text.rpartition(":")
    if sep and (not host or not port.isdigit()):
        raise SettingsError(f"{name}={text!r}: expected HOST or HOST:PORT")
    return text


def _text(name: str, text: str) -> str:
    return text


# -- the declarations -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Var:
    name: str                       # HPCDDP_...
    parse: Callable[[str, str], Any]
    default: Any                    # the value when unset or empty
    values: str                     # what it accepts, for people
    doc: str                        # one line: what it does
    topic: str                      # where docs/ says more

    @property
    def attr(self) -> str:
        return self.name[len(PREFIX):].lower()


VARS: tuple[Var, ...] = (
    # diagnostics (docs/hangs.md)
    Var("HPCDDP_TIMEOUT", seconds_or_off, DEFAULT_TIMEOUT, "seconds, or 0/off",
        "seconds an op may wait before the watchdog reports a stall; a group's torch "
        "timeout= wins over it (under ULFM MPI's start-up may take max(this, 300 s)); also "
        "how long a rank may be stopped (SIGSTOP) while the job starts before it is ended",
        "hangs.md"),
    Var("HPCDDP_STALL_POLICY", _choice("abort", "warn"), "abort", "abort, warn",
        "after a stall report: abort the job (exit code 3), or warn and keep waiting",
        "hangs.md"),
    Var("HPCDDP_ABORT_ON_EXCEPTION", _abort_mode, "auto", "auto, 1/on, 0/off",
        "auto: a rank whose script ends with an uncaught exception (or sys.exit(non-zero)) "
        "reports and ends the job instead of waiting at its exit for ranks that wait for it; "
        "on: any uncaught exception, also in a thread, aborts at once; "
        "init(abort_on_exception=) wins", "hangs.md"),
    Var("HPCDDP_PEER_TIMEOUT", _seconds, None, "seconds",
        "how long a rank has to answer the stall report's exchange before it is named "
        "unresponsive (unset: min(5, the timeout))", "hangs.md"),
    Var("HPCDDP_REPORT_DIR", _text, "", "a directory",
        "where hpcddp-stall-<jobid>.txt is written (unset: the working directory)", "hangs.md"),
    Var("HPCDDP_DEBUG", _words, frozenset(), "words: detail, and any other word",
        "detail: compare every collective's call across ranks before it runs; any value "
        "also prints start-up decisions on rank 0", "hangs.md"),
    Var("HPCDDP_AUDIT", _flag, True, "1, 0",
        "once a second and at the end, rank 0 compares the collectives every rank recorded: "
        "ranks that ran different calls (wrong results) get a report and the stall policy",
        "hangs.md"),
    Var("HPCDDP_RECORDER_SIZE", _positive_int, 2048, "entries",
        "flight recorder entries kept per rank", "hangs.md"),
    Var("HPCDDP_PID_CHECK", _flag, True, "1, 0",
        "a same-host peer whose process is gone is named dead at once (0: ranks in separate "
        "PID namespaces on one host)", "hangs.md"),
    # MPI and the launch (docs/launch.md)
    Var("HPCDDP_THREAD_LEVEL", _choice("multiple", "serialized", "funneled", "single"),
        "multiple", "multiple, serialized, funneled, single",
        "the MPI thread level asked for at start-up (DDP runs collectives from autograd "
        "threads)", "launching.md"),
    Var("HPCDDP_LAUNCHER", _text, "", "a launcher's name, or none",
        "read only this launcher's variables (the names `hpcddp info` lists); none: "
        "singleton", "launching.md"),
    Var("HPCDDP_TORCH_VARS", _flag, True, "1, 0",
        "under an MPI launcher, set torchrun's RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, "
        "GROUP_RANK, GROUP_WORLD_SIZE where unset (0: never)", "launching.md"),
    Var("HPCDDP_TORCH_VARS_SET", _text, "", "written by hpcddp",
        "which of torchrun's variables hpcddp set, and for which process (a child of another "
        "job's rank replaces them)", "launching.md"),
    Var("HPCDDP_RANK_PID", _text, "", "written by hpcddp",
        "the PID of the rank that started MPI: a Python process it starts by exec (spawn, "
        "forkserver) dies with it (the package's .pth file)", "hangs.md"),
    Var("HPCDDP_RANKS_PER_NODE", _positive_int, None, "ranks",
        "emulate nodes of this many consecutive ranks on one host (tests, demos)",
        "launching.md"),
    Var("HPCDDP_STORE_ADDR", _host_port, "", "HOST or HOST:PORT",
        "where ranks reach rank 0's torch TCPStore (unset: 127.0.0.1 on one host, else "
        "rank 0's hostname)", "launching.md"),
    # the collectives' paths (docs/benchmarks.md)
    Var("HPCDDP_SHM_ALLREDUCE", _path_mode, "auto", "0, 1/auto, force",
        "large all_reduce and reduce_scatter on one node through a shared-memory arena "
        "(auto: each op from the size where a start-up race finds it faster than MPI; force: "
        "from 256 KiB, no race)", "benchmarks.md"),
    Var("HPCDDP_CMA", _path_mode, "auto", "0, 1/auto, force",
        "large broadcasts on one node by cross-memory attach (auto: from the size where a "
        "start-up race finds it faster than MPI; force: from 256 KiB, no race)", "benchmarks.md"),
    Var("HPCDDP_HIER", _path_mode, "auto", "0, 1/auto, force",
        "large all_reduce across nodes in two levels: shared memory inside a node, each byte "
        "across nodes once (auto: each op from the size where a start-up race finds it faster "
        "than MPI; force: from 256 KiB, no race)",
        "multinode-testing.md"),
    Var("HPCDDP_RING", _path_mode, "auto", "0, 1/auto, force",
        "large SUM/AVG all_reduce, reduce_scatter_tensor and all_gather_into_tensor across "
        "nodes as a pipelined ring (auto: groups spanning "
        "several nodes, from the size where a start-up race finds it faster than MPI, or over "
        "TCP links no more than 5% slower; force: from 256 KiB, also on one node, no race)",
        "benchmarks.md"),
    Var("HPCDDP_RING_TRANSPORT", _choice("tcp", "mpi"), "tcp", "tcp, mpi",
        "what the rings' messages travel on (the all_reduce ring, hpcddp stage's ring "
        "strategy): hpcddp's own TCP links between ring neighbours (they wait in the kernel, "
        "as gloo's do) or MPI's point-to-point (it waits by polling, a core per rank)",
        "benchmarks.md"),
    Var("HPCDDP_SOCKET_IFNAME", _text, "", "interface[,interface...]",
        "the network interfaces hpcddp's TCP links use (as GLOO_SOCKET_IFNAME; default: "
        "Open MPI's btl_tcp_if_include, else every interface that is up)", "benchmarks.md"),
    Var("HPCDDP_FASTPATH", _path_mode, "auto", "0, 1/auto, force",
        "repeat calls run in the C module (0: the Python hit)", "benchmarks.md"),
    Var("HPCDDP_LIST_P2P_MAX_RANKS", _positive_int, 8, "ranks",
        "list all_gather/reduce_scatter/all_to_all exchange blocks point to point in groups "
        "up to this size (larger: one flat MPI call)", "benchmarks.md"),
    Var("HPCDDP_FUTURE", _choice("wait", "thread"), "wait", "wait, thread",
        "how an async Work's future completes: when waited on, or by a progress thread",
        "collectives.md"),
    Var("HPCDDP_ASYNC_ENGINE", _path_mode, "auto", "0, 1/auto, force",
        "collectives called with async_op=True run on a communication thread per group, "
        "in issue order, while the caller computes (auto: where the job spans several nodes)",
        "ddp.md"),
    # GPUs (docs/gpu.md)
    Var("HPCDDP_CUDA_AWARE", _choice("0", "1", "auto"), "auto", "0, 1, auto",
        "whether MPI takes CUDA buffers (auto: detected; 1: trust it; 0: stage through host "
        "memory)", "gpu.md"),
    Var("HPCDDP_CUDA_SMOKE", _flag, False, "1, 0",
        "confirm CUDA-aware MPI with a smoke test in a child process at start-up", "gpu.md"),
    Var("HPCDDP_PINNED_CACHE_BYTES", _bytes, 1 << 30, "bytes",
        "pinned host memory kept for reuse by the GPU staging path", "gpu.md"),
    Var("HPCDDP_STAGING_CHUNK_BYTES", _bytes, 4 << 20, "bytes",
        "chunk of a pipelined device <-> host copy", "gpu.md"),
    Var("HPCDDP_STAGING_PIPELINE_BYTES", _bytes, 8 << 20, "bytes",
        "from this size GPU tensors are staged in a pipeline of chunks", "gpu.md"),
    # data (docs/data.md)
    Var("HPCDDP_STAGE_LOCK", _choice("flock", "excl"), "flock", "flock, excl",
        "the destination lock's primitive (excl: O_CREAT|O_EXCL, for file systems without "
        "flock)", "data.md"),
    Var("HPCDDP_DATA_CHECK", _flag, True, "1, 0",
        "the datasets check each shard's CRC-32C on its first open in a process", "data.md"),
    # elastic training (docs/elastic.md)
    Var("HPCDDP_ELASTIC", _choice("auto", "force"), "auto", "auto, force",
        "force: start elastic mode even where the MPI's ULFM support is not detected",
        "elastic.md"),
    Var("HPCDDP_ELASTIC_REGROW", _flag, False, "1, 0",
        "after a lost rank, spawn a replacement and go on at full size (elastic.State's "
        "regrow=; no free slot: the job goes on smaller)", "elastic.md"),
    Var("HPCDDP_ELASTIC_SPARES", _count, 0, "count",
        "the last N processes of the job are spares: they wait inside hpcddp.init and replace "
        "lost ranks at once (elastic mode grows back onto them; released at the end)",
        "elastic.md"),
    Var("HPCDDP_ELASTIC_KILL", _text, "", "RANK@STEP[:PHASE],...",
        "fault injection for demos and tests: SIGKILL that rank at that step and phase",
        "elastic.md"),
    Var("HPCDDP_ELASTIC_KILL_LOG", _text, "", "path",
        "where injected kills note their time (hpcddp sets it in replacement ranks: the "
        "survivors' file, for the kill -> full size figure)", "elastic.md"),
    # the command line (docs/benchmarks.md)
    Var("HPCDDP_BENCH_PROGRESS", _flag, True, "1, 0",
        "hpcddp bench comm prints a line after each op and size", "benchmarks.md"),
)
BY_NAME = MappingProxyType({v.name: v for v in VARS})


class Settings:
    """The parsed value of every declared variable, as an attribute (frozen)."""
    __slots__ = ("_values",)

    def __init__(self, values: Mapping[str, Any]):
        object.__setattr__(self, "_values", MappingProxyType(dict(values)))

    def __getattr__(self, attr: str):
        try:
            return self._values[attr]
        except KeyError:
            raise AttributeError(f"hpcddp settings have no {attr!r} (declared: "
                                 f"{', '.join(self._values)})") from None

    def __setattr__(self, attr, value):
        raise AttributeError("hpcddp settings are read once and frozen; use replace()")

    def replace(self, **changes) -> "Settings":
        unknown = set(changes) - set(self._values)
        if unknown:
            raise AttributeError(f"hpcddp settings have no {sorted(unknown)}")
        return Settings({**self._values, **changes})

    def __repr__(self) -> str:
        return "Settings(" + ", ".join(f"{k}={v!r}" for k, v in self._values.items()) + ")"


def read(env: Mapping[str, str] | None = None) -> Settings:
    """Parse every declared variable from ENV (default: os.environ); SettingsError at the first
    bad value."""
    env = os.environ if env is None else env
    values = {}
    for var in VARS:
        text = str(env.get(var.name, "")).strip()
        values[var.attr] = var.default if text == "" else var.parse(var.name, text)
    return Settings(values)


_current: Settings | None = None


def get() -> Settings:
    """This process's settings: read from the environment at the first call, then kept."""
    global _current
    if _current is None:
        _current = read()
    return _current


def set_from_init(**changes) -> Settings:
    """What hpcddp.init's arguments change (e.g. timeout=): the settings every later reader
    sees, in place of writing the environment."""
    global _current
    _current = get().replace(**changes)
    return _current


def table() -> str:
    """The markdown table of docs/settings.md."""
    lines = ["| variable | accepts | default | what it does | more |", "|---|---|---|---|---|"]
    for v in VARS:
        default = v.default
        if isinstance(default, frozenset):
            default = ",".join(sorted(default))
        elif isinstance(default, bool):
            default = int(default)
        default = "unset" if default in (None, "") else f"`{default}`"
        lines.append(f"| `{v.name}` | {v.values} | {default} | {v.doc} | [{v.topic}]({v.topic}) |")
    return "\n".join(lines) + "\n"
