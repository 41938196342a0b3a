"""docs/elastic.md's table "A node that drops off the network" holds the figures the virtual-
cluster tests printed (docs/benchmarks/network-faults.txt), not numbers typed in."""
from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
LINE = re.compile(r"elastic, fault (.+?): recovered (\S+) s after it, the job ended ([\d.]+) s "
                  r"after it, status (\d+)")


def test_the_table_is_the_tests_output():
    runs = LINE.findall((ROOT / "docs/benchmarks/network-faults.txt").read_text())
    assert len(runs) == 4, runs
    doc = (ROOT / "docs/elastic.md").read_text()
    section = doc[doc.index("### A node that drops off the network"):doc.index("## Under Slurm")]
    rows = [r for r in section.splitlines() if r.startswith("| ") and " s |" in r]
    assert len(rows) == len(runs), rows
    table = sorted(tuple(c.strip() for c in r.strip("|").split("|"))[2:] for r in rows)
    measured = sorted(("-" if rec == "None" else f"{float(rec):.1f} s", f"{float(end):.1f} s",
                       status) for _fault, rec, end, status in runs)
    assert table == measured


def test_the_heartbeat_cost_table_is_the_committed_runs():
    """docs/elastic.md's "What it costs when nothing fails" table is what
    scripts/vcluster/heartbeat_cost.py --table prints from the committed runs."""
    import subprocess
    import sys
    runs = ROOT / "docs/benchmarks/heartbeat-cost/runs.jsonl"
    table = subprocess.run([sys.executable, str(ROOT / "scripts/vcluster/heartbeat_cost.py"),
                            "--table", str(runs)], capture_output=True, text=True, check=True,
                           timeout=60).stdout.strip()
    assert table.count("\n") == 4, table
    assert table in (ROOT / "docs/elastic.md").read_text()
