"""docs/elastic.md's grow-back figures are the committed runs of scripts/regrow_bench.sh
(spawned replacements, and spare processes)."""
import pathlib
import re
import statistics

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_docs_regrow_figures_are_the_committed_runs():
    runs = (ROOT / "docs" / "benchmarks" / "elastic-regrow" / "regrow-bench.txt").read_text()
    kill = [float(x) for x in re.findall(r"kill -> full size ([\d.]+) s", runs)]
    ratio = [float(x) for x in re.findall(r"after/before ([\d.]+)", runs)]
    assert len(kill) == len(ratio) == 6
    page = (ROOT / "docs" / "elastic.md").read_text()
    assert (f"| kill -> full size | {min(kill):.2f}-{max(kill):.2f} s, median "
            f"{statistics.median(kill):.2f} (6 runs;") in page
    assert (f"| {min(ratio):.2f}-{max(ratio):.2f}, median {statistics.median(ratio):.2f} "
            f"(6 runs) |") in page


def test_docs_spares_figures_are_the_committed_runs():
    runs = (ROOT / "docs" / "benchmarks" / "elastic-regrow" / "spares-bench.txt").read_text()
    kill = [float(x) for x in re.findall(r"kill -> full size ([\d.]+) s", runs)]
    ratio = [float(x) for x in re.findall(r"after/before ([\d.]+)", runs)]
    assert len(kill) == len(ratio) == 6
    page = (ROOT / "docs" / "elastic.md").read_text()
    assert (f"| kill -> full size, spare processes | {min(kill):.2f}-{max(kill):.2f} s, median "
            f"{statistics.median(kill):.2f} (6 runs;") in page
    assert (f"| {min(ratio):.2f}-{max(ratio):.2f}, median {statistics.median(ratio):.2f} "
            f"(6 runs) |") in page
