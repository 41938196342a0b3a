"""The journey of a call through hpcddp: which of its functions a torch.distributed call
enters, in order, and in which files (a newcomer's question: which path does a call take?).

    mpirun -n 2 python scripts/journey.py [-v]     # 8 B and 4 MiB all_reduce, three calls each

"first": the first call on a tensor (the full path: validation, record, the dispatch table),
the group already set up; "second": the same call again (the full path, and take's memo plans
it); "third": once more (the plan hit, where the path that ran it plans it).

A *stop* is a Python function of hpcddp entered during the call (sys.setprofile's "call"
events under hpcddp/, the C module's work not counted); a *return to a file* is a step into a
file the journey had already left. Rank 0 prints; every rank makes the calls.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

import hpcddp

ROOT = os.path.dirname(os.path.abspath(hpcddp.__file__))


def journey(fn) -> list[tuple[str, str]]:
    """(file relative to hpcddp/, function) of every hpcddp function FN's call enters."""
    stops: list[tuple[str, str]] = []

    def profile(frame, event, arg):
        if event == "call":
            path = frame.f_code.co_filename
            if path.startswith(ROOT):
                stops.append((os.path.relpath(path, ROOT), frame.f_code.co_name))
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return stops


def summary(stops) -> dict:
    files, left, returns = [], set(), 0
    for f, _ in stops:
        if files and files[-1] == f:
            continue
        if f in left:
            returns += 1
        if files:
            left.add(files[-1])
        files.append(f)
    return {"stops": len(stops), "files": len(set(f for f, _ in stops)), "returns": returns}


def ran_on(stops) -> str:
    """The path whose op the call ran (the last path module it entered), or the plan hit."""
    entered = [f for f, _ in stops if f.startswith("collectives/paths/")]
    return entered[-1] if entered else "the plan hit"


def main() -> None:
    dist.init_process_group("hpcddp")
    small, large = torch.ones(2), torch.ones(1 << 20)
    # the group's one-time set-up (its device map read, the arena made and raced, the table's
    # rows for the group read from them) is not a call's journey: warm it up with other
    # tensors of each size
    for _ in range(2):
        dist.all_reduce(torch.ones(2))
        dist.all_reduce(torch.ones(1 << 20))
    rows = []
    for name, t in (("8 B", small), ("4 MiB", large)):
        for turn in ("first", "second", "third"):
            stops = journey(lambda: dist.all_reduce(t))
            rows.append((f"{name} all_reduce, {turn}", stops))
    if dist.get_rank() == 0:
        verbose = "-v" in sys.argv
        for what, stops in rows:
            s = summary(stops)
            print(f"{what}: {s['stops']} stops, {s['files']} files, {s['returns']} returns "
                  f"to a file already left; ran on {ran_on(stops)}")
            if verbose:
                for f, name in stops:
                    print(f"    {f}:{name}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
