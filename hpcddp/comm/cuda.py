"""Is the MPI library CUDA-aware? Runtime detection, and the one gate for device pointers.

A CUDA-aware MPI takes device pointers; any other MPI reads them as host addresses and
segfaults (or corrupts memory). hpcddp therefore passes a device pointer to MPI only when
:func:`cuda_awareness` says ``aware is True``; otherwise CUDA tensors are staged through
pinned host memory (:mod:`hpcddp.collectives._gpu_staging`). What decides, in order:

1. ``HPCDDP_CUDA_AWARE=0|1``: the user's word wins (unset or ``auto``: detect).
2. The MPI flavour, from ``MPI_Get_library_version``:

   - Cray MPICH: device buffers need ``MPICH_GPU_SUPPORT_ENABLED=1`` (and the GTL library);
     without it, no.
   - MVAPICH2(-GDR): device buffers need ``MV2_USE_CUDA=1``; without it, no.
   - Open MPI: ``MPIX_Query_cuda_support()`` (ROCm: ``MPIX_Query_rocm_support``) called through
     ctypes on the libmpi this process loaded; it is only meaningful after MPI_Init. Before
     MPI_Init, or when the symbol is missing, ``ompi_info --parsable --all`` says whether the
     library was built with CUDA support (a build-time answer).
   - MPICH (and MPICH-derived libraries): ``MPIR_CVAR_ENABLE_GPU=0`` means no; otherwise
     ``MPIX_GPU_query_support`` (MPICH >= 4.0) or ``MPIX_Query_cuda_support`` answers.
   - Intel MPI: GPU buffers are off unless ``I_MPI_OFFLOAD`` is set; with it hpcddp does not
     guess (unknown: set ``HPCDDP_CUDA_AWARE=1`` if you have checked).

3. Optionally (``HPCDDP_CUDA_SMOKE=1`` or ``detect(smoke=True)``), a smoke test: a tiny
   device-buffer all_reduce on MPI_COMM_SELF in a child process, so a segfault cannot kill
   the job. A crash turns "yes" into "no"; a pass turns "unknown" into "yes".

Unknown (``aware is None``) is treated as no. Every input of :func:`detect` can be injected,
so each flavour is tested from faked environments and libraries without a GPU or that MPI.
The result is cached per process once MPI is initialised (:func:`cuda_awareness`).
"""
from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Callable, Mapping

from hpcddp import settings

ENV_OVERRIDE = "HPCDDP_CUDA_AWARE"
ENV_SMOKE = "HPCDDP_CUDA_SMOKE"
_OVERRIDE_VALUES = {"0": False, "1": True, "auto": None}

# MPICH's mpi.h (4.x): MPIX_GPU_query_support(int gpu_type, int *is_supported)
_MPICH_GPU_TYPE = {"cuda": 0, "ze": 1, "rocm": 2}

# Variables that tie a process to its launcher's job: removed from the smoke test's child so
# that it starts as an MPI singleton instead of trying to join (and hang) the parent's job.
_LAUNCHER_PREFIXES = ("OMPI_", "PMIX_", "PRTE_", "PMI_", "HYDRA_", "MPI_LOCALRANKID",
                      "MPI_LOCALNRANKS", "MPIR_CVAR_CH3_INTERFACE", "SLURM_", "PALS_", "MV2_COMM",
                      "I_MPI_HYDRA", "PBS_")


