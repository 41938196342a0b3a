"""scikit-learn's digits written as PNG files in class folders, with a fixed held-out split.

The data: 1,797 real 8x8 grey-scale handwritten digits (values 0..16) that ship inside
scikit-learn (``sklearn.datasets.load_digits``; no download). They are written the way a user's
own image data usually sits on a shared filesystem::

    ROOT/
      train/0/00000.png  train/0/00010.png ...  train/9/...
      test/0/...                                  test/9/...
      SPLIT.json           what was written: seed, test fraction, counts per split and class

File names are the sample's index in scikit-learn's array, so a file can be traced back.
The split is stratified (the same fraction of each class held out) and depends only on
``seed``, ``test_fraction`` and ``limit``: the same arguments write the same bytes.

Needs numpy, pillow and scikit-learn; no MPI, no torch.
"""
from __future__ import annotations

import io
import json
import os
import shutil

import numpy as np

MARKER = "SPLIT.json"
SPLITS = ("train", "test")


def load_arrays():
    """(images uint8 [N, 8, 8] scaled to 0..255, labels int64 [N]) from scikit-learn's public
    loader, ``sklearn.datasets.load_digits`` (its data file ships inside scikit-learn)."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise ImportError("load_arrays: the demo's data set ships with scikit-learn; install "
                          "it with `pip install 'hpcddp[demo]'` (or scikit-learn)") from None
    d = load_digits()
    pixels, target = d.images, d.target
    # 0..16 -> 0..255 (rounded): the PNGs look like images; the model divides by 255
    images = np.rint(pixels * (255.0 / 16.0)).astype(np.uint8)
    return images, target.astype(np.int64)


def split_indices(labels: np.ndarray, *, test_fraction: float = 0.2, seed: int = 0,
                  limit: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(train indices, test indices), each ascending: a stratified split, fixed by ``seed``.

    limit: keep only this many samples in all (a stratified subset, for small test runs).
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"split_indices: test_fraction={test_fraction!r}, expected a number "
                         f"strictly between 0 and 1")
    n = len(labels)
    rng = np.random.default_rng(seed)
    keep = np.arange(n)
    if limit is not None:
        if not isinstance(limit, int) or not 20 <= limit <= n:
            raise ValueError(f"split_indices: limit={limit!r}, expected an int from 20 (two per "
                             f"class) to {n} (every sample)")
        keep = np.sort(rng.permutation(n)[:limit])
    train, test = [], []
    for c in np.unique(labels[keep]):
        members = keep[labels[keep] == c]
        members = members[rng.permutation(len(members))]
        k = max(1, int(round(len(members) * test_fraction)))
        test.append(members[:k])
        train.append(members[k:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


def write_digits(root: str, *, test_fraction: float = 0.2, seed: int = 0,
                 limit: int | None = None, overwrite: bool = True) -> dict:
    """Write the digits as ``ROOT/{train,test}/<class>/<index>.png``; return the split summary.

    overwrite: replace a folder this function wrote before (recognised by its SPLIT.json);
        a non-empty folder without that marker is never deleted.
    Called by one process.
    """
    from PIL import Image

    root = os.fspath(root)
    if os.path.isdir(root) and os.listdir(root):
        if not (overwrite and os.path.exists(os.path.join(root, MARKER))):
            raise FileExistsError(
                f"write_digits: {root!r} is not empty and was not written by write_digits "
                f"(no {MARKER}); choose an empty or new folder")
        for name in SPLITS:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        os.remove(os.path.join(root, MARKER))
    images, labels = load_arrays()
    train, test = split_indices(labels, test_fraction=test_fraction, seed=seed, limit=limit)
    summary = {"source": "sklearn.datasets.load_digits", "seed": seed,
               "test_fraction": test_fraction, "limit": limit, "splits": {}}
    for name, idx in zip(SPLITS, (train, test)):
        for c in range(10):
            os.makedirs(os.path.join(root, name, str(c)), exist_ok=True)
        for i in idx:
            buf = io.BytesIO()
            Image.fromarray(images[i], mode="L").save(buf, format="PNG")
            path = os.path.join(root, name, str(int(labels[i])), f"{int(i):05d}.png")
            # one plain write: PIL's save(path) opens the file read-write and costs ~10x more
            with open(path, "wb") as f:
                f.write(buf.getvalue())
        summary["splits"][name] = {
            "samples": int(len(idx)),
            "per_class": [int(x) for x in np.bincount(labels[idx], minlength=10)]}
    # written last: its presence says the folder is complete
    with open(os.path.join(root, MARKER), "w") as f:
        json.dump(summary, f, indent=1, sort_keys=True)
        f.write("\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    """``python -m hpcddp.demo.digits OUT``: write the PNG folders (jobs/slurm/demo.sbatch)."""
    import argparse
    p = argparse.ArgumentParser(prog="python -m hpcddp.demo.digits",
                                description="Write scikit-learn's digits as PNG files in "
                                            "OUT/{train,test}/<class>/ with a fixed split.")
    p.add_argument("out", help="folder to write (created; replaced if this tool wrote it)")
    p.add_argument("--test-fraction", type=float, default=0.2, metavar="F")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit", type=int, default=None, metavar="N",
                   help="only N samples in all (a stratified subset)")
    args = p.parse_args(argv)
    try:
        s = write_digits(args.out, test_fraction=args.test_fraction, seed=args.seed,
                         limit=args.limit)
    except (ValueError, FileExistsError) as exc:
        import sys
        print(f"python -m hpcddp.demo.digits: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {s['splits']['train']['samples']} train + {s['splits']['test']['samples']} "
          f"test digits to {os.path.abspath(args.out)}/{{train,test}}/<class>/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
