#!/usr/bin/env bash
# Slurm on the virtual cluster of scripts/vcluster.sh: slurmctld on this machine (the bridge
# address), one slurmd inside each node (its own hostname, address and /scratch), its own munged.
#
#   scripts/vcluster.sh up 2 && scripts/vcluster.sh slurm-up
#   export SLURM_CONF=/run/vcluster/vc/slurm/slurm.conf
#   sbatch --nodes=2 --ntasks-per-node=2 --wrap 'srun --mpi=pmix hostname'
#   scripts/vcluster.sh slurm-down      # `down` does it too
#
# Separate from scripts/slurm-local.sh (the one-host cluster of tests/test_jobs_slurm.py) in
# every resource, so both may run at once: its own slurm.conf (clients need SLURM_CONF), its own
# controller port (PORT below), state and log dirs
# under /run/vcluster/NAME/slurm, and its own munged on its own socket (AuthInfo=socket=...), so
# stopping the other cluster's munged cannot break this one.
#
# What is real here: each slurmd is a separate host to Slurm (own NodeAddr, port 6818 in its own
# network namespace); srun's PMIx servers and the job's ranks talk across the bridge over TCP;
# SLURM_TMPDIR is /scratch/job.ID, the node's own tmpfs (TaskProlog sets it, Epilog removes it).
# Same settings as slurm-local.sh where no cgroups exist (proctrack/linuxproc, no accounting).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
NAME=${VCLUSTER_NAME:-vc}
DIR=/run/vcluster/$NAME
SDIR=$DIR/slurm
SUBNET=${VCLUSTER_SUBNET:-10.77.0}
# One controller port per cluster (7000 + the subnet's second octet: 7077 for 10.77.0) so several
# virtual clusters and slurm-local's 6817 never collide in this machine's network namespace.
IFS=. read -r _ OCTET _ <<<"$SUBNET"
PORT=$((7000 + OCTET))
SOCK=$SDIR/munge/munge.socket
HOST=$(hostname)

log() { echo "[vcluster-slurm] $*" >&2; }
die() { echo "[vcluster-slurm] error: $*" >&2; exit 1; }

alive() { [ -d "/proc/$1" ] && ! grep -qs '^State:[[:space:]]*Z' "/proc/$1/status"; }
pid_alive() { [ -f "$1" ] && alive "$(cat "$1")"; }

stop_pidfile() {  # TERM, wait up to 5 s, then KILL
    local f=$1 pid i
    [ -f "$f" ] || return 0
    pid=$(cat "$f")
    if alive "$pid"; then
        kill "$pid" 2>/dev/null || true
        for i in $(seq 25); do alive "$pid" || break; sleep 0.2; done
        alive "$pid" && kill -9 "$pid" 2>/dev/null || true
    fi
    rm -f "$f"
}

nodes() { awk '{print $1, $4}' "$DIR/nodes"; }   # NAME ADDR per node

write_conf() {
    local slots; slots=$(sed -n 's/.*slots=\([0-9]*\).*/\1/p' "$DIR/config")
    cat <<EOF
# written by hpcddp scripts/vcluster/slurm.sh
ClusterName=vc$NAME
SlurmctldHost=$HOST($SUBNET.254)
SlurmctldPort=$PORT
SlurmdPort=6818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$SOCK
CryptoType=crypto/munge
StateSaveLocation=$SDIR/ctld
SlurmdSpoolDir=$SDIR/spool/%n
TmpFS=/scratch
SlurmctldPidFile=$SDIR/run/slurmctld.pid
SlurmdPidFile=$SDIR/run/slurmd-%n.pid
SlurmctldLogFile=$SDIR/log/slurmctld.log
SlurmdLogFile=$SDIR/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
MinJobAge=3600
KillWait=10
SchedulerType=sched/backfill
TaskProlog=$SDIR/taskprolog.sh
Epilog=$SDIR/epilog.sh
EOF
    local name addr
    while read -r name addr; do
        echo "NodeName=$name NodeHostname=$name NodeAddr=$addr CPUs=$slots State=UNKNOWN"
    done < <(nodes)
    echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES"
}

