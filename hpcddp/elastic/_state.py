"""State: the training loop's elastic wrapper (model, optimizer, sampler, step counter).

A step either completes on the survivors or is retried; see docs/elastic.md for the whole
story. The parts:

- ``with state.step():`` runs one training step. An exception that is an MPI process failure
  (error class MPI_ERR_PROC_FAILED, _PENDING or MPI_ERR_REVOKED, however torch wrapped it,
  or any exception while this rank's world knows of a failed process) is swallowed and the
  step marked failed; any other exception propagates as usual.
- A step is *committed* when its ``optimizer.step()`` has run (a post-hook notices) or the
  block ended without error: from then on its samples count as trained.
- ``for batch in state.batches(loader)`` notices the failed step and recovers before handing
  out the next batch: revoke the world (every survivor still waiting in an MPI call returns
  MPI_ERR_REVOKED), shrink it to the survivors, agree on the furthest committed position
  (max over survivors), broadcast model, optimizer and scheduler state from the lowest
  survivor that holds it, rebuild hpcddp's world, topology and watchdog, the torch default
  group (new store on the new rank 0) and DDP, deal the rest of the epoch over the survivors,
  and go on. A second failure during recovery starts it again on the smaller world.
- The epoch ends with ``MPI_Comm_agree`` (fault tolerant, the same outcome on every survivor),
  so no survivor leaves an epoch while another retries its last step.
"""
from __future__ import annotations

import contextlib
import os
import socket
import time

import torch
import torch.distributed as dist

from hpcddp.diagnostics.abort import CUT_READ_ERRORS, WORKER_EXIT_WAIT_S
from hpcddp.elastic import _inject
from hpcddp.elastic._sampler import ElasticBatchSampler
from hpcddp.elastic._support import check_support
from hpcddp.launch.mpirun import (MINORITY_STOPS_LINE, NO_SLOT_LINE, RECOVERY_STUCK_LINE,
                                  REPLACEMENT_LINE, SURVIVOR_LEFT_LINE)


def _mpi():
    from hpcddp.comm._mpi import MPI
    return MPI


# hpcddp.comm.failures, imported when called: importing hpcddp.comm starts MPI, and
# importing hpcddp.elastic must not (a DataLoader worker, `hpcddp --help`)
def is_process_failure(exc: BaseException, comm=None) -> bool:
    """Whether EXC comes from a lost process (ULFM error classes), looking through torch's
    wrappers; with COMM, also whether COMM is revoked or knows a failed process."""
    from hpcddp.comm import failures
    return failures.is_process_failure(exc, comm)


def failed_world_ranks(comm) -> list[int]:
    from hpcddp.comm import failures
    return failures.failed_world_ranks(comm)


def is_replacement() -> bool:
    """Whether this process replaces a lost rank: spawned (``State(regrow=True)``; it runs
    the job's script from the top) or a spare process (HPCDDP_ELASTIC_SPARES; it goes on
    from its ``hpcddp.init``). It joins the survivors inside ``elastic.State``: until then it
    makes no collective call but ``init_process_group``, and skips work done once per job
    (staging, downloads, clearing old checkpoints)."""
    from hpcddp.comm import startup
    return startup.runtime().joined is not None


# torch's DataLoader says so when one of its worker processes died (killed from outside: the
# OOM killer picks the largest process, often a worker)
LOADER_WORKER_DIED = ("DataLoader worker (pid", "exited unexpectedly", "is killed by signal")


def is_loader_worker_death(exc: BaseException) -> bool:
    text = str(exc)
    return isinstance(exc, RuntimeError) and LOADER_WORKER_DIED[0] in text and any(
        m in text for m in LOADER_WORKER_DIED[1:])


def dead_loader_workers(it, exc: BaseException | None = None) -> list[int]:
    """PIDs of a DataLoader iterator's worker processes that have died. A worker killed while
    the rank reads its batch shows up as whatever that read raised (an EOFError or a
    ConnectionResetError from torch's file-descriptor sharing), not always as torch's "worker
    exited" error; after such an EXC, waits up to WORKER_EXIT_WAIT_S for the worker's exit."""
    workers = getattr(it, "_workers", None) or ()
    wait = WORKER_EXIT_WAIT_S if workers and isinstance(exc, CUT_READ_ERRORS) else 0
    deadline = time.monotonic() + wait
    while True:
        try:
            dead = []
            for w in workers:
                try:
                    if not w.is_alive() and w.exitcode not in (None, 0):
                        dead.append(w.pid)
                except (AssertionError, ValueError):   # not our child, or closed
                    pass
            if dead or time.monotonic() >= deadline:
                return dead
            time.sleep(0.01)
        except RuntimeError as died:
            # torch's SIGCHLD handler saw the exit first and raised here: look again
            if not is_loader_worker_death(died):
                raise


