#!/usr/bin/env bash
# A real Slurm cluster on this one machine, for testing the workshop's sbatch files.
#
#   bash tests/slurm/cluster.sh up       # install what is missing, start the cluster
#   bash tests/slurm/cluster.sh status   # daemons, nodes; exit 0 when up, 3 when down
#   bash tests/slurm/cluster.sh down     # stop every process by PID, delete the namespaces
#   bash tests/slurm/cluster.sh logs     # the ends of the daemons' logs
# The tests call `acquire PID` (up if needed) and `release PID` (down after the last user,
# unless started with `up`), so test sessions that run at the same time share one cluster.
#   export PATH=/tmp/slurm-harness/bin:$PATH   # then sbatch, squeue, scontrol, ... talk to it
#
# Layout (all private to this machine, nothing is routed anywhere else):
#   netns <prefix>-ctl     bridge br0 10.250.0.1 + 10.250.1.1, slurmctld (hostname slurmctl),
#                          dnsmasq answering nodeN -> 10.250.0.1N and nodeNi -> 10.250.1.1N
#   netns <prefix>-nodeN   eth0 (veth to br0) with both addresses, slurmd (hostname nodeN)
# Each daemon runs under `unshare --uts --mount` with its own hostname and bind-mounted
# /etc/hosts and /etc/resolv.conf (pointing at dnsmasq). Four fake GPUs per node are
# character devices (c 1 3) declared as gres. Clients run in the controller namespace.
#
# Needs root. Exit codes: 0 ok, 77 cannot run on this machine (reason on stderr), 1 error.
# Settings (environment): SLURM_HARNESS_DIR (state, logs, client wrappers; default
# /tmp/slurm-harness), SLURM_HARNESS_NODES (default 2), SLURM_HARNESS_PARTITIONS
# (space-separated, the first is the default; default "dc-gpu").
set -euo pipefail
export PATH=$PATH:/usr/sbin:/sbin:/usr/bin:/bin   # ip, dnsmasq, ... also from a minimal PATH

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
STATE=${SLURM_HARNESS_DIR:-/tmp/slurm-harness}
NODES=${SLURM_HARNESS_NODES:-2}
PARTITIONS=${SLURM_HARNESS_PARTITIONS:-dc-gpu}
PREFIX=slurmci            # namespace names: slurmci-ctl, slurmci-node1, ...
NET=10.250.0              # "ethernet": node names
IBNET=10.250.1            # "InfiniBand": node names with an i suffix
CTL_HOST=slurmctl
PACKAGES=(slurmctld slurmd slurm-client munge dnsutils dnsmasq-base)

log() { echo "cluster.sh: $*" >&2; }
skip() { echo "cannot run a Slurm test cluster here: $*" >&2; exit 77; }
die() {
    echo "cluster.sh: ERROR: $*" >&2
    if [[ ${STARTING:-} ]]; then log_tails >&2; echo >&2; down; fi
    exit 1
}

node_names() { local i; for ((i = 1; i <= NODES; i++)); do echo "node$i"; done; }

# ---------------------------------------------------------------- preflight
preflight() {
    [[ $(id -u) -eq 0 ]] || skip "needs root (network namespaces, slurmd); run as root or use SLURM_HARNESS=external on a real cluster"
    [[ $(uname -s) == Linux ]] || skip "needs Linux network namespaces"
    local cmd
    for cmd in ip nsenter unshare setpriv mknod; do
        command -v "$cmd" >/dev/null || skip "command '$cmd' is missing"
    done
    local missing=() p
    for p in "${PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    if ((${#missing[@]})); then
        command -v apt-get >/dev/null || skip "packages missing (${missing[*]}) and no apt-get"
        log "installing ${missing[*]}"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq >"$STATE.apt.log" 2>&1 &&
            apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >>"$STATE.apt.log" 2>&1 ||
            skip "apt-get install ${missing[*]} failed (see $STATE.apt.log)"
    fi
    ip netns add "$PREFIX-probe" 2>/dev/null || skip "cannot create network namespaces (ip netns add failed)"
    ip netns del "$PREFIX-probe"
}

