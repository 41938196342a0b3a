"""Multi-node for real, on one machine: the virtual cluster of scripts/vcluster.sh.

The module fixture makes 3 nodes (network + UTS + mount namespaces: own hostname, own address on
a bridge, own /scratch and /dev/shm) and takes them down afterwards, also when a test fails. Jobs
start inside node1 with the venv's mpirun, which reaches the other nodes through its own rsh
launcher (`vcluster.sh rsh`). Nothing sets HPCDDP_RANKS_PER_NODE: Open MPI and hpcddp find the
nodes themselves. Between nodes MPI has only TCP over the bridge (btl tcp,self,sm, TCP bound to
eth0, the node's bridge link); within a node, shared memory.

Checked: `hpcddp info` at 2 and 3 nodes; topology and every collective at 2 nodes x 2 ranks
against numpy (tests/vcluster/job_collectives.py), with the bytes counted on the node's veth
(node-local all_reduces put none on it, cross-node ones put theirs); that
shared memory alone cannot join two nodes; DDP, FSDP2 and HSDP against a one-process reference;
reduce_scatter_tensor and all_gather_into_tensor on the ring over TCP links at 3 x 1; `hpcddp stage`
into each node's own /scratch, the shared source read once per node group. A crashed `up` is
cleaned by `down`.

Skips, with the reason, where namespaces cannot be made (not root, no iproute2/util-linux, a
sandbox refusing unshare). HPCDDP_REQUIRE_VCLUSTER=1 turns those skips into failures.
"""
from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import pytest

from vcluster_needs import need_namespaces, unavailable

ROOT = pathlib.Path(__file__).resolve().parents[1]
VC = str(ROOT / "scripts" / "vcluster.sh")
JOBS = ROOT / "tests" / "vcluster"
NAME, SUBNET = "vct", "10.78.0"      # a cluster of its own: a developer's `vc` cluster is left alone
NODES = 3
REPORTS = os.path.join(tempfile.gettempdir(), "hpcddp-vcluster-reports")
os.makedirs(REPORTS, exist_ok=True)

pytestmark = pytest.mark.timeout(600)


def vc_env(name=NAME, subnet=SUBNET) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPCDDP_RANKS_PER_NODE",
                                                                     "OMPI_", "PMIX_", "PRTE_"))}
    env.update(VCLUSTER_NAME=name, VCLUSTER_SUBNET=subnet, PYTHONUNBUFFERED="1")
    # a fault's stall report goes here (the nodes share /tmp), not into the checkout (jobs
    # pass it on with -x)
    env.setdefault("HPCDDP_REPORT_DIR", REPORTS)
    # The rsh agent hands PATH to the other nodes: this venv's python, hpcddp and prted first,
    # also when pytest was started without activating it.
    env["PATH"] = os.path.join(sys.prefix, "bin") + os.pathsep + env.get("PATH", "")
    return env


def vc(*args, timeout=60, name=NAME, subnet=SUBNET, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", VC, *args], capture_output=True, text=True, timeout=timeout,
                          env=vc_env(name, subnet), cwd=ROOT, **kw)


@pytest.fixture(scope="module")
def cluster(request):
    need_namespaces("network, UTS and mount namespaces")
    # The finalizer goes in before `up`: a half-made cluster is taken down too.
    request.addfinalizer(lambda: vc("down", timeout=120))
    res = vc("up", str(NODES), timeout=120)
    if res.returncode != 0:
        unavailable(f"scripts/vcluster.sh up {NODES} failed (namespaces not allowed here?):\n"
                     f"{(res.stdout + res.stderr)[-2000:]}")
    return {"nodes": [f"node{i}" for i in range(1, NODES + 1)]}


