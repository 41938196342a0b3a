"""A DDP job that a test kills from outside (tests/test_outside_kill.py).

argv: OUTDIR MODE PHASE TARGET [WORKERS [START]]
  MODE: plain (DDP, DistributedSampler) or elastic (hpcddp.elastic.State)
  START: how DataLoader workers start: fork (default on Linux), spawn or forkserver
  PHASE: where TARGET (a rank) is when the test's SIGKILL arrives: data (inside a DataLoader
    worker's __getitem__), forward, backward (inside a gradient-bucket all-reduce), optimizer,
    eval, checkpoint (inside Checkpointer.save on rank 0), state (elastic: before building the
    hpcddp.elastic.State, which the others build meanwhile), arena (a 4 MiB all_reduce through
    the shared-memory arena or the hierarchical path), collective (just before the user's own
    all_reduce inside state.epochs(), outside state.step(), which its peers then call), raise (no kill: TARGET raises an exception
    in its forward pass while the others wait for it in the gradient all-reduce), none.
At step PAUSE_STEP of epoch 0 (eval: after training) TARGET prints
``[rankT] AT PHASE <phase> pid <pid>`` and then waits there: in the phase itself (a sleep), or
inside a collective whose peers come late: LATE_S after the test has touched OUTDIR/killed
after its SIGKILL (at most HOLD_S), as when a rank dies in a collective its peers reach later. The test sees the line and sends SIGKILL. The rank never kills itself. Survivors write OUTDIR/final.<rank>.json (elastic) and print
``[rankR] DONE``. EPOCHS: how many epochs (2).
OK_ABORT=default: hpcddp.init() with abort on exception left at its default
(a user's plain script), else abort_on_exception=True.
"""
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

import hpcddp

PAUSE_STEP = 3
HOLD_S = 60.0        # longer than any test waits: the kill always lands inside the phase
LATE_S = 2.0         # how long after the kill the peers come to the collective the target waited in


def at(phase, rank):
    print(f"[rank{rank}] AT PHASE {phase} pid {os.getpid()}", flush=True)


class Data(torch.utils.data.Dataset):
    def __init__(self, n, hold_index, target):
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 16, generator=g, dtype=torch.float64)
        self.y = (self.x[:, :4].sum(1) > 0).long()
        self.hold_index = hold_index     # the target's worker holds here (phase data)
        self.target = target
        self.rank = None                 # set in the rank before its workers start

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if i == self.hold_index and self.rank == self.target:
            at("data", self.rank)
            time.sleep(HOLD_S)
        return self.x[i], self.y[i], i


