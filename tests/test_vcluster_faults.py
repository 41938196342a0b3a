"""A node that drops off the network ends the job, naming the node, with no process left on the
nodes that can still be reached (docs/hangs.md, "A node drops off the network").

On a virtual cluster of 4 nodes (scripts/vcluster.sh; 1 rank per node), a job exchanging 4 MiB
gradients in a loop under `hpcddp launch -- mpirun ...` meets a fault from outside, injected with
`scripts/vcluster.sh fault` (`--abort-grace 15`: the default 30 s would add a minute to CI):
node3's link goes down; nodes 1-2 and 3-4 are partitioned; node3's
link loses 30% of its packets. Each must end the job within HPCDDP_TIMEOUT + 60 s with a non-zero
status and a line naming the node, the job's ranks gone everywhere (the cut-off node's too: their
own watchdog finds them alone). The lost-daemon path of Open MPI (its keepalives find the node
first, and it exits 0) is run with short keepalives: `hpcddp launch` turns it into status 1.

Under `mpirun --with-ft ulfm` outside elastic mode, a rank lost in start-up or killed from
outside while the job trains ends the job, the survivors naming it (never waiting in
MPI_Finalize). In elastic mode (docs/elastic.md) a rank SIGKILLed from outside is survived,
and a node cut off ("A node that drops off the network") is survived by the side holding the
majority, which never trains a second world.
"""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time

import pytest

from test_vcluster import vc as _vc, vc_env as _vc_env
from vcluster_needs import need_namespaces, node_processes, unavailable

ROOT = pathlib.Path(__file__).resolve().parents[1]
JOB = ROOT / "tests" / "vcluster" / "job_train_forever.py"
NAME, SUBNET = "vcf", "10.82.0"
TIMEOUT = 10           # HPCDDP_TIMEOUT of the jobs
LIMIT = TIMEOUT + 60   # what the issue allows from the fault to the job's end
LOSSY_GRACE = 90       # s for a daemon behind a lossy link to end once mpirun has

pytestmark = pytest.mark.timeout(900)


def vc(*args, timeout=120):
    return _vc(*args, timeout=timeout, name=NAME, subnet=SUBNET)


@pytest.fixture(scope="module")
def cluster(request):
    need_namespaces("network, UTS and mount namespaces")
    request.addfinalizer(lambda: vc("down"))
    res = vc("up", "4")
    if res.returncode != 0:
        unavailable(f"scripts/vcluster.sh up 4 failed:\n{(res.stdout + res.stderr)[-2000:]}")
    return NAME


@pytest.fixture
def healed(cluster):
    yield
    res = vc("fault", "heal")
    assert res.returncode == 0, res.stderr


def job_processes(node: str) -> list:
    """The job's processes (launcher daemons, ranks) inside NODE."""
    return node_processes(NAME, node, (JOB.name, "prte"))


@pytest.fixture(autouse=True)
def clean_nodes(cluster):
    """Each test starts with no process of an earlier job on the nodes: what a failed test left
    behind is killed here (and printed), so that it fails that test only."""
    kill_leftovers()


def kill_leftovers() -> None:
    for i in range(1, 5):
        for p in node_processes(NAME, f"node{i}", ("prte", "vcluster/job_")):
            print(f"killing what an earlier test left on node{i}: {p}")
            try:
                os.kill(int(p.split(":")[0]), 9)
            except ProcessLookupError:
                pass


def left_after_end(node: str, script: pathlib.Path, grace: float = 10.0) -> list:
    """SCRIPT's ranks and the launcher's daemons still on NODE GRACE s after the launcher
    ended (a rank may still be in its last fraction of a second when mpirun returns)."""
    deadline = time.monotonic() + grace
    while True:
        left = node_processes(NAME, node, (script.name, "prte"))
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def process_states(processes: list) -> str:
    """What each of PROCESSES ('PID: cmdline') waits in, and its TCP connections: for the
    message of a test that finds a process left behind."""
    lines = []
    for p in processes:
        pid = p.split(":")[0]
        try:
            wchan = pathlib.Path(f"/proc/{pid}/wchan").read_text()
            state = pathlib.Path(f"/proc/{pid}/stat").read_text().split()[2]
        except OSError:
            continue
        socks = subprocess.run(["nsenter", f"--net=/proc/{pid}/ns/net", "ss", "-tnpo"],
                               capture_output=True, text=True).stdout
        lines.append(f"{p}\n  state {state}, waits in {wchan}\n" + "".join(
            f"  {s}\n" for s in socks.splitlines() if f"pid={pid}," in s))
    return "".join(lines)


