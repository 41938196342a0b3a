"""The hang scenarios: what each one runs and what its output and exit code must show.

Shared by tests/test_hangs.py (one pytest case each) and tests/scenarios/loop.py (all of them,
N times in a row). Every case runs under ``run_mpi`` with a hard timeout and a short
HPCDDP_TIMEOUT; ``bound`` is how long after its stall point (the ``stall point <epoch>`` line a
scenario prints) the job must have ended: HPCDDP_TIMEOUT + 10 s.
"""
from __future__ import annotations

import os
import pathlib
import re
import sys
import time
from dataclasses import dataclass, field

HERE = pathlib.Path(__file__).parent
TIMEOUT = 3.0                 # HPCDDP_TIMEOUT in every scenario
BOUND = TIMEOUT + 10.0        # the bound: timeout + 10 s from the stall
HARD_TIMEOUT = 150            # run_mpi's kill switch (start-up on a loaded 2-core box is slow)
STALL = 3                     # hpcddp.diagnostics.STALL_EXIT_CODE


@dataclass
class Case:
    name: str
    script: str
    nprocs: int
    args: tuple = ()
    env: dict = field(default_factory=dict)
    extra: tuple = ()                 # mpirun flags
    rc: tuple = (STALL,)              # accepted exit codes
    expect: tuple = ()                # regexes that must match the job's output
    report: bool = True               # a stall report file must exist (and match `expect`)
    no_report: bool = False           # no stall report may exist
    marked: bool = True               # the scenario prints "stall point <epoch>"
    min_count: dict = field(default_factory=dict)   # regex -> least number of matches
    bound: float = BOUND              # seconds from the stall point to the end of the job


# Open MPI's own behaviour when a rank dies: mpirun ends the job at once. `--enable-recovery`
# keeps the survivors running, as srun does by default (no --kill-on-bad-exit): the hang
# hpcddp must explain.
SURVIVE = ("--enable-recovery",)

