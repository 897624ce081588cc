#!/usr/bin/env bash
# A single-machine Slurm for tests and demos: slurmctld + slurmd on this host, munge authentication with a
# generated key, proctrack/linuxproc and task/none (no cgroup needed). Debian's slurm-wlm (Slurm 22.05).
#
#   bash scripts/slurm-local.sh          # install if missing (apt), configure, start; wait until the node is idle
#   bash scripts/slurm-local.sh --check  # exit 0 if a local Slurm is up and idle, else 3 (changes nothing)
#   bash scripts/slurm-local.sh --stop   # stop the daemons this script started
#
# Idempotent: when the controller answers and the node is idle it returns at once. It never overwrites a
# slurm.conf it did not write (a real cluster's), and says why it cannot start Slurm in its last line on stderr
# with exit code 3 (not root, no apt, a foreign slurm.conf, daemons that do not come up).
set -uo pipefail

CONF=/etc/slurm/slurm.conf
MARK="# written by syncwise scripts/slurm-local.sh (v4)"  # bump when the configuration below changes
NODE=$(hostname -s)
STATE=/var/spool/syncwise-slurm
LOG=/var/log/syncwise-slurm

fail() { echo "slurm-local: cannot start Slurm: $*" >&2; exit 3; }
say() { echo "slurm-local: $*" >&2; }

node_ready() {
    # The controller answers and this host's node takes jobs (idle, mixed or allocated).
    timeout 5 scontrol ping 2>/dev/null | grep -q "UP" || return 1
    local st
    st=$(timeout 5 sinfo -h -n "$NODE" -o %t 2>/dev/null | head -1)
    case "$st" in idle*|mix*|alloc*|comp*) return 0 ;; *) return 1 ;; esac
}

case "${1:-}" in
    --check) node_ready && exit 0; echo "slurm-local: no local Slurm is up" >&2; exit 3 ;;
    --stop)
        for d in slurmd slurmctld; do
            [ -f "$STATE/$d.pid" ] && kill "$(cat "$STATE/$d.pid")" 2>/dev/null && say "stopped $d"
        done
        exit 0 ;;
esac

if command -v sbatch >/dev/null && grep -qsF "$MARK" "$CONF" && node_ready; then
    say "already running (node $NODE idle)"
    exit 0
fi
[ "$(id -u)" = 0 ] || fail "needs root (installs packages, writes $CONF, starts daemons)"

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
    command -v apt-get >/dev/null || fail "slurm-wlm is not installed and there is no apt-get"
    say "installing slurm-wlm and munge (apt)"
    export DEBIAN_FRONTEND=noninteractive
    if ! apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null 2>&1; then
        timeout 120 apt-get update -qq >/dev/null 2>&1 || fail "apt-get update failed (no package mirror reachable?)"
        apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null 2>&1 \
            || fail "apt-get install slurm-wlm munge failed"
    fi
fi

# --- munge: a key of our own if none exists, the daemon running -------------------------------------------
mkdir -p /etc/munge /run/munge /var/lib/munge /var/log/munge
if [ ! -s /etc/munge/munge.key ]; then
    if command -v mungekey >/dev/null; then mungekey --create --keyfile=/etc/munge/munge.key --force
    else dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null; fi
fi
chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge 2>/dev/null
chmod 700 /etc/munge; chmod 400 /etc/munge/munge.key; chmod 755 /run/munge
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    pkill -u munge -x munged 2>/dev/null  # a stale daemon of the munge user (never anyone else's)
    rm -f /run/munge/munged.pid
    runuser -u munge -- /usr/sbin/munged 2>/dev/null || /usr/sbin/munged --force 2>/dev/null \
        || fail "munged does not start"
    for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
    munge -n 2>/dev/null | unmunge >/dev/null 2>&1 || fail "munge does not authenticate (munged not answering)"
fi

# --- slurm.conf ---------------------------------------------------------------------------------------------
if [ -f "$CONF" ] && ! grep -qF "# written by syncwise scripts/slurm-local.sh" "$CONF"; then
    fail "$CONF exists and was not written by this script (a real cluster's?); not touching it"
fi
read -r CPUS MEM < <(slurmd -C 2>/dev/null | awk '/NodeName/ {for (i=1;i<=NF;i++) {split($i,a,"="); v[a[1]]=a[2]}
    print v["CPUs"], v["RealMemory"]}')
[ -n "${CPUS:-}" ] || fail "slurmd -C does not describe this host"
mkdir -p "$STATE/ctld" "$STATE/d" "$LOG"
NEW=$(mktemp)
cat > "$NEW" <<EOF
$MARK
ClusterName=syncwise-local
SlurmctldHost=$NODE
AuthType=auth/munge
CryptoType=crypto/munge
# a requeued job may start again after cred_expire + 1 s (default 120: too slow for tests)
AuthInfo=cred_expire=10
SlurmUser=root
SlurmdUser=root
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SchedulerType=sched/builtin
# look for runnable jobs every 2 s (a requeued job becomes eligible by time, which triggers no event)
SchedulerParameters=sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
JobRequeue=1
# seconds between SIGTERM and SIGKILL when a job is cancelled, requeued or runs out of time
KillWait=60
MinJobAge=600
SlurmdTimeout=60
InactiveLimit=0
NodeName=$NODE CPUs=$CPUS RealMemory=$MEM State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF
mkdir -p /etc/slurm
if ! cmp -s "$NEW" "$CONF"; then
    mv "$NEW" "$CONF"; chmod 644 "$CONF"; CHANGED=1
else
    rm -f "$NEW"; CHANGED=0
fi
# Slurm 22.05 reads cgroup.conf only for cgroup plugins; none is configured here.

# --- daemons ------------------------------------------------------------------------------------------------
running() { [ -f "$STATE/$1.pid" ] && kill -0 "$(cat "$STATE/$1.pid")" 2>/dev/null; }
if [ "$CHANGED" = 1 ]; then
    for d in slurmd slurmctld; do running "$d" && kill "$(cat "$STATE/$d.pid")" && sleep 1; done
fi
running slurmctld || /usr/sbin/slurmctld || fail "slurmctld does not start (see $LOG/slurmctld.log)"
running slurmd || /usr/sbin/slurmd || fail "slurmd does not start (see $LOG/slurmd.log)"

for i in $(seq 60); do
    node_ready && { say "Slurm is up: node $NODE ($CPUS CPUs), partition debug"; exit 0; }
    if [ "$i" = 10 ] || [ "$i" = 30 ]; then  # a node left down/drained by an earlier daemon
        scontrol update nodename="$NODE" state=resume >/dev/null 2>&1
    fi
    sleep 0.5
done
fail "the node $NODE did not become idle within 30 s (sinfo: $(sinfo -h -o '%t %E' 2>&1 | head -1); logs in $LOG)"