def launch_on_nodes(nodes: int, *, ulfm: bool = False, grace: int = 15) -> list:
    """`hpcddp launch -- mpirun ...` on node1..NODES, 1 rank each, run from node1; the job's
    command follows."""
    hosts = ",".join(f"node{i}:1" for i in range(1, nodes + 1))
    return ["bash", str(ROOT / "scripts" / "vcluster.sh"), "run", "node1",
            "timeout", "-k", "10", "300", "hpcddp", "launch", "--abort-grace", str(grace), "--",
            os.path.join(sys.prefix, "bin", "mpirun"), "--allow-run-as-root",
            *(["--with-ft", "ulfm"] if ulfm else []), "--host", hosts,
            "-n", str(nodes), "--bind-to", "none", "--mca", "btl", "tcp,self,sm",
            "--mca", "btl_tcp_if_include", "eth0", "--mca", "oob_tcp_if_include", "eth0",
            "-x", "OMP_NUM_THREADS=1", "-x", "PYTHONUNBUFFERED=1",
            "-x", "TORCH_CPP_LOG_LEVEL=ERROR", "-x", "HPCDDP_REPORT_DIR"]


# What mpirun prints when PRRTE's own start-up fails before any rank runs (seen once in CI,
# after a fault test's leftovers on a node: its PMIx listener could not start). Such a start
# is retried once: these tests are about the job's faults, not the launcher's start.
LAUNCHER_NOT_STARTED = "The PMIx server's listener thread failed to start"
# Open MPI 5.0.11's launcher (prterun) crashing in the PMIx_Connect that ends a spawn whose
# processes span nodes: PRRTE 3.0.14's connect_release (prted/pmix/pmix_server_dyn.c) reads and
# destructs the second element of a one-element array, so every such spawn logs its "line
# 1113" error (a plain mpi4py spawn onto another node does too, no fault, no hpcddp), and
# whether prterun then dies ("corrupted size vs. prev_size", "free(): invalid pointer", a lost
# daemon, status 250) depends on what lies past that array in its heap: never in runs of this
# test alone, every time in the whole suite on 2026-11-29 (docs/elastic.md).
PRRTE_CRASHED = "prted/pmix/pmix_server_dyn.c"


def start_then_fault(cmd: list, env: dict, fault, tries: int = 2):
    """Start CMD, inject FAULT (`vcluster.sh fault` arguments, or a function to call) once the
    job prints "looping" -> (process, output so far)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=ROOT)
    out, start = [], time.monotonic()
    for line in proc.stdout:
        out.append(line)
        if "looping" in line:
            break
        if time.monotonic() - start > 120:
            proc.kill()
            pytest.fail("the job did not start looping within 120 s:\n" + "".join(out))
    else:
        status = proc.wait()
        if tries > 1 and LAUNCHER_NOT_STARTED in "".join(out):
            print(f"mpirun did not start (status {status}), once more:\n" + "".join(out))
            time.sleep(2)
            return start_then_fault(cmd, env, fault, tries - 1)
        pytest.fail(f"the job ended before the fault (status {status}):\n" + "".join(out))
    if callable(fault):
        fault()
    else:
        res = vc("fault", *fault)
        assert res.returncode == 0, res.stderr
    return proc, out


def kill_ranks_on(node: str, script: pathlib.Path):
    """A fault: SIGKILL from outside (as the OOM killer sends it) to SCRIPT's ranks on NODE."""
    def kill():
        ranks = [p for p in node_processes(NAME, node, (script.name,)) if "prted" not in p]
        assert ranks, f"no rank of {script.name} found on {node}"
        for p in ranks:
            os.kill(int(p.split(":")[0]), 9)
    kill.__name__ = f"SIGKILL to the rank on {node}"
    return kill


