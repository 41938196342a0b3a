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