# ---------------------------------------------------------------- state files
render() { # template -> file, replacing @STATE@ etc.
    local nodes_lines="" part_lines="" i default=YES p
    for ((i = 1; i <= NODES; i++)); do
        nodes_lines+="NodeName=node$i NodeHostname=node$i NodeAddr=$NET.1$i"$'\n'
    done
    for p in $PARTITIONS; do
        part_lines+="PartitionName=$p Nodes=node[1-$NODES] Default=$default MaxTime=INFINITE State=UP OverSubscribe=NO"$'\n'
        default=NO
    done
    awk -v state="$STATE" -v host="$CTL_HOST" -v addr="$NET.1" -v range="node[1-$NODES]" \
        -v nodes="$nodes_lines" -v parts="$part_lines" '
        { gsub(/@STATE@/, state); gsub(/@CTL_HOST@/, host); gsub(/@CTL_ADDR@/, addr);
          gsub(/@NODE_RANGE@/, range);
          if ($0 == "@NODE_LINES@") { printf "%s", nodes; next }
          if ($0 == "@PARTITION_LINES@") { printf "%s", parts; next }
          print }' "$1" >"$2"
}

write_state() {
    rm -rf "$STATE"
    mkdir -p "$STATE"/{bin,etc,log,run,ctld,dev,pids,munge}
    local n
    for n in $(node_names); do mkdir -p "$STATE/spool/$n"; done
    render "$HERE/slurm.conf.in" "$STATE/etc/slurm.conf"
    render "$HERE/gres.conf.in" "$STATE/etc/gres.conf"   # found next to slurm.conf
    for n in 0 1 2 3; do mknod "$STATE/dev/nvidia$n" c 1 3; done

    { echo "127.0.0.1 localhost"; echo "$NET.1 $CTL_HOST"
      for ((n = 1; n <= NODES; n++)); do echo "$NET.1$n node$n"; done; } >"$STATE/etc/hosts"
    printf 'nameserver %s\noptions timeout:1 attempts:2\n' "$NET.1" >"$STATE/etc/resolv.conf"
    # What dnsmasq answers (and what tests compare with): nodeN and the InfiniBand-style nodeNi.
    { echo "$NET.1 $CTL_HOST"
      for ((n = 1; n <= NODES; n++)); do echo "$NET.1$n node$n"; echo "$IBNET.1$n node${n}i"; done
    } >"$STATE/etc/dns-hosts"

    # munge with a key of its own; munged runs as user munge and owns its directory.
    head -c 1024 /dev/urandom >"$STATE/munge/munge.key"
    chown -R munge:munge "$STATE/munge"
    chmod 755 "$STATE/munge"     # munged wants its socket folder open to everyone
    chmod 400 "$STATE/munge/munge.key"

    # Client wrappers: run the Slurm commands in the controller namespace with this
    # slurm.conf. Only inside one of the cluster's own namespaces (in a job, where the
    # wrappers may be on PATH) do they run the command where they are; never in the
    # machine's own namespace, where the cluster's addresses do not exist.
    local c
    for c in sbatch srun salloc squeue scontrol scancel sinfo sacct sstat; do
        cat >"$STATE/bin/$c" <<EOF
#!/bin/sh
export SLURM_CONF=$STATE/etc/slurm.conf
here=\$(stat -L -c %i /proc/self/ns/net)
for ns in /run/netns/$PREFIX-*; do
    [ "\$(stat -L -c %i "\$ns" 2>/dev/null)" = "\$here" ] && exec /usr/bin/$c "\$@"
done
exec nsenter --net=/run/netns/$PREFIX-ctl /usr/bin/$c "\$@"
EOF
        chmod +x "$STATE/bin/$c"
    done
}

# A Slurm client in the controller namespace.
client() { SLURM_CONF=$STATE/etc/slurm.conf nsenter --net="/run/netns/$PREFIX-ctl" "$@"; }

