#!/usr/bin/env bash
# A virtual multi-node cluster on this one machine: N nodes, each with its own network, hostname
# and node-local disk, so Open MPI, Slurm and staging see separate hosts (docs/multinode-testing.md).
#
#   scripts/vcluster.sh up N [--slots S] [--rate R] [--delay D]   make node1..nodeN
#   scripts/vcluster.sh run NODE CMD...      run CMD on NODE (its namespaces, this cwd, this env)
#   scripts/vcluster.sh rsh NODE CMDLINE...  ssh-like: CMDLINE through sh -c, clean env (mpirun's agent)
#   scripts/vcluster.sh slurm-up|slurm-down  slurmctld here + one slurmd per node (after `up`)
#   scripts/vcluster.sh status               nodes, their pids, addresses, shaping, Slurm
#   scripts/vcluster.sh fault cut NODE       NODE's link goes down (as a pulled cable)
#   scripts/vcluster.sh fault loss NODE PCT  PCT% of the packets on NODE's link lost, both ways
#   scripts/vcluster.sh fault partition A,B C,D   nodes A,B and C,D no longer reach each other
#   scripts/vcluster.sh fault heal           link up again, no loss, no partition
#   scripts/vcluster.sh down                 remove everything `up` made (also after a crash)
#
# A node is a holder process (`sleep`, argv[0] "vcluster-NAME-NODE") started by
# `unshare --net --uts --mount`; `run` and `rsh` nsenter its namespaces. Each node has:
#   - hostname NODE (UTS), so Open MPI and Slurm count it as its own host;
#   - eth0 = $SUBNET.I/24, a veth whose other end is on bridge $BRIDGE ($SUBNET.254 here), so
#     traffic between nodes is real TCP through the kernel's network stack (no shared loopback);
#   - its own tmpfs at /scratch (node-local disk) and at /dev/shm (shared memory stays in a node);
#   - /etc/hosts naming every node, bind-mounted in its mount namespace only;
#   - everything else shared with this machine: the project directory, the venv, /tmp.
# Optional shaping (`--rate 1gbit`, `--delay 0.1ms`): a qdisc on both ends of every veth (tbf
# for a rate alone, netem with a delay), so each direction of each node's link is limited;
# traffic between two nodes crosses two links.
#
# mpirun spans the nodes with its own rsh launcher: `run` exports PRTE_MCA_plm_ssh_agent and
# OMPI_MCA_plm_rsh_agent = "THIS_SCRIPT rsh", and VCLUSTER_HOSTFILE (one "NODE slots=S" line each):
#   scripts/vcluster.sh run node1 sh -c 'mpirun --allow-run-as-root --hostfile $VCLUSTER_HOSTFILE -n 4 hostname'
#
# Settings (environment): VCLUSTER_NAME=vc (several clusters may coexist under different names:
# state in /run/vcluster/NAME, bridge NAMEbr0, veths NAME-nodeI), VCLUSTER_SUBNET=10.77.0 (give
# each coexisting cluster its own), VCLUSTER_SCRATCH_SIZE=512m, VCLUSTER_SHM_SIZE=512m.
# Needs root (namespaces, links, mounts): `up` says so and exits 1 otherwise.
set -euo pipefail

SELF=$(readlink -f "${BASH_SOURCE[0]}")
NAME=${VCLUSTER_NAME:-vc}
[[ "$NAME" =~ ^[a-z][a-z0-9]{0,5}$ ]] || { echo "[vcluster] error: VCLUSTER_NAME='$NAME': expected 1-6 of [a-z0-9], a letter first" >&2; exit 1; }
DIR=/run/vcluster/$NAME
SUBNET=${VCLUSTER_SUBNET:-10.77.0}
BRIDGE=${NAME}br0
SCRATCH_SIZE=${VCLUSTER_SCRATCH_SIZE:-512m}
SHM_SIZE=${VCLUSTER_SHM_SIZE:-512m}
HOLDER=vcluster-$NAME-    # argv[0] prefix of the holder processes: `down` finds them without state
VETH=$NAME-               # host-side veth names: vc-node1, ... (at most 15 characters)

log() { echo "[vcluster] $*" >&2; }
die() { echo "[vcluster] error: $*" >&2; exit 1; }

need_root() {
    [ "$(id -u)" = 0 ] || die "must run as root (network/UTS/mount namespaces, veth, bridge, tmpfs)"
    local t
    for t in ip nsenter unshare; do command -v "$t" >/dev/null || die "'$t' not found (iproute2, util-linux)"; done
}