def leave(why: str) -> None:
    """End this rank as a lost rank (SIGKILL), after one line saying why: the survivors
    recover as from any lost rank. Used when this rank cannot go on but the job can."""
    import os
    import signal

    from hpcddp.comm import output as _log
    _log.log(f"elastic: {why}: this rank leaves the job (SIGKILL), the others go on without it")
    _flush_output()
    time.sleep(0.2)              # the launcher forwards the line before the process goes
    os.kill(os.getpid(), signal.SIGKILL)


class Recovery:
    """What one recovery did (``State.recoveries`` keeps them, in order)."""

    def __init__(self, **kw):
        self.__dict__.update(kw)

    def __repr__(self) -> str:
        return f"Recovery({self.__dict__})"


class State:
    """Elastic training state. Build it on every rank after ``hpcddp.init_process_group()``.

    Args:
        module: the model (not wrapped: State wraps it in DDP and rewraps after a failure;
            use ``state.model`` for the forward pass).
        optimizer: over ``module``'s parameters.
        batch_sampler: an :class:`ElasticBatchSampler` (the DataLoader's ``batch_sampler``).
        scheduler: optional LR scheduler, recovered with the optimizer.
        ddp_kwargs: passed to ``DistributedDataParallel`` each time it is built.
        on_recovery: callables run on every survivor after a recovery, with the State (e.g.
            to rebuild your own subgroups; ``state.groups`` has the topology groups).
        topology_groups: build ``hpcddp.topology_groups()`` now and after each recovery.
        verbose: the new rank 0 prints one line per recovery.
        fault_injection: ``"RANK@STEP[:PHASE],..."``: ranks that SIGKILL themselves (tests,
            demos; hpcddp.elastic._inject). Default: HPCDDP_ELASTIC_KILL.
        regrow: after a loss, spawn a replacement for each lost rank and go on at full size
            (docs/elastic.md, "Growing back"); where the launcher has no free slot the job goes
            on smaller. Where the job was started with spare processes
            (HPCDDP_ELASTIC_SPARES), a spare takes the lost rank's place at once, nothing is
            spawned, and regrow is on unless False is given. Default: HPCDDP_ELASTIC_REGROW
            (off). A replacement (spawned, or a spare returning from ``hpcddp.init``) runs
            the job's script on from ``init`` and joins the survivors in this constructor:
            before it, a regrowing script makes no collective call but
            ``init_process_group``.
    """

    def __init__(self, module: torch.nn.Module, optimizer, batch_sampler: ElasticBatchSampler,
                 *, scheduler=None, ddp_kwargs: dict | None = None, on_recovery=(),
                 topology_groups: bool = False, verbose: bool = True,
                 fault_injection: str | None = None, regrow: bool | None = None):
        if not isinstance(batch_sampler, ElasticBatchSampler):
            raise TypeError(f"State: batch_sampler must be an hpcddp.elastic.ElasticBatchSampler, "
                            f"got {type(batch_sampler).__name__}")
        if not dist.is_initialized():
            raise RuntimeError("State: call hpcddp.init_process_group() first")
        check_support()
        from hpcddp import settings
        from hpcddp.comm import startup
        self._rt = startup.runtime()
        from hpcddp.comm import spares
        # spares given (HPCDDP_ELASTIC_SPARES) are there to be used: regrow unless told not to
        self.regrow = (settings.get().elastic_regrow or spares.started_with_spares()
                       if regrow is None else bool(regrow))
        self.module, self.optimizer, self.scheduler = module, optimizer, scheduler
        self.sampler = batch_sampler
        self.ddp_kwargs = dict(ddp_kwargs or {})
        self.on_recovery = list(on_recovery)
        self.verbose = verbose
        self.want_groups = topology_groups
        self.groups: dict = {}
        self.epoch = 0
        self.pos = 0                      # committed position in the epoch's order
        self.global_step = 0              # committed steps over the whole run
        self.recoveries: list[Recovery] = []
        self.generation = 0               # recoveries this world went through (all ranks agree)
        self.trained: list[tuple[int, int, list[int]]] = []  # (epoch, global step, indices)
        self.record_indices = False
        self.original_rank = self.world.world_ranks[self.world.rank]
        self._failed = None
        self._stepped = False
        self._chunk = None
        self._failed_at = None
        self._first_step_after = None
        joined = self._rt.joined
        self.replacement = joined is not None    # spawned for a lost rank (hpcddp.comm.spawn)
        self._job_ranks = set(joined["job_ranks"] if joined else self.world.world_ranks)
        self._hosts = {}          # start-up rank -> host: which losses could be a cut link
        if joined is not None:    # the survivors' recovery goes on from their restore
            self._hosts.update(joined["hosts"])
            self.generation = joined["generation"]
            self._restore(self.world.world_ranks.index(joined["source"]))
        if fault_injection is None:
            fault_injection = settings.get().elastic_kill
        # a replacement skips the kills up to the step it joined in (its predecessor's)
        self._kills = [k for k in _inject.parse(fault_injection) if k[0] == self.original_rank
                       and (joined is None or k[1] > self.global_step)]
        optimizer.register_step_pre_hook(lambda *a: self._maybe_die("optimizer"))
        optimizer.register_step_post_hook(self._on_optimizer_step)
        if any(p == "forward" for _, _, p in self._kills):
            module.register_forward_pre_hook(lambda *a: self._maybe_die("forward"))
        _watchdog_survives_peers()
        _explain_losses_outside_steps(self)
        self.model = None
        try:
            self._gather_hosts()
            self.model = self._wrap()
        except Exception as exc:
            # a rank lost while the job starts (before: every survivor ended on the uncaught
            # MPI error, and mpirun under ULFM exited 0): recover as from a failed step
            if joined is not None or not is_process_failure(exc, self.world.mpi):
                raise
            self.recover(exc)         # (it builds the topology groups: a replacement builds
            topology_groups = False   # them once, in its constructor)
        if topology_groups:
            from hpcddp.backend import topology_groups as tg
            self.groups = tg()
        if joined is not None:
            self._joined(joined)
        elif self.rank == 0 and self.verbose:
            _warn_of_spawns_across_nodes(self)

    # -- what the loop sees ------------------------------------------------------------------
    @property
    def world(self):
        """hpcddp's world Communicator now (smaller after a recovery)."""
        return self._rt.world

    @property
    def rank(self) -> int:
        return self.world.rank

    @property
    def size(self) -> int:
        return self.world.size

    def epochs(self, num_epochs: int):
        """Yield epoch numbers from the current one to NUM_EPOCHS - 1, setting the sampler."""
        while self.epoch < num_epochs:
            self.sampler.set_epoch(self.epoch)
            self.sampler.repartition(self.size, self.rank, self.pos)
            yield self.epoch
            self.epoch += 1
            self.pos = 0

    def batches(self, loader):
        """Yield LOADER's batches for the rest of this epoch; after a failed step, recover and
        go on with the re-dealt rest of the epoch. The loader's batch_sampler must be this
        State's sampler."""
        if getattr(loader, "batch_sampler", None) is not self.sampler:
            raise ValueError("State.batches: the loader's batch_sampler is not this State's "
                             "ElasticBatchSampler (DataLoader(ds, batch_sampler=state.sampler))")
        while True:
            if self.pos >= self.sampler.epoch_samples:
                if self._epoch_agreed():
                    return
                continue
            self.sampler.start = self.pos    # where the loader's next pass begins
            chunks = self.sampler.chunks(self.pos)
            it = iter(loader)
            for chunk in chunks:
                self._chunk = chunk
                self._maybe_die("data")
                try:
                    batch = next(it)
                except Exception as exc:
                    dead = dead_loader_workers(it, exc)
                    if is_loader_worker_death(exc) or dead:
                        # its half-read batch is gone, and a new iterator would not start
                        # where the others are: leaving keeps every rank in the same step
                        leave(str(exc) if is_loader_worker_death(exc) else
                              f"DataLoader worker (pid(s) {', '.join(map(str, dead))}) exited "
                              f"unexpectedly ({type(exc).__name__} while its batch was read)")
                    raise
                self._failed, self._stepped = None, False
                yield batch
                if self._failed is not None:
                    break
            else:
                next(it, None)     # the loader's end of pass: its workers stop (or rest)
            if self._failed is not None:
                # end the abandoned pass's worker processes now: workers forked later would
                # inherit the iterator and trip over it when they collect it
                shutdown = getattr(it, "_shutdown_workers", None)
                if shutdown is not None and not getattr(loader, "persistent_workers", False):
                    shutdown()
                it = None
                self.recover(self._failed)

    @contextlib.contextmanager
    def step(self):
        """One training step: a process failure inside is caught and the step retried."""
        try:
            yield self
        except BaseException as exc:
            if is_loader_worker_death(exc):    # torch raises it from its SIGCHLD handler
                leave(str(exc))
            if not isinstance(exc, Exception) or not is_process_failure(exc, self.world.mpi):
                raise
            # the traceback would keep the loop's frames (and its loader iterator) alive
            self._failed = exc.with_traceback(None)
            if self._failed_at is None:
                self._failed_at = time.time()
            if self._stepped:
                self._commit()        # the update of the full world's gradient was applied
            return
        self._commit()

    # -- commits ----------------------------------------------------------------------------------
    def _on_optimizer_step(self, *args):
        self._stepped = True

    def _commit(self) -> None:
        if self._chunk is None:
            return
        if self.record_indices:
            self.trained.append((self.epoch, self.global_step, self.sampler.local(self._chunk)))
        self.pos = self._chunk[1]
        self._chunk = None
        self.global_step += 1
        if self._first_step_after is not None and self._failed is None:
            rec = self.recoveries[-1]
            rec.first_step_at = time.time()
            kill = _inject.kill_times()
            t_kill = min((kill[r] for r in rec.lost if r in kill), default=None)
            rec.kill_to_step_s = None if t_kill is None else rec.first_step_at - t_kill
            rec.detect_to_step_s = rec.first_step_at - rec.detected_at
            self._first_step_after = None
            if self.verbose and self.reporting:
                from hpcddp.comm import output as _log
                extra = "" if rec.kill_to_step_s is None else \
                    f"; kill -> first completed step {rec.kill_to_step_s:.3f} s"
                _log.log(f"elastic: first step after the recovery completed (step "
                         f"{self.global_step - 1}){extra}")

    def _maybe_die(self, phase: str) -> None:
        for r, s, p in self._kills:
            if p == phase and s == self.global_step:
                _inject.die(r, s, p)

    # -- recovery ---------------------------------------------------------------------------------
    def _epoch_agreed(self) -> bool:
        """MPI_Comm_agree at the end of an epoch; False (after recovering) if a rank was lost."""
        MPI = _mpi()
        try:
            self.world.mpi.Agree(1)
            return True
        except MPI.Exception as exc:
            if not is_process_failure(exc, self.world.mpi):
                raise
            if self._failed_at is None:
                self._failed_at = time.time()
            self.recover(exc)
            # the epoch ends with an agreement of the new world (replacements included)
            return False

    def recover(self, cause: BaseException | None = None) -> Recovery:
        """Revoke, shrink, agree, restore, rebuild (every survivor calls it)."""
        detected = self._failed_at or time.time()
        t0 = time.perf_counter()
        hosts_before = dict(self._hosts)      # a replacement may take a lost rank elsewhere
        comm = self.world.mpi
        old_model, self.model = self.model, None
        _unhook(old_model)
        del old_model
        phases = {}
        mark = [time.perf_counter()]

        def lap(name):
            now = time.perf_counter()
            phases[name] = phases.get(name, 0.0) + now - mark[0]
            mark[0] = now
        lost, src, replaced, no_slot = self._shrink_and_rebuild(comm, lap)
        redealt = len(self.sampler.chunks(self.pos))
        self.sampler.repartition(self.size, self.rank, self.pos)
        self.model = self._wrap()
        lap("ddp")
        if self.want_groups:
            from hpcddp.backend import topology_groups as tg
            self.groups = tg()
        for fn in self.on_recovery:
            fn(self)
        lap("groups_callbacks")
        seconds = time.perf_counter() - t0
        full = set(self.world.world_ranks) == self._job_ranks
        kill = _inject.kill_times()
        t_kill = min((kill[r] for r in lost if r in kill), default=None)
        rec = Recovery(lost=lost, world_size=self.size, step=self.global_step, epoch=self.epoch,
                       position=self.pos, steps_redealt=redealt, source_rank=src,
                       seconds=seconds, phases=phases, detected_at=detected,
                       cause=repr(cause)[:200], replaced=replaced, no_slot=no_slot,
                       from_spares=bool(replaced) and _started_with_spares(),
                       detect_to_full_size_s=(time.time() - detected if full and replaced
                                              else None),
                       kill_to_full_size_s=(time.time() - t_kill if full and replaced
                                            and t_kill is not None else None),
                       first_step_at=None, kill_to_step_s=None, detect_to_step_s=None)
        self.recoveries.append(rec)
        self.generation += 1
        _exit_without_finalize()
        from hpcddp.comm import startup
        startup.note_recovery()
        self._failed, self._failed_at, self._stepped = None, None, False
        self._first_step_after = rec
        if self.verbose and self.reporting:
            self._report_recovery(rec, hosts_before)
        return rec

    def _shrink_and_rebuild(self, comm, lap):
        """Revoke and shrink COMM (again while ranks are lost during it), stop on the minority
        side, agree on the furthest position, grow back where asked, rebuild and restore.
        -> (lost start-up ranks, sorted; the rank whose state was restored; the replacements
        placed; why no slot was found, or None)."""
        MPI = _mpi()
        from hpcddp.comm.communicator import translate_to_world
        old_ranks = set(self.world.world_ranks)
        lost: set = set()
        replaced, spawn_tries, no_slot = [], 0, None
        while True:
            for c in _comms_to_revoke(self._rt):
                try:
                    c.Revoke()
                except MPI.Exception:
                    pass
            with _stuck_after(SHRINK_LIMIT_S, "ULFM's shrink"):
                new = comm.Shrink()
            new.Set_errhandler(MPI.ERRORS_RETURN)
            lap("revoke_shrink")
            shrunk = set(translate_to_world(new))
            lost |= set(translate_to_world(comm)) - shrunk
            if not holds_majority(old_ranks, shrunk, self._hosts):
                _stop_on_the_minority_side(new, old_ranks, self._hosts)
            try:
                mine = (self.epoch, self.pos, self.global_step)
                best = new.allreduce((mine, -new.Get_rank()), op=MPI.MAX)
                src = -best[1]
                lap("agree")
                grown = False
                if self.regrow and self._job_ranks - shrunk and spawn_tries < MAX_SPAWN_TRIES:
                    spawn_tries += 1
                    got = self._grow(new, src)
                    lap("spawn_merge")
                    if isinstance(got, str):
                        no_slot = got
                    else:
                        new, src, placed = got
                        replaced += placed
                        grown = True
                self._rebuild_world(new, lap, grown)
                self._restore(src)
                self._gather_hosts()
                lap("restore")
                break
            except Exception as exc:
                # torch's errors count too (a TCPStore whose new host died): what decides is
                # whether the new world has lost a process
                if not is_process_failure(exc, new):
                    raise
                comm = new            # another rank was lost while recovering: again
        return sorted(lost), src, replaced, no_slot

    def _report_recovery(self, rec: Recovery, hosts_before: dict) -> None:
        """The recovery lines (printed by the reporting rank only)."""
        from hpcddp.comm import output as _log
        lost, seconds, src, redealt = rec.lost, rec.seconds, rec.source_rank, rec.steps_redealt
        replaced, no_slot = rec.replaced, rec.no_slot
        _log.log(f"elastic: lost rank{'s' if len(lost) != 1 else ''} "
                 f"{_ranks_on_nodes(lost, hosts_before)} (start-up numbering) before step "
                 f"{self.global_step} (epoch {self.epoch + 1}, {self.pos} of "
                 f"{self.sampler.epoch_samples} samples done); recovered in {seconds:.3f} s "
                 f"on {self.size} rank(s): state from rank {src}, the epoch's last "
                 f"{redealt} step(s) dealt over the "
                 f"{'world grown back' if replaced else 'survivors'}")
        how = ("a spare process on {} (HPCDDP_ELASTIC_SPARES)" if rec.from_spares
               else "a new process started on {} (MPI_Comm_spawn)")
        for r, host in replaced:
            _log.log(f"elastic: rank {r} replaced: {how.format(host or 'a free slot')} joined "
                     f"the world")
        if no_slot is not None:
            _log.log(f"elastic: {NO_SLOT_LINE} for rank{'s' if len(lost) != 1 else ''} "
                     f"{', '.join(map(str, lost))} ({no_slot[:160]}): the job goes on with "
                     f"{self.size} of {len(self._job_ranks)} ranks")
        if rec.detect_to_full_size_s is not None:
            kill = "" if rec.kill_to_full_size_s is None else \
                f", kill -> full size {rec.kill_to_full_size_s:.2f} s"
            _log.log(f"elastic: back to full size ({self.size} ranks): failure seen -> full "
                     f"size {rec.detect_to_full_size_s:.2f} s{kill}")

    @property
    def reporting(self) -> bool:
        """Whether this rank is the one to report what elastic mode did: the lowest rank that
        saw every recovery (a replacement, even at rank 0, saw only the later ones)."""
        new = {r for rec in self.recoveries for r, _ in rec.replaced}
        return not self.replacement and self.original_rank == min(
            set(self.world.world_ranks) - new, default=-1)

    def _grow(self, shrunk, src: int):
        """Spawn a replacement for every start-up rank the world lacks and merge them in
        (hpcddp.comm.spawn): (world, source rank in it, [(rank, host)]), or why not (a str)
        where the launcher has no free slot. Collective over the survivors (SHRUNK)."""
        MPI = _mpi()
        from hpcddp.comm import spares
        from hpcddp.comm.communicator import translate_to_world
        from hpcddp.comm.spawn import spawn_replacements
        now = translate_to_world(shrunk)
        missing = sorted(self._job_ranks - set(now))
        message = {"source": now[src], "hosts": self._hosts, "job_ranks": sorted(self._job_ranks),
                   "kill_log": _inject.kill_log_path(), "generation": self.generation + 1}
        if _started_with_spares():
            with _stuck_after(SHRINK_LIMIT_S, lambda: "the regroup with the spare processes "
                              f"({spares.step or 'done'})"):
                got = spares.call_spares(shrunk, missing, self.original_rank, message)
            if got is None:
                return "every spare process (HPCDDP_ELASTIC_SPARES) is taken"
            world, ranks, taken = got
            if not taken:             # the free spares were all lost meanwhile
                world.Free()
                return "every spare process (HPCDDP_ELASTIC_SPARES) is taken or lost"
            return world, ranks.index(now[src]), taken
        try:
            with _stuck_after(SPAWN_LIMIT_S, "MPI_Comm_spawn of replacement ranks"):
                world, ranks, placed = spawn_replacements(shrunk, missing, self._hosts,
                                                          self.original_rank, message)
        except MPI.Exception as exc:
            if is_process_failure(exc, shrunk):
                raise
            return str(exc).strip() or type(exc).__name__
        return world, ranks.index(now[src]), list(zip(missing, placed))

    def _joined(self, joined: dict) -> None:
        """The end of a replacement's constructor: what the survivors do after the restore."""
        import os
        os.environ[_inject.ENV_LOG] = joined["kill_log"]
        for fn in self.on_recovery:
            fn(self)
        spare = joined.get("spare", False)
        # a spare is a process of the job's own launch: it ends as the survivors do
        _exit_without_finalize(replacement=not spare)
        if self.verbose:
            from hpcddp.comm import output as _log
            line = (SPARE_LINE.format(rank=self.original_rank) if spare
                    else REPLACEMENT_LINE.format(rank=self.original_rank))
            _log.log(f"{line} {socket.gethostname()} and joined the world of {self.size} "
                     f"before step {self.global_step} (epoch {self.epoch + 1})")

    def _gather_hosts(self) -> None:
        self._hosts.update(zip(self.world.world_ranks,
                               self.world.mpi.allgather(socket.gethostname())))

    def _rebuild_world(self, new, lap, grown: bool = False) -> None:
        """hpcddp's world, topology and watchdog, and torch's default group, on NEW (in the
        order a replacement's hpcddp.init and init_process_group run them, when GROWN)."""
        from hpcddp.backend import bootstrap_store
        from hpcddp.comm import startup
        from hpcddp.comm.communicator import Communicator, translate_to_world
        from hpcddp.comm.topology import build_topology, emulated_ranks_per_node
        rt = self._rt
        _stop_watchdog()
        lap("watchdog_stop")
        try:
            dist.destroy_process_group()
        except Exception:
            pass
        lap("torch_destroy")
        world = Communicator(new, "WORLD", translate_to_world(new))
        rt.world = world
        launch = rt.launch
        key = launch.local_rank if launch is not None and launch.local_rank is not None else None
        # once a replacement is in the world (now or in an earlier recovery), no rank orders by
        # its launcher's local rank: a replacement has none, and every rank must order alike
        spawned = grown or self.replacement or any(r.replaced for r in self.recoveries)
        if (rt.local_rank_source == "emulated" or key is None or emulated_ranks_per_node()
                or spawned):
            key = None
        rt.topology = build_topology(world, emulated_ranks_per_node(), key)
        lap("topology")
        _restart_watchdog(world, rt.topology.hostname)
        lap("watchdog_start")
        store = bootstrap_store()
        dist.init_process_group("hpcddp", store=store, rank=world.rank, world_size=world.size)
        lap("torch_group")
        del startup

    def _restore(self, src: int) -> None:
        """Model, optimizer, scheduler, position from world rank SRC (broadcast)."""
        comm = self.world.mpi
        payload = None
        if comm.Get_rank() == src:
            payload = {"model": self.module.state_dict(),
                       "optimizer": self.optimizer.state_dict(),
                       "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
                       "where": (self.epoch, self.pos, self.global_step)}
        payload = comm.bcast(payload, root=src)
        if comm.Get_rank() != src:
            self.module.load_state_dict(payload["model"])
            self.optimizer.load_state_dict(payload["optimizer"])
            if self.scheduler is not None and payload["scheduler"] is not None:
                self.scheduler.load_state_dict(payload["scheduler"])
            self.epoch, self.pos, self.global_step = payload["where"]
        self.optimizer.zero_grad(set_to_none=True)

    def _wrap(self):
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(self.module, init_sync=False, **self.ddp_kwargs)
        if any(p == "backward" for _, _, p in self._kills):
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            def dying_allreduce(pg, bucket):
                fut = default_hooks.allreduce_hook(pg, bucket)
                self._maybe_die("backward")
                return fut
            model.register_comm_hook(None, dying_allreduce)
        return model