def mpirun(hosts: str, argv, *, timeout=150, btl="tcp,self,sm", extra=()) -> subprocess.CompletedProcess:
    """mpirun on node1 over HOSTS ("node1:2,node2:2"), TCP between nodes only through eth0."""
    n = sum(int(h.split(":")[1]) for h in hosts.split(","))
    # no --oversubscribe: with it PRRTE 3 maps every rank onto the first host
    cmd = [os.path.join(sys.prefix, "bin", "mpirun"), "--allow-run-as-root",
           "--host", hosts, "-n", str(n), "--mca", "btl", btl,
           "--mca", "btl_tcp_if_include", "eth0", "--mca", "oob_tcp_if_include", "eth0",
           "-x", "OMP_NUM_THREADS=1", "-x", "PYTHONUNBUFFERED=1",
           # c10d cannot name the peers of rank 0's TCPStore (no reverse DNS in the nodes): noise
           "-x", "TORCH_CPP_LOG_LEVEL=ERROR", "-x", "HPCDDP_REPORT_DIR", *extra, *argv]
    try:
        # TERM first: mpirun then stops its daemons and ranks on the other nodes too
        return vc("run", "node1", "timeout", "-k", "10", str(timeout), *cmd, timeout=timeout + 30)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"mpirun outlived {timeout + 30} s: {' '.join(cmd)}\n{e.stdout}\n{e.stderr}")


def ok(res, what: str):
    assert res.returncode == 0, f"{what} failed (exit {res.returncode}):\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}"


def veth_bytes(node: str) -> int:
    stats = pathlib.Path(f"/sys/class/net/{NAME}-{node}/statistics")
    return int((stats / "rx_bytes").read_text()) + int((stats / "tx_bytes").read_text())


# --- the nodes themselves ----------------------------------------------------------------------

def test_nodes_are_separate_hosts(cluster):
    marks = {}
    for i, node in enumerate(cluster["nodes"], 1):
        res = vc("run", node, "sh", "-c",
                 f"hostname; ip -4 -o addr show eth0; echo {node} > /scratch/mark; "
                 f"echo {node} > /dev/shm/vct-mark; ls /scratch /dev/shm; cat /etc/hosts; pwd")
        ok(res, f"run {node}")
        out = res.stdout.splitlines()
        assert out[0] == node
        assert f"{SUBNET}.{i}/24" in out[1]
        assert out[-1] == str(ROOT), "run keeps the caller's directory (the project is shared)"
        marks[node] = out
    for node, out in marks.items():
        # each node sees its own scratch and shared-memory file only
        assert out.count("mark") == 1 and out.count("vct-mark") == 1, out
        for j in range(1, NODES + 1):
            assert f"{SUBNET}.{j} node{j}" in out
    assert not pathlib.Path("/dev/shm/vct-mark").exists(), "a node's /dev/shm leaked to the host"
    res = vc("run", "node2", "cat", "/scratch/mark")
    assert res.stdout.strip() == "node2"
    status = vc("status")
    ok(status, "status")
    assert status.stdout.count("host=node") == NODES


