"""The watchdog: one thread per rank that turns a stalled op into one explained report.

How it works (docs/hangs.md has the long version):

- At init every rank duplicates hpcddp's world into a communicator reserved for diagnostics
  (never the user's, never an op's) and exchanges its PID and host name on it.
- The thread wakes every ``poll`` seconds (a tenth of HPCDDP_TIMEOUT, at most 1 s). A rank is
  *stalled* when one of its threads waits in hpcddp code (an op, a Work, the mismatch check,
  hpcddp's finalize), no op has started or ended on the rank for HPCDDP_TIMEOUT seconds, and
  an op is in flight. A same-host peer whose process has gone is noticed at once (one that
  said it calls MPI_Abort only ABORT_QUIET_S later: the launcher is ending the job).
- A stalled rank tells the coordinator (the lowest rank not known to be dead) with a
  non-blocking send. The coordinator asks every rank for its state (in-flight ops, last ops
  per group, Python stacks) with non-blocking point-to-point messages on the diagnostics
  communicator, waits at most HPCDDP_PEER_TIMEOUT seconds for the answers (the watchdog
  threads answer even while their main threads sit in a blocking MPI call: mpi4py releases
  the GIL there), names the ranks that did not answer as dead or unresponsive, writes the
  report to its stderr and to ``hpcddp-stall-<jobid>.txt`` (unless every rank answered and
  the call that passed its timeout has ended since: a paused job, slow, not stuck), then
  aborts the job (HPCDDP_STALL_POLICY=abort, exit code 3) or warns again after another
  timeout (warn).
- If the coordinator does not ask within HPCDDP_PEER_TIMEOUT (it is dead), the next lowest
  rank takes over.
- Once a second every rank also sends the collectives it recorded since to the coordinator,
  which compares them across ranks after the fact (the audit: diagnostics.audit); the last
  ones at the script's end, before hpcddp's final barrier.
- A rank whose script has ended tells the coordinator, which then asks every rank (after 1 s,
  then at doubling gaps): a rank waiting in a collective that an ended member never called
  waits for ever, so it reports at once instead of after HPCDDP_TIMEOUT (``_look_at_the_end``).
  So does a rank that has waited 2 s in a collective: where ranks wait in different calls as
  the same collective of a group, the coordinator reports at once (``_look_at_long_waits``).

The thread needs MPI_THREAD_MULTIPLE (hpcddp asks for it). With a lower level granted, each
stalled rank reports only its own state (it cannot talk to the others from a thread).
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import signal
import sys
import threading
import time

from hpcddp.comm import output as _log
from hpcddp.comm._mpi import MPI
from hpcddp.comm.failures import is_process_failure
from hpcddp.diagnostics import audit as _audit
from hpcddp.diagnostics import config as _cfg
from hpcddp.diagnostics import network as _network
from hpcddp.diagnostics import recorder as _rec
from hpcddp.diagnostics import report as _report
from hpcddp.diagnostics import state as _state
from hpcddp.launch.env import fault_tolerant_job
from hpcddp.launch.process import pid_state

(TAG_REQ, TAG_STATE, TAG_STALL, TAG_ACK, TAG_AUDIT, TAG_ENDED, TAG_WAITING, TAG_END,
 TAG_ABORTING) = range(11, 20)
# under ULFM the reporter's order to end reaches the others before it ends itself: at most this
# long to wait for its sends to leave (a peer that does not answer is not waited for)
END_SEND_WAIT = 1.0
# a rank about to call MPI_Abort tells the others first (Watchdog.abort_coming): its process
# then goes, and MPI's launcher ends the job. For this long the others take its death for that
# abort, not for a kill to report; a job still running after it gets the report
ABORT_QUIET_S = 5.0
ABORT_SEND_WAIT = 0.2
# a stall raised by a timeout is reported only if its call is still in flight this long after
# every rank has answered (Watchdog._went_on): a paused job resumes on its own
WENT_ON_GRACE = 1.0
AUDIT_EVERY = 1.0          # seconds between two audits of the recorded calls
# once a rank's script has ended, the coordinator looks whether another waits in a collective
# it never called: first this long after, then at doubling gaps up to ENDED_LOOK_MAX
ENDED_LOOK_AFTER, ENDED_LOOK_MAX = 1.0, 16.0
# a rank that has waited this long in a collective tells the coordinator, which looks (at gaps
# doubling up to WAIT_LOOK_MAX) whether ranks wait in different calls as the same collective
WAIT_LOOK_AFTER, WAIT_LOOK_MAX = 2.0, 32.0


def _call_of(d: dict) -> list:
    """One call of a group, as recorder.describe gives it: the same on every rank."""
    return [d.get("group"), d.get("gen"), d.get("seq"), d.get("op")]


class _Look:
    """When the coordinator next asks every rank for one kind of look: due DELAY seconds after
    it is first told, then at gaps doubling from FIRST to MOST; ONCE: each telling buys one
    look (a long wait), else it stays due (ranks whose script has ended)."""

    def __init__(self, delay: float, first: float, most: float, once: bool):
        self.delay, self.gap, self.most, self.once = delay, first, most, once
        self.due, self.next = False, 0.0

    def told(self, now: float) -> None:
        if not self.due:
            self.due, self.next = True, max(self.next, now + self.delay)

    def ready(self, now: float) -> bool:
        if not self.due or now < self.next:
            return False
        self.next, self.gap = now + self.gap, min(2 * self.gap, self.most)
        self.due = not self.once
        return True


class Watchdog:
    def __init__(self, world, settings: _cfg.Settings, host: str, base=None):
        self.world = world                       # hpcddp's WORLD Communicator (for records)
        self.settings = settings
        # collective: every rank of the world runs init (a replacement rank that hpcddp.elastic
        # spawned has an MPI_COMM_WORLD of its own: the world, not COMM_WORLD, is the job)
        self.diag = (world.mpi if base is None else base).Dup()
        # hpcddp.elastic sets it: a dead peer is then ULFM's to handle, not a stall to report
        self.peer_failures_survivable = False
        self.rank = self.diag.Get_rank()
        self.size = self.diag.Get_size()
        self.host = host
        self.pid = os.getpid()
        info = self.diag.allgather((self.pid, host))
        self.pids = [p for p, _ in info]
        self.hosts = [h for _, h in info]
        local = [r for r in range(self.size) if self.hosts[r] == host and r != self.rank]
        # PIDs are only comparable inside one PID namespace: trust them only if every
        # same-host peer's PID is visible now
        self.local_peers = local if settings.pid_check and all(
            pid_state(self.pids[r]) == "alive" for r in local) else []
        self.multiple = MPI.Query_thread() >= MPI.THREAD_MULTIPLE
        self.job = _cfg.job_id() or f"{self.hosts[0]}-{self.pids[0]}"
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._sends: list = []
        self._replies: dict = {}
        self._ids = itertools.count(1)
        self._suspect: set = set()
        self._notice = None
        self._quiet_until = 0.0
        self._tcp_before = None     # TCP counters read when a call had waited 1/4 of the timeout
        self._awaiting = None                    # (coordinator, sent_at) of my last notice
        self._notified_at = -1e30
        self._stopping = False
        self._errors = 0
        self._dead_seen: set = set()
        self._aborting: dict = {}               # rank -> when it said it calls MPI_Abort
        self._exit_reason = None    # report_at_exit's: this rank's script failed, report now
        self.exit_looked = threading.Event()     # ... and the report (if any) is written
        self.exit_stalled = False                # ... where the others wait for this rank
        self.reports = 0
        # the audit (diagnostics.audit): what this rank sent, what the coordinator holds
        self.audit = settings.audit and not settings.detail and self.multiple and self.size > 1
        self._audit_sent: dict = {}
        self._audit_next = 0.0
        self.ledger = _audit.Ledger()
        self._audit_final: set = set()           # ranks whose last calls have arrived
        self._audit_req = None                   # this rank's last calls, on their way (set:
        #                                          the script has ended, no more looks)
        # the coordinator's: ranks whose script has ended, when to look next and the gap after
        self._ended: set = set()
        self._ended_look = _Look(ENDED_LOOK_AFTER, ENDED_LOOK_AFTER, ENDED_LOOK_MAX, once=False)
        # a long wait: the call this rank told the coordinator of; the coordinator's look
        self._waiting_told = None
        self._waits_look = _Look(0.0, WAIT_LOOK_AFTER, WAIT_LOOK_MAX, once=True)
        self.thread = threading.Thread(target=self._run, name="hpcddp-watchdog", daemon=True)

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._stop.set()
        if self.thread.is_alive() and threading.current_thread() is not self.thread:
            self.thread.join(timeout=max(2.0, 2 * self.settings.peer_timeout))
        with self._lock:
            self._drain()
            for r in self._sends:
                try:
                    if not r.Test():
                        r.Cancel()
                        r.Wait()
                except MPI.Exception:
                    pass
            self._sends = []
        try:
            self.diag.Free()
        except MPI.Exception:
            pass

    def report_at_exit(self, reason: str) -> float:
        """This rank's script has ended with an uncaught exception (REASON) while the others
        may wait for it: the watchdog's thread asks every rank and reports the job's state
        now, as for a stall, not after the timeout (the report names what the others wait in
        and, where their flight recorders differ, the culprit), and its policy ends the job.
        This rank shows as in hpcddp's finalize. Returns the seconds that takes at most;
        ``exit_looked`` is set once the report is written or nothing was found to report
        (no rank waits in a call): the caller then ends the job itself."""
        _rec.RECORDER.add([self.world.seq, "finalize", self.world, None, None, None,
                           _rec._now(), 0.0])
        self._exit_reason = reason
        return 2 * self.settings.poll + self.settings.peer_timeout + 1.0

    def script_ended(self) -> None:
        """This rank's script has ended (hpcddp's finalize, before its final barrier): tell
        the coordinator, which looks whether another rank waits in a collective this one
        never called (:meth:`_look_at_the_end`). Not in elastic mode (groups are rebuilt
        under the same names there, their counts start again)."""
        if not self.multiple or self.size < 2 or self.settings.timeout is None \
                or self.peer_failures_survivable:
            return
        self._tell_coordinator(TAG_ENDED)

    def abort_coming(self) -> None:
        """This rank is about to call MPI_Abort (abort.abort_job: an uncaught exception,
        ``hpcddp run``'s failed script, the stall policy): tell the other ranks' watchdogs,
        which would otherwise see its process gone before MPI's launcher ends them, and
        report a rank killed from outside."""
        if self.multiple and self.size > 1:
            self._tell_everyone(TAG_ABORTING, None, ABORT_SEND_WAIT)

    def _tell_everyone(self, tag: int, obj, wait: float) -> None:
        """OBJ to every other rank not known to be dead; waits at most WAIT seconds for the
        sends to leave (a peer that does not answer is not waited for)."""
        sent = []
        for r in range(self.size):
            if r != self.rank and r not in self._suspect:
                try:     # a rank already gone may fail its send (ULFM); the others not
                    sent.append(self.diag.isend(obj, dest=r, tag=tag))
                except MPI.Exception:
                    pass
        deadline = time.monotonic() + wait
        try:
            while not MPI.Request.Testall(sent) and time.monotonic() < deadline:
                time.sleep(0.01)
        except MPI.Exception:
            pass

    def _tell_coordinator(self, tag: int) -> None:
        """TAG (no payload) to the coordinator; the coordinator notes it itself."""
        coord = self._coordinator()
        if coord != self.rank:
            self._send(None, coord, tag)
        elif tag == TAG_ENDED:
            self._note_ended(self.rank)
        else:
            self._waits_look.told(time.monotonic())

    def _note_ended(self, rank: int) -> None:
        with self._lock:
            self._ended.add(rank)
            self._ended_look.told(time.monotonic())

    def set_timeout(self, timeout: float | None) -> None:
        self.settings = dataclasses.replace(self.settings, timeout=timeout,
                                            peer_timeout=_cfg.peer_timeout_for(timeout))

    # -- messages --------------------------------------------------------------------------------
    def _send(self, obj, dest: int, tag: int) -> None:
        with self._lock:
            self._sends = [r for r in self._sends if not r.Test()]
            self._sends.append(self.diag.isend(obj, dest=dest, tag=tag))

    def _drain(self) -> None:
        status = MPI.Status()
        while True:
            msg = self.diag.improbe(MPI.ANY_SOURCE, MPI.ANY_TAG, status)
            if msg is None:
                return
            msg.recv()

    def _serve(self) -> None:
        """Handle every message that has arrived (any thread; one at a time)."""
        if not self.multiple and threading.current_thread() is self.thread:
            return
        with self._lock:
            status = MPI.Status()
            while True:
                msg = self.diag.improbe(MPI.ANY_SOURCE, MPI.ANY_TAG, status)
                if msg is None:
                    return
                obj = msg.recv()
                src, tag = status.Get_source(), status.Get_tag()
                if tag == TAG_REQ:
                    if self._awaiting is not None and self._awaiting[0] == src:
                        self._awaiting = None           # the coordinator is alive and on it
                        self._notified_at = time.monotonic()
                    self._send((obj[0], self._snapshot()), src, TAG_STATE)
                elif tag == TAG_STATE:
                    box = self._replies.get(obj[0])
                    if box is not None:
                        box[src] = obj[1]
                elif tag == TAG_STALL:
                    self._send(None, src, TAG_ACK)     # "alive, and on it"
                    self._suspect.update(r for r in obj.get("suspect", ()) if r != self.rank)
                    if self._notice is None:
                        self._notice = obj
                elif tag == TAG_ACK:
                    if self._awaiting is not None and self._awaiting[0] == src:
                        self._awaiting = None
                elif tag == TAG_ENDED:
                    self._note_ended(src)
                elif tag == TAG_WAITING:
                    self._waits_look.told(time.monotonic())
                elif tag == TAG_AUDIT:
                    final, rows = obj
                    self.ledger.add(src, rows, time.monotonic())
                    if final:
                        self._audit_final.add(src)
                elif tag == TAG_ABORTING:
                    self._aborting[src] = time.monotonic()
                elif tag == TAG_END:
                    self._end_here(f"rank {src}'s stall report ends the job "
                                   f"(HPCDDP_STALL_POLICY=abort): this rank ends, exit code "
                                   f"{_cfg.STALL_EXIT_CODE}")

    def _snapshot(self) -> dict:
        snap = _state.snapshot(self.rank, self.host, self.pid, exclude_thread=self.thread.ident)
        if self._tcp_before is not None:
            snap["tcp"] = _network.since(self._tcp_before, _network.tcp_peers())
        return snap

    def _watch_network(self, now: float) -> None:
        """Read TCP's counters once a call has waited a quarter of the timeout: the stall report
        then counts the segments resent since (see diagnostics.network). Only where the ranks
        span hosts: within one, no rank talks TCP to another, and the `ss` child's SIGCHLD would
        reach torch's DataLoader handler for nothing."""
        if len(set(self.hosts)) < 2:
            return
        timeout = self.settings.timeout
        starts = [e[_rec.T_START] for e in list(_rec.RECORDER.buf)
                  if e is not None and e[_rec.T_END] == 0.0]
        if not timeout or not starts or now - min(starts) < timeout / 4:
            self._tcp_before = None
        elif self._tcp_before is None:
            self._tcp_before = _network.tcp_peers()

    # -- the loop --------------------------------------------------------------------------------
    def _run(self) -> None:
        next_look = 0.0
        while not self._stop.is_set():
            now = _rec.tick()               # the flight recorder's clock (TICK_S resolution)
            if now >= next_look:
                try:
                    self._serve()
                    self._check()
                except Exception as exc:  # the watchdog must never take the job down itself
                    # a lost peer's MPI error (under ULFM) is hpcddp.elastic's to handle, or
                    # the rank's exit's, which names the lost rank: not the watchdog's error
                    quiet = isinstance(exc, MPI.Exception) and (
                        self.peer_failures_survivable or is_process_failure(exc))
                    self._errors += 0 if quiet else 1
                    if not quiet and self._errors <= 3:
                        _log.log(f"hpcddp watchdog: internal error (ignored): "
                                 f"{type(exc).__name__}: {exc}")
                next_look = time.monotonic() + self.settings.poll
            self._stop.wait(_rec.TICK_S)

    def _coordinator(self) -> int:
        for r in range(self.size):
            if r not in self._suspect:
                return r
        return self.rank

    def _dead_local(self, ranks) -> list:
        if self.peer_failures_survivable:
            return []
        return [r for r in ranks if r in self.local_peers and pid_state(self.pids[r]) == "dead"]

    def _killed_local(self, ranks) -> list:
        """The dead of RANKS but one that said it calls MPI_Abort (for ABORT_QUIET_S: MPI's
        launcher is ending the job). Its word left before its process did: the messages are
        read again before a death is trusted."""
        dead = self._dead_local(ranks)
        if dead:
            self._serve()
            now = time.monotonic()
            dead = [r for r in dead if now - self._aborting.get(r, -1e30) > ABORT_QUIET_S]
        return dead

    def local_stall(self, now: float | None = None):
        """(reason, immediate, waits) if this rank is stalled now, else None. WAITS names the
        call that passed its timeout (rank, group, generation, seq, op), None for a death."""
        timeout = self.settings.timeout
        if timeout is None:
            return None
        blocked = _state.blocked_threads(exclude=(self.thread.ident,))
        if not blocked:
            return None
        now = time.monotonic() if now is None else now
        dead = self._killed_local(self.local_peers)
        # in hpcddp's finalize a peer may end an instant before this rank sees the barrier
        # complete (MPI libraries whose MPI_Finalize does not synchronise): a death counts
        # there only when seen twice, a poll apart
        if dead and any(n == "finalize" for n in self._inflight_ops()):
            dead, self._dead_seen = [r for r in dead if r in self._dead_seen], set(dead)
        if dead:
            aborted = [r for r in dead if r in self._aborting]
            return (f"{_report.ranks_word(dead)} died (process gone: "
                    f"{', '.join(f'pid {self.pids[r]}' for r in dead)}) while rank "
                    f"{self.rank} waits for the others" +
                    (f" ({_report.ranks_word(aborted)} called MPI_Abort, and the launcher has "
                     f"not ended the job in {ABORT_QUIET_S:g} s)" if aborted else ""), True, None)
        activity, stuck, overdue, limit = 0.0, None, 0.0, timeout
        for e in list(_rec.RECORDER.buf):
            if e is None:
                continue
            t = e[_rec.T_END] or e[_rec.T_START]
            if t > activity:
                activity = t
            if e[_rec.T_END] == 0.0 and e[_rec.OP] not in _report._SELF_TIMED:
                # a group created with torch's timeout= waits that long, others HPCDDP_TIMEOUT
                own = getattr(e[_rec.GROUP], "timeout", None) or timeout
                if now - e[_rec.T_START] - own >= overdue:
                    stuck, overdue, limit = e, now - e[_rec.T_START] - own, own
        if stuck is None or now - activity < limit:
            return None
        d = _rec.describe(stuck, now)
        source = ("the group's timeout= given to torch" if getattr(stuck[_rec.GROUP], "timeout", None)
                  else "HPCDDP_TIMEOUT")
        return (f"rank {self.rank} has waited {d['age']:.1f} s in {_report.op_name(d)} "
                f"(timeout {limit:g} s: {source})", False,
                {"rank": self.rank, "call": _call_of(d)})

    @staticmethod
    def _inflight_ops() -> list:
        return [e[_rec.OP] for e in list(_rec.RECORDER.buf)
                if e is not None and e[_rec.T_END] == 0.0]

    def _check(self) -> None:
        now = time.monotonic()
        if self._exit_reason is not None:       # report_at_exit: this rank reports, once
            if not self.exit_looked.is_set():
                if self.multiple:
                    self.exit_stalled = self._report(self._exit_reason, now)
                else:
                    self._report_local(self._exit_reason)
                    self.exit_stalled = True
                self.exit_looked.set()
            return
        self._watch_network(now)
        if self.audit and now >= self._audit_next:
            self._audit_next = now + AUDIT_EVERY
            self._audit_look(now)
        if self._ended_look.ready(now) and len(self._ended) < self.size:
            self._look_at_the_end(now)
        if self._early_looks():
            self._tell_of_a_long_wait(now)
            if self._waits_look.ready(now):
                self._look_at_long_waits(now)
        local = self.local_stall(now)
        with self._lock:
            notice, self._notice = self._notice, None
        if not self.multiple:
            if local is not None and now >= self._quiet_until:
                self._report_local(local[0])
            return
        # a notice I sent went unanswered: its coordinator is dead, go to the next one
        if self._awaiting is not None:
            coord, sent = self._awaiting
            if now - sent > self.settings.peer_timeout or self._dead_local([coord]):
                self._suspect.add(coord)
                self._awaiting = None
                self._notified_at = -1e30
        if local is None and notice is None:
            return
        coord = self._coordinator()
        if coord == self.rank:
            if now < self._quiet_until and not (local and local[1]):
                return
            if local is not None:
                self._report(local[0], now, local[2])
            else:
                self._report(notice.get("reason", "?"), now, notice.get("waits"))
        elif local is not None and self._awaiting is None:
            again = max(self.settings.timeout or 0.0, 3 * self.settings.peer_timeout)
            if now - self._notified_at < again and not local[1]:
                return
            self._awaiting = (coord, now)
            self._notified_at = now
            self._send({"reason": local[0], "waits": local[2], "suspect": sorted(self._suspect)},
                       coord, TAG_STALL)

    # -- the audit (diagnostics.audit) -----------------------------------------------------------
    def _audit_on(self) -> bool:
        # in elastic mode groups are rebuilt under the same names as ranks come and go
        return self.audit and not self.peer_failures_survivable

    def _audit_look(self, now: float) -> None:
        """Send the calls recorded since the last look to the coordinator (or keep them, as
        the coordinator), and report what the ledger found."""
        if not self._audit_on():
            return
        coord = self._coordinator()
        with self._lock:        # one look at a time: audit_at_exit's message must come last
            if self._audit_req is not None:
                return                          # this rank's script has ended: sent already
            rows = _audit.collect(self._audit_sent, _audit.rows_per_look(self.size))
            if coord != self.rank:
                if rows:
                    self._send((False, rows), coord, TAG_AUDIT)
                return
            self.ledger.add(self.rank, rows, now)
            self.ledger.prune(now)
            found = self.ledger.take(now)
        if found:
            self._report_audit(found)

    def audit_at_exit(self) -> None:
        """This rank's script has ended: the calls not yet sent go to rank 0 (every rank, before
        hpcddp's final barrier); see :meth:`audit_after_barrier`."""
        if not self._audit_on():
            return
        with self._lock:        # after any look's message (MPI keeps their order)
            rows = _audit.collect(self._audit_sent, limit=_rec.RECORDER.capacity)
            if self.rank == 0:
                self.ledger.add(0, rows, time.monotonic())
                self._audit_req = True
            else:
                self._audit_req = self.diag.isend((True, rows), dest=0, tag=TAG_AUDIT)

    def audit_after_barrier(self) -> None:
        """Once every rank has passed hpcddp's final barrier (so each has sent its last
        calls): rank 0 compares them and reports what differs (the policy acts); the others
        see their message received (stop() would cancel it)."""
        if not self._audit_on():
            return
        deadline = time.monotonic() + self.settings.peer_timeout
        if self.rank != 0:
            req = self._audit_req
            while req is not None and not req.Test() and time.monotonic() < deadline:
                time.sleep(0.002)
            return
        while len(self._audit_final) < self.size - 1 and time.monotonic() < deadline:
            self._serve()
            time.sleep(0.002)
        with self._lock:
            found = self.ledger.take(time.monotonic(), final=True)
        if found:
            self._report_audit(found)

    def _report_audit(self, found: list) -> None:
        more = f" (and {len(found) - 3} more)" if len(found) > 3 else ""
        lines = "\n".join(f"  {t}" for t in found[:3])
        text = (f"hpcddp audit (job {self.job}, rank {self.rank} compared the calls every rank "
                f"recorded): ranks disagreed on a collective that has run; its results are "
                f"wrong on every rank of the group{more}:\n{lines}\n"
                f"Every rank of a group must call the same collectives in the same order, with "
                f"the same element count, dtype and root. Run with HPCDDP_DEBUG=detail to stop "
                f"at the first such call, before it runs, with each rank's traceback "
                f"(HPCDDP_AUDIT=0 turns the audit off).")
        self._emit(text, kind="audit")

    # -- a rank whose script has ended -----------------------------------------------------------
    def _look_at_the_end(self, now: float) -> None:
        """Some ranks' scripts have ended (:meth:`script_ended`): ask every rank, and where one
        waits in a collective that an ended member never called (it can only end now), report
        at once: that wait has no end, and HPCDDP_TIMEOUT (600 s by default) would pass
        first. Likewise a rank that waits only in sends and receives whose peers have all
        ended with nothing towards it in flight (:meth:`_p2p_stuck`). Ranks waiting in a
        call the ended ones made (a broadcast's root ends first) or computing are not
        reported."""
        def found(snaps):
            op, ended = _report.ended_without(snaps, self.size)
            if ended:
                return (f"{_report.ranks_word(ended)} ended without calling "
                        f"{_report.op_text(op)}, which other ranks wait in")
            return self._p2p_stuck(snaps)
        self._ask_and_report(now, found)

    def _p2p_stuck(self, snaps: dict) -> str | None:
        """Why a rank's sends and receives can never end (report.p2p_stuck), or None: their
        peers ended without the other half, or wait themselves (a point-to-point deadlock)."""
        stuck = _report.p2p_stuck(snaps, self.size)
        for rank, (op, peers) in stuck.items():
            if all(snaps[p].get("finalizing") for p in peers):
                return (f"{_report.ranks_word(peers)} ended without a "
                        f"{'send' if op['op'] == 'recv' else 'receive'} that rank {rank}'s "
                        f"{_report.op_text(op)} waits for")
        if stuck:
            return ("a point-to-point deadlock: " + "; ".join(
                f"rank {rank} waits in {_report.op_text(op)}" for rank, (op, _) in stuck.items())
                + ": each for a rank that itself waits or has ended, so none can go on")
        return None

    def _ask_and_report(self, now: float, found) -> None:
        """Ask every rank; where FOUND(snapshots) gives a reason, report with it now."""
        if now < self._quiet_until:
            return
        snaps, gone = self.query(list(range(self.size)), self.settings.peer_timeout)
        reason = None if self._stopping else found(snaps)
        if reason:
            self._report_from(snaps, gone, reason)

    # -- ranks waiting in different calls ------------------------------------------------------
    def _early_looks(self) -> bool:
        timeout = self.settings.timeout
        return self.multiple and self.size > 1 and not self.peer_failures_survivable \
            and timeout is not None and timeout > 2 * WAIT_LOOK_AFTER

    def _tell_of_a_long_wait(self, now: float) -> None:
        """Where this rank waits and its latest call in flight (a collective, a send or a
        receive) is WAIT_LOOK_AFTER seconds old, tell the coordinator (once per call; the
        latest, since an isend never waited for stays in flight while the rank goes on)."""
        latest = None
        for e in list(_rec.RECORDER.buf):
            if e is not None and e[_rec.T_END] == 0.0 \
                    and e[_rec.OP] not in _report._SELF_TIMED and e[_rec.OP] != "finalize" \
                    and now - e[_rec.T_START] >= WAIT_LOOK_AFTER \
                    and (latest is None or e[_rec.T_START] > latest[_rec.T_START]):
                latest = e
        if latest is None or latest is self._waiting_told \
                or not _state.blocked_threads(exclude=(self.thread.ident,)):
            return
        self._waiting_told = latest
        self._tell_coordinator(TAG_WAITING)

    def _look_at_long_waits(self, now: float) -> None:
        """A rank has waited WAIT_LOOK_AFTER seconds in a call: ask every rank, and where
        ranks have waited that long in calls that differ as the same collective of a group
        (audit.differ_in_flight: another op, element count, dtype or root), or in sends and
        receives no rank can match any more (:meth:`_p2p_stuck`), report at once rather than
        after HPCDDP_TIMEOUT: that wait has no good end."""
        def found(snaps):
            differ = _audit.differ_in_flight(snaps, WAIT_LOOK_AFTER)
            if differ:
                return (f"ranks have waited {WAIT_LOOK_AFTER:g} s or more in different calls "
                        f"as #{differ[0][3]} on {differ[0][0]}")
            return self._p2p_stuck(snaps)
        self._ask_and_report(now, found)

    # -- gathering and reporting -------------------------------------------------------------------
    def query(self, ranks, wait: float) -> tuple:
        """Ask RANKS for their state: ({rank: snapshot}, {rank: what is known if no answer})."""
        qid = (self.rank, next(self._ids))
        with self._lock:
            box = self._replies[qid] = {}
        for r in ranks:
            if r != self.rank:
                self._send((qid,), r, TAG_REQ)
        t_start = time.monotonic()
        deadline = t_start + wait
        while True:
            _rec.tick()
            self._serve()
            missing = [r for r in ranks if r not in box and r != self.rank]
            # a rank whose script has ended (stop) does not wait for answers: seen, its exit
            # held up for the rest of HPCDDP_PEER_TIMEOUT by a query the others left unanswered
            if not missing or time.monotonic() >= deadline or self._stopping:
                break
            # don't wait for ranks that cannot answer: same-host processes that are gone, and
            # ranks that already let a notice go unacknowledged for HPCDDP_PEER_TIMEOUT
            if not self._stopping and set(missing) <= set(self._dead_local(missing)) | (
                    self._suspect if time.monotonic() - t_start > 0.5 else set()):
                break
            time.sleep(0.01)
        waited = wait - max(0.0, deadline - time.monotonic())
        with self._lock:
            self._replies.pop(qid, None)
        if self.rank in ranks:      # this rank's own state last: as of the others' answers
            box[self.rank] = self._snapshot()
        gone = {}
        for r in ranks:
            if r not in box:
                same = r in self.local_peers
                # a suspect already had HPCDDP_PEER_TIMEOUT to acknowledge a notice
                w = max(waited, self.settings.peer_timeout) if r in self._suspect else waited
                gone[r] = {"host": self.hosts[r], "pid": self.pids[r], "waited": w,
                           "pid_state": pid_state(self.pids[r]) if same else "unknown"}
        return dict(box), gone

    def _report(self, reason: str, now: float, waits: dict | None = None) -> bool:
        """Ask every rank, and report where the job is stuck (then the policy acts). Returns
        whether it was. WAITS: the call whose timeout raised it (local_stall), if any."""
        snaps, gone = self.query(list(range(self.size)), self.settings.peer_timeout)
        if waits is not None and not gone and self._went_on(snaps, waits):
            # the machine paused the job (a VM descheduled, swapping, a rank stopped and
            # resumed), not a stall: every rank answered and the call has ended since. Ending
            # the job here would end a healthy one; a call that stays stuck is noticed again
            _log.log(f"hpcddp watchdog: {reason}, but it has gone on since: slow, not stuck "
                     f"(no report; raise the timeout if this recurs)")
            return False
        if self._stopping:
            return False
        return self._report_from(snaps, gone, reason)

    def _went_on(self, snaps: dict, waits: dict) -> bool:
        """Whether the call WAITS names has ended on its rank, by SNAPS; where every member of
        its group is in it (it can complete: ranks resumed together answer before their
        calls end), by that rank's answer WENT_ON_GRACE later. A member elsewhere (late, in
        Python) is a stall now. A script that reached its end meanwhile went on."""
        call = list(waits["call"])

        def entry(snap):
            return next((d for d in (snap or {}).get("inflight", ()) if _call_of(d) == call),
                        None)
        if self._stopping:
            return True
        snap = snaps.get(waits["rank"])
        mine = entry(snap)
        if snap and mine is None:
            return True
        members = (mine or {}).get("ranks") or ()
        if mine is None or mine["op"] in _rec.P2P_OPS or not members \
                or any(entry(snaps.get(m)) is None for m in members):
            return False
        self._stop.wait(WENT_ON_GRACE)
        if self._stopping:
            return True
        again, _ = self.query([waits["rank"]], self.settings.peer_timeout)
        return self._stopping or (waits["rank"] in again and entry(again[waits["rank"]]) is None)

    def _report_from(self, snaps: dict, gone: dict, reason: str) -> bool:
        """Report the job's state from the answers SNAPS (GONE: ranks that gave none)."""
        self._suspect.update(gone)
        analysis = _report.analyse(snaps, gone, self.size)
        if not analysis["stall"]:
            # e.g. ranks wait in finalize for one still running Python: slow, not stuck
            self._quiet_until = time.monotonic() + (self.settings.timeout or 0.0)
            return False
        text = _report.render(snaps, gone, self.size, timeout=self.settings.timeout or 0.0,
                              policy=self.settings.policy, job=self.job, reporter=self.rank,
                              reason=reason, analysis=analysis)
        self._emit(text, lose=self._losable(gone))
        return True

    def _losable(self, gone) -> list:
        """The ranks to end as lost instead of ending the job: in elastic mode, where every
        rank that did not answer is alive on this host (stopped, swapping: what ULFM's
        detector would take for lost across nodes), SIGKILL makes them lost ranks, which
        hpcddp.elastic survives. Else none (the policy ends the job)."""
        if not (self.peer_failures_survivable and self.settings.policy == "abort" and gone):
            return []
        if all(r in self.local_peers and pid_state(self.pids[r]) == "alive" for r in gone):
            return sorted(gone)
        return []

    def _end_job(self) -> None:
        """The stall policy's abort. MPI_Abort ends every rank, except under ULFM (``mpirun
        --with-ft ulfm``), where Open MPI 5 ends the caller only: seen, the other ranks waited
        on until their own timeout, and a rank that did not answer (stopped) stayed. There the
        reporter tells every rank to end, SIGKILLs the ranks of its own host that did not answer
        (it knows their PIDs), and ends; each rank's exit code 3 makes mpirun's non-zero."""
        if not fault_tolerant_job():
            from hpcddp.diagnostics.abort import abort_job
            abort_job(_cfg.STALL_EXIT_CODE)
        if self.multiple:
            self._tell_everyone(TAG_END, self.rank, END_SEND_WAIT)
        silent = [r for r in sorted(self._suspect & set(self.local_peers))
                  if pid_state(self.pids[r]) == "alive"]
        if silent:
            _log.log(f"hpcddp: ending {self._kill(silent)} on {self.host}, which did not "
                     f"answer: under ULFM nothing else would")
        self._end_here(None)

    def _kill(self, ranks) -> str:
        """SIGKILL the processes of RANKS (ranks of this host); returns 'rank 1 (pid N), ...'."""
        for r in ranks:
            os.kill(self.pids[r], signal.SIGKILL)
        return ", ".join(f"rank {r} (pid {self.pids[r]})" for r in ranks)

    @staticmethod
    def _end_here(why) -> None:
        if why:
            _log.log(why)
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except Exception:
            pass
        os._exit(_cfg.STALL_EXIT_CODE)

    def _report_local(self, reason: str) -> None:
        snap = self._snapshot()
        text = _report.render({self.rank: snap}, {}, self.size,
                              timeout=self.settings.timeout or 0.0, policy=self.settings.policy,
                              job=self.job, reporter=self.rank,
                              reason=reason + " (MPI gave less than MPI_THREAD_MULTIPLE: this "
                              "rank cannot ask the others, so it reports only itself)",
                              local_only=True)
        self._emit(text, suffix=f".rank{self.rank}")

    def _emit(self, text: str, suffix: str = "", kind: str = "stall", lose=()) -> None:
        self.reports += 1
        path = os.path.join(self.settings.report_dir, f"hpcddp-stall-{self.job}{suffix}.txt")
        try:
            # O_NOFOLLOW: the report directory may be shared; a planted symlink is refused
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o644)
            with os.fdopen(fd, "a") as f:
                f.write(text + "\n")
            where = f"the report is also in {path}"
        except OSError as exc:
            where = f"could not write {path}: {exc}"
        abort = self.settings.policy == "abort"
        lost = ", ".join(f"rank {r} (pid {self.pids[r]})" for r in lose)
        tail = (f"{where}\nelastic: ending {lost}, which did not answer, as lost ranks: the "
                f"job goes on without them (HPCDDP_STALL_POLICY=abort)" if lose else
                f"{where}\naborting the job (HPCDDP_STALL_POLICY=abort; exit code "
                f"{_cfg.STALL_EXIT_CODE})" if abort else
                f"{where}\ngoing on (HPCDDP_STALL_POLICY=warn)" if kind == "audit" else
                f"{where}\nwaiting on (HPCDDP_STALL_POLICY=warn): next report in "
                f"{self.settings.timeout:g} s if still stuck")
        try:
            sys.stdout.flush()
        except Exception:
            pass
        _log.log(text.rstrip("\n") + "\n" + tail)
        if lose and not self._stopping:
            self._kill(lose)
        elif abort and not self._stopping:
            self._end_job()
        if kind == "stall":
            self._quiet_until = time.monotonic() + (self.settings.timeout or 0.0)
