"""Slurm hostlist expansion and compression (hpcddp.launch.hostlist); no MPI."""
import random

import pytest

from hpcddp.launch.hostlist import MAX_HOSTS, compress_hostlist, expand_hostlist


@pytest.mark.parametrize("text,hosts", [
    ("gpu[001-004,010],cpu07",
     ["gpu001", "gpu002", "gpu003", "gpu004", "gpu010", "cpu07"]),
    ("a[1-2]b[3-4]", ["a1b3", "a1b4", "a2b3", "a2b4"]),            # leftmost varies slowest
    ("rack[1-2]n[01-02]-ib", ["rack1n01-ib", "rack1n02-ib", "rack2n01-ib", "rack2n02-ib"]),
    ("n[1,3-5]", ["n1", "n3", "n4", "n5"]),
    ("n[08-11]", ["n08", "n09", "n10", "n11"]),                     # padded to the lower bound
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),
    ("n[001-3]", ["n001", "n002", "n003"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("node7", ["node7"]),
    ("login", ["login"]),
    ("a,b,c", ["a", "b", "c"]),
    ("n[2],n[1]", ["n2", "n1"]),                                   # order as written
    ("n[1-2],n1", ["n1", "n2", "n1"]),                             # duplicates kept
    ("[1-3]", ["1", "2", "3"]),
    ("n[1, 3]", ["n1", "n3"]),
    (" a , b ", ["a", "b"]),
    ("a,,b,", ["a", "b"]),
    ("", []),
    ("c[0-1]x[7]", ["c0x7", "c1x7"]),
])
def test_expand(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text,why", [
    ("n[1-2", "without a matching ']'"),
    ("n1-2]", "']' without a matching '['"),
    ("n[1-[2]]", "nested"),
    ("n[5-3]", "reversed"),
    ("n[]", "empty brackets"),
    ("n[a-b]", "not a number"),
    ("n[1-]", "not a number"),
    ("n[1,,2]", "not a number"),
    ("n[-1]", "not a number"),
    ("n[1-2]x]", "without a matching '['"),
    ("a b", "unexpected character"),
])
def test_malformed_raises_naming_input(text, why):
    with pytest.raises(ValueError) as err:
        expand_hostlist(text)
    assert repr(text) in str(err.value)
    assert why in str(err.value)
    assert "expand_hostlist" in str(err.value)


def test_huge_expansion_is_refused():
    with pytest.raises(ValueError, match="more than"):
        expand_hostlist(f"n[0-{MAX_HOSTS}]")
    with pytest.raises(ValueError, match="more than"):
        expand_hostlist("a[0-999]b[0-999]c[0-9]")


def test_not_a_string():
    with pytest.raises(TypeError):
        expand_hostlist(["n1"])


@pytest.mark.parametrize("hosts,text", [
    (["gpu001", "gpu002", "gpu003", "gpu004", "gpu010", "cpu07"], "gpu[001-004,010],cpu07"),
    (["n1", "n2", "n3", "n7"], "n[1-3,7]"),
    (["n9", "n10"], "n[9-10]"),
    (["n099", "n100"], "n[099-100]"),
    (["n1"], "n1"),
    (["a", "b"], "a,b"),
    (["n2", "n1"], "n2,n1"),                  # order preserved, so no shared bracket
    (["n1", "n01"], "n1,n01"),                # different padding
    (["n1", "x", "n2"], "n1,x,n2"),
    ([], ""),
])
def test_compress(hosts, text):
    assert compress_hostlist(hosts) == text
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("bad", ["a,b", "n[1]", "", "a b", 7])
def test_compress_rejects_unwritable_names(bad):
    with pytest.raises(ValueError, match="compress_hostlist"):
        compress_hostlist(["ok", bad])


def test_compress_round_trips_random_lists():
    rng = random.Random(2)
    for _ in range(300):
        names = []
        for _ in range(rng.randint(0, 12)):
            prefix = rng.choice(["n", "gpu", "r1n", "x-"])
            number = rng.randint(0, 120)
            width = rng.choice([0, 0, 2, 3])
            names.append(prefix + (str(number).zfill(width) if width else str(number)))
        assert expand_hostlist(compress_hostlist(names)) == names, names