def holds_majority(before: set, after: set, hosts: dict) -> bool:
    """Whether the survivors AFTER of the world BEFORE may go on training.

    A rank lost on a host where a survivor runs died (ULFM hears of a death on a node from
    its launcher; no network lies between them). A rank lost on another host may be alive
    behind a cut link or a partition, training on as a world of its own: of the ranks not
    known dead, the survivors go on only if they are more than half, or exactly half and hold
    the lowest start-up rank; the other side then stops, so one world trains and writes
    checkpoints, never two. Every survivor computes the same answer (HOSTS: start-up rank ->
    host, gathered when the State was built)."""
    survivor_hosts = {hosts.get(r) for r in after}
    unsure = {r for r in before - after if hosts.get(r) not in survivor_hosts}
    if not unsure:
        return True
    voters = after | unsure
    return 2 * len(after) > len(voters) or (2 * len(after) == len(voters)
                                            and min(voters) in after)


def _started_with_spares() -> bool:
    from hpcddp.comm import spares      # hpcddp.comm starts MPI: imported when it runs
    return spares.started_with_spares()


def _ranks_on_nodes(ranks, hosts: dict) -> str:
    """"2 on node3", "2, 3 on node3, node4": start-up ranks and their hosts."""
    names = list(dict.fromkeys(hosts[r] for r in ranks if r in hosts))
    if not names:       # lost before the hosts were gathered (while the State was built)
        return ", ".join(map(str, ranks))
    return f"{', '.join(map(str, ranks))} on {', '.join(names)}"


