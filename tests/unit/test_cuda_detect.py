"""CUDA-awareness detection for every MPI flavour, from faked environments and libraries.

``hpcddp.comm.cuda.detect`` takes every input as an argument (environment, library version
string, a ctypes-like library, whether MPI is initialised, ompi_info's output, the smoke
test), so each flavour's rules are checked here without that MPI and without a GPU. The real
library of this machine is asked once at the end (the pip Open MPI: built without CUDA).
"""
from __future__ import annotations

import ctypes
import sys

import pytest

from hpcddp import settings
from hpcddp.comm import cuda
from hpcddp.comm.cuda import CudaAwareness, decide, detect

OMPI = "Open MPI v5.0.11, package: Open MPI user@localhost Distribution, ident: 5.0.11"
OMPI4 = "Open MPI v4.1.6, package: Debian OpenMPI, ident: 4.1.6, repo rev: v4.1.6"
MPICH = "MPICH Version:      4.1.2\nMPICH Release date: Wed Jun  7 15:22:45 CDT 2023"
CRAY = "MPI VERSION    : CRAY MPICH version 8.1.27.26 (ANL base 3.4a2)"
MVAPICH = "MVAPICH2 Version      :\t2.3.7\nMVAPICH2 Release date :\tWed March 02 22:00:00 EST 2022"
INTEL = "Intel(R) MPI Library 2021.10 for Linux* OS"


class Fn:
    """A ctypes function stand-in: records calls, returns a fixed value."""

    def __init__(self, ret: int, flag: int | None = None):
        self.ret, self.flag, self.calls = ret, flag, []

    def __call__(self, *args):
        self.calls.append(args)
        if self.flag is not None:        # MPIX_GPU_query_support(type, int *flag)
            args[1].contents.value = self.flag
        return self.ret


class FakeLib:
    def __init__(self, **symbols):
        for k, v in symbols.items():
            setattr(self, k, v)


class Exploding:
    """A library that must not be asked (MPI not initialised, or env decides first)."""

    def __getattr__(self, name):
        raise AssertionError(f"the library was asked for {name}")


def no_ompi_info():
    raise AssertionError("ompi_info must not run here")


def run(version, env=None, lib=None, initialized=True, ompi_info=no_ompi_info, **kw):
    return detect(env=env or {}, library_version=version, lib=lib, mpi_initialized=initialized,
                  ompi_info=ompi_info, smoke=kw.pop("smoke", False), gpu=kw.pop("gpu", "cuda"),
                  **kw)


# -- flavour, library path, parsers ---------------------------------------------------------

@pytest.mark.parametrize("text,name", [
    (OMPI, "Open MPI"), (OMPI4, "Open MPI"), (MPICH, "MPICH"), (CRAY, "Cray MPICH"),
    (MVAPICH, "MVAPICH"), (INTEL, "Intel MPI"),
    ("Fujitsu MPI Library 4.0, foo", "Fujitsu MPI Library 4.0"),
])
def test_mpi_flavour(text, name):
    assert cuda.mpi_flavour(text) == name


MAPS = """\
7f0000000000-7f0000001000 r--p 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6
7f0000002000-7f0000003000 r-xp 00000000 08:01 2 {gtl}
7f0000004000-7f0000005000 r-xp 00000000 08:01 3 {lib}
7f0000006000-7f0000007000 r-xp 0 08:01 4 /sp/mpi4py/MPI.openmpi.cpython-311-x86_64-linux-gnu.so
"""


@pytest.mark.parametrize("lib", [
    "/venv/lib/libmpi.so.40", "/opt/cray/pe/mpich/8.1.27/ofi/gnu/9.1/lib/libmpi_cray.so.12",
    "/usr/lib/x86_64-linux-gnu/libmpich.so.12", "/opt/mvapich2/lib/libmpi.so.12.1.1",
    "/opt/intel/oneapi/mpi/2021.10.0/lib/release/libmpi.so.12"])
def test_find_libmpi_skips_gtl_and_the_mpi4py_extension(lib):
    text = MAPS.format(gtl="/opt/cray/pe/mpich/8.1.27/gtl/lib/libmpi_gtl_cuda.so.0", lib=lib)
    assert cuda.find_libmpi(text) == lib