def main():
    out, mode, phase, target = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    workers = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    start = {"multiprocessing_context": sys.argv[6]} if len(sys.argv) > 6 and workers else {}
    torch.set_num_threads(1)
    hpcddp.init(abort_on_exception=None if os.environ.get("OK_ABORT") == "default" else True)
    hpcddp.init_process_group()
    me = hpcddp.world().rank
    size = hpcddp.world().size
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 2)).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    batch = 8 * size
    state = None
    if mode == "elastic":
        import hpcddp.elastic as elastic
        sampler = elastic.ElasticBatchSampler(240, batch, seed=3)
        # the sample the target's worker holds on: one of its own at step PAUSE_STEP
        hold = sampler.order()[PAUSE_STEP * batch + target] if phase == "data" else -1
        ds = Data(240, hold, target)
        loader = torch.utils.data.DataLoader(ds, batch_sampler=sampler, num_workers=workers,
                                             **start)
        if phase == "state" and me == target:   # the others wait in State's first collective
            at("state", me)
            time.sleep(HOLD_S)
        state = elastic.State(model, opt, sampler, ddp_kwargs={"bucket_cap_mb": 0.001})
        ddp = state.model
    else:
        sampler = torch.utils.data.DistributedSampler(range(240), shuffle=True, seed=3,
                                                      drop_last=True)
        local = list(iter(sampler))
        hold = local[PAUSE_STEP * 8] if phase == "data" and me == target else -1
        ds = Data(240, hold, target)
        loader = torch.utils.data.DataLoader(ds, batch_size=8, sampler=sampler,
                                             drop_last=True, num_workers=workers, **start)
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.001)
    ds.rank = me
    step = [0]

    def holding(name):
        return phase == name and step[0] == PAUSE_STEP

    def hold_here(name):
        if holding(name) and me == target:
            at(name, me)
            time.sleep(HOLD_S)

    def late_peers(name):
        """The target waits inside a collective that its peers reach LATE_S after the test
        says it has killed the target (timed from the target's line instead, the kill lost
        the race on a loaded machine, where the line reached the test through Slurm's output
        file seconds late)."""
        if holding(name):
            if me == target:
                at(name, me)
            else:
                killed = os.path.join(out, "killed")
                deadline = time.monotonic() + HOLD_S
                while not os.path.exists(killed) and time.monotonic() < deadline:
                    time.sleep(0.05)
                time.sleep(LATE_S)

    model.register_forward_pre_hook(lambda *a: hold_here("forward"))

    def raise_here(*a):                   # a bug on one rank: its exception ends the job
        if holding("raise") and me == target:
            at("raise", me)
            time.sleep(0.5)
            raise RuntimeError(f"a bug on rank {me}")
    model.register_forward_pre_hook(raise_here)
    # a Checkpointer catches SIGTERM (preemption), as real jobs' do: a rank that must end
    # cannot count on SIGTERM then (Open MPI under --with-ft ulfm sends no SIGKILL after it)
    from hpcddp.parallel.checkpoint import Checkpointer
    Checkpointer(os.path.join(out, "ckpt"))
    opt.register_step_pre_hook(lambda *a: hold_here("optimizer"))

    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    def hook(pg, bucket):
        return default_hooks.allreduce_hook(pg, bucket)
    # 4 MiB: the arena's (or hierarchical path's) size; BIG_MIB=16: the hierarchical path's
    # pieces, one crossing on the path's own thread when the rank is killed
    big = torch.ones(int(os.environ.get("BIG_MIB", "4")) << 18)

    def one_step(x, y):
        model_ = state.model if state else ddp
        loss = F.cross_entropy(model_(x), y)
        opt.zero_grad()
        late_peers("backward")
        loss.backward()
        opt.step()
        if phase == "arena" and step[0] == PAUSE_STEP:
            late_peers("arena")
            torch.distributed.all_reduce(big)
    if state is None:
        ddp.register_comm_hook(None, hook)

    rounds = int(os.environ.get("EPOCHS", "2"))
    epochs = state.epochs(rounds) if state else range(rounds)
    for epoch in epochs:
        if state is None:
            sampler.set_epoch(epoch)
        for x, y, _ in (state.batches(loader) if state else loader):
            if state is not None:
                with state.step():
                    one_step(x, y)
            else:
                one_step(x, y)
            step[0] += 1
        if phase == "collective" and epoch == 0:
            step[0] = PAUSE_STEP
            # killed before its call, not inside it: a rank killed after it sent its part of
            # this small all_reduce may let the survivors' call complete (where Open MPI has
            # not yet told them of the death: seen in CI under load), and the loss is then
            # found, and recovered, in the next step (docs/elastic.md, "Outside the step")
            if me == target:
                hold_here("collective")
            else:
                late_peers("collective")
            torch.distributed.all_reduce(torch.ones(4))
        if phase == "checkpoint" and epoch == 0:
            from hpcddp.parallel.checkpoint import Checkpointer
            ck = Checkpointer(os.path.join(out, "ckpt"), signals=())
            step[0] = PAUSE_STEP

            class Slow:                    # pickled in the middle of the write
                def __reduce__(self):
                    hold_here("checkpoint")
                    return (int, (5,))
            ck.save({"model": model.state_dict(), "slow": Slow(),
                     "big": torch.zeros(1 << 18)}, 1)
    step[0] = PAUSE_STEP
    with torch.no_grad():                  # evaluation: a metric all-reduced by every rank
        model.eval()
        hold_here("eval")
        correct = torch.tensor([float((model(ds.x).argmax(1) == ds.y).sum())])
        torch.distributed.all_reduce(correct)
    world = hpcddp.world()
    if state is not None:
        blob = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
        with open(os.path.join(out, f"final.{state.original_rank}.json"), "w") as f:
            json.dump({"size": state.size, "global_step": state.global_step,
                       "params": blob.hex(),
                       "lost": sorted(r for rec in state.recoveries for r in rec.lost)}, f)
    print(f"[rank{world.rank}] DONE size {world.size}", flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
