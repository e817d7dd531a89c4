#!/bin/bash
# Install (Debian slurm-wlm + munge) and start a one-node Slurm cluster on this machine, for tests/test_submit_slurm.py.
#
#   sudo tools/slurm_local.sh            # install if needed, write /etc/slurm/slurm.conf, start munged/slurmctld/slurmd
#   sudo tools/slurm_local.sh stop       # stop the daemons this script started (by their pid files)
#
# One node only: the node is this machine (its short hostname), all its CPUs, no GPUs (no gres), partition "debug".
# Two nodes in network namespaces were not attempted (time). Runs as root: SlurmUser=root keeps the container simple.
# No cgroups in containers: proctrack/linuxproc and task/none.
set -euo pipefail

STATE=/var/lib/slurm-local
PIDS=/run/slurm-local
if [ "${1:-start}" = stop ]; then
  for p in slurmd slurmctld; do
    [ -f "$PIDS/$p.pid" ] && kill "$(cat "$PIDS/$p.pid")" 2>/dev/null || true
  done
  exit 0
fi

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
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

cat > /etc/slurm/slurm.conf <<CONF
ClusterName=local
SlurmctldHost=$NODE
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=$PIDS/slurmctld.pid
SlurmdPidFile=$PIDS/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
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
NodeName=$NODE CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF

[ -f "$PIDS/slurmctld.pid" ] && kill -0 "$(cat "$PIDS/slurmctld.pid")" 2>/dev/null || slurmctld -c
[ -f "$PIDS/slurmd.pid" ] && kill -0 "$(cat "$PIDS/slurmd.pid")" 2>/dev/null || slurmd

for _ in $(seq 30); do
  if sinfo -h -o '%t' 2>/dev/null | grep -qE '^(idle|mix|alloc)'; then
    sinfo
    exit 0
  fi
  scontrol update NodeName="$NODE" State=RESUME >/dev/null 2>&1 || true
  sleep 1
done
echo "slurm_local: node $NODE did not become idle; see /var/log/slurm/*.log" >&2
sinfo >&2 || true
exit 1
