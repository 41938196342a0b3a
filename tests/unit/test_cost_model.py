"""scripts/cost_model.py: its formulas against values worked by hand for small N, its staging
strategy against hpcddp's, its calibration and the measured figures it takes from the docs, and
the docs' tables against what it prints (no MPI; the model is arithmetic)."""
from __future__ import annotations

import importlib.util
import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("cost_model", ROOT / "scripts" / "cost_model.py")
cm = importlib.util.module_from_spec(_spec)
sys.modules["cost_model"] = cm   # dataclasses resolve the module's annotations through it
_spec.loader.exec_module(cm)


def unit_net(gamma=0.0, alpha=1.0, **kw):
    """beta = 1 s per byte: 8 bit/s carried whole."""
    return cm.Net(rate_bits=8, alpha=alpha, efficiency=1.0, gamma=gamma, **kw)


def test_ring_by_hand():
    # 2 nodes, 4 bytes: 2 steps of 2 bytes, each alpha + 2 beta
    assert cm.ring(2, 4, unit_net()) == pytest.approx(6)
    # 4 nodes, 8 bytes, gamma 0.5, 1-byte chunks: a reduce-scatter step carries its 2 bytes at
    # max(beta, gamma) and adds its last byte after: 1 + 2 + 0.5; an all-gather step 1 + 2
    assert cm.ring(4, 8, unit_net(0.5), chunk=1) == pytest.approx(3 * (3.5 + 3))
    # a block within one chunk is added after it arrives: nothing overlaps
    assert cm.ring(4, 8, unit_net(0.5)) == pytest.approx(3 * (1 + 2 * 1.5) + 3 * 3)
    assert cm.ring(1, 8, unit_net()) == 0


def test_trees_and_halving_doubling_by_hand():
    net = unit_net(0.5)
    # binomial: 2 steps up (1 + 8 + 4 each), 2 down (1 + 8 each)
    assert cm.binomial_tree(4, 8, net) == pytest.approx(2 * 13 + 2 * 9)
    # halving-doubling at 4: 2 log2 4 alpha + 3/4 x 8 x (2 beta + gamma)
    assert cm.halving_doubling(4, 8, net) == pytest.approx(4 + 15)
    # at 3: the power of two below (2) plus the extra rank's hand-over and return
    assert cm.halving_doubling(3, 8, net) == pytest.approx((2 + 10) + (2 + 20))
    # pipelined, S below the smallest chunk: one chunk; 2 nodes: one child, one stage each way
    assert cm.pipelined_tree(2, 8, net) == pytest.approx((1 + 8) + (1 + 8))
    assert cm.pipelined_tree(4, 8, net) == pytest.approx(2 * ((1 + 16) + (1 + 16)))


def test_pipelined_tree_picks_the_better_chunk():
    net = cm.Net(rate_bits=8e9, alpha=1e-6, efficiency=1.0, gamma=0.0)   # 1 ns per byte
    s = 128 * cm.KiB
    two_chunks = 3 * 2 * (1e-6 + 2 * 64 * cm.KiB * 1e-9)     # depth 2 + 2 chunks - 1 stages
    one_chunk = 2 * 2 * (1e-6 + 2 * s * 1e-9)
    assert two_chunks < one_chunk
    assert cm.pipelined_tree(4, s, net) == pytest.approx(two_chunks)


def test_hierarchical_by_hand():
    net = unit_net(shm=0.25, alpha_shm=0.1)
    # 2 nodes of 2: reduce-scatter and all-gather in the node, 0.1 + 2 x 0.25 each; across,
    # a ring of 2 on 2 bytes with the link shared by 2 streams (beta 2): 2 x (1 + 1 x 2)
    assert cm.hierarchical(2, 2, 4, net) == pytest.approx(0.6 + 6 + 0.6)
    assert cm.flat_ring(2, 2, 4, net) == cm.ring(4, 4, net)


def test_ddp_step_overlaps_buckets_with_backward():
    grad = 2 * cm.BUCKET                     # two buckets; forward 1 s, backward 2 s
    assert cm.ddp_step(grad, 3.0, lambda b: 1.0) == pytest.approx(4.0)   # 2->3, 3->4
    assert cm.ddp_step(grad, 3.0, lambda b: 0.1) == pytest.approx(3.1)   # the last one shows
    assert cm.buckets(cm.RESNET50[1])[-1] == cm.RESNET50[1] - 3 * cm.BUCKET


