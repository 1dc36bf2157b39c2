# Shared by slurm/local_cluster.sh and slurm/sim_cluster.sh (sourced, not run): what a test
# cluster on this machine needs whatever its shape -- Debian's SLURM and munge, a running munged,
# and the slurm.conf settings both clusters use.

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

install_slurm_packages() {  # Debian's SLURM, munge and PMIx when missing
  local missing=() pkg
  for pkg in slurm-wlm munge slurm-wlm-basic-plugins libpmix-dev; do
    dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
  done
  [ ${#missing[@]} -gt 0 ] || return 0
  command -v apt-get >/dev/null || { echo "needs ${missing[*]} (SLURM and munge) and apt-get is unavailable" >&2; return 1; }
  as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
}

start_munge() {  # one munged serves every node of either cluster
  pgrep -x munged >/dev/null && return 0
  as_root mkdir -p /run/munge /var/log/munge /var/lib/munge
  [ -f /etc/munge/munge.key ] || as_root mungekey --create >/dev/null 2>&1 || as_root /usr/sbin/create-munge-key -f
  as_root /usr/sbin/munged --force
}

slurm_conf_common() {  # slurm.conf lines both clusters share: root daemons, munge, no cgroups, requeue
  cat <<CONF
AuthType=auth/munge
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobRequeue=1
KillWait=30
MinJobAge=3600
InactiveLimit=0
JobCompType=jobcomp/filetxt
AccountingStorageType=accounting_storage/none
CONF
}