def test_find_libmpi_none():
    assert cuda.find_libmpi(MAPS.format(gtl="/x/libfoo.so", lib="/x/libbar.so")) is None


def test_find_libmpi_this_process():
    from hpcddp.comm._mpi import MPI  # noqa: F401  (loads the library)
    path = cuda.find_libmpi()
    assert path is not None and "libmpi" in path


def test_query_library_open_mpi_style():
    assert cuda.query_library(FakeLib(MPIX_Query_cuda_support=Fn(1))) == (
        True, "MPIX_Query_cuda_support")
    assert cuda.query_library(FakeLib(MPIX_Query_cuda_support=Fn(0))) == (
        False, "MPIX_Query_cuda_support")


def test_query_library_rocm_uses_its_own_symbol():
    lib = FakeLib(MPIX_Query_cuda_support=Fn(1), MPIX_Query_rocm_support=Fn(0))
    assert cuda.query_library(lib, "rocm") == (False, "MPIX_Query_rocm_support")


def test_query_library_mpich_gpu_query():
    fn = Fn(0, flag=1)
    assert cuda.query_library(FakeLib(MPIX_GPU_query_support=fn)) == (
        True, "MPIX_GPU_query_support")
    assert fn.calls[0][0] == 0              # MPIX_GPU_SUPPORT_CUDA
    fn = Fn(0, flag=0)
    assert cuda.query_library(FakeLib(MPIX_GPU_query_support=fn), "rocm") == (
        False, "MPIX_GPU_query_support")
    assert fn.calls[0][0] == 2              # MPIX_GPU_SUPPORT_HIP
    # an error return is no answer
    assert cuda.query_library(FakeLib(MPIX_GPU_query_support=Fn(1, flag=1))) == (None, "")


def test_query_library_nothing():
    assert cuda.query_library(FakeLib()) == (None, "")
    assert cuda.query_library(None) == (None, "")


def test_query_library_real_ctypes_symbol():
    """The ctypes plumbing on a real library function (libc's getpid stands in: int(void))."""
    libc = ctypes.CDLL(None)
    lib = FakeLib(MPIX_Query_cuda_support=libc.getpid)
    assert cuda.query_library(lib) == (True, "MPIX_Query_cuda_support")


OMPI5_INFO = """\
mca:opal:base:param:opal_built_with_cuda_support:value:{cuda}
mca:opal:base:param:opal_built_with_cuda_support:source:default
mca:opal:base:param:opal_built_with_rocm_support:value:{rocm}
"""
OMPI4_INFO = "mca:mpi:base:param:mpi_built_with_cuda_support:value:{cuda}\n"


def test_parse_ompi_info():
    assert cuda.parse_ompi_info(OMPI5_INFO.format(cuda="true", rocm="false")) is True
    assert cuda.parse_ompi_info(OMPI5_INFO.format(cuda="false", rocm="true")) is False
    assert cuda.parse_ompi_info(OMPI5_INFO.format(cuda="false", rocm="true"), "rocm") is True
    assert cuda.parse_ompi_info(OMPI4_INFO.format(cuda="true")) is True
    assert cuda.parse_ompi_info(OMPI4_INFO.format(cuda="false")) is False
    assert cuda.parse_ompi_info("config:cli: --without-cuda\n") is None
    assert cuda.parse_ompi_info("") is None


def test_parse_override():
    assert cuda.parse_override(None) is None
    assert cuda.parse_override("1") is True
    assert cuda.parse_override(" 0 ") is False
    assert cuda.parse_override("auto") is None and cuda.parse_override("") is None
    with pytest.raises(ValueError, match=r"HPCDDP_CUDA_AWARE='yes': expected one of 0, 1 or auto"):
        cuda.parse_override("yes")


# -- detect(): each flavour -----------------------------------------------------------------