def test_down_cleans_up_after_a_crash():
    """`up` killed half-way (its state file lost): `down` still finds and removes everything."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        unavailable("the virtual cluster needs root and util-linux")
    name, subnet = "vcx", "10.79.0"
    try:
        res = vc("up", "2", name=name, subnet=subnet)
        if res.returncode != 0:
            unavailable(f"scripts/vcluster.sh up 2 failed:\n{res.stderr[-2000:]}")
        pathlib.Path(f"/run/vcluster/{name}/nodes").unlink()     # as if `up` died before writing it
        ok(vc("down", name=name, subnet=subnet), "down")
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        assert f"{name}br0" not in links and f"{name}-node" not in links, links
        holders = subprocess.run(["pgrep", "-f", f"^vcluster-{name}-"], capture_output=True, text=True)
        assert holders.stdout == "", f"holders left: {holders.stdout}"
        assert vc("status", name=name, subnet=subnet).returncode != 0
        ok(vc("down", name=name, subnet=subnet), "second down")   # idempotent
    finally:
        vc("down", name=name, subnet=subnet)


def test_shaping_puts_a_qdisc_on_both_ends_of_each_link():
    if os.geteuid() != 0 or not shutil.which("tc"):
        unavailable("link shaping needs root and tc (iproute2)")
    name, subnet = "vcx", "10.79.0"
    try:
        res = vc("up", "2", "--rate", "100mbit", name=name, subnet=subnet)
        if res.returncode != 0:
            unavailable(f"scripts/vcluster.sh up 2 --rate 100mbit failed:\n{res.stderr[-2000:]}")
        for node in ("node1", "node2"):
            host_side = subprocess.run(["tc", "qdisc", "show", "dev", f"{name}-{node}"],
                                       capture_output=True, text=True).stdout
            node_side = vc("run", node, "tc", "qdisc", "show", "dev", "eth0", name=name, subnet=subnet).stdout
            for side in (host_side, node_side):
                assert "rate 100Mbit" in side, (node, host_side, node_side)
        bad = vc("up", "2", "--rate", "fast", name=name, subnet=subnet)
        assert bad.returncode == 1 and "--rate 'fast': expected NUMBER" in bad.stderr, bad.stderr
    finally:
        vc("down", name=name, subnet=subnet)


# --- MPI finds the nodes -----------------------------------------------------------------------

@pytest.mark.parametrize("hosts,nodes", [("node1:2,node2:2", 2), ("node1:2,node2:1,node3:1", 3)],
                         ids=["2nodes", "3nodes"])
def test_hpcddp_info_finds_the_nodes(cluster, hosts, nodes):
    res = mpirun(hosts, ["hpcddp", "info", "--json"])
    ok(res, "hpcddp info")
    info = json.loads(res.stdout[res.stdout.index("{"):])
    want = [(h.split(":")[0], int(h.split(":")[1])) for h in hosts.split(",")]
    layout = [(name, node, local) for node, (name, k) in enumerate(want) for local in range(k)]
    assert info["nodes"] == nodes and info["ranks_per_node_emulated"] is False, info
    assert info["local_rank_source"] == "mpi-shared-memory"
    got = [(r["host"], r["node"], r["local_rank"]) for r in sorted(info["ranks"], key=lambda r: r["rank"])]
    assert got == layout
    assert info["fault_tolerance"].startswith("off: a lost rank ends the job"), info


def test_hpcddp_info_says_what_keeps_ulfms_detector_beating_across_nodes(cluster):
    res = mpirun("node1:1,node2:1", ["hpcddp", "info"], extra=("--with-ft", "ulfm"))
    ok(res, "hpcddp info under --with-ft ulfm")
    line = next(x for x in res.stdout.splitlines() if x.startswith("failures"))
    c_built = importlib.util.find_spec("hpcddp.comm._heartbeat") is not None
    assert line == ("failures   ULFM on; heartbeat detector every 1 s, a node silent 5 s is "
                    f"lost; beaten by hpcddp's heartbeat pump "
                    f"({'C thread' if c_built else 'Python thread'})"), res.stdout


def test_shared_memory_alone_cannot_join_nodes(cluster):
    """With only sm and self, ranks on two nodes cannot reach each other: the nodes share no
    MPI path but the network (what makes TCP between them real)."""
    # python -m mpi4py: the failing rank aborts the job instead of waiting in MPI_Finalize
    res = mpirun("node1:1,node2:1", ["python", "-m", "mpi4py", "-c",
                 "from mpi4py import MPI; MPI.COMM_WORLD.allreduce(1)"], btl="self,sm", timeout=60)
    assert res.returncode != 0, f"sm joined two nodes:\n{res.stdout}\n{res.stderr}"
    assert "unable to reach" in (res.stdout + res.stderr).lower(), res.stdout + res.stderr


# --- what runs across them -------------------------------------------------------------------

def test_topology_and_collectives_2x2(cluster):
    before = veth_bytes("node2")
    res = mpirun("node1:2,node2:2", ["python", str(JOBS / "job_collectives.py")])
    ok(res, "job_collectives.py")
    for r, (host, node) in enumerate([("node1", 0), ("node1", 0), ("node2", 1), ("node2", 1)]):
        assert f"[rank{r}] vcluster-collectives ok host={host} node={node}" in res.stdout, res.stdout
    # 2 MiB tensors crossed node2's link (all_reduce, all_gather... of 256 Ki float64)
    moved = veth_bytes("node2") - before
    assert moved > 16 << 20, f"only {moved} bytes crossed node2's link"


def test_hierarchical_all_reduce_2x2(cluster):
    """The same checks with the two-level all_reduce forced (HPCDDP_HIER=force): shared memory
    inside each node, TCP between them, results equal to numpy's."""
    res = mpirun("node1:2,node2:2", ["python", str(JOBS / "job_collectives.py")],
                 extra=("-x", "HPCDDP_HIER=force"))
    ok(res, "job_collectives.py with HPCDDP_HIER=force")
    assert res.stdout.count("hierarchical all_reduce open") == 4, res.stdout
    assert res.stdout.count("vcluster-collectives ok") == 4, res.stdout


def test_ddp_matches_one_process_2x2(cluster):
    res = mpirun("node1:2,node2:2", ["python", str(JOBS / "job_ddp.py")])
    ok(res, "job_ddp.py")
    assert res.stdout.count("vcluster-ddp ok") == 4, res.stdout


