"""docs/security.md: every test it names exists, and its checkpoint example prints what the page
shows (run as a script, one process, under a timeout)."""
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGE = (ROOT / "docs" / "security.md").read_text()


def _named_tests():
    return sorted(set(re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", PAGE)))


def test_the_page_names_tests():
    assert len(_named_tests()) >= 20


@pytest.mark.parametrize("path,name", _named_tests())
def test_named_test_exists(path, name):
    source = (ROOT / path).read_text()
    assert re.search(rf"^def {name}\(", source, re.M), f"docs/security.md names {path}::{name}"


def test_checkpoint_example_prints_what_the_page_shows(tmp_path):
    code = re.search(r"```python\n(.*?)```", PAGE, re.S).group(1)
    shown = re.search(r"```python\n.*?```\n\n```text\n(.*?)```", PAGE, re.S).group(1)
    script = tmp_path / "example.py"
    script.write_text(code)
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120, cwd=str(tmp_path))
    assert res.returncode == 0, res.stderr[-4000:]
    assert res.stdout == shown, res.stdout


def test_the_page_is_listed():
    assert "security.md" in (ROOT / "mkdocs.yml").read_text()
    assert "(docs/security.md)" in (ROOT / "README.md").read_text()
