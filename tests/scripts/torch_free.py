"""Run `hpcddp ARGS` as the console script does, and say at exit whether torch was loaded:
"torch_free: no torch module loaded" or "torch_free: loaded torch, ..." (tests/test_no_torch_staging.py)."""
import atexit
import runpy
import sys


def _report():
    loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
    print("torch_free: no torch module loaded" if not loaded else
          f"torch_free: loaded torch, {len(loaded)} modules", flush=True)


atexit.register(_report)
sys.argv = ["hpcddp"] + sys.argv[1:]
runpy.run_module("hpcddp", run_name="__main__", alter_sys=True)