@dataclass(frozen=True)
class CudaAwareness:
    """What detection found.

    aware: True (device pointers may go to MPI), False (they must not), None (unknown:
        treated as False).
    source: what decided (``MPIX_Query_cuda_support``, ``ompi_info``, ``HPCDDP_CUDA_AWARE``,
        ``MPICH_GPU_SUPPORT_ENABLED``, ``MV2_USE_CUDA``, ``MPIR_CVAR_ENABLE_GPU``,
        ``MPIX_GPU_query_support``, ``smoke test``, or ``none``).
    detail: one sentence for humans (``hpcddp info``, error messages).
    library: the MPI flavour ("Open MPI", "MPICH", "Cray MPICH", "MVAPICH", "Intel MPI", ...).
    """
    aware: bool | None
    source: str
    detail: str
    library: str = ""

    def status(self) -> str:
        """"yes (SOURCE)", "no (DETAIL)" or "unknown (DETAIL)": one line for ``hpcddp info``."""
        if self.aware is True:
            return f"yes ({self.source})"
        if self.aware is False:
            return f"no ({self.detail})"
        return f"unknown ({self.detail})"


# -- pieces (each injectable in tests) ------------------------------------------------------

def mpi_flavour(library_version: str) -> str:
    """The MPI flavour named by an ``MPI_Get_library_version`` string."""
    lower = library_version.lower()
    for key, name in (("open mpi", "Open MPI"), ("cray mpich", "Cray MPICH"),
                      ("mvapich", "MVAPICH"), ("intel(r) mpi", "Intel MPI"),
                      ("intel mpi", "Intel MPI"), ("mpich", "MPICH")):
        if key in lower:
            return name
    return library_version.split(",")[0].strip() or "unknown"


_LIBMPI_RE = re.compile(r"/lib(mpi|mpich|mpi_cray|mpi_intel|mpi_ibm)[\w.-]*\.so[\d.]*$")


def find_libmpi(maps_text: str | None = None) -> str | None:
    """Path of the MPI library this process has mapped (from /proc/self/maps), or None.

    mpi4py >= 4 loads libmpi with dlopen (the path is not in its extension's DT_NEEDED), so
    the mapping table is the reliable way to find the library actually in use.
    """
    if maps_text is None:
        try:
            with open("/proc/self/maps") as fh:
                maps_text = fh.read()
        except OSError:
            return None
    for line in maps_text.splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6:
            path = parts[5].strip()
            base = os.path.basename(path)
            if _LIBMPI_RE.search(path) and "gtl" not in base and "fort" not in base \
                    and "cxx" not in base:
                return path
    return None


def _open_libmpi():
    """ctypes handle on the loaded libmpi (dlopen of a loaded library returns its handle)."""
    path = find_libmpi()
    if path is None:
        return None, "no libmpi found in /proc/self/maps"
    try:
        # RTLD_NOLOAD: the handle of the copy already loaded, never a second copy
        return ctypes.CDLL(path, mode=getattr(os, "RTLD_NOLOAD", 0) | os.RTLD_LAZY), path
    except OSError as exc:
        return None, f"cannot open {path}: {exc}"


def query_library(lib, gpu: str = "cuda") -> tuple[bool | None, str]:
    """Ask the MPI library itself (after MPI_Init). Returns (answer, symbol used).

    LIB is a ctypes library (or any object with the same attributes: tests pass fakes).
    Tries ``MPIX_Query_<gpu>_support()`` (Open MPI, MVAPICH2 >= 2.3.4, MPICH >= 4.1), then
    MPICH's ``MPIX_GPU_query_support(type, &flag)``. (None, "") when neither exists.
    """
    if lib is None:
        return None, ""
    name = "MPIX_Query_rocm_support" if gpu == "rocm" else "MPIX_Query_cuda_support"
    fn = getattr(lib, name, None)
    if fn is not None:
        fn.restype = ctypes.c_int
        fn.argtypes = []
        return bool(fn()), name
    fn = getattr(lib, "MPIX_GPU_query_support", None)
    if fn is not None and gpu in _MPICH_GPU_TYPE:
        flag = ctypes.c_int(0)
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
        if fn(_MPICH_GPU_TYPE[gpu], ctypes.pointer(flag)) == 0:
            return bool(flag.value), "MPIX_GPU_query_support"
    return None, ""


