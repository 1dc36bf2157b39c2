#!/usr/bin/env bash
# A real single-node SLURM cluster on this machine, for the test suite and for trying the
# templates: Debian's slurm-wlm + munge, munged/slurmctld/slurmd as root, one node with this
# machine's CPUs and memory, ProctrackType=proctrack/linuxproc, TaskPlugin=task/none.
#
#   slurm/local_cluster.sh start     # install packages if missing, write the config, start daemons
#   slurm/local_cluster.sh env       # print 'export SLURM_CONF=...' for clients
#   slurm/local_cluster.sh status
#   slurm/local_cluster.sh stop
#
# HVD_RL_SLURM_CPUS=4 declares more CPUs than the machine has (SlurmdParameters=config_overrides),
# so that jobs which would queue behind each other on 2 cores run side by side (the sweep tests'
# two concurrent workers); the default is the machine's own count.
#
# Everything lives under $HVD_RL_SLURM_DIR (default /tmp/hvd_rl_slurm; created mode 700, and
# refused if it is a symlink or someone else's or writable by others); the machine's own
# /etc/slurm is not touched. Needs root (or passwordless sudo) to install and run the daemons.
set -euo pipefail

STATE="${HVD_RL_SLURM_DIR:-/tmp/hvd_rl_slurm}"
CONF="$STATE/slurm.conf"
HOST="$(hostname -s)"

# shellcheck source=slurm/cluster_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/cluster_common.sh"

write_config() {
  mkdir -p "$STATE/ctld" "$STATE/d" "$STATE/munge"
  local cpus mem_mb
  cpus="${HVD_RL_SLURM_CPUS:-$(nproc --all)}"
  mem_mb="$(awk '/MemTotal/ {printf "%d", $2 / 1024 * 0.9}' /proc/meminfo)"
  cat > "$CONF" <<EOF
ClusterName=hvdrl
SlurmctldHost=$HOST
$(slurm_conf_common)
FirstJobId=$(( $(date +%s) % 1000000 + 1000 ))
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdLogFile=$STATE/slurmd.log
SlurmctldPort=6817
SlurmdPort=6818
JobCompLoc=$STATE/jobcomp.log
$([ "$cpus" != "$(nproc --all)" ] && echo "SlurmdParameters=config_overrides")
NodeName=$HOST CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
EOF
}

start_daemons() {
  start_munge
  if ! pgrep -x slurmctld >/dev/null; then
    as_root /usr/sbin/slurmctld -f "$CONF" -i
  fi
  if ! pgrep -x slurmd >/dev/null; then
    as_root /usr/sbin/slurmd -f "$CONF"
  fi
  export SLURM_CONF="$CONF"
  for _ in $(seq 1 60); do
    if sinfo -h -o "%T" 2>/dev/null | grep -qE "^idle"; then
      echo "SLURM up: $(sinfo -h -o '%P %D %c %T')"
      return 0
    fi
    scontrol update nodename="$HOST" state=resume >/dev/null 2>&1 || true
    sleep 1
  done
  echo "SLURM did not come up; see $STATE/slurmctld.log and $STATE/slurmd.log" >&2
  tail -5 "$STATE/slurmctld.log" "$STATE/slurmd.log" >&2 || true
  return 1
}

stop_daemons() {
  # Cancel what still runs, so no job of this cluster outlives it (or talks to the next one).
  if pgrep -x slurmctld >/dev/null; then
    SLURM_CONF="$CONF" scancel --full --quiet --state=RUNNING,PENDING,SUSPENDED 2>/dev/null || true
    for _ in $(seq 1 30); do
      [ -z "$(SLURM_CONF="$CONF" squeue -h 2>/dev/null)" ] && break
      sleep 1
    done
  fi
  for daemon in slurmd slurmctld; do
    as_root pkill -x "$daemon" 2>/dev/null || true
  done
  for _ in $(seq 1 20); do
    pgrep -x slurmd >/dev/null || pgrep -x slurmctld >/dev/null || break
    sleep 0.5
  done
  as_root pkill -x slurmstepd 2>/dev/null || true
}

case "${1:-}" in
  start) ensure_state_dir "$STATE" HVD_RL_SLURM_DIR; install_slurm_packages; write_config; start_daemons ;;
  stop) if [ -e "$STATE" ] || [ -L "$STATE" ]; then ensure_state_dir "$STATE" HVD_RL_SLURM_DIR; fi; stop_daemons ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  status) SLURM_CONF="$CONF" sinfo; SLURM_CONF="$CONF" squeue ;;
  *) sed -n '2,15p' "$0"; exit 2 ;;
esac
