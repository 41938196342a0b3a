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