# ---------------------------------------------------------------- network
make_network() {
    local ctl=$PREFIX-ctl i ns
    # Safety belt: in the machine's own namespace the cluster's addresses are unreachable,
    # so a client started there by mistake fails at once instead of leaving the machine.
    ip route replace unreachable "$NET.0/23"
    ip netns add "$ctl"
    ip -n "$ctl" link set lo up
    ip -n "$ctl" link add br0 type bridge
    ip -n "$ctl" addr add "$NET.1/24" dev br0
    ip -n "$ctl" addr add "$IBNET.1/24" dev br0
    ip -n "$ctl" link set br0 up
    for ((i = 1; i <= NODES; i++)); do
        ns=$PREFIX-node$i
        ip netns add "$ns"
        ip -n "$ns" link set lo up
        ip -n "$ctl" link add "veth$i" type veth peer name eth0 netns "$ns"
        ip -n "$ctl" link set "veth$i" master br0 up
        ip -n "$ns" addr add "$NET.1$i/24" dev eth0
        ip -n "$ns" addr add "$IBNET.1$i/24" dev eth0
        ip -n "$ns" link set eth0 up
    done
}

# ---------------------------------------------------------------- daemons
# start NAME NETNS HOSTNAME COMMAND...: a daemon in its own UTS and mount namespace,
# detached (setsid), output to log/NAME.out, PID in pids/NAME.
start() {
    local name=$1 ns=$2 host=$3; shift 3
    setsid nsenter --net="/run/netns/$ns" unshare --uts --mount -- /bin/sh -c '
        hostname "$1" && mount --bind "$2/etc/hosts" /etc/hosts &&
        mount --bind "$2/etc/resolv.conf" /etc/resolv.conf && shift 2 && exec "$@"' \
        sh "$host" "$STATE" "$@" </dev/null >>"$STATE/log/$name.out" 2>&1 9>&- &
    echo $! >"$STATE/pids/$name"
}

start_daemons() {
    local ctl=$PREFIX-ctl conf=$STATE/etc/slurm.conf i
    # munge: unix socket in the shared file system, reachable from every namespace.
    setsid nsenter --net="/run/netns/$ctl" setpriv --reuid=munge --regid=munge --clear-groups \
        /usr/sbin/munged --foreground --socket="$STATE/munge/munge.socket" \
        --key-file="$STATE/munge/munge.key" --pid-file="$STATE/munge/munged.pid" \
        --seed-file="$STATE/munge/munged.seed" --log-file="$STATE/munge/munged.log" \
        </dev/null >>"$STATE/log/munged.out" 2>&1 9>&- &
    echo $! >"$STATE/pids/munged"

    # No upstream servers, every name answered locally (--local=/#/): names it does not
    # know get NXDOMAIN, known names without an IPv6 address get an empty AAAA answer.
    setsid nsenter --net="/run/netns/$ctl" dnsmasq --keep-in-foreground --conf-file=/dev/null \
        --no-resolv --no-hosts --no-poll --local=/#/ --bind-interfaces --listen-address="$NET.1" \
        --user=root --pid-file= --log-facility="$STATE/log/dnsmasq.log" --addn-hosts="$STATE/etc/dns-hosts" \
        </dev/null >>"$STATE/log/dnsmasq.out" 2>&1 9>&- &
    echo $! >"$STATE/pids/dnsmasq"

    local t
    for ((t = 0; t < 100; t++)); do [[ -S $STATE/munge/munge.socket ]] && break; sleep 0.1; done
    [[ -S $STATE/munge/munge.socket ]] || die "munged did not start"

    start slurmctld "$ctl" "$CTL_HOST" /usr/sbin/slurmctld -D -i -f "$conf"
    for ((i = 1; i <= NODES; i++)); do
        start "slurmd-node$i" "$PREFIX-node$i" "node$i" /usr/sbin/slurmd -D -f "$conf"
    done
}

wait_ready() {
    local t states
    for ((t = 0; t < 300; t++)); do
        states=$(client sinfo -h -N -o '%N %T' 2>/dev/null | sort -u || true)
        if [[ $(grep -c ' idle$' <<<"$states") -eq $NODES ]]; then
            return 0
        fi
        check_alive || die "a daemon died during start-up"
        sleep 0.1
    done
    die "nodes not idle after 30 s: $states"
}