MINORITY_EXIT = 1
# spawn attempts in one recovery (a replacement lost while joining is replaced again)
MAX_SPAWN_TRIES = 3
# Open MPI 5.0's launcher (PRRTE 3.0.14) reads and frees past a one-element array in the
# PMIx_Connect that ends every MPI_Comm_spawn whose processes span nodes (connect_release in
# prted/pmix/pmix_server_dyn.c; Open MPI asks for no context id, so the array has one
# element): a plain mpi4py spawn onto another node logs its "pmix_server_dyn.c at line 1113"
# error, and whether the launcher then dies depends on its heap (docs/elastic.md).
SPAWN_ACROSS_NODES_LINE = (
    "elastic: a replacement for a lost rank is spawned (MPI_Comm_spawn) and this job spans "
    "{nodes} nodes: Open MPI 5.0's launcher can crash in such a spawn and end the job "
    "(docs/elastic.md, \"Open MPI's launcher can crash here\"); spare processes started with "
    "the job (HPCDDP_ELASTIC_SPARES) spawn nothing")


def _warn_of_spawns_across_nodes(state) -> None:
    """One line at start where a loss would be answered by a spawn across nodes under Open
    MPI 5.0 (SPAWN_ACROSS_NODES_LINE)."""
    nodes = len(set(state._hosts.values()))
    if (state.regrow and not _started_with_spares() and nodes > 1
            and state._rt.mpi_version.startswith("Open MPI v5.0")):
        from hpcddp.comm import output as _log
        _log.log(SPAWN_ACROSS_NODES_LINE.format(nodes=nodes))