_OMPI_INFO_RE = re.compile(
    r"^mca:(?:mpi|opal):base:param:(?:mpi|opal)_built_with_(cuda|rocm)_support:value:(\w+)",
    re.M)


def parse_ompi_info(text: str, gpu: str = "cuda") -> bool | None:
    """``ompi_info --parsable --all`` output -> built with CUDA (ROCm) support? None if absent.

    Open MPI 4 names the parameter ``mpi_built_with_cuda_support``, Open MPI 5
    ``opal_built_with_cuda_support``.
    """
    for kind, value in _OMPI_INFO_RE.findall(text or ""):
        if kind == gpu:
            return value.lower() in ("true", "1", "yes")
    return None


def run_ompi_info(libmpi: str | None = None, timeout: float = 30) -> str | None:
    """Output of the ompi_info that belongs to LIBMPI (its prefix's bin/), else the one on PATH."""
    candidates = []
    if libmpi:
        candidates.append(os.path.join(os.path.dirname(os.path.dirname(libmpi)), "bin",
                                       "ompi_info"))
    candidates.append(os.path.join(os.path.dirname(sys.executable), "ompi_info"))
    found = shutil.which("ompi_info")
    if found:
        candidates.append(found)
    for exe in candidates:
        if os.access(exe, os.X_OK):
            try:
                res = subprocess.run([exe, "--parsable", "--all"], capture_output=True,
                                     text=True, timeout=timeout)
            except (OSError, subprocess.TimeoutExpired):
                continue
            if res.returncode == 0:
                return res.stdout
    return None


def parse_override(value: str | None) -> bool | None:
    """HPCDDP_CUDA_AWARE -> True/False, or None (detect). Raise on anything else."""
    return _OVERRIDE_VALUES[settings.read({ENV_OVERRIDE: value or ""}).cuda_aware]


def _gpu_kind() -> str:
    """"rocm" under a ROCm build of torch (its tensors also say device 'cuda'), else "cuda"."""
    torch = sys.modules.get("torch")
    return "rocm" if torch is not None and getattr(torch.version, "hip", None) else "cuda"


# -- the decision ---------------------------------------------------------------------------

_UNSET = object()


def detect(*, env: Mapping[str, str] | None = None, library_version: str | None = None,
           lib=_UNSET, mpi_initialized: bool | None = None,
           ompi_info: Callable[[], str | None] | None = None, smoke: bool | None = None,
           smoke_runner: Callable[[], tuple[bool | None, str]] | None = None,
           gpu: str | None = None) -> CudaAwareness:
    """Decide whether device pointers may go to this process's MPI. No caching (see
    :func:`cuda_awareness`); every argument defaults to what this process has:

    env: the environment (``os.environ``); library_version: ``MPI.Get_library_version()``;
    lib: a ctypes handle on the loaded libmpi (None: no library to ask); mpi_initialized:
    ``MPI.Is_initialized()``; ompi_info: a callable returning ``ompi_info --parsable --all``
    output (or None); smoke: run the child-process smoke test (default: ``HPCDDP_CUDA_SMOKE``);
    smoke_runner: replaces :func:`smoke_test`; gpu: "cuda" or "rocm" (default from torch).
    """
    env = os.environ if env is None else env
    gpu = gpu or _gpu_kind()
    declared = settings.get() if env is os.environ else settings.read(env)
    if smoke is None:
        smoke = declared.cuda_smoke
    forced = _OVERRIDE_VALUES[declared.cuda_aware]
    if library_version is None:
        from hpcddp.comm._mpi import MPI
        library_version = MPI.Get_library_version()
    flavour = mpi_flavour(library_version)
    if forced is not None:
        return CudaAwareness(forced, ENV_OVERRIDE, f"{ENV_OVERRIDE}={int(forced)} set by the user",
                             flavour)
    if mpi_initialized is None:
        from hpcddp.comm._mpi import MPI
        mpi_initialized = bool(MPI.Is_initialized())

    def ask_library():
        nonlocal lib
        if not mpi_initialized:
            return None, ""
        if lib is _UNSET:
            lib, _ = _open_libmpi()
        return query_library(lib, gpu)

    result = _static(flavour, env, gpu, ask_library, ompi_info, mpi_initialized)
    if smoke and result.aware is not False:
        result = _apply_smoke(result, smoke_runner or smoke_test)
    return result


