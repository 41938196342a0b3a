"""docs/elastic.md's grow-back figures are the committed runs of scripts/regrow_bench.sh
(spawned replacements, and spare processes)."""
import pathlib
import re
import statistics

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("runs_file, kill_row", [
    ("regrow-bench.txt", "| kill -> full size |"),
    ("spares-bench.txt", "| kill -> full size, spare processes |"),
])
def test_docs_regrow_figures_are_the_committed_runs(runs_file, kill_row):
    runs = (ROOT / "docs" / "benchmarks" / "elastic-regrow" / runs_file).read_text()
    kill = [float(x) for x in re.findall(r"kill -> full size ([\d.]+) s", runs)]
    ratio = [float(x) for x in re.findall(r"after/before ([\d.]+)", runs)]
    assert len(kill) == len(ratio) == 6
    page = (ROOT / "docs" / "elastic.md").read_text()
    assert (f"{kill_row} {min(kill):.2f}-{max(kill):.2f} s, median "
            f"{statistics.median(kill):.2f} (6 runs;") in page
    assert (f"| {min(ratio):.2f}-{max(ratio):.2f}, median {statistics.median(ratio):.2f} "
            f"(6 runs) |") in page


def test_docs_outside_kill_and_same_sitting_figures_are_the_committed_runs():
    runs = ROOT / "docs" / "benchmarks" / "elastic-regrow"
    page = (ROOT / "docs" / "elastic.md").read_text()
    whole = [float(x) for x in re.findall(r"kill -> the full-size line ([\d.]+) s",
                                          (runs / "spares-outside-kill.txt").read_text())]
    assert len(whole) == 3
    assert f"| {min(whole):.2f}-{max(whole):.2f} s (3 runs of `tests/test_outside_kill.py" in page
    spawned = re.findall(r"kill -> full size ([\d.]+) s", (runs / "spawn-same-sitting.txt").read_text())
    assert len(spawned) == 2 and f"{spawned[0]} and {spawned[1]} s" in page
