#!/bin/bash
# Elastic grow-back on this machine: kill -> full size, and steps/s before the loss and after
# the job is whole again, in the same job (python -m hpcddp.elastic.bench --regrow-kill).
# Usage: scripts/regrow_bench.sh OUTDIR [RUNS]   (docs/elastic.md, "Growing back")
set -euo pipefail
out=${1:?usage: scripts/regrow_bench.sh OUTDIR [RUNS]}
runs=${2:-3}
mkdir -p "$out"
root=(); [ "$(id -u)" = 0 ] && root=(--allow-run-as-root)
for n in 3 4; do
    for i in $(seq 1 "$runs"); do
        echo "== $n ranks, run $i ($(date -u +%FT%TZ), load $(cut -d' ' -f1 /proc/loadavg))"
        OMP_NUM_THREADS=1 timeout 300 mpirun "${root[@]}" --oversubscribe --with-ft ulfm -n "$n" \
            python -m hpcddp.elastic.bench --regrow-kill "$((n - 2))@100" --steps 300 2>&1 \
            | grep -E "after/before|kill -> full size|recovered in"
    done
done | tee "$out/regrow-bench.txt"
