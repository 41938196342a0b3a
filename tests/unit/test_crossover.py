"""hpcddp.collectives._node.crossover, the rule that decides from which size a node-local path
serves an op, on one process with the race's times given (tests/mpi/test_paths.py forces them
per rank in real jobs): up the ladder, stop after two wins in a row, serve from the first."""
from __future__ import annotations

import pytest

from hpcddp.collectives import _node

KIB, MIB = 1 << 10, 1 << 20


class _OneRank:
    """The communicator calls crossover makes, on one rank (the max over one rank is itself)."""
    name, size, rank = "WORLD", 1, 0

    class mpi:
        Barrier = staticmethod(lambda: None)
        Allreduce = staticmethod(lambda sendbuf, recvbuf, op: None)
        allreduce = staticmethod(lambda value, op: value)


def _decide(monkeypatch, wins: str):
    """WINS: one letter per size of the ladder, w (the path faster) or l (MPI faster)."""
    outcome = dict(zip(_node.LADDER, wins))
    monkeypatch.setattr(_node, "best_times",
                        lambda comm, ours, mpis, tries=3: (1.0, 2.0) if outcome[ours] == "w"
                        else (2.0, 1.0))
    monkeypatch.setattr(_node, "decisions", [])
    found = _node.crossover("test path", "all_reduce", _OneRank(),
                            lambda nbytes: (nbytes, None))
    return found, [s[0] for s in found.steps]


@pytest.mark.parametrize("wins, start, raced", [
    ("wwlllll", 256 * KIB, 2),          # wins from the first size: two sizes raced
    ("lllwwww", 2 * MIB, 5),            # the crossover at 2 MiB
    ("lwlwwll", 2 * MIB, 5),            # a lone win below the crossover does not count
    ("llllllw", 16 * MIB, 7),           # wins at the top size only: from there
    ("lllllll", None, 7),               # never
    ("wllllll", None, 7),               # a lone win at the bottom is not a crossover
])
def test_the_path_serves_from_the_first_of_two_wins_in_a_row(monkeypatch, wins, start, raced):
    found, sizes = _decide(monkeypatch, wins)
    assert found.start == start
    assert sizes == list(_node.LADDER[:raced])
    assert _node.decisions == [found.as_dict()] and found.as_dict()["start_bytes"] == start


def test_the_decision_says_which_sizes_decided_it(monkeypatch):
    found, _ = _decide(monkeypatch, "lllwwww")
    assert found.why().startswith("not 5% faster at 1 MiB: this path 2000.00 ms, MPI 1000.00 ms; "
                                  "faster at 2 MiB: this path 1000.00 ms, MPI 2000.00 ms; race ")


def test_a_forced_path_serves_from_its_floor_without_a_race(monkeypatch):
    monkeypatch.setattr(_node, "crossover", lambda *a, **k: pytest.fail("raced"))
    starts = _node.Starts("test path", _OneRank(), None, forced=True, floor=256 * KIB)
    assert starts.start("all_reduce") == 256 * KIB and starts.found == {}


def test_docs_crossover_tables_are_the_committed_runs(capsys):
    """docs/benchmarks/crossover/tables.md is what scripts/crossover_table.py makes of the
    committed runs, and the page's per-run decisions are theirs."""
    import runpy
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    folder = root / "docs" / "benchmarks" / "crossover"
    runpy.run_path(str(root / "scripts" / "crossover_table.py"), run_name="tables")["main"](
        str(folder))
    assert capsys.readouterr().out == (folder / "tables.md").read_text()
    page = (root / "docs" / "benchmarks.md").read_text()
    import json
    for i in range(1, 6):
        run = json.loads((folder / f"run{i}.json").read_text())
        starts = {d["op"] + d["path"]: d["start_bytes"] for d in run["node_paths"]}
        row = f"| {i} | from {_node._mib(starts['all_reduceshm arena'])} "
        assert row in page, row