def _static(flavour, env, gpu, ask_library, ompi_info, mpi_initialized) -> CudaAwareness:
    what = "ROCm" if gpu == "rocm" else "CUDA"
    if flavour == "Cray MPICH":
        if env.get("MPICH_GPU_SUPPORT_ENABLED", "").strip() != "1":
            return CudaAwareness(False, "MPICH_GPU_SUPPORT_ENABLED",
                                 "Cray MPICH without MPICH_GPU_SUPPORT_ENABLED=1 reads device "
                                 "pointers as host memory", flavour)
        answer, sym = ask_library()
        if answer is not None:
            return CudaAwareness(answer, sym, f"{sym}() returned {int(answer)} with "
                                 f"MPICH_GPU_SUPPORT_ENABLED=1", flavour)
        return CudaAwareness(True, "MPICH_GPU_SUPPORT_ENABLED",
                             "Cray MPICH with MPICH_GPU_SUPPORT_ENABLED=1", flavour)
    if flavour == "MVAPICH":
        var = "MV2_USE_ROCM" if gpu == "rocm" else "MV2_USE_CUDA"
        if env.get(var, "").strip() != "1":
            return CudaAwareness(False, var, f"MVAPICH2 without {var}=1 does not take device "
                                 f"pointers", flavour)
        answer, sym = ask_library()
        if answer is not None:
            return CudaAwareness(answer, sym, f"{sym}() returned {int(answer)} with {var}=1",
                                 flavour)
        return CudaAwareness(True, var, f"MVAPICH2 with {var}=1", flavour)
    if flavour == "Open MPI":
        answer, sym = ask_library()
        if answer is not None:
            return CudaAwareness(answer, sym, f"{sym}() returned {int(answer)}", flavour)
        why = ("MPI is not initialised yet" if not mpi_initialized
               else "MPIX_Query_cuda_support not in the library")
        text = (ompi_info or run_ompi_info)()
        built = parse_ompi_info(text, gpu) if text else None
        if built is None:
            return CudaAwareness(None, "none", f"Open MPI: {why} and ompi_info did not say "
                                 f"whether it was built with {what} support", flavour)
        return CudaAwareness(built, "ompi_info",
                             f"Open MPI built {'with' if built else 'without'} {what} support "
                             f"(ompi_info; {why})", flavour)
    if flavour == "Intel MPI":
        if env.get("I_MPI_OFFLOAD", "0").strip() in ("", "0"):
            return CudaAwareness(False, "I_MPI_OFFLOAD", "Intel MPI without I_MPI_OFFLOAD does "
                                 "not take device pointers", flavour)
        return CudaAwareness(None, "none", f"Intel MPI with I_MPI_OFFLOAD: not verified by "
                             f"hpcddp; set {ENV_OVERRIDE}=1 if you have checked it", flavour)
    if flavour == "MPICH" or "mpich" in flavour.lower():
        if env.get("MPIR_CVAR_ENABLE_GPU", "").strip() == "0":
            return CudaAwareness(False, "MPIR_CVAR_ENABLE_GPU", "MPICH with "
                                 "MPIR_CVAR_ENABLE_GPU=0", flavour)
        answer, sym = ask_library()
        if answer is not None:
            return CudaAwareness(answer, sym, f"{sym}() returned {int(answer)}", flavour)
        why = ("MPI is not initialised yet" if not mpi_initialized
               else "this MPICH has no GPU query (MPICH < 4.0)")
        return CudaAwareness(None, "none", f"MPICH: {why}; set {ENV_OVERRIDE}=1 if it is "
                             f"{what}-aware", flavour)
    # an MPI we do not know: it may still export Open MPI's query
    answer, sym = ask_library()
    if answer is not None:
        return CudaAwareness(answer, sym, f"{sym}() returned {int(answer)}", flavour)
    return CudaAwareness(None, "none", f"{flavour}: hpcddp cannot tell; set {ENV_OVERRIDE}=1 "
                         f"if it is {what}-aware", flavour)