def test_staging_by_hand():
    net = unit_net(alpha=0.0)
    st = cm.Storage(fs=10, reader=1, write=50, check=100)
    # allgather: read 100 / min(10, 4 x 1); link 3/4 x 100; one round of 4 chunks of 5 to fill
    r = cm.staging(100, 4, "allgather", net, st, chunk=5)
    assert (r["read"], r["exchange"], r["bound"]) == (25, 75, "exchange")
    assert r["total"] == pytest.approx(75 + 5 + 4 * 5 / 50 + 4 * 5 / 100)
    # bcast: one reader at a time; per chunk the better of binomial (2 x 5) and scatter +
    # all-gather (2 x 3/4 x 5)
    r = cm.staging(100, 4, "bcast", net, st, chunk=5)
    assert (r["read"], r["exchange"]) == (100, pytest.approx(20 * 7.5))
    assert r["total"] == pytest.approx(150 + 5 + 5 / 50 + 5 / 100)
    r = cm.staging(100, 4, "every-rank", net, st, chunk=5)
    assert (r["read"], r["exchange"], r["bound"]) == (100, 0, "read")
    with pytest.raises(ValueError, match="valid: allgather, ring, bcast, every-rank"):
        cm.staging(100, 4, "cp", net, st)


def test_auto_strategy_is_hpcddps():
    from hpcddp.data._staging_plan import auto_strategy
    assert all(cm.auto_strategy(n) == auto_strategy(n, cm.STAGE_CHUNK) for n in range(1, 65))


def test_calibration_holds_and_check_says_so(capsys):
    assert all(r["ok"] for r in cm.calibration())
    assert cm.main(["--check"]) == 0
    assert "16 of 16 figures within ±15%" in capsys.readouterr().out


def test_the_bench_models_gradients():
    from hpcddp.bench.ddp import CLASSES, MODELS   # the shapes only: no torch at import
    d_in, width, depth = MODELS["10M"]
    params = d_in * width + width + depth * (width * width + width) + width * CLASSES + CLASSES
    assert cm.MLP10M_GRAD_BYTES == params * 4


def test_help_explains(capsys):
    with pytest.raises(SystemExit) as exc:
        cm.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--check" in out and "alpha-beta-gamma" in out and "off by more than 15%" in out


def test_check_fails_beyond_the_tolerance(monkeypatch, capsys):
    what, source, nodes, nbytes, quantity, _, _ = cm.CALIBRATION[0]
    monkeypatch.setattr(cm, "CALIBRATION", [(what, source, nodes, nbytes, quantity, 200, 200)])
    assert cm.main(["--check"]) == 1          # the model says 116 MB/s
    assert "0 of 1 figures within ±15%" in capsys.readouterr().out


def test_calibration_figures_are_the_pages():
    """CALIBRATION's measured figures are those docs/benchmarks.md and docs/ddp.md quote."""
    bench = (ROOT / "docs" / "benchmarks.md").read_text()
    measured = {what: (lo, hi) for what, _, _, _, _, lo, hi in cm.CALIBRATION}

    def span(cell):              # "120-121" or "120"
        lo, _, hi = cell.partition("-")
        return float(lo), float(hi or lo)
    for who, quoted in [("ring, 2 nodes", "120-121 / 120 / 117-118"),
                        ("gloo, 2 nodes", "102-126 / 113-120 / 118-120"),
                        ("hpcddp ring path, 4 nodes", "102-116 / 102-108 / 104-107"),
                        ("gloo, 4 nodes", "112-123 / 112-118 / 114-119")]:
        assert quoted in bench, quoted
        for size, cell in zip(("1 MiB", "4 MiB", "16 MiB"), quoted.split(" / ")):
            assert measured[f"{who}, {size}"] == span(cell)
    assert "(gloo: 223-225 ms)" in bench
    assert "| one 25 MiB bucket all_reduce alone | 675 ms | 386 ms | 335-340 ms |" in bench
    assert measured["gloo, 2 nodes, 25 MiB"] == (223, 225)
    assert measured["hpcddp ring path, 4 nodes, 25 MiB"] == (386, 386)
    assert measured["gloo, 4 nodes, 25 MiB"] == (335, 340)
    ddp = (ROOT / "docs" / "ddp.md").read_text()
    table = ddp[ddp.index("| comm ms/step, hpcddp / gloo |"):].split("\n\n")[0]
    gloo = [int(g) for row in table.splitlines()[2:]
            for g in re.findall(r"\d+ / (\d+)", row.split("|")[-2])]
    assert len(gloo) == 5
    assert measured["DDP 10M, gloo, 2 nodes: comm ms/step"] == (min(gloo), max(gloo))


def _section(page: str, title: str) -> str:
    """docs/PAGE from the heading TITLE to the next second-level heading."""
    text = (ROOT / "docs" / page).read_text()
    start = text.index(title)
    end = text.find("\n## ", start)
    return text[start:end if end > 0 else None]


@pytest.mark.parametrize("page, title, key", [
    ("benchmarks.md", "### On paper: 2 to 1024 nodes", "benchmarks"),
    ("data.md", "### On paper: staging time", "data")])
def test_docs_quote_what_the_script_prints(page, title, key):
    section = _section(page, title)
    for table in cm.sections()[key]:
        assert table in section, (f"docs/{page} is out of date: regenerate it with "
                                  f"python scripts/cost_model.py --section {key}\n{table}")
