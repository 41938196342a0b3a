"""Abort on exception's mode (hpcddp.diagnostics.abort.set_mode): what hpcddp.init's
abort_on_exception= and HPCDDP_ABORT_ON_EXCEPTION choose, and that an explicit choice is kept
when a later init (torch's init_process_group calls one) leaves it at its default.

Each case runs in a fresh interpreter: the hooks cannot be removed from the pytest process.
The jobs themselves: tests/test_hangs.py (exception_default_*), tests/test_outside_kill.py."""
import os
import subprocess
import sys
import textwrap

import pytest


def _run(code: str, **env) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k != "HPCDDP_ABORT_ON_EXCEPTION"}
    full.update(env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=60, env=full)


MODES = """
    from hpcddp.diagnostics import abort
    seen = []
    for asked in {asks}:
        abort.set_mode(asked, 2)
        seen.append(abort._mode)
    print(*seen)
"""


@pytest.mark.parametrize("env,asks,want", [
    ({}, [None], ["auto"]),
    ({}, [None, False, None], ["auto", "off", "off"]),       # the explicit False is kept
    ({}, [True, None], ["on", "on"]),
    ({"HPCDDP_ABORT_ON_EXCEPTION": "0"}, [None], ["off"]),
    ({"HPCDDP_ABORT_ON_EXCEPTION": "1"}, [None], ["on"]),
    ({"HPCDDP_ABORT_ON_EXCEPTION": "0"}, [True], ["on"]),    # the argument wins
])
def test_mode_from_the_argument_else_the_setting(env, asks, want):
    res = _run(MODES.format(asks=asks), **env)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == want


def test_a_bad_setting_is_refused_naming_it():
    res = _run(MODES.format(asks=[None]), HPCDDP_ABORT_ON_EXCEPTION="maybe")
    assert res.returncode != 0
    assert "HPCDDP_ABORT_ON_EXCEPTION='maybe': expected auto, 1 (on) or 0 (off)" in res.stderr


def test_auto_records_the_main_threads_exception_only_in_the_rank():
    """auto keeps the main thread's uncaught exception for the exit (Python still prints it);
    an exception that ends another thread is not the script's end; one rank alone: nothing."""
    res = _run("""
        import sys, threading
        from hpcddp.launch import process
        from hpcddp.diagnostics import abort
        process.own()
        abort.set_mode(None, 1)
        alone = sys.excepthook is sys.__excepthook__
        abort.set_mode(None, 2)
        t = threading.Thread(target=lambda: 1 / 0); t.start(); t.join()
        after_thread = list(abort._uncaught)
        try:
            raise ValueError("bad batch")
        except ValueError:
            sys.excepthook(*sys.exc_info())
        print(alone, after_thread, abort._uncaught, flush=True)
        abort._uncaught.clear()         # else this process's exit would end it (no MPI: exit 1)
    """)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "True [] [ValueError('bad batch')]", res.stdout
    assert "ValueError: bad batch" in res.stderr and "ZeroDivisionError" in res.stderr


def test_auto_counts_a_non_zero_sys_exit_as_the_scripts_failure():
    res = _run("""
        import sys
        from hpcddp.launch import process
        from hpcddp.diagnostics import abort
        process.own()
        abort.set_mode(None, 2)
        seen = []
        for code in (0, None, 3):
            try:
                sys.exit(code)
            except SystemExit:
                seen.append([repr(e) for e in abort._uncaught])
        print(seen, flush=True)
        abort._uncaught.clear()
    """)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[[], [], ['SystemExit(3)']]", res.stdout
