"""Which side of a cut network trains on (hpcddp.elastic._state.holds_majority): one world,
never two. Each survivor decides alone, from what every rank knows: the lost ranks and the
host each start-up rank ran on."""
from __future__ import annotations

import pytest

pytest.importorskip("torch")
from hpcddp.elastic._state import holds_majority  # noqa: E402


def hosts(*names):
    return dict(enumerate(names))


ONE_PER_NODE = hosts("n1", "n2", "n3", "n4")


@pytest.mark.parametrize("after, goes_on", [
    ({0, 1, 3}, True),      # node3 cut off: the three others
    ({2}, False),           # ... and node3, alone
    ({0, 1}, True),         # partition 1-2 | 3-4: the half with rank 0
    ({2, 3}, False),        # ... the other half stops
    ({1, 2, 3}, True),      # node1 (rank 0) lost: three of four still a majority
    ({1}, False),
])
def test_one_rank_per_node(after, goes_on):
    assert holds_majority({0, 1, 2, 3}, after, ONE_PER_NODE) is goes_on


def test_deaths_on_a_survivors_host_are_deaths_not_a_cut():
    # one host, 4 ranks: any loss is a death (no network between them), even of rank 0 and half
    same = hosts("h", "h", "h", "h")
    assert holds_majority({0, 1, 2, 3}, {2, 3}, same)
    assert holds_majority({0, 1, 2, 3}, {3}, same)
    assert holds_majority({0, 1}, {1}, hosts("h", "h"))
    # two nodes of two ranks: node B's ranks lost, one of them on a survivor's host? no: both
    # on B, which may be cut off; the survivors hold half and rank 0: on
    two = hosts("A", "A", "B", "B")
    assert holds_majority({0, 1, 2, 3}, {0, 1}, two)
    # node A (rank 0) lost as a whole: B holds half without rank 0: stops (A may be alive)
    assert not holds_majority({0, 1, 2, 3}, {2, 3}, two)
    # one rank of A killed, A's other rank and B survive: that death is certain
    assert holds_majority({0, 1, 2, 3}, {1, 2, 3}, two)


def test_voters_leave_out_the_certain_deaths():
    # 3 nodes x 2: a rank on node A died (its node-mate saw it) and node C was cut at once:
    # of the 5 that may be alive, 3 survive: a majority
    six = hosts("A", "A", "B", "B", "C", "C")
    assert holds_majority(set(range(6)), {1, 2, 3}, six)
    # seen from C: everything else lost, nothing certain: 2 of 6
    assert not holds_majority(set(range(6)), {4, 5}, six)


def test_later_recoveries_count_from_the_world_before_them():
    # 3 ranks, then 2: the second loss leaves 1 of 2, half, with the lowest rank of that world
    assert holds_majority({1, 2}, {1}, hosts("a", "b", "c"))
    assert not holds_majority({1, 2}, {2}, hosts("a", "b", "c"))