CASES = [
    Case("skip_collective", "skip_collective.py", 3, expect=(
        r"ranks 0,1 have waited [\d.]+ s in all_reduce #6 \(shape=\[256\], float32\) on WORLD",
        r"rank 2 has not called all_reduce #6 on WORLD: it is in Python at "
        r"skip_collective\.py:\d+ \(in slow_python\)",
    )),
    Case("skip_collective_async_engine", "skip_collective.py", 3, args=("async",),
         env={"HPCDDP_ASYNC_ENGINE": "force"}, expect=(
             r"ranks 0,1 have waited [\d.]+ s in all_reduce #6 \(shape=\[256\], float32\) on "
             r"WORLD",
             r"rank 2 has not called all_reduce #6 on WORLD: it is in Python at "
             r"skip_collective\.py:\d+ \(in slow_python\)",
         )),
    Case("skip_first_all_gather", "skip_collective.py", 3, args=("first_all_gather",), expect=(
        r"ranks 0,1 have waited [\d.]+ s in all_gather #6 \(shape=\[256\], float32\) on WORLD",
        r"rank 2 has not called all_gather #6 on WORLD: it is in Python at "
        r"skip_collective\.py:\d+ \(in slow_python\)",
    )),
    Case("mismatch_detail", "mismatch.py", 4, env={"HPCDDP_DEBUG": "detail"}, rc=(5,),
         report=False, no_report=True, expect=(
             r"rank 1 called broadcast\(src=0, shape=\[4\]\) while ranks 0,2,3 called "
             r"all_reduce\(shape=\[4\]\)",),
         min_count={r"\[rank\d\] CollectiveMismatchError: collective mismatch on group WORLD": 4}),
    Case("mismatch_watchdog", "mismatch.py", 4, expect=(
        r"ranks 0,2,3 have waited [\d.]+ s in all_reduce #4 \(shape=\[4\], float32\) on WORLD",
        r"rank 1 called broadcast #4 \(src=0, shape=\[4\], float32\) on WORLD instead",
    )),
    Case("exception_abort", "exception_rank.py", 4, args=("abort",), rc=(1,), report=False,
         no_report=True, expect=(
             r"\[rank2\] uncaught exception, aborting the job",
             r"\[rank2\] ValueError: corrupt sample in batch 3",
             r"MPI_ABORT was invoked on rank 2",
         )),
    Case("exception_abort_hook_raises", "exception_rank.py", 4, args=("abort-hook-raises",),
         rc=(1,), report=False, no_report=True, expect=(
             r"\[rank2\] uncaught exception, aborting the job",
             r"\[rank2\] ValueError: corrupt sample in batch 3",
             r"MPI_ABORT was invoked on rank 2",
         )),
    # the default (HPCDDP_ABORT_ON_EXCEPTION=auto): rank 2's exit reports at once, long
    # before the timeout, and the report's abort ends the job
    *(Case(f"exception_default_{api}", "exception_rank.py", 4, args=(mode,),
           env={"HPCDDP_TIMEOUT": "600"}, bound=10.0, expect=(
               r"rank 2 writes it: rank 2's script ended with an uncaught exception "
               r"\(ValueError: corrupt sample in batch 3\)",
               r"ranks 0,1,3 have waited [\d.]+ s in all_reduce #3 \(shape=\[8\], float32\) on "
               r"WORLD",
               r"rank 2 has not called all_reduce #3 on WORLD: it is in hpcddp's finalize: its "
               r"script has ended after an uncaught exception \(ValueError: corrupt sample in "
               r"batch 3\)",
               r"\[rank2\]:? ValueError: corrupt sample in batch 3",
           )) for api, mode in (("hpcddp", "default"), ("torch", "torch"))),
    Case("exception_default_others_computing", "exception_rank.py", 4,
         args=("default-computing",), env={"HPCDDP_TIMEOUT": "600"}, bound=10.0, rc=(1,),
         report=False, no_report=True, expect=(
             r"\[rank2\] the script ended with an uncaught exception, aborting the job, exit "
             r"code 1",
             r"\[rank2\] ValueError: corrupt sample in batch 3",
             r"MPI_ABORT was invoked on rank 2",
         )),
    Case("exit_default", "exception_rank.py", 4, args=("exit",), env={"HPCDDP_TIMEOUT": "600"},
         bound=10.0, expect=(
             r"rank 2 writes it: rank 2's script ended with sys\.exit\(4\)",
             r"rank 2 has not called all_reduce #3 on WORLD: it is in hpcddp's finalize: its "
             r"script has ended",
         )),
    Case("exit_builtin_default", "exception_rank.py", 3, args=("exit-builtin",),
         env={"HPCDDP_TIMEOUT": "600"}, bound=10.0, expect=(
             r"rank 2 writes it: rank 2's script ended with sys\.exit\(4\)",)),
    # a rank ends its script normally (no exception) without a call the others wait in:
    # reported at once, not after HPCDDP_TIMEOUT
    Case("ended_early_skip", "ended_early.py", 3, args=("skip",),
         env={"HPCDDP_TIMEOUT": "600"}, bound=12.0, expect=(
             r"rank 0 writes it: rank 2 ended without calling all_reduce #6 \(shape=\[256\], "
             r"float32\) on WORLD, which other ranks wait in",
             r"rank 2 has not called all_reduce #6 on WORLD: it is in hpcddp's finalize: its "
             r"script has ended; its last op on WORLD was all_reduce #5",
         )),
    Case("ended_early_clean", "ended_early.py", 3, args=("clean",),
         env={"HPCDDP_TIMEOUT": "600"}, rc=(0,), report=False, no_report=True, marked=False,
         min_count={r"\[rank\d\] done": 3}),
    # point-to-point: a rank waits in a send or receive whose peer has ended without its half
    Case("ended_early_recv", "ended_early.py", 3, args=("recv",),
         env={"HPCDDP_TIMEOUT": "600"}, bound=12.0, expect=(
             r"rank 0 writes it: rank 2 ended without a send that rank 1's recv #1 \(from rank "
             r"2, shape=\[256\], float32\) on WORLD waits for",
             r"rank 2 \(its peer\) is in hpcddp's finalize: its script has ended",
         )),
    Case("ended_early_send", "ended_early.py", 3, args=("send",),
         env={"HPCDDP_TIMEOUT": "600"}, bound=12.0, expect=(
             r"rank 0 writes it: rank 2 ended without a receive that rank 1's send #1 \(to rank "
             r"2, shape=\[2097152\], float32\) on WORLD waits for",
         )),
    Case("ended_early_p2p_clean", "ended_early.py", 3, args=("p2p_clean",),
         env={"HPCDDP_TIMEOUT": "600"}, rc=(0,), report=False, no_report=True, marked=False,
         min_count={r"\[rank\d\] done": 3}),
    # ranks wait in different calls as the same collective, HPCDDP_TIMEOUT=600: reported
    # within seconds by the coordinator's look at long waits
    Case("wait_mismatch_op", "wait_mismatch.py", 3, args=("op",),
         env={"HPCDDP_TIMEOUT": "600"}, bound=12.0, expect=(
             r"rank 0 writes it: ranks have waited 2 s or more in different calls as #4 on WORLD",
             r"ranks 0,2 all_reduce\(shape=\[4\], float32\); rank 1 broadcast\(src=0, "
             r"shape=\[4\], float32\); the culprit: rank 1",
         )),
    Case("wait_mismatch_count", "wait_mismatch.py", 3, args=("count",),
         env={"HPCDDP_TIMEOUT": "600"}, bound=12.0, expect=(
             r"rank 0 writes it: ranks have waited 2 s or more in different calls as #4 on WORLD",
             r"ranks 0,2 all_reduce\(shape=\[2097151\], float32\); rank 1 all_reduce\("
             r"shape=\[2097152\], float32\); the culprit: rank 1",
         )),
    Case("exception_no_abort", "exception_rank.py", 4, args=("no-abort",), expect=(
        r"ranks 0,1,3 have waited [\d.]+ s in all_reduce #3 \(shape=\[8\], float32\) on WORLD",
        r"rank 2 has not called all_reduce #3 on WORLD: it is in hpcddp's finalize: its script "
        r"has ended after an uncaught exception \(ValueError: corrupt sample in batch 3\)",
        r"\[rank2\] ValueError: corrupt sample in batch 3",
    )),
    Case("sigkill_allreduce", "sigkill.py", 3, args=("allreduce",), extra=SURVIVE, expect=(
        r"ranks 0,2 have waited [\d.]+ s in all_reduce #4 \(shape=\[65536\], float32\) on WORLD",
        r"rank 1 is dead: its process \(pid \d+ on \S+\) has exited",
    )),
    Case("sigkill_allreduce_mpirun", "sigkill.py", 3, args=("allreduce",), rc=(137, STALL),
         report=False, expect=(
             r"(prterun noticed that process rank 1 with PID \d+ on node \S+ exited on\s+"
             r"signal 9|rank 1 is dead: its process)",)),
    Case("sigkill_ddp_backward", "sigkill.py", 3, args=("ddp",), extra=SURVIVE, expect=(
        r"ranks 0,2 have waited [\d.]+ s in all_reduce #\d+ \(shape=\[\d+\], float32\) on WORLD",
        r"rank 1 is dead: its process \(pid \d+ on \S+\) has exited",
        r"loss\.backward\(\)",
    )),
    Case("sigkill_coordinator_no_pid", "sigkill.py", 3, args=("allreduce", "0"), extra=SURVIVE,
         env={"HPCDDP_PID_CHECK": "0"}, expect=(
             r"\[rank1\] hpcddp stall report",
             r"ranks 1,2 have waited [\d.]+ s in all_reduce #4",
             r"rank 0 is dead or unresponsive: it did not answer the diagnostics exchange "
             r"within [\d.]+ s",
         )),
    Case("seed_grad_allreduce", "seed_grad_allreduce.py", 3, expect=(
        r"ranks 0,2 have waited [\d.]+ s in all_reduce #\d+ \(shape=\[4, 8\], float32\) on WORLD",
        r"rank 1 has not called all_reduce #\d+ on WORLD: it is in hpcddp's finalize: its script "
        r"has ended",
    )),
    Case("seed_grad_weight_only_detail", "seed_grad_allreduce.py", 3, args=("weight-only",),
         env={"HPCDDP_DEBUG": "detail"}, rc=(1,), report=False, no_report=True, expect=(
             r"rank 1 called all_reduce\(shape=\[4\]\) while ranks 0,2 called "
             r"all_reduce\(shape=\[4, 8\]\)",)),
    Case("seed_swallowed_exception", "seed_swallowed_exception.py", 3, expect=(
        r"\[rank1\] Error in custom module: overflow in complex_operation",
        r"ranks 0,2 have waited [\d.]+ s in all_reduce #\d+ \(shape=\[36\], float32\) on WORLD",
        r"rank 1 has not called all_reduce #\d+ on WORLD: it is in hpcddp's finalize",
    )),
    Case("monitored_barrier", "monitored_barrier.py", 3, rc=(1,), report=False, no_report=True,
         expect=(r"BarrierTimeout: monitored_barrier: 1 rank\(s\) of group 'WORLD' did not reach "
                 r"the barrier within 3\.0 s \(its timeout=, else the group's, else "
                 r"HPCDDP_TIMEOUT\): rank 2: in Python at "
                 r"monitored_barrier\.py:\d+ \(in load_checkpoint\)",)),
    # torch's timeout= (2 s) bounds the wait although HPCDDP_TIMEOUT is 600 s
    *(Case(f"torch_timeout_{mode}", "torch_timeout.py", 3, args=(mode,),
           env={"HPCDDP_TIMEOUT": "600"}, bound=2.0 + 10.0, expect=(
               rf"ranks 0,1 have waited [\d.]+ s in {op} #\d+ .*on {group}",
               r"\(timeout 2 s: the group's timeout= given to torch\)",
               rf"rank 2 has not called {op} #\d+ on {group}: it is in Python at "
               r"torch_timeout\.py:\d+"))
      for mode, op, group in (("init", "all_reduce", "WORLD"), ("barrier", "barrier", "WORLD"),
                              ("new_group", "all_reduce", r"group\[0, 1, 2\]"))),
    # the coordinator's look at long waits names the deadlock at once (HPCDDP_TIMEOUT=600),
    # and never a correct program's waits
    Case("p2p_deadlock_early", "p2p_deadlock.py", 2, args=("torch",),
         env={"HPCDDP_TIMEOUT": "600"}, bound=12.0, expect=(
             r"rank 0 writes it: a point-to-point deadlock: rank 0 waits in recv #1 \(from rank "
             r"1, shape=\[4\], float32\) on WORLD; rank 1 waits in recv #1 \(from rank 0, "
             r"shape=\[4\], float32\) on WORLD",
         )),
    # the same beside a DataLoader's workers and a progress bar (their threads never send)
    Case("p2p_deadlock_beside_loader", "p2p_deadlock.py", 2, args=("loader",),
         env={"HPCDDP_TIMEOUT": "600"}, bound=12.0, expect=(
             r"rank 0 writes it: a point-to-point deadlock: rank 0 waits in recv #1 \(from rank "
             r"1, shape=\[4\], float32\) on WORLD",
         )),
    Case("p2p_waits_clean", "p2p_waits.py", 3, env={"HPCDDP_TIMEOUT": "600"}, rc=(0,),
         report=False, no_report=True, marked=False, min_count={r"\[rank\d\] done": 3}),
    *(Case(f"p2p_deadlock_{api}", "p2p_deadlock.py", 2, args=(api,), expect=(
        r"a point-to-point deadlock: rank (\d) waits for rank (\d); rank \2 waits for rank \1",
        r"Blocking point-to-point calls wait for each other in a cycle")) for api in
      ("torch", "direct")),
    # MPI's path: the shared-memory arena agrees on every call it serves (it would corrupt
    # memory), and its start-up race gives it 256 KiB on a fast machine (seen in CI)
    Case("dtype_culprit", "dtype_mismatch.py", 3, rc=(1, STALL),
         env={"HPCDDP_SHM_ALLREDUCE": "0"}, expect=(
        r"the flight recorders hold different calls as #4 on WORLD: ranks 0,1 all_reduce\("
        r"shape=\[65536\], float32\); rank 2 all_reduce\(shape=\[65536\], float64\); the "
        r"culprit: rank 2, whose call differs",)),
    # the audit (diagnostics.audit): small calls that completed with wrong data
    Case("audit_dtype_at_exit", "small_mismatch.py", 3, args=("dtype",), expect=(
        r"hpcddp audit .*ranks disagreed on a collective that has run",
        r"as #4 on WORLD \(ranks \[0, 1, 2\]\), and the call completed: ranks 0,1 all_reduce"
        r"\(shape=\[4\], float32\); rank 2 all_reduce\(shape=\[4\], int32\); the culprit: "
        r"rank 2",)),
    Case("audit_reduce_op_at_exit", "small_mismatch.py", 3, args=("op",), expect=(
        r"as #4 on WORLD \(ranks \[0, 1, 2\]\), and the call completed: ranks 0,1 all_reduce"
        r"\(shape=\[4\], float32\); rank 2 all_reduce\[MAX\]\(shape=\[4\], float32\); the "
        r"culprit: rank 2",)),
    Case("audit_root_while_running", "small_mismatch.py", 2, args=("root",), bound=6.0,
         expect=(r"as #4 on WORLD \(ranks \[0, 1\]\), and the call completed: rank 0 "
                 r"broadcast\(src=0, shape=\[8\], float32\); rank 1 broadcast\(src=1, "
                 r"shape=\[8\], float32\)",)),
    Case("audit_off", "small_mismatch.py", 3, args=("dtype",), env={"HPCDDP_AUDIT": "0"},
         rc=(0,), report=False, no_report=True, min_count={r"\[rank\d\] done": 3}),
    Case("audit_clean", "small_mismatch.py", 3, args=("clean",), rc=(0,), report=False,
         no_report=True, min_count={r"\[rank\d\] done": 3,
                                    r"\[rank\d\] refused as expected": 3}),
    # not a hang: rank 1 is 9 s late, the job ends normally after two reports
    Case("warn_policy", "warn_policy.py", 3, env={"HPCDDP_STALL_POLICY": "warn"}, rc=(0,),
         bound=9.0 + BOUND,
         expect=(r"rank 1 has not called all_reduce #3 on WORLD: it is in Python at "
                 r"warn_policy\.py:\d+",
                 r"next report in 3 s if still stuck"),
         min_count={r"\[rank\d\] hpcddp stall report": 2, r"\[rank\d\] done 81": 3}),
    Case("slow_not_stuck", "slow_finish.py", 3, rc=(0,), report=False, no_report=True,
         marked=False, min_count={r"\[rank\d\] done 27": 3}),
]

