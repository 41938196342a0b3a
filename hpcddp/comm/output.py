"""Rank-prefixed output: every diagnostic line says which rank printed it (``[rank2] ...``).

Pure standard library and safe before MPI starts: the rank comes from the launcher's
environment until :func:`hpcddp.comm.init` has run.
"""
from __future__ import annotations

import sys

_rank: int | None = None


def set_rank(rank: int) -> None:
    global _rank
    _rank = rank


def rank() -> int:
    if _rank is not None:
        return _rank
    try:
        from hpcddp.launch import detect
        info = detect()
    except Exception:  # a broken launcher env must not break logging
        info = None
    return info.rank if info else 0


def prefix() -> str:
    return f"[rank{rank()}]"


def log(*parts, file=None, flush: bool = True) -> None:
    """Print one message with the rank prefix on each line (stderr by default)."""
    text = " ".join(str(p) for p in parts)
    out = file or sys.stderr
    pre = prefix()
    out.write("".join(f"{pre} {line}\n" for line in text.splitlines() or [""]))
    if flush:
        out.flush()


def rank_print(*parts, flush: bool = True) -> None:
    """Like print(), to stdout, with the rank prefix."""
    log(*parts, file=sys.stdout, flush=flush)


def debug_enabled() -> bool:
    from hpcddp import settings
    return bool(settings.get().debug)