def test_fsdp2_and_hsdp_match_one_process_2x2(cluster):
    """FSDP2 across nodes as users run it: HSDP (shard inside each node, replicate across),
    then plain FSDP2 over all 4 ranks, against one process; then the groups destroyed and the
    default group made again (tests/vcluster/job_fsdp2.py)."""
    res = mpirun("node1:2,node2:2", ["python", str(JOBS / "job_fsdp2.py")], timeout=240)
    ok(res, "job_fsdp2.py")
    assert res.stdout.count("vcluster-fsdp2 ok") == 4, res.stdout


def test_reduce_scatter_and_all_gather_on_the_ring_3x1(cluster):
    """reduce_scatter_tensor and all_gather_into_tensor across 3 real nodes, one rank each,
    on the ring's halves over its TCP links, against numpy (tests/vcluster/job_ring_halves.py)."""
    res = mpirun("node1:1,node2:1,node3:1", ["python", str(JOBS / "job_ring_halves.py")],
                 extra=("-x", "HPCDDP_RING=force"))
    ok(res, "job_ring_halves.py")
    assert res.stdout.count("vcluster-ring-halves ok") == 3, res.stdout


def _pack(tmp_path) -> pathlib.Path:
    files = tmp_path / "files" / "cls"
    files.mkdir(parents=True)
    for i in range(8):
        (files / f"{i}.bin").write_bytes(os.urandom(200_000 + 1000 * i))
    res = subprocess.run([sys.executable, "-m", "hpcddp", "pack", str(files.parent),
                          str(tmp_path / "packed"), "--format", "lmdb", "--shard-size", "300K",
                          "--no-progress"], capture_output=True, text=True, timeout=120)
    ok(res, "hpcddp pack")
    return tmp_path / "packed"


def scratch_files(node: str, dest: str) -> dict:
    """{name: sha256} of NODE's DEST, read inside the node."""
    res = vc("run", node, "sh", "-c", f"cd {dest} 2>/dev/null && sha256sum * || true")
    ok(res, f"listing {dest} on {node}")
    return {line.split()[1]: line.split()[0] for line in res.stdout.splitlines() if line.strip()}


@pytest.mark.parametrize("mode,group_nodes", [("replicate", 1), ("partition", 2)])
def test_stage_to_each_nodes_scratch(cluster, tmp_path, mode, group_nodes):
    src = _pack(tmp_path)
    dest = f"/scratch/vct-{mode}"
    report = tmp_path / "stage.json"
    res = mpirun("node1:2,node2:2", ["hpcddp", "stage", str(src), dest, "--mode", mode,
                                     "--group-nodes", str(group_nodes), "--no-progress",
                                     "--json", str(report)])
    ok(res, "hpcddp stage")
    r = json.loads(report.read_text())
    assert r["nodes"] == 2 and r["groups"] == 2 // group_nodes, r
    assert r["dest_per_node"] == [dest, dest]          # same path on each node: its own disk
    # the shared source is read once per node group
    assert r["bytes_read_per_group"] == [r["dataset_bytes"]] * r["groups"], r
    assert r["read_amplification"] == 1.0
    manifest = json.loads((src / "manifest.json").read_text())
    shards = sorted(p.name for p in src.glob("shard-*"))
    source = {name: subprocess.run(["sha256sum", str(src / name)], capture_output=True,
                                   text=True).stdout.split()[0] for name in shards}
    got = {node: {k: v for k, v in scratch_files(node, dest).items() if k.startswith("shard-")}
           for node in ("node1", "node2")}
    for node, files in got.items():
        for name, digest in files.items():
            assert source[name] == digest, f"{node}:{dest}/{name} differs from the source"
    if mode == "replicate":
        assert sorted(got["node1"]) == shards and sorted(got["node2"]) == shards
    else:   # each node holds its own part: disjoint, together the whole data set
        assert got["node1"] and got["node2"], got
        assert not set(got["node1"]) & set(got["node2"]), got
        assert sorted(set(got["node1"]) | set(got["node2"])) == shards
    assert len(manifest["shards"]) == len(shards)
    assert not scratch_files("node3", dest), "node3 was not in the job: its scratch stays empty"
    assert not pathlib.Path(dest).exists(), "the staged copy leaked to the host's file system"