def run_with_fault(nodes: int, fault: list, env: dict | None = None):
    """Start the job on node1..NODES, inject FAULT once it loops; -> (status, output, seconds
    from the fault to the end)."""
    cmd = launch_on_nodes(nodes) + ["-x", "HPCDDP_TIMEOUT", sys.executable, str(JOB)]
    full_env = _vc_env(NAME, SUBNET)
    full_env.update({"HPCDDP_TIMEOUT": str(TIMEOUT)}, **(env or {}))
    proc, out = start_then_fault(cmd, full_env, fault)
    cut = time.monotonic()
    rest, _ = proc.communicate(timeout=400)
    took = time.monotonic() - cut
    print(f"fault {' '.join(fault)}: the job ended {took:.1f} s later, status {proc.returncode}")
    return proc.returncode, "".join(out) + rest, took


def gone_everywhere(nodes: int, grace: float = 30.0) -> dict:
    """{node: processes} still there after GRACE s: the reachable nodes' must all be gone at
    once, the cut-off node's ranks within GRACE (their own watchdog ends them)."""
    deadline = time.monotonic() + grace
    while True:
        left = {f"node{i}": [p for p in job_processes(f"node{i}") if JOB.name in p]
                for i in range(1, nodes + 1)}
        if not any(left.values()) or time.monotonic() > deadline:
            return {n: p for n, p in left.items() if p}
        time.sleep(1)


def ended(status, out, took, *, expect=3, limit=LIMIT, reachable=("node1", "node2"), lossy=()):
    """The job ended with EXPECT within LIMIT s of the fault, nothing of it on REACHABLE; on
    the LOSSY nodes (reachable through a lossy link) its daemon may need resends, or PRRTE's
    keepalives (60 s, set by `hpcddp launch`), to hear that mpirun is gone: LOSSY_GRACE."""
    assert status == expect, f"expected status {expect}, got {status}:\n{out[-6000:]}"
    assert took < limit, f"the job ended {took:.0f} s after the fault (limit {limit}):\n{out[-4000:]}"
    for node in reachable:
        assert not job_processes(node), f"left on {node}: {job_processes(node)}"
    deadline = time.monotonic() + LOSSY_GRACE
    for node in lossy:
        while job_processes(node) and time.monotonic() < deadline:
            time.sleep(1)
        left = job_processes(node)
        assert not left, f"left on {node} {LOSSY_GRACE} s after the end:\n{process_states(left)}"


def test_link_down_ends_the_job(healed):
    status, out, took = run_with_fault(3, ["cut", "node3"])
    ended(status, out, took)
    assert "rank 2 (node3" in out and "dead or unresponsive" in out, out[-6000:]
    assert not gone_everywhere(3), out[-3000:]


def test_link_down_found_by_keepalives_is_a_failure(healed):
    """Open MPI's keepalives find the node before hpcddp's watchdog: mpirun ends the job and
    exits 0; `hpcddp launch` makes it 1 and names the node."""
    short = {"PRTE_MCA_oob_tcp_keepalive_time": "5", "PRTE_MCA_oob_tcp_keepalive_intvl": "2",
             "PRTE_MCA_oob_tcp_keepalive_probes": "3", "HPCDDP_TIMEOUT": "600"}
    status, out, took = run_with_fault(3, ["cut", "node3"], env=short)
    assert "PRTE has lost communication with a remote daemon" in out, out[-6000:]
    ended(status, out, took, expect=1, limit=60)
    assert "the launcher lost node node3" in out, out[-4000:]


def test_partition_ends_the_job(healed):
    status, out, took = run_with_fault(4, ["partition", "node1,node2", "node3,node4"])
    ended(status, out, took)
    assert "rank 2 (node3" in out and "rank 3 (node4" in out, out[-6000:]
    assert not gone_everywhere(4), out[-3000:]


