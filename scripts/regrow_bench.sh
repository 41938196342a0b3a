#!/bin/bash
# Elastic grow-back on this machine: kill -> full size, and steps/s before the loss and after
# the job is whole again, in the same job (python -m hpcddp.elastic.bench --regrow-kill).
# Usage: scripts/regrow_bench.sh OUTDIR [RUNS] [spawn|spares]   (docs/elastic.md, "Growing back")
#   spawn:  the replacement is started after the loss (MPI_Comm_spawn) -> OUTDIR/regrow-bench.txt
#   spares: one spare process started with the job takes the place (HPCDDP_ELASTIC_SPARES=1)
#           -> OUTDIR/spares-bench.txt
set -euo pipefail
out=${1:?usage: scripts/regrow_bench.sh OUTDIR [RUNS] [spawn|spares]}
runs=${2:-3}
mode=${3:-spawn}
case "$mode" in
    spawn) spares=0; file=regrow-bench.txt ;;
    spares) spares=1; file=spares-bench.txt ;;
    *) echo "regrow_bench.sh: mode must be spawn or spares, got '$mode'" >&2; exit 2 ;;
esac
mkdir -p "$out"
root=(); [ "$(id -u)" = 0 ] && root=(--allow-run-as-root)
for n in 3 4; do
    for i in $(seq 1 "$runs"); do
        echo "== $n ranks ($mode), run $i ($(date -u +%FT%TZ), load $(cut -d' ' -f1 /proc/loadavg))"
        OMP_NUM_THREADS=1 HPCDDP_ELASTIC_SPARES=$spares timeout 300 mpirun "${root[@]}" \
            --oversubscribe --with-ft ulfm -x HPCDDP_ELASTIC_SPARES -n "$((n + spares))" \
            python -m hpcddp.elastic.bench --regrow-kill "$((n - 2))@100" --steps 300 2>&1 \
            | grep -E "after/before|kill -> full size|recovered in"
    done
done | tee "$out/$file"