def _apply_smoke(result: CudaAwareness, runner) -> CudaAwareness:
    ok, detail = runner()
    if ok is True and result.aware is None:
        return CudaAwareness(True, "smoke test", f"device-buffer all_reduce passed in a child "
                             f"process ({result.detail})", result.library)
    if ok is False:
        if result.aware:
            detail = f"{detail}, although {result.source} said yes"
        return CudaAwareness(False, "smoke test", detail, result.library)
    if ok is None:
        return CudaAwareness(result.aware, result.source,
                             f"{result.detail}; smoke test inconclusive: {detail}", result.library)
    return CudaAwareness(result.aware, result.source, f"{result.detail}; smoke test passed",
                         result.library)


_SMOKE_CODE = r"""
import sys
import torch
from mpi4py import MPI
if not torch.cuda.is_available():
    print("no-cuda"); sys.exit(3)
a = torch.arange(1, 5, dtype=torch.float32, device="cuda")
b = torch.zeros(4, dtype=torch.float32, device="cuda")
torch.cuda.synchronize()
MPI.COMM_SELF.Allreduce([a, MPI.FLOAT], [b, MPI.FLOAT], op=MPI.SUM)
torch.cuda.synchronize()
print("ok" if b.cpu().tolist() == [1.0, 2.0, 3.0, 4.0] else "wrong:" + repr(b.cpu().tolist()))
"""


def smoke_env(env: Mapping[str, str] | None = None) -> dict:
    """ENV without the launcher's job variables (the child must be an MPI singleton)."""
    env = os.environ if env is None else env
    return {k: v for k, v in env.items() if not k.startswith(_LAUNCHER_PREFIXES)}


def smoke_test(argv=None, timeout: float = 120, env: Mapping[str, str] | None = None
               ) -> tuple[bool | None, str]:
    """Run a device-buffer all_reduce in a child process: (True|False|None, detail).

    True: the result was right. False: the child died of a signal (a non-CUDA-aware MPI
    segfaults on device pointers) or returned a wrong result. None: inconclusive (no CUDA in
    the child, could not start MPI, timed out). ARGV replaces the child's command (tests).
    """
    argv = list(argv) if argv is not None else [sys.executable, "-c", _SMOKE_CODE]
    try:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                             env=smoke_env(env))
    except subprocess.TimeoutExpired:
        return None, f"the smoke test did not finish within {timeout:.0f} s"
    except OSError as exc:
        return None, f"the smoke test could not start: {exc}"
    out = res.stdout.strip().splitlines()[-1:] or [""]
    if res.returncode < 0:
        try:
            name = signal.Signals(-res.returncode).name
        except ValueError:
            name = f"signal {-res.returncode}"
        return False, f"smoke test: a device-buffer all_reduce crashed the child with {name}"
    if res.returncode == 0 and out[0] == "ok":
        return True, "device-buffer all_reduce gave the right result"
    if out[0].startswith("wrong:"):
        return False, f"smoke test: a device-buffer all_reduce gave a wrong result {out[0][6:]}"
    tail = (res.stderr.strip().splitlines() or [out[0]])[-1][:200]
    return None, f"the smoke test exited with {res.returncode} ({tail})"


# -- cached answer for this process ---------------------------------------------------------

_cache: CudaAwareness | None = None
_cache_lock = threading.Lock()


