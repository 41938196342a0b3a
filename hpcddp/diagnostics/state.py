"""What one rank is doing right now, as plain data: in-flight ops, last ops, Python stacks.

:func:`snapshot` is what a rank sends to the rank writing a stall report. It runs on the
watchdog thread while the main thread may sit inside a blocking MPI call (mpi4py releases
the GIL there), so it reads the flight recorder and ``sys._current_frames()`` only.
"""
from __future__ import annotations

import os
import sys
import threading
import time
import traceback

from hpcddp.diagnostics import recorder as _rec

_HPCDDP_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# code a thread sits in while it waits for other ranks: an op, its Work, the mismatch check,
# hpcddp's finalize; mpi4py's pickle-5 object collectives; the ring's TCP links (their poll);
# a path's private duplicate of the group's communicator (MPI_Comm_dup, made inside an op's
# first call: a peer stopped before it once left the others there unseen by the watchdog)
_BLOCKING_DIRS = tuple(os.path.join(_HPCDDP_DIR, d) + os.sep
                       for d in ("collectives", "backend", "diagnostics")) + tuple(
    # hpcddp stage's own MPI calls (hpcddp.data._comm.watched holds them in the recorder)
    os.path.join(_HPCDDP_DIR, "data", f) for f in ("staging.py", "_staging_")) + tuple(
    os.path.join(_HPCDDP_DIR, "comm", f) for f in ("links.py", "communicator.py"))
_NOT_USER = ("<frozen", "<string>")
STACK_LIMIT = 24   # frames per stack in a report


def _lib_dirs() -> tuple:
    dirs = [_HPCDDP_DIR + os.sep, os.path.dirname(threading.__file__) + os.sep]
    for name in ("torch", "mpi4py", "numpy"):
        mod = sys.modules.get(name)
        f = getattr(mod, "__file__", None)
        if f:
            dirs.append(os.path.dirname(f) + os.sep)
    return tuple(dirs)


def _mpi4py_dir() -> str | None:
    mod = sys.modules.get("mpi4py")
    f = getattr(mod, "__file__", None)
    return os.path.dirname(f) + os.sep if f else None


def is_blocking_frame(frame) -> bool:
    """Is this (innermost) frame hpcddp or mpi4py code that waits for other ranks?"""
    name = frame.f_code.co_filename
    if name.startswith(_BLOCKING_DIRS):
        return not name.endswith(("watchdog.py", "state.py"))
    m = _mpi4py_dir()
    return bool(m and name.startswith(m))


def user_frame(frame):
    """The innermost frame outside hpcddp, torch, mpi4py, numpy and the standard library."""
    libs = _lib_dirs()
    f = frame
    while f is not None:
        name = f.f_code.co_filename
        if not name.startswith(libs) and not name.startswith(_NOT_USER):
            return f
        f = f.f_back
    return None


def where(frame) -> str:
    """'train.py:88 (in step)': where a thread is in the user's code."""
    f = user_frame(frame)
    if f is None:
        f = frame
    if f is None:
        return "?"
    return f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno} (in {f.f_code.co_name})"


def format_stack(frame, limit: int = STACK_LIMIT) -> str:
    lines = traceback.format_stack(frame)
    if len(lines) > limit:
        lines = [f"  ... {len(lines) - limit} outer frames left out ...\n"] + lines[-limit:]
    return "".join(lines).rstrip("\n")


def blocked_threads(frames=None, exclude=()) -> list:
    """(thread ident, name) of threads whose innermost frame is hpcddp/mpi4py waiting code."""
    frames = sys._current_frames() if frames is None else frames
    names = {t.ident: t.name for t in threading.enumerate()}
    return [(tid, names.get(tid, f"thread {tid}")) for tid, f in frames.items()
            if tid not in exclude and is_blocking_frame(f)]


# Threads of libraries that never call hpcddp, told by the module of the function they run
# (or of their Thread subclass): hpcddp's own; a multiprocessing queue's feeder (every
# DataLoader with workers starts one per worker in the rank's process); torch's pin-memory
# thread; tqdm's monitor (a progress bar's). A training script has them all along, and each
# would otherwise count as a thread that might still send.
QUIET_THREAD_MODULES = ("hpcddp.", "multiprocessing.queues", "multiprocessing.resource_sharer",
                        "torch.utils.data._utils.pin_memory", "tqdm._monitor")