# a spare's line once it took a lost rank's place (the launcher need not read it: a spare is
# a process of the job's own launch, unlike a spawned replacement)
SPARE_LINE = "elastic: spare process took rank {rank} on"
# a replacement imports torch and the user's script before it joins: seconds on a loaded node
SPAWN_LIMIT_S = 300.0
# ULFM's shrink returns in well under a second once every lost rank is reported failed. Seen
# with Open MPI 5.0.11 on 4 virtual nodes, one cut off, before hpcddp.comm._mpi passed failures
# on over MPI's reliable broadcast: the lost rank was reported to some survivors and never to
# rank 0, and every survivor waited in the shrink for good. Past this limit a survivor ends
# itself with a line saying so (`hpcddp launch` ends the job on it): a stall, never a hang.
SHRINK_LIMIT_S = 60.0
STUCK_EXIT = 1


@contextlib.contextmanager
def _stuck_after(seconds: float, what):
    """End this rank if the block is still running after SECONDS (a call that cannot return).
    WHAT names the block, or says it when called (where a long block is by then)."""
    import threading

    def give_up():
        _end_rank(f"{RECOVERY_STUCK_LINE}: {what() if callable(what) else what} did not return within {seconds:.0f} s "
                  f"(a lost rank that MPI reported to some ranks only: docs/elastic.md, \"A node "
                  f"that drops off the network\"); this rank ends (exit {STUCK_EXIT})", STUCK_EXIT)
    timer = threading.Timer(seconds, give_up)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _end_rank(line: str | None, code: int) -> None:
    """Print LINE (if any), stop the watchdog, and end this process with CODE, without
    MPI_Finalize (it would wait for ranks it cannot reach)."""
    try:
        from hpcddp import diagnostics
        diagnostics.stop_without_barrier()
    except Exception:
        pass
    from hpcddp.comm.failures import end_process
    end_process(line, code)


