"""tests/conftest.py's clean-up of Open MPI session directories left by killed launchers."""
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from conftest import remove_stale_mpi_session_dirs  # noqa: E402


def test_a_dead_launchers_dir_goes_a_live_ones_stays(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    for name in (f"ompi.{dead}", f"prted.{dead}", f"ompi.{os.getpid()}", "ompi.notapid",
                 "other.123"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "pmix.node1.tool").write_text("x")
    assert sorted(remove_stale_mpi_session_dirs(str(tmp_path))) == \
        sorted([f"ompi.{dead}", f"prted.{dead}"])
    assert sorted(p.name for p in tmp_path.iterdir()) == \
        sorted([f"ompi.{os.getpid()}", "ompi.notapid", "other.123"])
