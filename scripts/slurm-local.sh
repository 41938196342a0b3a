#!/usr/bin/env bash
# A real Slurm on this one machine, for testing job templates (tests/test_jobs_slurm.py, docs/jobs.md).
#
#   scripts/slurm-local.sh start     # install if needed, configure, start munged/slurmctld/slurmd(s)
#   scripts/slurm-local.sh status    # sinfo + the daemons' pids
#   scripts/slurm-local.sh stop      # stop what start started
#   scripts/slurm-local.sh install   # only the apt-get step
#   scripts/slurm-local.sh config    # print the slurm.conf that start would write
#
# Idempotent: `start` on a running cluster with an unchanged config returns at once; a changed
# config (other node count, ...) restarts the daemons. Needs root and Debian/Ubuntu packages
# (slurm-wlm 22.05 on Debian 12). Settings, from the environment:
#
#   SLURM_LOCAL_NODES=2   Slurm nodes on this host: 1 is the plain one-node cluster named after
#                         `hostname`; 2+ runs one slurmd per node (`slurmd -N`), each on its own
#                         port, so multi-node templates really span "nodes" (one host underneath)
#   SLURM_LOCAL_CPUS=     CPUs per Slurm node (default: the host's online CPUs). Every node advertises them, so two
#                         nodes on a 2-core host oversubscribe the cores 2x: keep test jobs small
#   SLURM_LOCAL_GPUS=2    count-only "gpu" GRES per node (no devices behind them) so GPU templates'
#                         --gpus-per-node directives schedule here unchanged; 0 turns it off
#   SLURM_LOCAL_DIR=/var/lib/slurm-local   state, spool, logs, per-node scratch
#
# Why these settings (the machine has no systemd and no cgroup delegation, and runs as root):
#   proctrack/linuxproc + task/affinity  work without cgroups (task/affinity pins tasks with
#   sched_setaffinity, so --cpu-bind works as on a cluster); SlurmUser=root  no slurm user needed;
#   select/cons_tres CR_Core  schedule cores (and GRES) like a real cluster; OverSubscribe=YES
#   lets several small jobs share the cores when they ask for it (--oversubscribe);
#   no slurmdbd, so `sacct` has no data: MinJobAge keeps finished jobs in `scontrol show job`,
#   and jobcomp/filetxt writes one line per finished job to $SLURM_LOCAL_DIR/jobcomp.log.
#   TmpFS per node (%n): slurmd's PMIx plugin makes its client dir "spmix_appdir_<job>.<step>"
#   under TmpFS, so two slurmds sharing /tmp collide ("File exists") and srun --mpi=pmix fails.
#   A TaskProlog exports SLURM_TMPDIR (a per-job scratch dir, as many sites do) and the Epilog
#   removes it. With 2+ nodes each slurmd has its own hostname and its own scratch disk (UTS and
#   mount namespaces), so staging to node-local scratch is exercised as on a cluster.
set -euo pipefail

NODES=${SLURM_LOCAL_NODES:-2}
# Not plain `nproc`: GNU nproc answers OMP_NUM_THREADS when it is set, and scripts/test.sh sets
# it to 1, which made every Slurm node a 1-CPU node and 2-task jobs unschedulable.
CPUS=${SLURM_LOCAL_CPUS:-$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)}
GPUS=${SLURM_LOCAL_GPUS:-2}
DIR=${SLURM_LOCAL_DIR:-/var/lib/slurm-local}
CONF=/etc/slurm/slurm.conf
MUNGE_PID=/run/munge/munged.pid   # munged runs as munge: its pid file lives where it may write
HOST=$(hostname)
MARK="# written by hpcddp scripts/slurm-local.sh"
# A changed script (new prolog, new namespaces) must restart the daemons, as a changed config does.
SELF_HASH=$(md5sum <"${BASH_SOURCE[0]}" | cut -c1-12)

log() { echo "[slurm-local] $*" >&2; }
die() { echo "[slurm-local] error: $*" >&2; exit 1; }

need_root() { [ "$(id -u)" = 0 ] || die "must run as root (it installs packages and starts daemons)"; }

node_names() {
    if [ "$NODES" -le 1 ]; then echo "$HOST"; return; fi
    local i; for i in $(seq 1 "$NODES"); do echo "node$i"; done
}