def _flush_output() -> None:
    from hpcddp.comm.failures import flush_output
    flush_output()


def _stop_on_the_minority_side(new, before: set, hosts: dict) -> None:
    """End this rank: its side of a cut network holds no majority (holds_majority)."""
    from hpcddp.comm.communicator import translate_to_world
    after = sorted(translate_to_world(new))
    lost = sorted(before - set(after))
    line = None
    if new.Get_rank() == 0:
        line = (f"elastic: rank{'s' if len(after) != 1 else ''} {_ranks_on_nodes(after, hosts)} "
                f"lost contact with rank{'s' if len(lost) != 1 else ''} "
                f"{_ranks_on_nodes(lost, hosts)} and hold {len(after)} of {len(before)}: "
                f"{MINORITY_STOPS_LINE} (exit {MINORITY_EXIT}) so that only one side trains "
                f"on; resume from the last checkpoint if the other side is gone too")
    _end_rank(line, MINORITY_EXIT)


_exit_code = [0]
_exit_installed = [False]


def _exit_without_finalize(replacement: bool = False) -> None:
    """After a lost rank, end this process at exit without MPI_Finalize.

    Open MPI 5.0's MPI_Finalize runs a fence over every process of the job, the dead ones
    included: with --with-ft ulfm it usually returns, but now and then a survivor waits in it
    forever (seen in about one run in ten with two failures, 4 ranks, here). So once a rank
    is lost, hpcddp's exit handler is replaced by one that stops the watchdog, flushes the
    output and calls os._exit: with sys.exit's code, 1 after an uncaught exception, else 0
    (``raise SystemExit(n)`` without sys.exit is not seen: it exits 0). atexit handlers
    registered before the recovery do not run then (register yours in ``on_recovery``).

    A REPLACEMENT rank (spawned) finalizes PMIx first: its launcher counts a spawned process
    that exits without it as an abnormal end of the whole job.
    """
    if _exit_installed[0]:
        return
    _exit_installed[0] = True
    import atexit
    import os
    import sys
    import threading

    from hpcddp.comm import startup
    atexit.unregister(startup._finalize_at_exit)
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        if not issubclass(exc_type, SystemExit):
            _exit_code[0] = 1
        previous(exc_type, exc, tb)
    sys.excepthook = hook
    previous_thread_hook = threading.excepthook
    previous_exit = sys.exit

    def exit_with(code=None):
        _exit_code[0] = 0 if code is None else code if isinstance(code, int) else 1
        previous_exit(code)
    sys.exit = exit_with

    def thread_hook(args):
        _exit_code[0] = 1
        previous_thread_hook(args)
    threading.excepthook = thread_hook

    def finish():
        from hpcddp.launch import process
        if not process.in_rank_process():  # a forked child exiting: not the rank's exit
            return
        try:
            from hpcddp import diagnostics
            diagnostics.stop_without_barrier()
        except Exception:
            pass
        try:
            from hpcddp.comm import output as _log
            world = startup._runtime.world      # never runtime(): it would start MPI again
            # `hpcddp launch` counts these lines: once every survivor has left, a launcher
            # still waiting for a node it cannot reach is ended (hpcddp.launch.mpirun)
            _log.log(SURVIVOR_LEFT_LINE.format(rank=world.rank, size=world.size,
                                               code=_exit_code[0]))
        except Exception:
            pass
        try:
            from hpcddp.comm import spares
            spares.release(startup._runtime.world.rank, finalize=False)
        except Exception:
            pass
        _flush_output()
        if replacement:
            _leave_launcher_cleanly()
        os._exit(_exit_code[0])
    atexit.register(finish)


