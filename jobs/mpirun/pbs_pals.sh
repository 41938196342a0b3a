#!/bin/bash
# DDP on a PBS Pro cluster with Cray PALS (HPE Cray EX: Polaris, Aurora-style systems).
# An example to adapt, NOT tested here (no PBS in our CI): check your site's docs.
#
# Submit:  qsub jobs/mpirun/pbs_pals.sh
#PBS -N ddp-pbs
#PBS -l select=2:ncpus=64:ngpus=4
#PBS -l walltime=01:00:00
#PBS -l filesystems=home
#PBS -q debug
#PBS -A myproject
#PBS -j oe
#PBS -r y
# -r y: the job may be rerun (requeued) after a preemption or node failure; it resumes from
# its checkpoints (CKPT_DIR), as the Slurm templates do.

# ---- settings ---------------------------------------------------------------------------------
RANKS_PER_NODE=4           # one per GPU
DEPTH=16                   # cores per rank (ncpus / RANKS_PER_NODE); OMP_NUM_THREADS follows
SCRIPT=train.py
ARGS=()
# module load cray-python   # and activate your venv: the same software on every node

set -euo pipefail
cd "$PBS_O_WORKDIR"
NODES=$(sort -u "$PBS_NODEFILE" | wc -l)
export OMP_NUM_THREADS=$DEPTH
export CKPT_DIR=${CKPT_DIR:-$PBS_O_WORKDIR/checkpoints/${PBS_JOBID%%.*}}
mkdir -p "$CKPT_DIR"
# Cray MPICH speaks PMI (PALS), not PMIx: hpcddp reads the PALS_* variables for rank layout.
# --depth/--cpu-bind depth: DEPTH cores per rank, each rank bound to them.
# Preemption: PBS sends TERM to the job; PALS's mpiexec passes it to the ranks, which
# checkpoint (hpcddp.parallel.checkpoint handles TERM) before PBS's kill delay runs out.
echo "[job] $(date +%T) ${NODES} node(s) x ${RANKS_PER_NODE} rank(s)"
mpiexec -n $((NODES * RANKS_PER_NODE)) --ppn "$RANKS_PER_NODE" --depth "$DEPTH" \
    --cpu-bind depth hpcddp run "$SCRIPT" "${ARGS[@]}"
echo "[job] $(date +%T) done"
