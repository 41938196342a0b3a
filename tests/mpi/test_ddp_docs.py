"""docs/ddp.md runs as written: each example (a ```python title="NAME.py"``` block) runs on
every rank and the job's output must be the ``text`` block after it. train.py prints the same
losses at 2 and 4 ranks (the parity guarantee), so both sizes check the same page.

The examples are whole scripts: their init_process_group/destroy_process_group lines are
skipped here (the job has one process group for all of them).
Set HPCDDP_DOCS_WRITE=1 to rewrite the output blocks from a run (at 4 ranks).
"""
from __future__ import annotations

import contextlib
import io
import os
import pathlib
import re

import pytest
import torch.distributed as dist

import test_collectives as M  # noqa: E402  (tests/mpi is on sys.path: pytest's rootdir import)

MPI_SIZES = (2, 4)
MPI_TIMEOUT = 240

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "ddp.md"
BLOCK = re.compile(r'```python title="(?P<name>[\w.]+\.py)"\n(?P<code>.*?)```\n\n'
                   r'```text title="mpirun -n 4 python (?P=name)"\n(?P<out>.*?)```', re.S)
PER_RANK = {"join.py"}  # examples whose every rank prints: compared at 4 ranks only


def run_example(code: str) -> str:
    code = code.replace('dist.init_process_group("hpcddp")', "pass")
    code = code.replace("dist.destroy_process_group()", "pass")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(compile(code, "<example>", "exec"), {"__name__": "__main__"})
    outs = [None] * dist.get_world_size()
    dist.all_gather_object(outs, buf.getvalue())
    return "".join(outs)


@pytest.fixture(scope="module")
def world():
    return M.init_world()


def test_examples(world):
    text = DOC.read_text()
    found = list(BLOCK.finditer(text))
    assert {m.group("name") for m in found} == {"train.py", "hooks.py", "join.py"}
    writes = []
    for m in found:
        name = m.group("name")
        printed = run_example(m.group("code"))
        dist.barrier()
        if name in PER_RANK and dist.get_world_size() != 4:
            continue
        if os.environ.get("HPCDDP_DOCS_WRITE") == "1":
            writes.append((m.span("out"), printed))
            continue
        assert printed == m.group("out"), f"{name}:\n--- page ---\n{m.group('out')}" \
                                          f"--- run ---\n{printed}"
    if writes and dist.get_rank() == 0 and dist.get_world_size() == 4:
        for (a, b), printed in sorted(writes, reverse=True):
            text = text[:a] + printed + text[b:]
        DOC.write_text(text)