BY_NAME = {c.name: c for c in CASES}


def run_case(case: Case, report_dir: str) -> dict:
    """Run one scenario; returns what happened and the list of failed checks ('problems')."""
    sys.path.insert(0, str(HERE.parent.parent))
    from hpcddp.launch.mpirun import run_mpi
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               HPCDDP_TIMEOUT=str(TIMEOUT), HPCDDP_REPORT_DIR=report_dir)
    for k in ("HPCDDP_DEBUG", "HPCDDP_STALL_POLICY", "HPCDDP_PID_CHECK", "HPCDDP_PEER_TIMEOUT",
              "HPCDDP_AUDIT"):
        env.pop(k, None)
    env.update(case.env)
    t0 = time.time()
    res = run_mpi(case.nprocs, [sys.executable, str(HERE / case.script), *case.args],
                  timeout=HARD_TIMEOUT, env=env, extra=case.extra, cwd=report_dir)
    t_end = time.time()
    out = res.stdout + res.stderr
    reports = sorted(pathlib.Path(report_dir).glob("hpcddp-stall-*.txt"))
    report_text = "".join(p.read_text() for p in reports)
    problems = []
    if res.returncode not in case.rc:
        problems.append(f"exit code {res.returncode}, expected one of {case.rc}")
    for rx in case.expect:
        if not re.search(rx, out):
            problems.append(f"output does not match {rx!r}")
        # the file holds the report itself: not the ranks' own lines nor the policy's tail
        in_file = not rx.startswith(r"\[rank") and "next report" not in rx
        if case.report and in_file and not re.search(rx, report_text):
            problems.append(f"report file does not match {rx!r}")
    for rx, n in case.min_count.items():
        got = len(re.findall(rx, out))
        if got < n:
            problems.append(f"{rx!r} matched {got} times, expected at least {n}")
    if case.report and not reports:
        problems.append("no hpcddp-stall-*.txt report file was written")
    if case.no_report and reports:
        problems.append(f"a stall report was written: {reports[0].name}")
    stall = [float(m) for m in re.findall(r"stall point (\d+\.\d+)", out)]
    after = (t_end - min(stall)) if stall else None
    if case.marked and after is None:
        problems.append("the scenario printed no 'stall point' line")
    if after is not None and after > case.bound:
        problems.append(f"the job ended {after:.1f} s after its stall point "
                        f"(bound {case.bound:g} s)")
    return {"name": case.name, "rc": res.returncode, "wall": t_end - t0, "after_stall": after,
            "problems": problems, "output": out, "report": report_text}
