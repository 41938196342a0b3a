"""What the virtual-cluster tests (test_vcluster*.py) need of the machine, and how they say it
is missing: a skip naming what, or with HPCDDP_REQUIRE_VCLUSTER=1 (set by .ci/run) a failure."""
from __future__ import annotations

import os
import shutil

import pytest


def unavailable(reason: str):
    if os.environ.get("HPCDDP_REQUIRE_VCLUSTER") == "1":
        pytest.fail(f"HPCDDP_REQUIRE_VCLUSTER=1 but {reason}")
    pytest.skip(reason)


def need_namespaces(what: str) -> None:
    """Root and the namespace tools; WHAT: why root (named in the skip)."""
    if os.geteuid() != 0:
        unavailable(f"the virtual cluster needs root ({what})")
    missing = [t for t in ("ip", "nsenter", "unshare") if not shutil.which(t)]
    if missing:
        unavailable(f"the virtual cluster needs {', '.join(missing)} (iproute2, util-linux)")


def node_processes(cluster: str, node: str, markers) -> list:
    """'PID: cmdline' of the processes inside NODE of virtual cluster CLUSTER (found by the
    node's network namespace) whose command line holds one of MARKERS."""
    import pathlib
    import subprocess

    holder = subprocess.run(["pgrep", "-f", f"^vcluster-{cluster}-{node}( |$)"],
                            capture_output=True, text=True).stdout.split()
    assert holder, f"no holder process for {node} of cluster {cluster}: is it up?"
    netns = os.readlink(f"/proc/{holder[0]}/ns/net")
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{pid}/ns/net") != netns:
                continue
            cmd = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if any(m in cmd for m in markers):
            found.append(f"{pid}: {cmd[:120]}")
    return found