def _quiet(t: threading.Thread) -> bool:
    target = getattr(t, "_target", None)
    module = getattr(target, "__module__", None) if target is not None else type(t).__module__
    return str(module).startswith(QUIET_THREAD_MODULES)


def running_threads(frames: dict, *exclude) -> int:
    """How many threads other than EXCLUDE (the threads waiting in hpcddp, the main thread, the
    watchdog's), and other than hpcddp's own and the libraries' that never call it
    (QUIET_THREAD_MODULES), may still call hpcddp on their own (a thread of the script, of a
    library). Every thread the interpreter runs counts (FRAMES, sys._current_frames: also
    those started with ``_thread``, which threading does not list); a thread is told by the
    function it runs, not by its name."""
    quiet = {t.ident for t in threading.enumerate() if _quiet(t)}
    return sum(1 for tid in frames if tid not in exclude and tid not in quiet)


def _exc_text(exc) -> str:
    t = type(exc)
    name = t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"
    text = str(exc).strip().splitlines()
    return f"{name}: {text[0][:300]}" if text else name


def snapshot(rank: int, host: str, pid: int, exclude_thread=None, extra=None) -> dict:
    """This rank's state (plain data): what it is doing, what it last did, its stacks."""
    now = _rec._now()
    entries = _rec.RECORDER.entries()
    inflight = [_rec.describe(e, now) for e in entries if e[_rec.T_END] == 0.0]
    groups: dict = {}
    for e in entries:        # oldest first: the last entry per group wins
        comm = e[_rec.GROUP]
        key = getattr(comm, "uid", id(comm))
        g = groups.setdefault(key, {
            "group": getattr(comm, "name", str(comm)),
            "ranks": list(getattr(comm, "world_ranks", ())), "gen": _rec.generation(comm),
            "seq": getattr(comm, "seq", None), "p2p_seq": _rec.RECORDER.p2p_seq(comm),
            "last": None, "recent": []})
        g["seq"] = getattr(comm, "seq", None)
        d = None
        if e[_rec.T_END] != 0.0 and e[_rec.OP] != "finalize" and len(e) == 8:
            d = _rec.describe(e, now)
            if d["op"] not in _rec.P2P_OPS:
                g["last"] = d
        if e[_rec.OP] not in _rec.P2P_OPS and e[_rec.OP] != "finalize":
            g["recent"].append(d or _rec.describe(e, now))
    for g in groups.values():
        g["recent"] = g["recent"][-6:]
    frames = sys._current_frames()
    main = threading.main_thread()
    main_frame = frames.get(main.ident)
    threads, blocked = {}, []
    for tid, name in blocked_threads(frames, exclude=(main.ident, exclude_thread)):
        threads[name] = format_stack(frames[tid])
        blocked.append(tid)
    exc = getattr(sys, "last_value", None)
    snap = {
        "rank": rank, "host": host, "pid": pid, "wall": time.time(),
        "inflight": inflight,
        "groups": list(groups.values()),
        "main_blocked": bool(main_frame is not None and is_blocking_frame(main_frame)),
        "blocked": bool(threads) or bool(main_frame is not None and is_blocking_frame(main_frame)),
        "where": where(main_frame) if main_frame is not None else "main thread has ended",
        "stack": format_stack(main_frame) if main_frame is not None else "",
        "threads": threads,
        "exception": None if exc is None else _exc_text(exc),
        "finalizing": any(e[_rec.OP] == "finalize" and e[_rec.T_END] == 0.0 for e in entries),
        "running_threads": running_threads(frames, main.ident, exclude_thread, *blocked),
        # seconds since this rank last began or ended a call: a send that ended a moment ago
        # (a worker thread's, now gone) may still be on its way to a peer
        "quiet_for": now - max((e[_rec.T_END] or e[_rec.T_START] for e in entries),
                               default=now - 1e9),
    }
    if extra:
        snap.update(extra)
    return snap
