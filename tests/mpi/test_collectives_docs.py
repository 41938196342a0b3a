"""docs/collectives.md runs as written: every example (a ```python title="NAME.py"``` block)
is executed on 4 ranks and what each rank prints must be the ``text`` block that follows it
(shown in rank order). The reduce-op table must agree with what test_collectives.py enforces.

Set HPCDDP_DOCS_WRITE=1 to rewrite the output blocks from a run instead (then read the diff).
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

MPI_OWN_JOB = True    # each example starts the world anew (destroy_process_group)
MPI_SIZES = (4,)
MPI_TIMEOUT = 240
pytestmark = pytest.mark.filterwarnings("ignore:.*is deprecated:FutureWarning")

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "collectives.md"
BLOCK = re.compile(r'```python title="(?P<name>[\w.]+\.py)"\n(?P<code>.*?)```\n\n'
                   r'```text title="mpirun -n 4 python (?P=name)"\n(?P<out>.*?)```', re.S)


def examples(path=DOC):
    return [(m.group("name"), m.group("code"), m.group("out"), m.span("out"))
            for m in BLOCK.finditer(path.read_text())]


def run_example(code: str) -> str:
    """Run CODE on every rank; return every rank's output in rank order (on every rank)."""
    if "init_process_group(" in code and dist.is_initialized():
        # each example is a script of its own: its init_process_group starts the world anew
        # (a second init raises, as torch's does)
        dist.destroy_process_group()
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(compile(code, "<example>", "exec"), {"__name__": "__main__"})
    outs = [None] * dist.get_world_size()
    dist.all_gather_object(outs, buf.getvalue())
    return "".join(outs)


@pytest.fixture(scope="module")
def world():
    return M.init_world()


def test_every_op_has_an_example():
    names = {name for name, *_ in examples()}
    assert len(names) == len(examples()) >= 15
    text = DOC.read_text()
    for op in ("broadcast", "all_reduce", "reduce", "all_gather", "all_gather_into_tensor",
               "gather", "scatter", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
               "all_to_all_single", "barrier", "monitored_barrier", "send", "recv", "isend",
               "irecv", "batch_isend_irecv", "broadcast_object_list", "all_gather_object",
               "gather_object", "scatter_object_list", "send_object_list", "recv_object_list"):
        assert f"dist.{op}(" in text or f"hpcddp.{op}(" in text, op


def test_examples_print_what_the_page_shows(world):
    got = {}
    for name, code, out, span in examples():
        got[name] = (run_example(code), out, span)
        dist.barrier()
    if os.environ.get("HPCDDP_DOCS_WRITE") == "1":
        if dist.get_rank() == 0:
            text = DOC.read_text()
            for name, (printed, out, span) in sorted(got.items(), key=lambda kv: -kv[1][2][0]):
                text = text[:span[0]] + printed + text[span[1]:]
            DOC.write_text(text)
        return
    bad = [f"{name}:\n--- page ---\n{out}--- run ---\n{printed}"
           for name, (printed, out, _) in got.items() if printed != out]
    assert not bad, "\n".join(bad)


def test_reduce_op_table_matches_the_tests():
    """Each cell's ✓ or · is what test_collectives.defined() makes the matrix enforce."""
    rows = [line for line in DOC.read_text().splitlines()
            if line.startswith("| ") and line.count("|") == len(M.OP_NAMES) + 2
            and line.split("|")[1].strip() in {M.short(d) for d in M.DTYPES}]
    assert len(rows) == len(M.DTYPES)
    header = "| dtype | " + " | ".join(M.OP_NAMES) + " |"
    assert header in DOC.read_text()
    for line in rows:
        cells = [c.strip() for c in line.strip("|").split("|")]
        dtype = next(d for d in M.DTYPES if M.short(d) == cells[0])
        for op, cell in zip(M.OP_NAMES, cells[1:]):
            # a ✓ where any reduction defines it (complex PRODUCT: reduce/reduce_scatter)
            want = any(M.defined(op, dtype, "hpcddp", f) for f in M.REDUCING)
            assert cell.startswith("✓") == want, (M.short(dtype), op, cell)
