#!/usr/bin/env bash
# The README's first command: set up (or reuse) .venv, then run the main job.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-venv.sh
. .venv/bin/activate
export OMP_NUM_THREADS=1
if python -c "import hpcddp.cli.demo" 2>/dev/null; then
    exec hpcddp demo "$@"
fi
# before the end-to-end demo existed, the main job was the layout report on 4 ranks
exec python -c "from hpcddp.launch.mpirun import mpirun_command; import os, sys; c = mpirun_command(4, ['hpcddp', 'info']); os.execvp(c[0], c)"