def test_packet_loss_ends_the_job_naming_the_link(healed):
    status, out, took = run_with_fault(3, ["loss", "node3", "30"])
    ended(status, out, took, lossy=("node3",))
    # node3 named: by its TCP connections' resends, or (its answer to the stall report lost on
    # the way: 1 run in 5 here) as unresponsive; never another node
    lossy = [line for line in out.splitlines() if "the network loses packets" in line]
    # the report's head (what it found), not the stacks at the output's end
    report = out[max(0, out.find("hpcddp stall report")):][:6000]
    assert all("node3" in line for line in lossy), report
    assert lossy or ("rank 2 (node3" in out and "dead or unresponsive" in out), report
    assert not [line for line in out.splitlines() if "dead or unresponsive" in line
                and ("(node1" in line or "(node2" in line)], report


# -- ULFM outside elastic mode: a lost rank ends the job ----------------------------------------
# With --with-ft ulfm mpirun does not end a job whose rank died; each survivor's next call
# fails. Across nodes MPI_Finalize then waited for the dead rank until the time limit (seen in
# CI under Slurm: a rank crashed in MPI's start-up); hpcddp ends the survivors instead.
PLAIN_JOB = ROOT / "tests" / "vcluster" / "job_plain_ulfm.py"
ULFM_LIMIT = 30       # s from the loss to the job's end: no timeout is involved, only the exit


def plain_ulfm_job(nodes: int, env: dict | None = None):
    cmd = launch_on_nodes(nodes, ulfm=True) + ["-x", "DIE_AT_START", sys.executable,
                                               str(PLAIN_JOB)]
    full_env = _vc_env(NAME, SUBNET)
    full_env.update({"DIE_AT_START": ""}, **(env or {}))
    return cmd, full_env


def test_rank_lost_in_start_up_ends_a_fault_tolerant_job(cluster):
    cmd, env = plain_ulfm_job(3, {"DIE_AT_START": "2"})
    start = time.monotonic()
    res = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    took, out = time.monotonic() - start, res.stdout + res.stderr
    print(f"rank 2 lost in start-up: the job ended after {took:.1f} s, status {res.returncode}")
    assert res.returncode != 0, out[-4000:]
    assert took < ULFM_LIMIT, f"the job took {took:.0f} s:\n{out[-4000:]}"
    assert "hpcddp.init: rank 2 of the job died during start-up" in out, out[-4000:]
    assert "hpcddp: rank 2 of the job lost: this rank exits (exit 1)" in out, out[-4000:]
    for node in ("node1", "node2", "node3"):
        assert not left_after_end(node, PLAIN_JOB), node


def test_rank_killed_from_outside_ends_a_fault_tolerant_job(cluster):
    """SIGKILL from another process (as the OOM killer does) to rank 2 on node3 while the job
    trains: the survivors end naming it, status non-zero, nothing left."""
    cmd, env = plain_ulfm_job(3)

    proc, out = start_then_fault(cmd, env, kill_ranks_on("node3", PLAIN_JOB))
    killed = time.monotonic()
    rest, _ = proc.communicate(timeout=300)
    took, out = time.monotonic() - killed, "".join(out) + rest
    print(f"rank 2 killed from outside: the job ended {took:.1f} s later, status {proc.returncode}")
    assert proc.returncode != 0, out[-4000:]
    assert took < ULFM_LIMIT, f"the job ended {took:.0f} s after the kill:\n{out[-4000:]}"
    assert "hpcddp: rank 2 of the job lost" in out, out[-4000:]
    for node in ("node1", "node2", "node3"):
        assert not left_after_end(node, PLAIN_JOB), node


# -- elastic mode: the job survives, one side goes on ---------------------------------------
ELASTIC_JOB = ROOT / "tests" / "vcluster" / "job_elastic.py"


def run_elastic_with_fault(nodes: int, fault, outdir, epochs: int = 30, *, mpirun_args=(),
                           job_args=()) -> tuple:
    """ELASTIC_JOB under `hpcddp launch -- mpirun --with-ft ulfm` on node1..NODES, FAULT once
    it loops -> (status, output, seconds from the fault to the end, seconds from the fault to
    the survivors' recovery line or None)."""
    cmd = launch_on_nodes(nodes, ulfm=True, grace=10) + [*mpirun_args,
        sys.executable, str(ELASTIC_JOB), str(outdir), str(epochs), *job_args]
    proc, out = start_then_fault(cmd, _vc_env(NAME, SUBNET), fault)
    cut, recovered = time.monotonic(), None
    for line in proc.stdout:
        out.append(line)
        if recovered is None and "elastic: lost rank" in line:
            recovered = time.monotonic() - cut
    proc.wait(timeout=60)
    took = time.monotonic() - cut
    what = fault.__name__ if callable(fault) else " ".join(fault)
    print(f"elastic, fault {what}: recovered {recovered} s after it, the job ended "
          f"{took:.1f} s after it, status {proc.returncode}")
    return proc.returncode, "".join(out), took, recovered