# --- state --------------------------------------------------------------------------------------
# $DIR/nodes: one line per node, "NAME PID NETNS_INODE ADDR"; a pid counts only while its net
# namespace is still the recorded one (a reused pid is not a node).

node_line() { [ -f "$DIR/nodes" ] && awk -v n="$1" '$1 == n' "$DIR/nodes"; }
node_names() { [ -f "$DIR/nodes" ] && awk '{print $1}' "$DIR/nodes"; }
ns_inode() { stat -L -c %i "/proc/$1/ns/net" 2>/dev/null; }
# Alive = exists and is no zombie (a container's init may be slow to reap what `down` killed).
alive() { [ -d "/proc/$1" ] && ! grep -qs '^State:[[:space:]]*Z' "/proc/$1/status"; }

node_pid() {  # node_pid NAME -> holder pid, or fail with a message
    local line pid ino
    line=$(node_line "$1") || true
    [ -n "$line" ] || die "no node '$1' (nodes: $(node_names 2>/dev/null | xargs echo || true); run 'up N' first)"
    read -r _ pid ino _ <<<"$line"
    [ "$(ns_inode "$pid")" = "$ino" ] || die "node '$1' is gone (holder pid $pid dead); run 'down' then 'up'"
    echo "$pid"
}

# Every process in the net namespace with inode INO (holder, slurmd, ranks left behind).
# One stat over all of /proc: a fork per process would take seconds.
pids_in_netns() {
    { stat -L -c '%i %n' /proc/[0-9]*/ns/net 2>/dev/null || true; } | awk -v ino="$1" '$1 == ino {split($2, a, "/"); print a[3]}'
}

holder_pids() {  # every live holder, from argv[0], whatever the state file says
    { grep -las "^$HOLDER" /proc/[0-9]*/cmdline 2>/dev/null || true; } | cut -d/ -f3
}

# --- up -----------------------------------------------------------------------------------------

do_up() {
    need_root
    local n=${1:-} slots rate="" delay=""
    [[ "$n" =~ ^[1-9][0-9]?$ ]] || die "up: expected a node count 1..99, got '${n}'"
    shift
    slots=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
    while [ $# -gt 0 ]; do
        case "$1" in
            --slots) slots=${2:?--slots needs a value}; shift 2 ;;
            --rate) rate=${2:?--rate needs a value (e.g. 1gbit)}; shift 2 ;;
            --delay) delay=${2:?--delay needs a value (e.g. 0.1ms)}; shift 2 ;;
            *) die "up: unknown option '$1' (valid: --slots S, --rate R, --delay D)" ;;
        esac
    done
    [ -z "$rate$delay" ] || check_shaping "$rate" "$delay"
    if [ -s "$DIR/nodes" ] || [ -n "$(holder_pids)" ]; then
        log "a cluster exists: taking it down first"; do_down
    fi
    mkdir -p "$DIR"
    # A failure half-way takes down what was made (die exits 1 from anywhere below).
    trap '[ $? = 0 ] || { log "up failed: taking down what it made"; do_down; }' EXIT
    : >"$DIR/nodes.tmp"; : >"$DIR/hostfile"
    { echo "127.0.0.1 localhost"; local i
      for i in $(seq 1 "$n"); do echo "$SUBNET.$i node$i"; done; } >"$DIR/hosts"
    ip link add "$BRIDGE" type bridge
    ip addr add "$SUBNET.254/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
    for i in $(seq 1 "$n"); do make_node "node$i" "$SUBNET.$i" "$rate" "$delay"; done
    mv "$DIR/nodes.tmp" "$DIR/nodes"
    for i in $(seq 1 "$n"); do echo "node$i slots=$slots" >>"$DIR/hostfile"; done
    printf 'nodes=%s slots=%s rate=%s delay=%s\n' "$n" "$slots" "${rate:-none}" "${delay:-none}" >"$DIR/config"
    # node1 must reach every node before anyone relies on it (where ping exists).
    local first; first=$(node_pid node1) || exit 1
    command -v ping >/dev/null && for i in $(seq 1 "$n"); do
        nsenter -t "$first" -n ping -c1 -W2 "$SUBNET.$i" >/dev/null 2>&1 \
            || die "up: node1 cannot reach node$i ($SUBNET.$i); 'down' cleans up"
    done
    trap - EXIT
    log "up: $n node(s) on $BRIDGE ($SUBNET.0/24), $slots slot(s) each, scratch /scratch, shaping ${rate:-none}/${delay:-none}"
}