start_munge() {
    pid_alive "$SDIR/munge/munged.pid" && return
    [ -s /etc/munge/munge.key ] || {
        mkdir -p /etc/munge; dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none; }
    chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
    mkdir -p "$SDIR/munge" && chown munge:munge "$SDIR/munge" && chmod 755 "$SDIR/munge"
    runuser -u munge -- munged --force --socket="$SOCK" --pid-file="$SDIR/munge/munged.pid" \
        --log-file="$SDIR/munge/munged.log" --seed-file="$SDIR/munge/munged.seed"
    local i
    for i in $(seq 50); do munge -S "$SOCK" -n </dev/null 2>/dev/null | unmunge -S "$SOCK" >/dev/null 2>&1 && return; sleep 0.1; done
    die "munged started but munge -S $SOCK -n | unmunge fails"
}

do_up() {
    [ "$(id -u)" = 0 ] || die "must run as root"
    [ -s "$DIR/nodes" ] || die "no virtual cluster '$NAME': run scripts/vcluster.sh up N first"
    command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
        && ls /usr/lib/*/slurm-wlm/mpi_pmix.so >/dev/null 2>&1 \
        || bash "$HERE/../slurm-local.sh" install
    # Debian's mpi_pmix.so dlopen()s libpmix.so, a link only libpmix-dev ships (slurm-local.sh).
    local d; for d in /usr/lib/*/pmix2/lib; do [ -e "$d/libpmix.so" ] || ln -s libpmix.so.2 "$d/libpmix.so"; done
    do_down quiet
    mkdir -p "$SDIR"/{ctld,spool,run,log}
    write_conf >"$SDIR/slurm.conf"
    cat >"$SDIR/taskprolog.sh" <<'EOF'
#!/bin/sh
# Per-job scratch on the node's own tmpfs, as sites provide it: templates read $SLURM_TMPDIR.
d=/scratch/job.$SLURM_JOB_ID
mkdir -p "$d" && echo "export SLURM_TMPDIR=$d"
EOF
    cat >"$SDIR/epilog.sh" <<'EOF'
#!/bin/sh
rm -rf "/scratch/job.$SLURM_JOB_ID"
exit 0
EOF
    chmod 755 "$SDIR/taskprolog.sh" "$SDIR/epilog.sh"
    start_munge
    export SLURM_CONF=$SDIR/slurm.conf
    slurmctld -c -i -f "$SLURM_CONF"
    local name addr
    while read -r name addr; do
        mkdir -p "$SDIR/spool/$name"
        bash "$HERE/../vcluster.sh" run "$name" slurmd -c -N "$name" -f "$SLURM_CONF"
    done < <(nodes)
    local n i state; n=$(wc -l <"$DIR/nodes")
    for i in $(seq 150); do
        state=$(sinfo -h -N -o '%N %t' 2>/dev/null || true)
        if [ "$(grep -cE ' (idle|mix|alloc)$' <<<"$state")" -ge "$n" ]; then
            log "up: $n slurmd(s), slurmctld on $SUBNET.254:$PORT; export SLURM_CONF=$SLURM_CONF"
            return 0
        fi
        sleep 0.2
    done
    sinfo -N >&2 || true; tail -n 20 "$SDIR"/log/*.log >&2 || true
    die "slurm nodes did not come up in 30 s"
}

do_down() {
    local f
    # slurmds die with their nodes (vcluster.sh down); stop them here too for slurm-down alone.
    for f in "$SDIR"/run/slurmd-*.pid; do [ -e "$f" ] && stop_pidfile "$f"; done
    stop_pidfile "$SDIR/run/slurmctld.pid"
    stop_pidfile "$SDIR/munge/munged.pid"
    rm -rf "$SDIR"
    [ "${1:-}" = quiet ] || log "down"
}

case "${1:-}" in
    up) do_up ;;
    down) do_down ;;
    conf) write_conf ;;
    *) die "unknown command '${1:-}'; use up, down or conf" ;;
esac
