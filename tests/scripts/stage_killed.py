"""`hpcddp stage ...` whose one rank dies mid-copy: a stager killed the way a node crash or
the OOM killer kills it, for the resume tests (tests/test_data_cli.py).

    mpirun -n 2 python tests/scripts/stage_killed.py CHUNKS RANK stage SRC DEST ...
    mpirun -n 1 python tests/scripts/stage_killed.py hold:SHARDS 0 pack SRC OUT ...

``hold:N`` instead of N: the rank does not exit, it prints ``[rankR] AT PHASE stage pid P``
(``pack``: after writing its N-th shard, before renaming it into place) and waits there,
for a SIGKILL from outside (tests/test_outside_kill.py).

On world rank RANK, the process exits with status 137 (no cleanup, no atexit, no MPI
finalize: what SIGKILL leaves) right after its CHUNKS-th write of shard bytes; the other ranks
run the command unchanged. The fault comes from here, wrapping the two calls the stager writes
shard bytes with (``os.pwrite`` on the exchange path, ``os.sendfile`` on the local one), so
production code carries no test hook. A count of writes, not a timer or a signal, decides
when: the kill lands at the same point of the copy however loaded the machine is.
"""
import os
import sys


def _rank() -> int:
    from hpcddp.launch import detect
    info = detect()
    return info.rank if info is not None and info.rank is not None else 0


def _hold(phase: str) -> None:
    import time
    print(f"[rank{_rank()}] AT PHASE {phase} pid {os.getpid()}", flush=True)
    time.sleep(120)


def _die_after(chunks: int, hold: bool = False) -> None:
    done = [0]

    def counted(real):
        def call(*args, **kw):
            out = real(*args, **kw)
            done[0] += 1
            if done[0] >= chunks and hold:
                _hold("stage")
            if done[0] >= chunks:
                print(f"[rank{_rank()}] stage_killed.py: {chunks} chunk writes done: exiting "
                      f"mid-copy (test kill point)", file=sys.stderr, flush=True)
                os._exit(137)
            return out
        return call

    os.pwrite = counted(os.pwrite)
    os.sendfile = counted(os.sendfile)


def _hold_in_pack(shards: int) -> None:
    from hpcddp.data import packing
    done = [0]
    for name in ("_write_lmdb", "_write_hdf5"):
        real = getattr(packing, name)

        def call(*args, _real=real, **kw):
            out = _real(*args, **kw)
            done[0] += 1
            if done[0] >= shards:
                _hold("pack")
            return out
        setattr(packing, name, call)


def main() -> int:
    count, rank, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    hold = count.startswith("hold:")
    chunks = int(count.removeprefix("hold:"))
    if _rank() == rank:
        if hold and argv[0] == "pack":
            _hold_in_pack(chunks)
        else:
            _die_after(chunks, hold)
    from hpcddp.cli import main as hpcddp_main
    return hpcddp_main(argv)


if __name__ == "__main__":
    sys.exit(main())