make_node() {  # make_node NAME ADDR RATE DELAY
    local name=$1 addr=$2 rate=$3 delay=$4 pid ino i
    # setsid: the holder outlives this script and any terminal; exec -a: findable by `down`.
    setsid unshare --net --uts --mount --propagation private \
        bash -c "exec -a $HOLDER$name sleep infinity" </dev/null >/dev/null 2>&1 &
    pid=$!
    for i in $(seq 50); do  # until unshare has exec'd the holder inside its new namespaces
        tr '\0' ' ' 2>/dev/null <"/proc/$pid/cmdline" | grep -q "^$HOLDER$name" && break
        sleep 0.1
    done
    ino=$(ns_inode "$pid")
    [ -n "$ino" ] && [ "$ino" != "$(ns_inode $$)" ] || die "up: the holder for $name did not start"
    echo "$name $pid $ino $addr" >>"$DIR/nodes.tmp"
    nsenter -t "$pid" -u hostname "$name"
    nsenter -t "$pid" -m sh -c "
        mkdir -p /scratch &&
        mount -t tmpfs -o size=$SCRATCH_SIZE,mode=1777 vcluster-scratch-$name /scratch &&
        mount -t tmpfs -o size=$SHM_SIZE,mode=1777 vcluster-shm-$name /dev/shm &&
        mount --bind '$DIR/hosts' /etc/hosts" || die "up: mounts for $name failed"
    ip link add "$VETH$name" type veth peer name "vce-$name"
    ip link set "vce-$name" netns "$pid"
    ip link set "$VETH$name" master "$BRIDGE" up
    nsenter -t "$pid" -n sh -c "
        ip link set lo up &&
        ip link set vce-$name name eth0 &&
        ip addr add $addr/24 dev eth0 &&
        ip link set eth0 up" || die "up: network for $name failed"
    if [ -n "$rate$delay" ]; then
        local spec; spec=$(qdisc_spec "$rate" "$delay")
        tc qdisc add dev "$VETH$name" root $spec
        nsenter -t "$pid" -n tc qdisc add dev eth0 root $spec
    fi
}

# The qdisc for a link: netem when there is a delay (it also limits the rate), else tbf. Kernels
# without sch_netem (some VMs and sandboxes) still have tbf, so --rate alone works there.
qdisc_spec() {  # qdisc_spec RATE DELAY
    local rate=$1 delay=$2
    if [ -n "$delay" ]; then
        echo "netem delay $delay${rate:+ rate $rate} limit 10000"; return
    fi
    local bits; bits=$(rate_bits "$rate")
    # burst: 1 ms at full rate (at least 64 KiB), what the token bucket may send at once
    local burst=$((bits / 8 / 1000)); [ "$burst" -lt 65536 ] && burst=65536
    echo "tbf rate $rate burst $burst latency 50ms"
}

rate_bits() {  # "1gbit" -> 1000000000
    [[ "$1" =~ ^([0-9]+)(bit|kbit|mbit|gbit)$ ]] || die "up: --rate '$1': expected NUMBER followed by bit, kbit, mbit or gbit (e.g. 1gbit)"
    local n=${BASH_REMATCH[1]}
    case "${BASH_REMATCH[2]}" in
        bit) echo "$n" ;; kbit) echo $((n * 1000)) ;; mbit) echo $((n * 1000000)) ;; gbit) echo $((n * 1000000000)) ;;
    esac
}

check_shaping() {  # fail early, with the reason, before any node exists
    local rate=$1 delay=$2 probe=vcq$$
    command -v tc >/dev/null || die "up: --rate/--delay need 'tc' (iproute2)"
    [ -z "$rate" ] || rate_bits "$rate" >/dev/null
    ip link add "$probe" type veth peer name "${probe}p" || die "up: cannot make a veth pair"
    local spec; spec=$(qdisc_spec "$rate" "$delay")
    if ! tc qdisc add dev "$probe" root $spec 2>/dev/null; then
        ip link del "$probe"
        [ -n "$delay" ] && die "up: --delay needs the netem qdisc (kernel module sch_netem), which this kernel lacks; --rate alone uses tbf"
        die "up: this kernel refuses 'tc qdisc add ... $spec'"
    fi
    ip link del "$probe"
}

# --- run / rsh ----------------------------------------------------------------------------------


