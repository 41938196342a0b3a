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
    for i in range(1, 6):     # | run | arena, all_reduce (last size lost) | ... | costs |
        run = json.loads((folder / f"run{i}.json").read_text())
        found = {(d["path"], d["op"]): d for d in run["node_paths"]}
        ar, rs, bc = (found["shm arena", "all_reduce"], found["shm arena", "reduce_scatter"],
                      found["cma", "broadcast"])
        lost = [st for st in ar["steps"] if st[1] > _node.WIN * st[2]][-1]
        costs = " + ".join(f"{d['cost_s'] * 1e3:.0f}" for d in (ar, rs, bc))
        row = (f"| {i} | from {_node._mib(ar['start_bytes'])} ({_node._mib(lost[0])}: "
               f"{lost[1] / lost[2]:.2f}) | from {_node._mib(rs['start_bytes'])} | from "
               f"{_node._mib(bc['start_bytes'])} | {costs} ms |")
        assert row in page, row
    # 2 nodes x 2 ranks, in prose: the ring's race
    ring = [d for d in json.loads((folder / "vcluster-2x2" / "new.json").read_text())["node_paths"]
            if d["path"] == "ring"][0]
    r = [o / m for _, o, m in ring["steps"]]
    assert ring["start_bytes"] is None and \
        f"({min(r):.2f}-{max(r):.2f}× MPI's time at 1-8 MiB)" in page.replace("\n", " ")
    # 4 nodes x 2 ranks, in prose: the hierarchical race and gloo/direct, new and old
    runs = {k: json.loads((folder / "vcluster-4x2" / f"{k}.json").read_text())
            for k in ("old", "new")}
    hier = runs["new"]["node_paths"][0]
    steps = " and ".join(f"{o / m:.2f}" for _, o, m in hier["steps"])
    assert f"({steps.replace(' and ', '× and ')}× MPI's time, {hier['cost_s'] * 1e3:.0f} ms)" \
        in page.replace("\n", " ")
    g = {k: {c["bytes"] >> 20: c["ratios"]["gloo/direct"]["median"] for c in r["cells"]}
         for k, r in runs.items()}
    text = (f"gloo/direct time {g['new'][4]:.2f} at 4 and 16 MiB new, {g['old'][4]:.2f} and "
            f"{g['old'][16]:.2f} old (one job each; 1 MiB swings: {g['new'][1]:.2f} new, "
            f"{g['old'][1]:.2f} old)")
    assert f"{g['new'][16]:.2f}" == f"{g['new'][4]:.2f}" and text in page.replace("\n", " "), text


_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20}
# docs/benchmarks.md's old/new tables under "Where each path starts": the header's first cell
# -> the folder of runs under docs/benchmarks/crossover, and per row label the runs (old, new)
# and the ratio (the op: the label's first word where the table has several)
_AB_TABLES = {
    "": ("ab", {"all_reduce, old": ("old", "direct/mpi4py"), "all_reduce, new": ("new", "direct/mpi4py"),
                "reduce_scatter, old": ("old", "direct/mpi4py"),
                "reduce_scatter, new": ("new", "direct/mpi4py"),
                "broadcast, old": ("old", "direct/mpi4py"), "broadcast, new": ("new", "direct/mpi4py")}),
    "broadcast, 2 ranks": ("bcast-plan", {
        "direct, old": ("old", "direct/mpi4py"), "direct, new": ("new", "direct/mpi4py"),
        "`dist.broadcast`, old": ("old", "hpcddp/mpi4py"),
        "`dist.broadcast`, new": ("new", "hpcddp/mpi4py")}),
    "all_gather_into_tensor, 2 ranks": ("agt-plan", {
        "direct, old": ("old", "direct/mpi4py"), "direct, new": ("new", "direct/mpi4py"),
        "`dist.all_gather_into_tensor`, old": ("old", "hpcddp/mpi4py"),
        "`dist.all_gather_into_tensor`, new": ("new", "hpcddp/mpi4py")}),
    "all_reduce, 2 nodes x 2 ranks, 1 Gbit/s": ("vcluster-2x2", {
        "direct/raw mpi4py time, old (the unraced ring)": ("old", "direct/mpi4py"),
        "direct/raw mpi4py time, new": ("new", "direct/mpi4py"),
        "gloo/direct time, old": ("old", "gloo/direct"),
        "gloo/direct time, new (hpcddp this many times gloo's speed)": ("new", "gloo/direct")}),
}


def _cells(line: str) -> list[str]:
    return [c.strip().strip("*") for c in line.strip().strip("|").split("|")]


