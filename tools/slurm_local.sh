#!/bin/bash
# Install (Debian slurm-wlm + munge) and start a local Slurm cluster on this machine: one node (tests/test_submit_slurm.py)
# or two nodes in network namespaces (tests/test_submit_slurm2.py).
#
#   sudo tools/slurm_local.sh            # install if needed, write /etc/slurm/slurm.conf, start munged/slurmctld/slurmd
#   sudo tools/slurm_local.sh stop       # stop the daemons this script started (by their pid files), both modes
#   sudo tools/slurm_local.sh start2     # two nodes n1, n2, each slurmd in its own network namespace (below)
#   sudo tools/slurm_local.sh stop2      # stop them; remove the namespaces, veths, bridge, per-node /tmp and spool
#
# One-node mode: the node is this machine (its short hostname), all its CPUs, no GPUs (no gres), partition "debug".
# Two-node mode: n1 = 10.77.0.11 (netns mcrl-n1), n2 = 10.77.0.12 (mcrl-n2), slurmctld at 10.77.0.1 on bridge mcrl-br;
# each node has all the CPUs and half the memory, and a private /tmp; run dirs must be outside /tmp (e.g. /var/tmp).
# Debian's slurmd (22.05) runs twice on one host with `-N nX` and %n in its spool/pid/log paths, no rebuild needed.
# The modes exclude each other: each one's start stops the other. Runs as root: SlurmUser=root keeps it simple.
# No cgroups in containers: proctrack/linuxproc and task/none.
set -euo pipefail

STATE=/var/lib/slurm-local
PIDS=/run/slurm-local
MODE=${1:-start}
case "$MODE" in start|stop|start2|stop2) ;; *) echo "usage: $0 [start|stop|start2|stop2]" >&2; exit 2 ;; esac

# ---------------------------------------------------------------------------------------------- two-node mode
# start2: two slurmd, nodes n1 and n2, each in its own network namespace (mcrl-n1 10.77.0.11, mcrl-n2 10.77.0.12),
# joined to the root namespace by veth pairs on a bridge mcrl-br (10.77.0.1, where slurmctld listens). The
# namespaces share the filesystem (munge's unix socket, the venv, /tmp), the PID space and the hostname; only the
# network differs, so jobs on n1 and n2 see different addresses (`hostname -I`), as on two machines.
BR=mcrl-br
NET=10.77.0
stop2() {
  for n in 1 2; do
    f=$PIDS/slurmd-n$n.pid
    [ -f "$f" ] && kill "$(cat "$f")" 2>/dev/null || true
  done
  [ -f "$PIDS/slurmctld.pid" ] && kill "$(cat "$PIDS/slurmctld.pid")" 2>/dev/null || true
  for _ in $(seq 20); do
    alive=0
    for f in "$PIDS"/slurmd-n1.pid "$PIDS"/slurmd-n2.pid "$PIDS"/slurmctld.pid; do
      [ -f "$f" ] && kill -0 "$(cat "$f")" 2>/dev/null && alive=1
    done
    [ "$alive" = 0 ] && break
    sleep 0.5
  done
  # Whatever still runs in the namespaces (job steps, a slurmd blocked on a stuck slurmstepd's socket) would outlive
  # the network it needs: TERM it by pid, then KILL what is left after 5 s.
  left=""
  for n in 1 2; do left="$left $(ip netns pids "mcrl-n$n" 2>/dev/null || true)"; done
  for pid in $left; do kill "$pid" 2>/dev/null || true; done
  for _ in $(seq 10); do
    alive=""; for pid in $left; do kill -0 "$pid" 2>/dev/null && alive="$alive $pid"; done
    [ -z "$alive" ] && break
    sleep 0.5
  done
  for pid in $alive; do kill -9 "$pid" 2>/dev/null || true; done
  for n in 1 2; do
    ip netns del "mcrl-n$n" 2>/dev/null || true
    ip link del "mcrl-v$n" 2>/dev/null || true
  done
  ip link del "$BR" 2>/dev/null || true
  rm -f "$PIDS"/slurmd-n1.pid "$PIDS"/slurmd-n2.pid
  # private /tmp of the nodes, and their spool dirs: stale step sockets there would make the next slurmd wait on them
  rm -rf "$STATE/tmp-n1" "$STATE/tmp-n2" "$STATE/d-n1" "$STATE/d-n2"
  rmdir "$STATE/repo-n1" "$STATE/repo-n2" 2>/dev/null || true
}
if [ "$MODE" = stop2 ]; then
  stop2
  exit 0
fi
if [ "$MODE" = stop ]; then
  for p in slurmd slurmctld; do
    [ -f "$PIDS/$p.pid" ] && kill "$(cat "$PIDS/$p.pid")" 2>/dev/null || true
  done
  stop2  # and the two-node cluster's daemons, namespaces and bridge, if any
  exit 0
fi
# `start` after `start2`: slurmctld runs with the two-node config, so take that cluster down first
if [ "$MODE" = start ] && ip link show "$BR" >/dev/null 2>&1; then
  stop2
fi

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sinfo >/dev/null \
   || ! command -v munged >/dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge
fi

NODE=$(hostname -s)
CPUS=$(nproc)
MEM_MB=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))
mkdir -p /etc/slurm "$STATE/ctld" "$STATE/d" "$PIDS" /var/log/slurm /etc/munge /run/munge /var/lib/munge /var/log/munge

# munge: one key, daemon as root (no munge user needed in a container)
[ -s /etc/munge/munge.key ] || dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
chmod 400 /etc/munge/munge.key
chown -R root:root /etc/munge /run/munge /var/lib/munge /var/log/munge
if ! pgrep -x munged >/dev/null; then
  munged --force