def _leave_launcher_cleanly() -> None:
    """Tell the launcher (PMIx) this process ends normally, without MPI_Finalize.

    MPI_Finalize in a spawned replacement disconnects from every process it shares a
    communicator with, and waits for survivors that have already left (seen: for good). A
    spawned process that exits without finalizing PMIx is, for Open MPI's launcher, an
    abnormal end of the whole job (mpirun exit 1), so it finalizes PMIx alone."""
    import ctypes
    for name in ("libpmix.so.2", "libpmix.so"):
        try:
            lib = ctypes.CDLL(name, mode=getattr(os, "RTLD_NOLOAD", 4) | ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        try:
            lib.PMIx_Finalize(None, ctypes.c_size_t(0))
        except Exception:
            pass
        return


_states: list = []       # the State whose world an uncaught exception is explained against


def _explain_losses_outside_steps(state) -> None:
    """An uncaught process failure (a rank lost during evaluation, a checkpoint save, the
    user's own collectives: anywhere outside ``state.step()``) ends the job, as any uncaught
    exception does; first one line says which rank was lost and what to do."""
    import sys
    import weakref

    from hpcddp.launch import process
    _states[:] = [weakref.ref(state)]
    if getattr(sys.excepthook, "_hpcddp_elastic", False):
        return
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        st = _states[0]() if _states else None
        if st is not None and process.in_rank_process() and isinstance(exc, Exception):
            try:
                comm = st.world.mpi
                if is_process_failure(exc, comm):
                    from hpcddp.comm import output as _log
                    lost = failed_world_ranks(comm)
                    from hpcddp.comm.failures import ranks_text
                    who = ranks_text(lost)
                    from hpcddp.diagnostics import abort
                    abort.end_whole_job()     # every survivor meets it: the job has failed
                    _log.log(f"elastic: {who} was lost outside state.step() (in "
                             f"{type(exc).__name__}: {str(exc)[:120]}): hpcddp.elastic recovers "
                             f"a lost rank only inside `with state.step():` (evaluation, "
                             f"checkpoint saves and your own collectives are not retried); the "
                             f"job ends. Resume it from its last checkpoint, or move that work "
                             f"into the training step (docs/elastic.md, 'Outside the step')")
            except Exception:
                pass
        previous(exc_type, exc, tb)
    hook._hpcddp_elastic = True
    sys.excepthook = hook


def _unhook(ddp) -> None:
    """Detach a retired DDP's reducer from the parameters: a caller may still hold the old
    wrapper, and its autograd hooks would fire beside the new one's."""
    reducer = getattr(ddp, "reducer", None)
    remove = getattr(reducer, "_remove_autograd_hooks", None)
    if remove is not None:
        remove()


def _comms_to_revoke(rt):
    """The world and the topology's communicators: revoking them wakes any survivor (or any
    thread of this one) blocked on them."""
    out = [rt.world.mpi]
    topo = rt.topology
    for c in (topo.node_comm, topo.leader_comm, topo.cross_comm):
        if c is not None:
            out.append(c)
    return out


def _watchdog_survives_peers() -> None:
    from hpcddp import diagnostics
    wd = diagnostics._watchdog   # (the name "watchdog" is also its submodule)
    if wd is not None:
        wd.peer_failures_survivable = True


def _stop_watchdog() -> None:
    from hpcddp import diagnostics
    diagnostics.stop_without_barrier()


def _restart_watchdog(world, host) -> None:
    from hpcddp import diagnostics
    wd = diagnostics.start_diagnostics(world, host, base=world.mpi)
    if wd is not None:
        wd.peer_failures_survivable = True
