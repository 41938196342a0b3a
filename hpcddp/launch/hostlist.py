"""Slurm hostlists: ``gpu[001-004,010],cpu07`` <-> ``['gpu001', ..., 'gpu010', 'cpu07']``.

Pure standard library. The grammar is Slurm's (``SLURM_JOB_NODELIST``, ``SLURM_STEP_NODELIST``,
``scontrol show hostnames``):

- a hostlist is host expressions separated by commas at the top level (commas inside brackets
  separate ranges);
- a host expression is literal text and bracket groups, ``rack[1-2]node[01-04]``; several groups
  expand as a cartesian product, the leftmost group varying slowest (rack1node01, rack1node02,
  ..., rack2node04), as Slurm and python-hostlist order them;
- a bracket group holds comma-separated numbers ``7`` and ranges ``3-5``; a range is padded to
  the width of its lower bound, so ``[001-010]`` gives ``001 ... 010`` and ``[8-10]`` gives
  ``8 9 10``.

Order and duplicates are kept as written: the order is the node order Slurm reports, and
``SLURM_NODEID`` indexes into it.
"""
from __future__ import annotations

import itertools
import re
from typing import Iterable

# A typo such as ``n[1-100000000]`` must fail, not fill the memory of every rank.
MAX_HOSTS = 1_000_000

_RANGE = re.compile(r"(\d+)(?:-(\d+))?")
_TRAILING_NUMBER = re.compile(r"^(.*?)(\d+)$")


def _bad(text: str, why: str) -> ValueError:
    return ValueError(f"expand_hostlist: cannot parse hostlist {text!r}: {why} "
                      f"(expected Slurm's form, e.g. 'gpu[001-004,010],cpu07')")


def _split_top_level(text: str) -> list[str]:
    """Split at commas outside brackets; reject nesting and unbalanced brackets."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            if depth:
                raise _bad(text, f"nested '[' at position {i}")
            depth = 1
        elif ch == "]":
            if not depth:
                raise _bad(text, f"']' without a matching '[' at position {i}")
            depth = 0
        elif ch == "," and not depth:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise _bad(text, "'[' without a matching ']'")
    items.append(text[start:])
    return items


def _expand_group(text: str, group: str) -> list[str]:
    """``'1,3-5'`` -> ``['1', '3', '4', '5']``, padded to each range's lower bound."""
    if not group:
        raise _bad(text, "empty brackets '[]'")
    out: list[str] = []
    for part in group.split(","):
        m = _RANGE.fullmatch(part.strip())
        if not m:
            raise _bad(text, f"{part!r} in '[{group}]' is not a number or a range 'lo-hi'")
        lo_s, hi_s = m.group(1), m.group(2)
        lo = int(lo_s)
        hi = lo if hi_s is None else int(hi_s)
        if hi < lo:
            raise _bad(text, f"range '{part}' in '[{group}]' is reversed ({lo} > {hi})")
        if len(out) + hi - lo + 1 > MAX_HOSTS:
            raise _bad(text, f"'[{group}]' expands to more than {MAX_HOSTS} names")
        width = len(lo_s)
        out.extend(str(i).zfill(width) for i in range(lo, hi + 1))
    return out


def _expand_one(text: str, expr: str) -> list[str]:
    # Alternate literal text and bracket groups: 'a[1-2]b[3]' -> ['a', '1-2', 'b', '3', ''].
    pieces = re.split(r"\[([^\]]*)\]", expr)
    choices: list[list[str]] = []
    for i, piece in enumerate(pieces):
        if i % 2 == 0:
            if any(c in piece for c in "[] \t\n"):
                raise _bad(text, f"unexpected character in {piece!r}")
            choices.append([piece])
        else:
            choices.append(_expand_group(text, piece))
    count = 1
    for c in choices:
        count *= len(c)
    if count > MAX_HOSTS:
        raise _bad(text, f"{expr!r} expands to {count} names, more than {MAX_HOSTS}")
    return ["".join(p) for p in itertools.product(*choices)]


def expand_hostlist(text: str) -> list[str]:
    """Every host name in a Slurm hostlist, in order, duplicates kept.

    ``expand_hostlist("gpu[001-002,010],cpu07") == ["gpu001", "gpu002", "gpu010", "cpu07"]``.
    Blank items between top-level commas and surrounding whitespace are ignored; an empty
    string gives ``[]``. Raises ValueError naming the input for unbalanced or nested brackets,
    empty brackets, reversed ranges (``[5-3]``), non-numeric ranges, or more than
    ``MAX_HOSTS`` names.
    """
    if not isinstance(text, str):
        raise TypeError(f"expand_hostlist: text must be a str, got {type(text).__name__}")
    hosts: list[str] = []
    for expr in _split_top_level(text.strip()):
        expr = expr.strip()
        if not expr:
            continue
        hosts.extend(_expand_one(text, expr))
        if len(hosts) > MAX_HOSTS:
            raise _bad(text, f"expands to more than {MAX_HOSTS} names")
    return hosts


def compress_hostlist(hosts: Iterable[str]) -> str:
    """The inverse of :func:`expand_hostlist`: ``['n1', 'n2', 'n3', 'n7'] -> 'n[1-3,7]'``.

    Order-preserving, so ``expand_hostlist(compress_hostlist(h)) == list(h)`` for every list
    of plain names: only neighbours sharing a prefix and a zero-padding width, with increasing
    numbers, share a bracket. Names without a trailing number are written as they are.
    Raises ValueError for a name holding ``[``, ``]``, ``,`` or whitespace, or an empty name.
    """
    out: list[str] = []
    # The open group: prefix, padding width (0 = unpadded), and runs of [lo, hi].
    prefix: str | None = None
    width = 0
    runs: list[list[int]] = []

    def flush() -> None:
        nonlocal prefix, runs
        if prefix is None:
            return
        fmt = (lambda i: str(i).zfill(width)) if width else str
        parts = [fmt(lo) if lo == hi else f"{fmt(lo)}-{fmt(hi)}" for lo, hi in runs]
        if len(parts) == 1 and runs[0][0] == runs[0][1]:
            out.append(prefix + parts[0])
        else:
            out.append(f"{prefix}[{','.join(parts)}]")
        prefix, runs = None, []

    for name in hosts:
        if not isinstance(name, str) or not name or re.search(r"[\[\],\s]", name):
            raise ValueError(f"compress_hostlist: host name {name!r} cannot be written in a "
                             "hostlist (expected a non-empty name without '[', ']', ',' "
                             "or spaces)")
        m = _TRAILING_NUMBER.match(name)
        if not m:
            flush()
            out.append(name)
            continue
        pre, digits = m.group(1), m.group(2)
        num = int(digits)
        padded = len(digits) > 1 and digits.startswith("0")
        fits = (prefix == pre and num > runs[-1][1]
                and (len(digits) == width if width else not padded))
        if fits:
            if num == runs[-1][1] + 1:
                runs[-1][1] = num
            else:
                runs.append([num, num])
            continue
        flush()
        prefix, width, runs = pre, (len(digits) if padded else 0), [[num, num]]
    flush()
    return ",".join(out)
