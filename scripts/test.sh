#!/usr/bin/env bash
# Set up (or reuse) .venv and run every test: unit tests, MPI jobs at 2, 3 and 4 ranks,
# the docs build, job templates on a local Slurm (when it can start), benchmark smoke runs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-venv.sh
. .venv/bin/activate
export OMP_NUM_THREADS=1
echo "[test] mkdocs build --strict"
mkdocs build --strict --quiet --site-dir "$(mktemp -d)"
echo "[test] pytest"
exec python -m pytest --durations=25 "$@"