fi

if [ "$MODE" = start2 ]; then
  # a one-node slurmd started by `start` would be a third, unknown node: stop it first
  [ -f "$PIDS/slurmd.pid" ] && kill "$(cat "$PIDS/slurmd.pid")" 2>/dev/null || true
  stop2  # leftovers of an earlier start2 (also stops slurmctld, restarted below with the two-node config)
  ip link add "$BR" type bridge
  ip addr add "$NET.1/24" dev "$BR"
  ip link set "$BR" up
  for n in 1 2; do
    ip netns add "mcrl-n$n"
    ip link add "mcrl-v$n" type veth peer name eth0 netns "mcrl-n$n"
    ip link set "mcrl-v$n" master "$BR" up
    ip -n "mcrl-n$n" addr add "$NET.1$n/24" dev eth0
    ip -n "mcrl-n$n" link set lo up
    ip -n "mcrl-n$n" link set eth0 up
  done
  # bridged frames go through iptables when br_netfilter is loaded: let the bridge's own traffic pass
  if [ "$(cat /proc/sys/net/bridge/bridge-nf-call-iptables 2>/dev/null || echo 0)" = 1 ] && command -v iptables >/dev/null; then
    iptables -C FORWARD -i "$BR" -o "$BR" -j ACCEPT 2>/dev/null || iptables -I FORWARD -i "$BR" -o "$BR" -j ACCEPT || true
  fi
  CTLD_HOST="$NODE($NET.1)"
  SPOOL="$STATE/d-%n"; DPID="$PIDS/slurmd-%n.pid"; DLOG=/var/log/slurm/slurmd-%n.log
  NODE_MEM=$(( MEM_MB / 2 ))
  NODE_LINES="NodeName=n1 NodeAddr=$NET.11 CPUs=$CPUS RealMemory=$NODE_MEM State=UNKNOWN
NodeName=n2 NodeAddr=$NET.12 CPUs=$CPUS RealMemory=$NODE_MEM State=UNKNOWN"
  NODE_LIST=n1,n2
  WANT=2
  mkdir -p "$STATE/d-n1" "$STATE/d-n2"
else
  CTLD_HOST=$NODE
  SPOOL="$STATE/d"; DPID="$PIDS/slurmd.pid"; DLOG=/var/log/slurm/slurmd.log
  NODE_LINES="NodeName=$NODE CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN"
  NODE_LIST=$NODE
  WANT=1
fi

cat > /etc/slurm/slurm.conf <<CONF
ClusterName=local
SlurmctldHost=$CTLD_HOST
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$SPOOL
SlurmctldPidFile=$PIDS/slurmctld.pid
SlurmdPidFile=$DPID
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=$DLOG
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SlurmctldTimeout=30
SlurmdTimeout=30
$NODE_LINES
PartitionName=debug Nodes=$NODE_LIST Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF

[ -f "$PIDS/slurmctld.pid" ] && kill -0 "$(cat "$PIDS/slurmctld.pid")" 2>/dev/null || slurmctld -c
if [ "$MODE" = start2 ]; then
  # nsenter --net, not `ip netns exec`: the latter remounts /sys for the namespace, which drops /sys/fs/cgroup, and
  # slurmd then fails ("No filesystem mounted on /sys/fs/cgroup ... slurmd initialization failed")
  # Each node also gets a private /tmp (a mount namespace with $STATE/tmp-nX bound on /tmp), as real nodes have:
  # with one shared /tmp the two Ray nodes of a job share their session dir (--temp-dir=/tmp/ray_j<id>, the session
  # name comes from the head), the second raylet replaces the first's unix socket `sockets/raylet`, and workers forked
  # on n1 register with n2's raylet (Ray then reports them at n2's address while they live in n1's network).
  # So run dirs (sbatch output, metrics) must be outside /tmp to be seen from the root namespace. A checkout that
  # itself lives under /tmp (a CI clone, say) is bound back into each node's private /tmp at the same path, so jobs
  # still find its .venv and sources.
  REPO=$(cd "$(dirname "$0")/.." && pwd)
  for n in 1 2; do
    mkdir -p "$STATE/tmp-n$n" "$STATE/repo-n$n" && chmod 1777 "$STATE/tmp-n$n"
    expose=":"
    case "$REPO/" in
      /tmp/*) expose="mount --bind '$REPO' '$STATE/repo-n$n' && mount --bind '$STATE/tmp-n$n' /tmp && \
                      mkdir -p '$REPO' && mount --bind '$STATE/repo-n$n' '$REPO'" ;;
      *) expose="mount --bind '$STATE/tmp-n$n' /tmp" ;;
    esac
    nsenter --net="/run/netns/mcrl-n$n" unshare --mount --propagation private \
      sh -c "$expose && exec slurmd -N n$n"
  done
else
  [ -f "$PIDS/slurmd.pid" ] && kill -0 "$(cat "$PIDS/slurmd.pid")" 2>/dev/null || slurmd
fi

for _ in $(seq 30); do
  if [ "$(sinfo -h -N -o '%t' 2>/dev/null | grep -cE '^(idle|mix|alloc)')" -ge "$WANT" ]; then
    sinfo -N
    exit 0
  fi
  scontrol update NodeName="$NODE_LIST" State=RESUME >/dev/null 2>&1 || true
  sleep 1
done
echo "slurm_local: $WANT node(s) ($NODE_LIST) did not become idle; see /var/log/slurm/*.log" >&2
sinfo -N >&2 || true
exit 1