def survivors(outdir) -> list:
    import json
    return sorted((json.loads(p.read_text()) for p in pathlib.Path(outdir).glob("final.*.json")),
                  key=lambda f: f["rank"])


def elastic_gone(nodes, grace: float = 30.0) -> dict:
    """{node: the job's ranks} still there GRACE s on (the cut-off side's end themselves)."""
    deadline = time.monotonic() + grace
    while True:
        left = {n: node_processes(NAME, n, (ELASTIC_JOB.name,)) for n in nodes}
        if not any(left.values()) or time.monotonic() > deadline:
            return {n: p for n, p in left.items() if p}
        time.sleep(1)


def test_elastic_job_survives_a_node_off_the_network(healed, tmp_path):
    """node3 of 4 loses its link: ULFM's detector (switched on by hpcddp) reports rank 2 failed,
    ranks 0, 1 and 3 recover and train to the end at 3; rank 2, alone on its side, stops; the
    launcher, still waiting for node3's daemon, is ended once every survivor left: status 0."""
    status, out, took, recovered = run_elastic_with_fault(4, ["cut", "node3"], tmp_path)
    assert status == 0, out[-6000:]
    assert recovered is not None and recovered < 20, out[-6000:]
    assert "lost rank 2 on node3" in out, out[-6000:]
    final = survivors(tmp_path)
    assert [f["rank"] for f in final] == [0, 1, 3], out[-6000:]
    assert all(f["size"] == 3 and f["lost"] == [[2]] for f in final), final
    assert len({f["params"] for f in final}) == 1 and len({f["global_step"] for f in final}) == 1
    assert "every survivor of the elastic job left" in out, out[-3000:]
    for node in ("node1", "node2", "node4"):
        assert not left_after_end(node, ELASTIC_JOB), node
    # the cut-off rank found itself alone, without a majority, and stopped (no world of one)
    assert not elastic_gone(["node3"]), out[-3000:]


@pytest.mark.parametrize("gradients", ["small", "ring"])
def test_elastic_job_survives_a_rank_killed_from_outside(healed, tmp_path, gradients):
    """Rank 2 on node3 of 3 SIGKILLed by another process: ranks 0 and 1 recover at once and
    train to the end at 2, status 0, nothing left on any node. "ring": gradients of 2.4 MB,
    each bucket all-reduced by the ring over TCP links (HPCDDP_RING=force), so the kill
    lands in the ring's exchange: the survivors' links see the end of their neighbour, and
    MPI's report of the lost process is what they raise (elastic recovery reads it)."""
    ring = gradients == "ring"
    status, out, took, recovered = run_elastic_with_fault(
        3, kill_ranks_on("node3", ELASTIC_JOB), tmp_path, epochs=8,
        mpirun_args=["-x", "HPCDDP_RING=force"] if ring else [],
        job_args=["16384"] if ring else [])
    if ring:     # the ring over TCP links ran (the rebuilt world's, at least)
        assert all(f["ring_links"] >= 1 for f in survivors(tmp_path)), survivors(tmp_path)
    assert status == 0, out[-6000:]
    assert recovered is not None and recovered < 5, out[-6000:]
    assert "lost rank 2 on node3" in out, out[-6000:]
    final = survivors(tmp_path)
    assert [f["rank"] for f in final] == [0, 1], out[-6000:]
    assert all(f["size"] == 2 and f["lost"] == [[2]] for f in final), final
    assert len({f["params"] for f in final}) == 1, final
    for node in ("node1", "node2", "node3"):
        assert not left_after_end(node, ELASTIC_JOB), node


