"""hpcddp.settings: every HPCDDP_* variable declared once, parsed with a clear error, and the
docs' table made from the declarations."""
from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys

import pytest

from hpcddp import settings

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "hpcddp"
# names that look like variables but are not read from the environment
NOT_VARIABLES = {"HPCDDP_IMPLS"}


def _mentioned_variables() -> set[str]:
    found = set()
    for path in list(PACKAGE.rglob("*.py")) + list(PACKAGE.rglob("*.c")):
        found |= set(re.findall(r"\bHPCDDP_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    return found - NOT_VARIABLES


def test_every_variable_the_package_mentions_is_declared():
    undeclared = _mentioned_variables() - set(settings.BY_NAME)
    assert not undeclared, f"declare these in hpcddp/settings.py: {sorted(undeclared)}"


def test_only_settings_reads_hpcddp_variables_from_the_environment():
    """No module but hpcddp.settings looks an HPCDDP_* variable up in os.environ (the CLI's
    launchers may still *set* them for the processes they start)."""
    reads = re.compile(r"(environ\.get|getenv|environ\[)\(?\s*[\"']HPCDDP_")
    offenders = [f"{p.relative_to(ROOT)}:{i}" for p in PACKAGE.rglob("*.py")
                 if p.name != "settings.py"
                 for i, line in enumerate(p.read_text().splitlines(), 1)
                 if reads.search(line) and "=" not in line.split("environ[")[-1][:40]]
    assert not offenders, offenders


def test_defaults_when_nothing_is_set():
    s = settings.read({})
    assert s.timeout == settings.DEFAULT_TIMEOUT and s.stall_policy == "abort"
    assert s.shm_allreduce == s.cma == s.fastpath == "auto"
    assert s.debug == frozenset() and s.ranks_per_node is None and s.peer_timeout is None
    assert s.recorder_size == 2048 and s.data_check and s.pid_check


@pytest.mark.parametrize("name,text,value", [
    ("HPCDDP_TIMEOUT", "off", None), ("HPCDDP_TIMEOUT", "0", None), ("HPCDDP_TIMEOUT", "4", 4.0),
    ("HPCDDP_SHM_ALLREDUCE", "1", "auto"), ("HPCDDP_CMA", " FORCE ", "force"),
    ("HPCDDP_CMA", "0", "0"), ("HPCDDP_DEBUG", "trace,detail", frozenset({"trace", "detail"})),
    ("HPCDDP_DEBUG", "off", frozenset()), ("HPCDDP_RANKS_PER_NODE", "2", 2),
    ("HPCDDP_DATA_CHECK", "0", False), ("HPCDDP_STORE_ADDR", "10.0.0.1:29500", "10.0.0.1:29500"),
    ("HPCDDP_PINNED_CACHE_BYTES", "0", 0),
])
def test_values_are_parsed(name, text, value):
    assert getattr(settings.read({name: text}), settings.BY_NAME[name].attr) == value


@pytest.mark.parametrize("name,text,expected", [
    ("HPCDDP_TIMEOUT", "soon", "seconds"), ("HPCDDP_TIMEOUT", "-3", "seconds"),
    ("HPCDDP_CMA", "off", "0, 1, auto or force"), ("HPCDDP_SHM_ALLREDUCE", "yes", "force"),
    ("HPCDDP_STALL_POLICY", "kill", "abort or warn"), ("HPCDDP_RANKS_PER_NODE", "0", "positive"),
    ("HPCDDP_RECORDER_SIZE", "many", "positive"), ("HPCDDP_PID_CHECK", "2", "1 or 0"),
    ("HPCDDP_STORE_ADDR", "host:port", "HOST:PORT"), ("HPCDDP_THREAD_LEVEL", "all", "multiple"),
    ("HPCDDP_STAGING_CHUNK_BYTES", "-1", "bytes"),
])
def test_a_bad_value_names_the_variable_the_value_and_what_it_accepts(name, text, expected):
    with pytest.raises(settings.SettingsError) as info:
        settings.read({name: text})
    message = str(info.value)
    assert message.startswith(f"{name}={text.strip()!r}: expected") and expected in message


def test_settings_are_frozen():
    s = settings.read({})
    with pytest.raises(AttributeError, match="frozen"):
        s.timeout = 3
    assert s.replace(timeout=3.0).timeout == 3.0 and s.timeout == settings.DEFAULT_TIMEOUT
    with pytest.raises(AttributeError, match="no 'timeot'"):
        s.timeot


def test_a_bad_value_stops_the_process_at_import_with_its_message():
    env = {"HPCDDP_SHM_ALLREDUCE": "sometimes", "PATH": "/usr/bin:/bin"}
    res = subprocess.run([sys.executable, "-c", "import hpcddp.collectives"], env=env,
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode != 0
    assert "HPCDDP_SHM_ALLREDUCE='sometimes': expected 0, 1, auto or force" in res.stderr


def test_settings_import_only_the_standard_library():
    allowed = set(sys.stdlib_module_names) | {"__future__"}
    tree = ast.parse((PACKAGE / "settings.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            assert all(n.split(".")[0] in allowed for n in names), names


def test_docs_table_is_the_declarations():
    page = (ROOT / "docs" / "settings.md").read_text()
    table = settings.table()
    assert table in page, ("docs/settings.md is out of date: regenerate its table with "
                           "python -c 'from hpcddp import settings; print(settings.table())'")
    for var in settings.VARS:
        assert (ROOT / "docs" / var.topic).exists(), f"{var.name}: docs/{var.topic} missing"
