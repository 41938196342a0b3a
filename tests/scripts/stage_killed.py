"""`hpcddp stage ...` whose one rank dies mid-copy: a stager killed the way a node crash or
the OOM killer kills it, for the resume tests (tests/test_data_cli.py).

    mpirun -n 2 python tests/scripts/stage_killed.py CHUNKS RANK stage SRC DEST ...

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


def _die_after(chunks: int) -> None:
    done = [0]

    def counted(real):
        def call(*args, **kw):
            out = real(*args, **kw)
            done[0] += 1
            if done[0] >= chunks:
                print(f"[rank{_rank()}] stage_killed.py: {chunks} chunk writes done: exiting "
                      f"mid-copy (test kill point)", file=sys.stderr, flush=True)
                os._exit(137)
            return out
        return call

    os.pwrite = counted(os.pwrite)
    os.sendfile = counted(os.sendfile)


def main() -> int:
    chunks, rank, argv = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    if _rank() == rank:
        _die_after(chunks)
    from hpcddp.cli import main as hpcddp_main
    return hpcddp_main(argv)


if __name__ == "__main__":
    sys.exit(main())
