"""The layer map (CONTRIBUTING.md): every import between hpcddp's packages points down."""
from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "hpcddp"
# package -> the hpcddp packages it may import (besides itself)
ALLOWED = {
    "settings": set(),
    "launch": {"settings"},
    "comm": {"launch", "settings"},
    "diagnostics": {"comm", "launch", "settings"},
    "collectives": {"comm", "diagnostics", "launch", "settings"},
    "backend": {"collectives", "comm", "diagnostics", "launch", "settings"},
    "parallel": {"backend", "collectives", "comm", "diagnostics", "launch", "settings"},
    "data": {"comm", "diagnostics", "launch", "settings"},
}


def _imports(path: pathlib.Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            parts = node.module.split(".")
            if parts[0] == "hpcddp":
                yield from ([parts[1]] if len(parts) > 1 else [a.name for a in node.names])
        elif isinstance(node, ast.Import):
            yield from (a.name.split(".")[1] for a in node.names
                        if a.name.startswith("hpcddp."))


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_point_down(package):
    paths = [PACKAGE / f"{package}.py"] if (PACKAGE / f"{package}.py").exists() else \
        sorted((PACKAGE / package).rglob("*.py"))
    assert paths, package
    wrong = sorted({f"{p.relative_to(PACKAGE)} imports hpcddp.{target}"
                    for p in paths for target in _imports(p)
                    if target != package and target not in ALLOWED[package]})
    assert not wrong, wrong
