#!/usr/bin/env bash
# A one-node Slurm on this machine, from Debian's packages, for tests/test_slurm.py and `.ci/run`.
#   bash scripts/local-slurm.sh start    # install (once, ~20 s), configure, start munged, slurmctld, slurmd
#   bash scripts/local-slurm.sh stop     # stop the three daemons (by the pids in their pid files)
#   bash scripts/local-slurm.sh status   # exit 0 when `srun` works
# Needs root and apt (no systemd: the daemons are started by hand). No accounting (no slurmdbd):
# profiles/slurm asks the executor for status via squeue. Two jobs may share a core (OverSubscribe=FORCE:2)
# so that the test's reference and two-node runs overlap: this cluster tests plumbing, not timings. Exit 3: cannot be set up here (the reason
# is printed), so the caller can skip.
set -euo pipefail

CONF_DIR=/etc/slurm
RUN_DIR=/run/slurm
PIDS=("$RUN_DIR/slurmd.pid" "$RUN_DIR/slurmctld.pid" /run/munge/munged.pid)

cannot() { echo "local-slurm: cannot set up Slurm here: $*" >&2; exit 3; }

install_packages() {
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v srun >/dev/null \
    && command -v munged >/dev/null && return 0
  [ "$(id -u)" = 0 ] || cannot "not root (apt-get and the daemons need root)"
  command -v apt-get >/dev/null || cannot "no apt-get (Debian/Ubuntu packages slurmctld, slurmd, slurm-client, munge)"
  export DEBIAN_FRONTEND=noninteractive
  { apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge \
      || { apt-get update && apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge; }; } \
    >/tmp/local-slurm-apt.log 2>&1 || cannot "apt-get install failed (no mirror reachable?), see /tmp/local-slurm-apt.log"
}

write_config() {
  local host mem
  host=$(hostname -s)
  mem=$(slurmd -C | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p')
  mem=$(( mem * 9 / 10 ))
  install -d -m 755 "$CONF_DIR" "$RUN_DIR" /var/lib/slurm/slurmctld /var/lib/slurm/slurmd /var/log/slurm
  chown slurm: /var/lib/slurm/slurmctld /var/log/slurm 2>/dev/null || true
  cat > "$CONF_DIR/slurm.conf" <<EOF
# Written by scripts/local-slurm.sh: one node, no accounting (status via squeue).
ClusterName=ci
SlurmctldHost=$host
SlurmUser=slurm
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
ReturnToService=2
SlurmctldPidFile=$RUN_DIR/slurmctld.pid
SlurmdPidFile=$RUN_DIR/slurmd.pid
StateSaveLocation=/var/lib/slurm/slurmctld
SlurmdSpoolDir=/var/lib/slurm/slurmd
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=500
MinJobAge=300
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
NodeName=$host CPUs=$(nproc) RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:2
EOF
}

running() { srun --immediate=10 -n1 -t 1 true >/dev/null 2>&1; }

start() {
  install_packages
  if running; then echo "local-slurm: already running"; return 0; fi
  [ "$(id -u)" = 0 ] || cannot "not root (the daemons need root)"
  write_config
  install -d -o munge -g munge -m 755 /run/munge
  [ -s /etc/munge/munge.key ] || cannot "no /etc/munge/munge.key (the munge package makes one)"
  pgrep -x munged >/dev/null || runuser -u munge -- /usr/sbin/munged
  slurmctld
  slurmd
  for _ in $(seq 30); do
    if running; then echo "local-slurm: up ($(hostname -s), $(nproc) CPUs, partition debug)"; return 0; fi
    sleep 1
  done
  cannot "srun does not work 30 s after start, see /var/log/slurm/"
}

stop() {
  local pid
  for file in "${PIDS[@]}"; do
    [ -s "$file" ] || continue
    pid=$(cat "$file")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
  done
  echo "local-slurm: stopped"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) running && echo "local-slurm: up" || { echo "local-slurm: down"; exit 1; } ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
