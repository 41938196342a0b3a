"""Run every hang scenario N times in a row (default 20) and count failures and hangs.

    python tests/scenarios/loop.py              # all cases, 20 rounds
    python tests/scenarios/loop.py -n 3 skip_collective sigkill_allreduce

Not part of CI (it takes a while); each job runs under run_mpi's hard timeout, so a hang shows
up as a failure with exit code -9, never as a stuck loop. Prints one line per run and a
summary: runs, failures, the slowest time from stall point to the end of the job.
"""
import argparse
import importlib.util
import pathlib
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).parent
spec = importlib.util.spec_from_file_location("hang_cases", HERE / "cases.py")
cases = importlib.util.module_from_spec(spec)
sys.modules["hang_cases"] = cases  # dataclasses look their module up
spec.loader.exec_module(cases)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-n", "--runs", type=int, default=20, help="rounds (default 20)")
    p.add_argument("--save", metavar="DIR",
                   help="write each case's last output and report to DIR/<case>.txt")
    p.add_argument("names", nargs="*", help=f"cases (default all): {', '.join(cases.BY_NAME)}")
    args = p.parse_args(argv)
    unknown = [n for n in args.names if n not in cases.BY_NAME]
    if unknown:
        p.error(f"unknown case(s) {unknown}; valid: {', '.join(cases.BY_NAME)}")
    chosen = [cases.BY_NAME[n] for n in args.names] or cases.CASES
    fails, worst, t0 = [], {}, time.time()
    for i in range(1, args.runs + 1):
        for case in chosen:
            with tempfile.TemporaryDirectory() as d:
                r = cases.run_case(case, d)
            after = r["after_stall"]
            if after is not None:
                worst[case.name] = max(worst.get(case.name, 0.0), after)
            status = "ok" if not r["problems"] else "FAIL: " + "; ".join(r["problems"])
            print(f"round {i:2d} {case.name:30s} rc={r['rc']:4d} wall={r['wall']:5.1f}s "
                  f"after-stall={'-' if after is None else f'{after:4.1f}s'} {status}",
                  flush=True)
            if r["problems"]:
                fails.append((i, case.name, r))
            if args.save:
                pathlib.Path(args.save).mkdir(parents=True, exist_ok=True)
                (pathlib.Path(args.save) / f"{case.name}.txt").write_text(
                    f"=== rc {r['rc']} ===\n{r['output']}\n=== report file ===\n{r['report']}")
    total = args.runs * len(chosen)
    print(f"\n{total} runs, {len(fails)} failed, {time.time() - t0:.0f} s in all; slowest end "
          f"after the stall point (bound {cases.BOUND:g} s):")
    for name, t in sorted(worst.items()):
        print(f"  {name:30s} {t:5.1f} s")
    for i, name, r in fails[:3]:
        print(f"\n--- round {i} {name} ---\n{r['output'][-4000:]}")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