log_tails() {
    local f
    for f in "$STATE"/log/*.log "$STATE"/log/*.out "$STATE"/munge/munged.log; do
        [[ -s $f ]] && printf '\n--- %s (last 15 lines) ---\n%s' "$f" "$(tail -15 "$f")"
    done
}

check_alive() { # all recorded daemons are running
    local f
    compgen -G "$STATE/pids/*" >/dev/null || return 1
    for f in "$STATE"/pids/*; do kill -0 "$(cat "$f")" 2>/dev/null || return 1; done
}

# ---------------------------------------------------------------- teardown
ns_list() { ip netns list 2>/dev/null | awk -v p="$PREFIX-" 'index($1, p) == 1 {print $1}'; }

down() {
    local f pid pids=() ns
    # The daemons we started, by PID.
    if compgen -G "$STATE/pids/*" >/dev/null; then
        for f in "$STATE"/pids/*; do
            pid=$(cat "$f"); kill -TERM "$pid" 2>/dev/null && pids+=("$pid"); rm -f "$f"
        done
    fi
    # Everything else still inside our namespaces (slurmstepd, job steps), by PID.
    for ns in $(ns_list); do
        for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -TERM "$pid" 2>/dev/null && pids+=("$pid"); done
    done
    local t alive
    for ((t = 0; t < 50; t++)); do
        alive=()
        for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive+=("$pid"); done
        ((${#alive[@]})) || break
        sleep 0.1
    done
    for pid in "${alive[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
    for ns in $(ns_list); do
        for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null || true; done
        ip netns del "$ns"
    done
    ip route del unreachable "$NET.0/23" 2>/dev/null || true
    log "down"
}

status() {
    if is_up; then
        local f
        for f in "$STATE"/pids/*; do echo "$(basename "$f") pid $(cat "$f")"; done
        client sinfo -N -o '%N %P %T %c %m %G' || return 3
        echo "clients: export PATH=$STATE/bin:\$PATH"
        return 0
    fi
    echo "down"
    return 3
}

is_up() {
    check_alive 2>/dev/null && ip netns list | grep -q "^$PREFIX-ctl\b" &&
        client scontrol ping 2>/dev/null | grep -q "is UP"
}

up() {
    if is_up; then
        log "already up (state in $STATE)"
        return 0
    fi
    local t0=$SECONDS
    preflight
    down 2>/dev/null || true     # leftovers of an earlier run
    STARTING=1
    write_state
    make_network
    start_daemons
    wait_ready
    log "up in $((SECONDS - t0)) s: $(node_names | tr '\n' ' ')partition(s) $PARTITIONS; clients: export PATH=$STATE/bin:\$PATH"
}

# Test sessions share one cluster: each holds a lease (a file named after its PID) from
# `acquire` to `release`; the last release stops the cluster unless it was started by hand.
acquire() {
    [[ ${1:-} =~ ^[0-9]+$ ]] || die "usage: $0 acquire PID"
    up
    mkdir -p "$STATE/leases"
    touch "$STATE/leases/$1"
}

release() {
    [[ ${1:-} =~ ^[0-9]+$ ]] || die "usage: $0 release PID"
    rm -f "$STATE/leases/$1"
    local f
    for f in "$STATE"/leases/*; do   # leases of sessions that died
        [[ -e $f ]] && ! kill -0 "$(basename "$f")" 2>/dev/null && rm -f "$f"
    done
    if compgen -G "$STATE/leases/*" >/dev/null; then
        log "still used by PIDs $(ls "$STATE/leases" | tr '\n' ' ')"
    elif [[ -e $STATE/manual ]]; then
        log "left running (started with cluster.sh up; stop it with cluster.sh down)"
    else
        down
    fi
}

locked() { # one up/down/acquire/release at a time (the daemons do not inherit fd 9)
    mkdir -p "$(dirname "$STATE")"
    exec 9>>"$STATE.lock"
    flock 9
    "$@"
}

case ${1:-} in
    up) locked up && touch "$STATE/manual" ;;
    down) locked down ;;
    acquire) locked acquire "${2:-}" ;;
    release) locked release "${2:-}" ;;
    status) status ;;
    logs) log_tails; echo ;;
    *) echo "usage: $0 up|down|status|logs|acquire PID|release PID" >&2; exit 2 ;;
esac