installed() {
    command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
        && command -v munged >/dev/null && dpkg -s libpmix2 >/dev/null 2>&1 \
        && ls /usr/lib/*/slurm-wlm/mpi_pmix.so >/dev/null 2>&1
}

do_install() {
    need_root
    if installed; then log "slurm, munge and libpmix2 already installed"; return; fi
    command -v apt-get >/dev/null || die "no apt-get: install slurm-wlm, munge and libpmix2 by hand"
    log "apt-get install slurm-wlm munge libpmix2 (a minute on a fresh machine)"
    # libpmix2 must be there before slurmd starts, or `srun --mpi=pmix` fails (mpi_pmix is loaded then).
    DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        slurm-wlm munge libpmix2 >/dev/null
    installed || die "packages installed but slurmctld/slurmd/sbatch/munged/mpi_pmix.so not found"
}

fix_pmix_link() {
    # Debian's mpi_pmix.so dlopen()s .../pmix2/lib/libpmix.so, a link shipped only by libpmix-dev
    # (which drags in autotools and -dev packages); without it slurmd logs "pmi/pmix: can not load
    # PMIx library" and `srun --mpi=pmix` fails. The link is all that is needed.
    local d
    for d in /usr/lib/*/pmix2/lib; do
        [ -e "$d/libpmix.so" ] || ln -s libpmix.so.2 "$d/libpmix.so"
    done
}

write_conf() {  # the full slurm.conf on stdout
    local port=6818 name
    cat <<EOF
$MARK (SLURM_LOCAL_NODES=$NODES SLURM_LOCAL_CPUS=$CPUS SLURM_LOCAL_GPUS=$GPUS script=$SELF_HASH)
ClusterName=local
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CryptoType=crypto/munge
SlurmctldPort=6817
StateSaveLocation=$DIR/ctld
SlurmdSpoolDir=$DIR/spool/%n
TmpFS=$DIR/tmp/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/jobcomp.log
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
MinJobAge=3600
KillWait=20
SchedulerType=sched/backfill
TaskProlog=$DIR/taskprolog.sh
Epilog=$DIR/epilog.sh
EOF
    [ "$GPUS" -gt 0 ] && echo "GresTypes=gpu"
    for name in $(node_names); do
        printf 'NodeName=%s NodeHostname=%s NodeAddr=127.0.0.1 Port=%s CPUs=%s%s State=UNKNOWN\n' \
            "$name" "$name" "$port" "$CPUS" "$([ "$GPUS" -gt 0 ] && echo " Gres=gpu:$GPUS")"
        port=$((port + 1))
    done
    echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES"
}

write_gres() {
    local name last=$((GPUS - 1))
    for name in $(node_names); do echo "NodeName=$name Name=gpu File=$DIR/dev/gpu[0-$last]"; done
}

make_fake_gpus() {
    # slurmd counts a gpu GRES by its device files; give it character devices that are /dev/null
    # underneath (no cgroup device constraint here, so nothing opens them).
    local i; mkdir -p "$DIR/dev"
    for i in $(seq 0 $((GPUS - 1))); do
        [ -e "$DIR/dev/gpu$i" ] || mknod "$DIR/dev/gpu$i" c 1 3 2>/dev/null || touch "$DIR/dev/gpu$i"
    done
}

add_hosts() {
    # The emulated nodes' names resolve to this host (a job's rank 0 may publish its hostname).
    local name
    for name in $(node_names); do
        grep -qE "^127\.0\.0\.1[[:space:]].*\b$name\b" /etc/hosts \
            || echo "127.0.0.1 $name  # slurm-local.sh" >>/etc/hosts || return 1
    done
}

# A pid file's process is alive when it exists and is not a zombie (in containers without an
# init that reaps, a stopped daemon can linger as a zombie, which `kill -0` still reaches).
alive() { kill -0 "$1" 2>/dev/null && ! grep -qs '^State:[[:space:]]*Z' "/proc/$1/status"; }
pid_alive() { [ -f "$1" ] && alive "$(cat "$1")"; }
munge_works() { munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; }

all_running() {
    munge_works || return 1
    pid_alive "$DIR/run/slurmctld.pid" || return 1
    local name; for name in $(node_names); do pid_alive "$DIR/run/slurmd-$name.pid" || return 1; done
}

stop_pidfile() {  # stop_pidfile FILE: TERM, wait up to 10 s, then KILL
    local f=$1 pid i
    [ -f "$f" ] || return 0
    pid=$(cat "$f")
    if alive "$pid"; then
        kill "$pid" 2>/dev/null || true
        for i in $(seq 50); do alive "$pid" || break; sleep 0.2; done
        if alive "$pid"; then kill -9 "$pid" 2>/dev/null || true; fi
    fi
    rm -f "$f"
}

stop_slurm() {
    local f
    for f in "$DIR"/run/slurmd-*.pid; do [ -e "$f" ] && stop_pidfile "$f"; done
    stop_pidfile "$DIR/run/slurmctld.pid"
}

do_stop() {
    need_root
    stop_slurm
    stop_pidfile "$MUNGE_PID"
    log "stopped"
}

start_munge() {
    munge_works && return  # munged needs no restart when the Slurm config changes
    # The package's postinst normally makes the key; make one if it did not (a copied image).
    if [ ! -s /etc/munge/munge.key ]; then
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
    fi
    chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge
    # As the munge user (as the package's service does); --force: start over a stale socket.
    runuser -u munge -- munged --force --pid-file="$MUNGE_PID"
    local i; for i in $(seq 50); do munge -n </dev/null | unmunge >/dev/null 2>&1 && return; sleep 0.2; done
    die "munged started but munge -n | unmunge fails"
}

