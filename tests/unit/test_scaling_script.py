"""scripts/vcluster/scaling.py's tables, without a cluster: the ratios a reader compares are
computed from the rows, and a layout whose jobs failed says so instead of a number."""
import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("scaling", ROOT / "scripts" / "vcluster" / "scaling.py")
scaling = importlib.util.module_from_spec(spec)
spec.loader.exec_module(scaling)


def _row(nodes, per_node, hp16, gl16, ddp=None):
    bus = {"mpi": {"1": 10, "4": 20, "16": 30, "cores": 1.0},
           "hpcddp": {"1": 100, "4": 110, "16": hp16, "cores": 0.5},
           "gloo": {"1": 120, "4": 121, "16": gl16, "cores": 0.1}}
    return {"nodes": nodes, "per_node": per_node, "busbw": bus,
            "ddp": ddp if ddp is not None else {"hpcddp": 1.0, "gloo": 2.0, "bound": 4.0}}


def test_tables_ratios_and_bound():
    text = scaling.tables([_row(2, 1, 90, 120), _row(4, 2, 60, 120)], 125.0, 2)
    assert "118 MB/s" in text and "2 cores" in text           # 0.94 x 125 MB/s of payload
    lines = [line for line in text.splitlines() if line.startswith("| 2 x 1")]
    cells = [c.strip() for c in lines[0].strip("|").split("|")]
    assert cells[1:4] == ["10 / 20 / 30", "100 / 110 / 90", "120 / 121 / 120"]
    assert cells[4] == "0.75"                                  # 90 / 120
    assert cells[5] == "1.00 / 0.50 / 0.10"
    assert cells[-2:] == ["0.50", "0.25"]                      # hpcddp/gloo, hpcddp/bound


def test_a_failed_job_is_shown_as_failed():
    row = _row(8, 1, 99, 118, ddp={"error": "timed out"})
    row["busbw"]["hpcddp"] = {"error": "mpirun failed"}
    line = [x for x in scaling.tables([row], 125.0, 2).splitlines() if x.startswith("| 8 x 1")][0]
    assert "failed" in line and line.count(" - ") >= 3
