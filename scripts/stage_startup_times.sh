#!/usr/bin/env bash
# hpcddp stage's start-up, two source trees interleaved (docs/data.md "Start-up: no torch").
#   git worktree add /tmp/before 3fe30ad        # the last commit whose stage imported torch
#   cp hpcddp/collectives/_fastpath*.so /tmp/before/hpcddp/collectives/
#   NP=2 bash scripts/stage_startup_times.sh /tmp/before [ROUNDS]
# Prints per round: which tree, `hpcddp stage --help` seconds, and a whole
# `mpirun -n NP hpcddp stage` run of a small packed data set. "before" runs with
# PYTHONPATH=BEFORE (ahead of the editable install), "after" with this checkout.
set -euo pipefail
BEFORE=${1:?usage: stage_startup_times.sh BEFORE_TREE [ROUNDS]}
ROUNDS=${2:-5}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=$ROOT/.venv/bin/python
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
cd "$WORK"
$PY -c "import numpy as np; np.save('x.npy', np.random.rand(300, 4, 8, 8).astype('float32'))"
$PY -m hpcddp pack x.npy packed --no-progress >/dev/null
secs() { local t0; t0=$(date +%s.%N); "$@" >/dev/null 2>&1; echo "$(date +%s.%N) - $t0" | bc; }
for i in $(seq 1 "$ROUNDS"); do
  for which in before after; do
    if [ "$which" = before ]; then export PYTHONPATH=$BEFORE; else unset PYTHONPATH; fi
    help=$(secs $PY -m hpcddp stage --help)
    rm -rf "$WORK"/st-*
    run=$(secs timeout 300 "$ROOT/.venv/bin/mpirun" --allow-run-as-root --oversubscribe -n "${NP:-2}" \
          -x PYTHONPATH -x HPCDDP_RANKS_PER_NODE=1 $PY -m hpcddp stage packed "$WORK/st-{node}" \
          --no-progress --quiet)
    echo "$which help $help stage-np${NP:-2} $run"
  done
done