@pytest.mark.parametrize("version", [OMPI, MPICH, CRAY, MVAPICH, INTEL, "Mystery MPI 1.0"])
def test_override_wins_everywhere(version):
    yes = run(version, env={"HPCDDP_CUDA_AWARE": "1"}, lib=Exploding())
    assert (yes.aware, yes.source) == (True, "HPCDDP_CUDA_AWARE")
    no = run(version, env={"HPCDDP_CUDA_AWARE": "0", "MPICH_GPU_SUPPORT_ENABLED": "1"},
             lib=FakeLib(MPIX_Query_cuda_support=Fn(1)))
    assert (no.aware, no.source) == (False, "HPCDDP_CUDA_AWARE")
    assert no.status() == "no (HPCDDP_CUDA_AWARE=0 set by the user)"


def test_override_auto_detects():
    r = run(OMPI, env={"HPCDDP_CUDA_AWARE": "auto"}, lib=FakeLib(MPIX_Query_cuda_support=Fn(1)))
    assert (r.aware, r.source) == (True, "MPIX_Query_cuda_support")


def test_bad_override_is_rejected():
    with pytest.raises(ValueError, match="expected one of 0, 1 or auto"):
        run(OMPI, env={"HPCDDP_CUDA_AWARE": "true"})


def test_open_mpi_asks_the_library():
    r = run(OMPI, lib=FakeLib(MPIX_Query_cuda_support=Fn(1)))
    assert (r.aware, r.source, r.library) == (True, "MPIX_Query_cuda_support", "Open MPI")
    assert r.status() == "yes (MPIX_Query_cuda_support)"
    r = run(OMPI, lib=FakeLib(MPIX_Query_cuda_support=Fn(0)))
    assert (r.aware, r.source) == (False, "MPIX_Query_cuda_support")
    assert r.status() == "no (MPIX_Query_cuda_support() returned 0)"


@pytest.mark.parametrize("info,aware", [
    (OMPI5_INFO.format(cuda="true", rocm="false"), True),
    (OMPI4_INFO.format(cuda="false"), False),
])
def test_open_mpi_falls_back_to_ompi_info(info, aware):
    # the symbol is missing (extension disabled by the admin)
    r = run(OMPI4, lib=FakeLib(), ompi_info=lambda: info)
    assert (r.aware, r.source) == (aware, "ompi_info")
    assert "MPIX_Query_cuda_support not in the library" in r.detail


def test_open_mpi_before_init_uses_ompi_info_not_the_library():
    r = run(OMPI, lib=Exploding(), initialized=False,
            ompi_info=lambda: OMPI5_INFO.format(cuda="true", rocm="false"))
    assert (r.aware, r.source) == (True, "ompi_info")
    assert "not initialised" in r.detail


def test_open_mpi_without_any_answer_is_unknown():
    r = run(OMPI, lib=FakeLib(), ompi_info=lambda: None)
    assert r.aware is None and r.status().startswith("unknown (Open MPI:")


def test_open_mpi_rocm():
    lib = FakeLib(MPIX_Query_cuda_support=Fn(0), MPIX_Query_rocm_support=Fn(1))
    r = run(OMPI, lib=lib, gpu="rocm")
    assert (r.aware, r.source) == (True, "MPIX_Query_rocm_support")


def test_cray_mpich_needs_gpu_support_enabled():
    r = run(CRAY, lib=Exploding())
    assert (r.aware, r.source) == (False, "MPICH_GPU_SUPPORT_ENABLED")
    assert "MPICH_GPU_SUPPORT_ENABLED=1" in r.status()
    r = run(CRAY, env={"MPICH_GPU_SUPPORT_ENABLED": "0"}, lib=Exploding())
    assert r.aware is False
    r = run(CRAY, env={"MPICH_GPU_SUPPORT_ENABLED": "1"}, lib=FakeLib())
    assert (r.aware, r.source) == (True, "MPICH_GPU_SUPPORT_ENABLED")
    # with the variable set, the library's own answer counts when it has one
    r = run(CRAY, env={"MPICH_GPU_SUPPORT_ENABLED": "1"},
            lib=FakeLib(MPIX_GPU_query_support=Fn(0, flag=0)))
    assert (r.aware, r.source) == (False, "MPIX_GPU_query_support")


def test_mvapich_needs_mv2_use_cuda():
    r = run(MVAPICH, lib=Exploding())
    assert (r.aware, r.source) == (False, "MV2_USE_CUDA")
    r = run(MVAPICH, env={"MV2_USE_CUDA": "1"}, lib=FakeLib())
    assert (r.aware, r.source) == (True, "MV2_USE_CUDA")
    r = run(MVAPICH, env={"MV2_USE_CUDA": "1"}, lib=FakeLib(MPIX_Query_cuda_support=Fn(0)))
    assert (r.aware, r.source) == (False, "MPIX_Query_cuda_support")