do_run() {
    [ $# -ge 2 ] || die "run: expected NODE CMD..., got '$*'"
    local node=$1 pid; shift
    pid=$(node_pid "$node") || exit 1
    export PRTE_MCA_plm_ssh_agent="$SELF rsh" OMPI_MCA_plm_rsh_agent="$SELF rsh"
    export VCLUSTER_HOSTFILE="$DIR/hostfile" VCLUSTER_NODE="$node"
    # --wd: entering a mount namespace resets the cwd to its root; keep the caller's.
    exec nsenter -t "$pid" -n -u -m --wd="$PWD" -- "$@"
}

do_rsh() {
    # As ssh does: the remote command line runs through a shell with a fresh login environment
    # (not mpirun's: PRTE/PMIx variables of the launching side must not leak into the daemon).
    # PATH is kept, as a shared home's shell profile would give the venv on every node.
    [ $# -ge 2 ] || die "rsh: expected NODE CMDLINE..., got '$*'"
    local node=$1 pid; shift
    pid=$(node_pid "$node") || exit 1
    exec nsenter -t "$pid" -n -u -m --wd="${HOME:-/}" -- env -i HOME="${HOME:-/root}" USER="${USER:-root}" \
        PATH="$PATH" ${LD_LIBRARY_PATH:+LD_LIBRARY_PATH="$LD_LIBRARY_PATH"} \
        LANG=C.UTF-8 SHELL=/bin/sh VCLUSTER_NODE="$node" \
        PRTE_MCA_plm_ssh_agent="$SELF rsh" OMPI_MCA_plm_rsh_agent="$SELF rsh" \
        /bin/sh -c "$*"
}

# --- down / status ------------------------------------------------------------------------------

do_down() {
    need_root
    do_slurm_down quiet || true
    local pids="" line name pid ino p h
    # Every process inside a node (holder, daemons, ranks), found by its net namespace, from the
    # state file and from the holders' argv[0] (a crash may have lost or never written the file).
    if [ -f "$DIR/nodes" ]; then
        while read -r name pid ino _; do
            [ "$(ns_inode "$pid")" = "$ino" ] && pids+=" $(pids_in_netns "$ino" | xargs echo)"
        done <"$DIR/nodes"
    fi
    [ -f "$DIR/nodes.tmp" ] && while read -r name pid ino _; do
        [ "$(ns_inode "$pid")" = "$ino" ] && pids+=" $(pids_in_netns "$ino" | xargs echo)"
    done <"$DIR/nodes.tmp"
    for h in $(holder_pids); do
        ino=$(ns_inode "$h"); [ -n "$ino" ] && pids+=" $(pids_in_netns "$ino" | xargs echo)"
    done
    pids=$(echo $pids | tr ' ' '\n' | sort -u | grep -v "^$$\$" | xargs echo || true)
    if [ -n "$pids" ]; then
        kill $pids 2>/dev/null || true
        for p in $(seq 30); do
            local left=""; for h in $pids; do alive "$h" && left+=" $h"; done
            [ -z "$left" ] && break; sleep 0.1
        done
        for h in $pids; do kill -9 "$h" 2>/dev/null || true; done
    fi
    # A veth dies with its namespace; delete any left (namespace still dying) and the bridge.
    for p in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1 | grep "^$VETH" || true); do
        ip link del "$p" 2>/dev/null || true
    done
    ip link del "$BRIDGE" 2>/dev/null || true
    if command -v nft >/dev/null; then     # fault rules on the host side (see do_fault)
        local t
        for t in $(nft list tables 2>/dev/null | awk -v p="$NAME" '$3 ~ "^"p"(loss|part)" {print $2 ":" $3}'); do
            nft delete table "${t%%:*}" "${t#*:}" 2>/dev/null || true
        done
    fi
    rm -f "$DIR/nodes" "$DIR/nodes.tmp" "$DIR/hostfile" "$DIR/hosts" "$DIR/config"
    rmdir "$DIR" 2>/dev/null || true
    log "down"
}

do_status() {
    if [ ! -s "$DIR/nodes" ]; then echo "no cluster (scripts/vcluster.sh up N)"; return 1; fi
    cat "$DIR/config" 2>/dev/null || true
    local name pid ino addr ok=0
    while read -r name pid ino addr; do
        if [ "$(ns_inode "$pid")" = "$ino" ]; then
            echo "$name pid=$pid addr=$addr host=$(nsenter -t "$pid" -u hostname) procs=$(pids_in_netns "$ino" | wc -l)"
        else
            echo "$name pid=$pid DEAD"; ok=1
        fi
    done <"$DIR/nodes"
    [ -f "$DIR/slurm/slurm.conf" ] && SLURM_CONF=$DIR/slurm/slurm.conf sinfo -N 2>/dev/null || true
    return $ok
}

# --- faults (docs/hangs.md: "A node drops off the network") ------------------------------------
# Loss and partitions are nftables rules (the kernel here has no netem): a netdev table on the
# node's eth0 ingress drops what comes to it, one on its veth's host end what leaves it; a bridge
# table drops what crosses between the two sides of a partition. All are named ${NAME}... so
# `fault heal` and `down` find them.

need_nft() {
    command -v nft >/dev/null && return 0
    command -v apt-get >/dev/null || die "fault loss/partition need nftables (nft); install it"
    log "apt-get install nftables (loss and partitions are nftables rules)"
    # a fresh machine may have no package lists yet: update once, then try again
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends nftables >/dev/null 2>&1 \
        || { DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null \
             && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends nftables >/dev/null; } \
        || die "apt-get install nftables failed"
    command -v nft >/dev/null || die "nftables installed but no nft on PATH"
}

node_addr() { node_line "$1" | awk '{print $4}'; }

do_fault() {
    need_root
    local kind=${1:-} node pct
    case "$kind" in
    cut)
        node=${2:?fault cut NODE}; node_pid "$node" >/dev/null
        ( do_run "$node" ip link set eth0 down )
        log "fault: $node's link is down" ;;
    loss)
        node=${2:?fault loss NODE PCT}; pct=${3:?fault loss NODE PCT}
        [[ "$pct" =~ ^[0-9]+$ ]] && [ "$pct" -le 100 ] || die "fault loss: PCT must be 0-100, got '$pct'"
        node_pid "$node" >/dev/null; need_nft
        printf 'table netdev %sloss {\n chain in {\n  type filter hook ingress device eth0 priority 0; policy accept;\n  numgen random mod 100 < %s drop\n }\n}\n' "$NAME" "$pct" \
            | ( do_run "$node" nft -f - )
        printf 'table netdev %sloss%s {\n chain in {\n  type filter hook ingress device "%s%s" priority 0; policy accept;\n  numgen random mod 100 < %s drop\n }\n}\n' "$NAME" "$node" "$VETH" "$node" "$pct" \
            | nft -f -
        log "fault: $pct% of the packets on $node's link are lost, both ways" ;;
    partition)
        local a=${2:?fault partition A,B C,D} b=${3:?fault partition A,B C,D} n left="" right=""
        need_nft
        for n in ${a//,/ }; do node_pid "$n" >/dev/null; left+="${left:+, }$(node_addr "$n")"; done
        for n in ${b//,/ }; do node_pid "$n" >/dev/null; right+="${right:+, }$(node_addr "$n")"; done
        printf 'table bridge %spart {\n chain cut {\n  type filter hook forward priority 0; policy accept;\n  ip saddr { %s } ip daddr { %s } drop\n  ip saddr { %s } ip daddr { %s } drop\n }\n}\n' "$NAME" "$left" "$right" "$right" "$left" \
            | nft -f -
        log "fault: $a and $b no longer reach each other" ;;
    heal)
        local t
        if command -v nft >/dev/null; then
            for t in $(nft list tables 2>/dev/null | awk -v p="$NAME" '$3 ~ "^"p"(loss|part)" {print $2 " " $3}' | tr ' ' ':'); do
                nft delete table "${t%%:*}" "${t#*:}" 2>/dev/null || true
            done
        fi
        for node in $(node_names); do
            ( do_run "$node" sh -c "ip link set eth0 up; nft delete table netdev ${NAME}loss 2>/dev/null || true" ) || true
        done
        log "fault: healed" ;;
    *) die "fault: expected cut NODE, loss NODE PCT, partition A,B C,D or heal; got '${kind}'" ;;
    esac
}

# --- Slurm --------------------------------------------------------------------------------------

do_slurm_up() { exec bash "$(dirname "$SELF")/vcluster/slurm.sh" up; }
do_slurm_down() {
    local f=$(dirname "$SELF")/vcluster/slurm.sh
    [ -f "$f" ] || return 0
    if [ "${1:-}" = quiet ]; then bash "$f" down >/dev/null 2>&1; else bash "$f" down; fi
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
    up) do_up "$@" ;;
    run) do_run "$@" ;;
    rsh) do_rsh "$@" ;;
    down) do_down ;;
    status) do_status ;;
    fault) do_fault "$@" ;;
    slurm-up) do_slurm_up ;;
    slurm-down) do_slurm_down ;;
    *) die "unknown command '${cmd}'; use up N, run NODE CMD..., rsh NODE CMDLINE, status, fault ..., down, slurm-up, slurm-down" ;;
esac
