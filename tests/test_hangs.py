"""Hangs become short, explained failures: each scenario in a child mpirun under a hard timeout.

tests/scenarios/cases.py says what each scenario runs and what its output, stall report file
and exit code must show; every job must end within HPCDDP_TIMEOUT + 10 s of its stall point.
tests/scenarios/loop.py runs them all 20 times in a row (not in CI).
"""
import importlib.util
import pathlib
import sys

import pytest

HERE = pathlib.Path(__file__).parent
_spec = importlib.util.spec_from_file_location("hang_cases", HERE / "scenarios" / "cases.py")
cases = importlib.util.module_from_spec(_spec)
sys.modules["hang_cases"] = cases  # dataclasses look their module up
_spec.loader.exec_module(cases)


@pytest.mark.parametrize("name", [c.name for c in cases.CASES])
def test_hang_scenario(name, tmp_path):
    r = cases.run_case(cases.BY_NAME[name], str(tmp_path))
    assert not r["problems"], (
        f"{name}: " + "; ".join(r["problems"]) +
        f"\n--- output (last 6000 chars) ---\n{r['output'][-6000:]}"
        f"\n--- report file ---\n{r['report'][:4000]}")