def test_mpich():
    r = run(MPICH, env={"MPIR_CVAR_ENABLE_GPU": "0"}, lib=Exploding())
    assert (r.aware, r.source) == (False, "MPIR_CVAR_ENABLE_GPU")
    r = run(MPICH, lib=FakeLib(MPIX_GPU_query_support=Fn(0, flag=1)))
    assert (r.aware, r.source) == (True, "MPIX_GPU_query_support")
    r = run(MPICH, env={"MPIR_CVAR_ENABLE_GPU": "1"},
            lib=FakeLib(MPIX_GPU_query_support=Fn(0, flag=0)))
    assert r.aware is False
    # MPICH >= 4.1 also exports Open MPI's query
    r = run(MPICH, lib=FakeLib(MPIX_Query_cuda_support=Fn(1)))
    assert (r.aware, r.source) == (True, "MPIX_Query_cuda_support")
    r = run(MPICH, lib=FakeLib())
    assert r.aware is None and "MPICH < 4.0" in r.detail
    r = run(MPICH, lib=Exploding(), initialized=False)
    assert r.aware is None and "not initialised" in r.detail


def test_intel_mpi():
    r = run(INTEL, lib=Exploding())
    assert (r.aware, r.source) == (False, "I_MPI_OFFLOAD")
    r = run(INTEL, env={"I_MPI_OFFLOAD": "1"}, lib=Exploding())
    assert r.aware is None and "HPCDDP_CUDA_AWARE=1" in r.detail


def test_unknown_mpi():
    r = run("Mystery MPI 1.0, build 7", lib=FakeLib())
    assert r.aware is None and r.library == "Mystery MPI 1.0"
    r = run("Mystery MPI 1.0", lib=FakeLib(MPIX_Query_cuda_support=Fn(1)))
    assert r.aware is True


# -- the smoke test -------------------------------------------------------------------------

def test_smoke_runs_only_when_asked_and_useful():
    def boom():
        raise AssertionError("smoke test ran")
    run(OMPI, lib=FakeLib(MPIX_Query_cuda_support=Fn(1)), smoke_runner=boom)   # not asked
    run(OMPI, lib=FakeLib(MPIX_Query_cuda_support=Fn(0)), smoke=True, smoke_runner=boom)  # no


def test_smoke_env_variable_asks_for_it():
    calls = []
    run(OMPI, env={"HPCDDP_CUDA_SMOKE": "1"}, lib=FakeLib(MPIX_Query_cuda_support=Fn(1)),
        smoke=None, smoke_runner=lambda: calls.append(1) or (True, "ok"))
    assert calls == [1]


def test_smoke_crash_turns_yes_into_no():
    r = run(OMPI, lib=FakeLib(MPIX_Query_cuda_support=Fn(1)), smoke=True,
            smoke_runner=lambda: (False, "smoke test: crashed the child with SIGSEGV"))
    assert (r.aware, r.source) == (False, "smoke test")
    assert "SIGSEGV" in r.detail and "MPIX_Query_cuda_support said yes" in r.detail


def test_smoke_pass_turns_unknown_into_yes():
    r = run(MPICH, lib=FakeLib(), smoke=True, smoke_runner=lambda: (True, "ok"))
    assert (r.aware, r.source) == (True, "smoke test")


def test_smoke_inconclusive_keeps_the_answer():
    r = run(MPICH, lib=FakeLib(), smoke=True, smoke_runner=lambda: (None, "no CUDA"))
    assert r.aware is None and "inconclusive: no CUDA" in r.detail
    r = run(OMPI, lib=FakeLib(MPIX_Query_cuda_support=Fn(1)), smoke=True,
            smoke_runner=lambda: (True, "ok"))
    assert (r.aware, r.source) == (True, "MPIX_Query_cuda_support")
    assert "smoke test passed" in r.detail


def _child(code: str):
    return [sys.executable, "-c", code]