wait_nodes_idle() {
    local i state
    for i in $(seq 150); do
        # every node idle/mixed/allocated (not down/unknown/drained)
        state=$(sinfo -h -N -o '%N %t' 2>/dev/null || true)
        if [ -n "$state" ] && ! grep -qvE ' (idle|mix|alloc)$' <<<"$state" \
            && [ "$(wc -l <<<"$state")" -ge "$NODES" ]; then
            return 0
        fi
        sleep 0.2
    done
    log "nodes not ready after 30 s:"; sinfo -N >&2 || true
    tail -n 20 "$DIR"/log/*.log >&2 || true
    die "slurm nodes did not come up"
}

namespaces_work() {  # can we give a slurmd its own hostname and its own scratch mount?
    local d; d=$(mktemp -d)
    unshare -u -m sh -c "hostname slurm-local-probe && mount --make-rprivate / 2>/dev/null; \
        mount --bind '$d' '$d'" >/dev/null 2>&1
    local rc=$?; rmdir "$d" 2>/dev/null; return $rc
}

do_start() {
    need_root
    do_install
    if [ "$NODES" -gt 1 ] && ! namespaces_work; then
        log "unshare -u -m is not allowed here: falling back to one Slurm node"
        NODES=1
    fi
    if [ "$NODES" -gt 1 ] && ! add_hosts; then
        log "cannot add the node names to /etc/hosts: falling back to one Slurm node"
        NODES=1
    fi
    fix_pmix_link
    mkdir -p "$DIR"/{ctld,spool,run,log,scratch} /etc/slurm
    local name
    for name in $(node_names); do mkdir -p "$DIR/spool/$name" "$DIR/tmp/$name"; done
    local new; new=$(write_conf)
    if all_running && [ -f "$CONF" ] && [ "$new" = "$(cat "$CONF")" ]; then
        log "already running ($NODES node(s))"; wait_nodes_idle; return
    fi
    stop_slurm
    if [ -f "$CONF" ] && ! head -n1 "$CONF" | grep -qF "$MARK"; then
        cp "$CONF" "$CONF.orig.$(date +%s)"; log "kept the previous $CONF as $CONF.orig.*"
    fi
    printf '%s\n' "$new" >"$CONF"
    if [ "$GPUS" -gt 0 ]; then make_fake_gpus; write_gres >/etc/slurm/gres.conf; else rm -f /etc/slurm/gres.conf; fi
    cat >"$DIR/taskprolog.sh" <<EOF
#!/bin/sh
# Per-job scratch on the node's own disk, as sites provide it: templates read \$SLURM_TMPDIR.
d=$DIR/scratch/\$SLURM_JOB_ID
mkdir -p "\$d" && echo "export SLURM_TMPDIR=\$d"
EOF
    cat >"$DIR/epilog.sh" <<EOF
#!/bin/sh
rm -rf "$DIR/scratch/\$SLURM_JOB_ID"
exit 0
EOF
    chmod 755 "$DIR/taskprolog.sh" "$DIR/epilog.sh"
    start_munge
    # -c: start clean (no jobs from a previous run of this cluster come back).
    slurmctld -c -i
    for name in $(node_names); do
        if [ "$NODES" -le 1 ]; then slurmd -c; continue; fi
        # -N NAME: this slurmd is Slurm node NAME (its own port and spool from slurm.conf).
        # unshare -u: its own hostname too, so what runs on the node sees `hostname` = NAME.
        # Open MPI decides which ranks share a node by comparing host names with the node map
        # Slurm's PMIx server sends (node names): with the real hostname everywhere, ranks on
        # one Slurm node are not "local" to each other (no shared memory, wrong local ranks).
        # unshare -m: its own local disk too: $DIR/scratch (where SLURM_TMPDIR points) is
        # $DIR/nodes/NAME/scratch underneath, so a job sees the same scratch path on every
        # node, as on a real cluster, but each node's files are its own.
        mkdir -p "$DIR/nodes/$name/scratch"
        unshare -u -m sh -c "hostname $name && mount --make-rprivate / 2>/dev/null; \
            mount --bind '$DIR/nodes/$name/scratch' '$DIR/scratch' && exec slurmd -c -N $name"
    done
    wait_nodes_idle
    log "running: $(sinfo -h -o '%D node(s) %c CPUs each, partition %P' | head -n1)"
}

do_status() {
    sinfo -N -o '%N %t %c %G' || true
    local f; for f in "$DIR"/run/*.pid; do [ -e "$f" ] && echo "$(basename "$f" .pid) pid $(cat "$f") $(pid_alive "$f" && echo alive || echo dead)"; done
}

case "${1:-start}" in
    install) do_install ;;
    start) do_start ;;
    stop) do_stop ;;
    restart) do_stop; do_start ;;
    status) do_status ;;
    config) write_conf ;;
    *) die "unknown command '$1'; use start, stop, restart, status, install or config" ;;
esac