@pytest.mark.parametrize("head", sorted(_AB_TABLES))
def test_docs_old_new_tables_are_the_committed_runs(head):
    """Every figure of the old/new tables is the median over the committed jobs (one job: its
    figure), formatted as the page does: none typed in by hand."""
    import json
    import statistics
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    folder, rows = _AB_TABLES[head]
    runs = root / "docs" / "benchmarks" / "crossover" / folder
    lines = (root / "docs" / "benchmarks.md").read_text().splitlines()
    at = next(i for i, l in enumerate(lines) if l.startswith("|") and _cells(l)[0] == head
              and len(_cells(l)) > 2 and _cells(l)[1].split(" ")[-1] in _UNITS)
    sizes = [int(c.split()[0]) * _UNITS[c.split()[1]] for c in _cells(lines[at])[1:]]
    seen = set()
    for line in lines[at + 2:]:
        if not line.startswith("|"):
            break
        label, *figures = _cells(line)
        which, ratio = rows[label]
        op = label.split(",")[0]
        jobs = [json.loads(f.read_text()) for f in sorted(runs.glob(f"{which}*.json"))]
        assert jobs, (runs, which)
        for size, shown in zip(sizes, figures):
            vals = [c["ratios"][ratio]["median"] for j in jobs for c in j["cells"]
                    if c["bytes"] == size and (op not in ("all_reduce", "reduce_scatter",
                                                          "broadcast") or c["op"] == op)]
            assert len(vals) == len(jobs), (label, size)
            v = statistics.median(vals)
            assert shown == (f"{v:.2f}" if v < 10 else f"{v:.1f}"), (head, label, size, shown, v)
        seen.add(label)
    assert seen == set(rows), (head, set(rows) - seen)


def test_docs_count_of_rows_held_is_the_committed_runs():
    """'the direct API holds N of its M op-size rows from 256 KiB ... the torch.distributed
    column K': counted from the five runs (<= 1/0.95 of raw mpi4py's time in 4 of 5)."""
    import json
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    runs = [json.loads(f.read_text())
            for f in sorted((root / "docs" / "benchmarks" / "crossover").glob("run*.json"))]
    assert len(runs) == 5
    keys = [(c["op"], c["bytes"]) for c in runs[0]["cells"] if c["bytes"] >= 256 << 10]
    held = {}
    for impl in ("direct", "hpcddp"):
        per = [{(c["op"], c["bytes"]): c["ratios"][f"{impl}/mpi4py"]["median"]
                for c in r["cells"]} for r in runs]
        held[impl] = sum(sum(p[k] <= 1 / 0.95 for p in per) >= 4 for k in keys)
    page = (root / "docs" / "benchmarks.md").read_text().replace("\n", " ")
    assert f"the direct API holds {held['direct']} of its {len(keys)} op-size rows from 256 KiB" \
        in page
    assert f"the `torch.distributed` column {held['hpcddp']}." in page


@pytest.mark.parametrize("ratio, win, takes", [
    (1.03, _node.WIN, False),   # a path that polls as MPI does must be 5% faster
    (1.03, _node.TIE, True),    # one that waits in the kernel also takes a tie (within 5%)
    (1.10, _node.TIE, False),   # but not a clear loss
    (0.90, _node.TIE, True),
])
def test_a_path_that_leaves_the_core_free_takes_a_tie(monkeypatch, ratio, win, takes):
    """The ring over TCP links races with win=TIE: its time / MPI's at most 1/0.95 serves."""
    monkeypatch.setattr(_node, "best_times", lambda comm, ours, mpis, tries=3: (ratio, 1.0))
    monkeypatch.setattr(_node, "decisions", [])
    found = _node.crossover("ring", "all_reduce", _OneRank(), lambda nbytes: (None, None),
                            win=win)
    assert (found.start == _node.LADDER[0]) is takes
    assert found.as_dict()["win"] == win
    if not takes:
        assert found.why().startswith("not 5% faster" if win < 1 else "over 5% slower")


def test_docs_spread_tables_are_the_committed_runs(capsys):
    """docs/benchmarks/spread-5-runs/tables.md (every size) is what scripts/crossover_table.py
    makes of those five runs, and the page's counts of rows held are theirs."""
    import glob
    import json
    import runpy
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    folder = root / "docs" / "benchmarks" / "spread-5-runs"
    script = runpy.run_path(str(root / "scripts" / "crossover_table.py"), run_name="tables")
    script["main"](str(folder), 4)
    assert capsys.readouterr().out == (folder / "tables.md").read_text()
    runs = [json.loads(Path(f).read_text()) for f in sorted(glob.glob(str(folder / "run*.json")))]
    held = {}
    for impl in ("direct", "hpcddp"):
        per = [script["ratios"](r, impl) for r in runs]
        for small in (True, False):
            keys = [k for k in per[0] if (k[1] < 256 << 10) == small]
            held[impl, small] = (sum(sum(p[k] <= script["LIMIT"] for p in per) >= 4
                                     for k in keys), len(keys))
    page = (root / "docs" / "benchmarks.md").read_text()
    assert f"| direct API, now | {held['direct', True][0]} of {held['direct', True][1]} " in page
    assert f"**{held['direct', False][0]} of {held['direct', False][1]}** |" in page
    assert (f"| `torch.distributed`, now | {held['hpcddp', True][0]} of {held['hpcddp', True][1]} "
            f"| {held['hpcddp', False][0]} of {held['hpcddp', False][1]} |") in page