def test_smoke_test_child_outcomes():
    """The real runner on stand-in children: a segfault, a right answer, a wrong answer, a
    child without CUDA, a hang (all in child processes: the test process survives)."""
    ok, detail = cuda.smoke_test(_child("import os, signal; os.kill(os.getpid(), "
                                        "signal.SIGSEGV)"), timeout=60)
    assert ok is False and "SIGSEGV" in detail
    assert cuda.smoke_test(_child("print('ok')"), timeout=60)[0] is True
    ok, detail = cuda.smoke_test(_child("print('wrong:[0.0]')"), timeout=60)
    assert ok is False and "wrong result" in detail
    ok, detail = cuda.smoke_test(_child("import sys; print('no-cuda'); sys.exit(3)"), timeout=60)
    assert ok is None and "exited with 3" in detail
    ok, detail = cuda.smoke_test(_child("import time; time.sleep(30)"), timeout=1)
    assert ok is None and "did not finish" in detail


def test_smoke_child_is_a_singleton():
    env = {"OMPI_COMM_WORLD_RANK": "1", "PMIX_RANK": "1", "PMI_RANK": "1", "SLURM_PROCID": "1",
           "HYDRA_CONTROL_FD": "5", "PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0",
           "MPICH_GPU_SUPPORT_ENABLED": "1", "MV2_USE_CUDA": "1"}
    assert cuda.smoke_env(env) == {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0",
                                   "MPICH_GPU_SUPPORT_ENABLED": "1", "MV2_USE_CUDA": "1"}


# -- the decision and the gate --------------------------------------------------------------

def test_decide():
    assert decide(True, on_device=False) == "host"
    assert decide(None, on_device=False) == "host"
    assert decide(True, on_device=True) == "direct"
    assert decide(False, on_device=True) == "staging"
    assert decide(None, on_device=True) == "staging"       # unknown is no
    assert decide(True, on_device=True, custom_op=True) == "staging"


def test_device_buffer_refuses_without_awareness():
    import torch
    from hpcddp.comm.buffers import DevicePointerRefused
    for aware in (False, None):
        a = CudaAwareness(aware, "test", "faked", "x")
        with pytest.raises(DevicePointerRefused, match=r"broadcast: tensor is on cpu, and this "
                                                      r"MPI is not known to be CUDA-aware"):
            cuda.device_buffer(torch.ones(3), "broadcast", "tensor", sync=False, awareness=a)
    buf = cuda.device_buffer(torch.ones(3, dtype=torch.bfloat16), sync=False,
                             awareness=CudaAwareness(True, "test", "faked", "x"))
    assert buf.nbytes == 6 and str(buf.dtype) == "uint16"


# -- this machine ---------------------------------------------------------------------------

def test_this_machine(monkeypatch):
    """The real library: the pip Open MPI answers through MPIX_Query_cuda_support, and the
    cached status line is what `hpcddp info` prints."""
    monkeypatch.delenv("HPCDDP_CUDA_AWARE", raising=False)
    monkeypatch.delenv("HPCDDP_CUDA_SMOKE", raising=False)
    from hpcddp.comm._mpi import MPI
    cuda.reset_cache()
    r = cuda.cuda_awareness()
    if cuda.mpi_flavour(MPI.Get_library_version()) == "Open MPI" and MPI.Is_initialized():
        assert r.source == "MPIX_Query_cuda_support"
        assert r.aware in (True, False)
        # the build-time answer agrees when the runtime one is yes
        if r.aware:
            assert cuda.parse_ompi_info(cuda.run_ompi_info(cuda.find_libmpi())) is True
    assert cuda.cuda_awareness() is cuda.cuda_awareness()      # cached
    status = cuda.cuda_aware_status()
    assert status.split(" ", 1)[0] in ("yes", "no", "unknown")
    # the process's settings say HPCDDP_CUDA_AWARE=1 (as if set before it started)
    monkeypatch.setattr(settings, "_current", settings.get().replace(cuda_aware="1"))
    assert cuda.cuda_awareness() is r                           # still cached
    cuda.reset_cache()
    assert cuda.cuda_aware_status() == "yes (HPCDDP_CUDA_AWARE)"
    monkeypatch.undo()
    cuda.reset_cache()