def cuda_awareness(refresh: bool = False) -> CudaAwareness:
    """:func:`detect` for this process, cached once MPI is initialised (an answer found before
    MPI_Init may change after it, so it is not kept)."""
    global _cache
    hit = _cache
    if hit is not None and not refresh:
        return hit
    with _cache_lock:
        if _cache is not None and not refresh:
            return _cache
        from hpcddp.comm._mpi import MPI
        initialized = bool(MPI.Is_initialized())
        result = detect(mpi_initialized=initialized)
        if initialized or result.source == ENV_OVERRIDE:
            _cache = result
        return result


def reset_cache() -> None:
    """Forget the cached answer (tests; after changing HPCDDP_CUDA_AWARE)."""
    global _cache
    with _cache_lock:
        _cache = None


def cuda_aware_status() -> str:
    """One line for ``hpcddp info``: "yes (MPIX_Query_cuda_support)", "no (...)" or
    "unknown (...)"."""
    return cuda_awareness().status()


# -- the gate -------------------------------------------------------------------------------

DIRECT, STAGING, HOST = "direct", "staging", "host"


def decide(aware: bool | None, *, on_device: bool, custom_op: bool = False) -> str:
    """Where a tensor's bytes go: HOST (a CPU tensor: MPI reads it), DIRECT (a device pointer
    to a CUDA-aware MPI) or STAGING (copied through pinned host memory).

    Only ``aware is True`` allows DIRECT; unknown is no. Reductions with a user-defined MPI
    op (bfloat16; float16 where MPI lacks MPIX_C_FLOAT16) are staged even then: MPI would
    call our Python op on whatever pointers it holds, and the standard does not promise host
    memory.
    """
    if not on_device:
        return HOST
    if aware is True and not custom_op:
        return DIRECT
    return STAGING


def refusal(fn: str, arg: str, device, awareness: CudaAwareness) -> str:
    return (f"{fn}: {arg} is on {device}, and this MPI is not known to be CUDA-aware "
            f"({awareness.status()}): hpcddp never hands it a device pointer (a non-CUDA-aware "
            f"MPI would crash). hpcddp's collectives stage such tensors through pinned host "
            f"memory; set {ENV_OVERRIDE}=1 only if your MPI is CUDA-aware (docs/gpu.md)")


def device_buffer(t, fn: str = "hpcddp", arg: str = "tensor", *, sync: bool = True,
                  awareness: CudaAwareness | None = None):
    """A buffer over CUDA tensor T's device memory for a CUDA-aware MPI.

    Refuses (DevicePointerRefused, before any message) unless detection says CUDA-aware.
    With SYNC, waits for T's current stream first: mpi4py does not, and MPI would otherwise
    read memory the producing kernels have not written yet. T must be contiguous and of a
    supported dtype (hpcddp.comm.buffers.check_tensor).
    """
    from hpcddp.comm.buffers import NUMPY_DTYPE, DevicePointerRefused
    awareness = awareness or cuda_awareness()
    if awareness.aware is not True:
        raise DevicePointerRefused(refusal(fn, arg, t.device, awareness))
    if sync:
        import torch
        torch.cuda.current_stream(t.device).synchronize()
    import numpy as np
    from hpcddp.comm._mpi import MPI
    np_dtype = NUMPY_DTYPE[t.dtype]
    n = t.numel()
    if n == 0:
        return np.empty(0, np_dtype)
    # numpy never reads this memory: the array only carries address, length and type to mpi4py
    return np.frombuffer(MPI.buffer.fromaddress(t.data_ptr(), n * t.element_size()),
                         dtype=np_dtype)


__all__ = ["CudaAwareness", "DIRECT", "HOST", "STAGING", "cuda_aware_status",
           "cuda_awareness", "decide", "detect", "device_buffer", "find_libmpi", "mpi_flavour",
           "parse_ompi_info", "parse_override", "query_library", "reset_cache", "smoke_test"]