@pytest.mark.parametrize("how", ["spawn", "spare"])
def test_elastic_job_grows_back_onto_a_spare_node(healed, tmp_path, how):
    """3 ranks on node1-3, node4 spare: a free slot (`--host node1:1,...,node4:1 -n 3`,
    HPCDDP_ELASTIC_REGROW=1: a replacement is spawned there) or a spare process started with
    the job (`-n 4`, HPCDDP_ELASTIC_SPARES=1). node3 loses its link, ranks 0 and 1 (a
    majority) recover, and rank 2's replacement joins from node4; the job ends at 3 ranks,
    status 0, parameters equal, nothing left. The spawn case's rank 0 warns at start that
    Open MPI 5.0's launcher can crash in a spawn across nodes; where it does so twice (an
    upstream bug: PRRTE_CRASHED), the test checks that the job ended and left nothing, and
    xfails."""
    cmd = launch_on_nodes(4, ulfm=True, grace=10)
    if how == "spawn":
        cmd[cmd.index("-n") + 1] = "3"
        cmd += ["-x", "HPCDDP_ELASTIC_REGROW=1"]
        joined = "[rank2] elastic: replacement for rank 2 started on node4"
    else:
        cmd += ["-x", "HPCDDP_ELASTIC_SPARES=1"]
        joined = "[rank2] elastic: spare process took rank 2 on node4"
    cmd += [sys.executable, str(ELASTIC_JOB), str(tmp_path), "30"]
    for attempt in (1, 2):
        proc, out = start_then_fault(cmd, _vc_env(NAME, SUBNET), ["cut", "node3"])
        rest, _ = proc.communicate(timeout=400)
        out = "".join(out) + rest
        crashed = proc.returncode != 0 and PRRTE_CRASHED in out and joined not in out
        if attempt == 1 and crashed:
            print("Open MPI's launcher crashed in the spawn, once more:\n" + out[-3000:])
            assert vc("fault", "heal").returncode == 0
            kill_leftovers()
            continue
        break
    # the user was told at start (rank 0's line) that a spawn across nodes risks this crash
    assert ("can crash in such a spawn" in out) == (how == "spawn"), out[-6000:]
    if crashed:       # the job still ended, and left nothing behind
        for node in ("node1", "node2", "node4"):
            assert not left_after_end(node, ELASTIC_JOB), node
        pytest.xfail("Open MPI 5.0.11's launcher crashed in the spawn's PMIx_Connect across "
                     "nodes (PRRTE 3.0.14 connect_release, pmix_server_dyn.c), twice: "
                     + out[-1500:])
    assert proc.returncode == 0, out[-6000:]
    assert "lost rank 2 on node3" in out, out[-6000:]
    assert joined in out, out[-6000:]
    final = survivors(tmp_path)
    assert [(f["rank"], f["host"], f["size"]) for f in final] == [
        (0, "node1", 3), (1, "node2", 3), (2, "node4", 3)], out[-6000:]
    assert len({f["params"] for f in final}) == 1 and len({f["global_step"] for f in final}) == 1
    for node in ("node1", "node2", "node4"):
        assert not left_after_end(node, ELASTIC_JOB), node
    assert not elastic_gone(["node3"]), out[-3000:]


def test_elastic_partition_half_with_rank0_goes_on(healed, tmp_path):
    """Nodes 1-2 against 3-4: each half sees the other failed. The half holding start-up rank 0
    trains on at 2 and ends with status 0; the other half stops (never two worlds training:
    no result from ranks 2 and 3)."""
    status, out, took, recovered = run_elastic_with_fault(
        4, ["partition", "node1,node2", "node3,node4"], tmp_path)
    assert status == 0, out[-6000:]
    assert recovered is not None and recovered < 30, out[-6000:]
    final = survivors(tmp_path)
    assert [f["rank"] for f in final] == [0, 1], out[-6000:]
    assert all(f["size"] == 2 and sorted(sum(f["lost"], [])) == [2, 3] for f in final), final
    assert len({f["params"] for f in final}) == 1
    assert not elastic_gone(["node1", "node2", "node3", "node4"]), out[-3000:]
