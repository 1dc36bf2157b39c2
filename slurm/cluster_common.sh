# Shared by slurm/local_cluster.sh and slurm/sim_cluster.sh (sourced, not run): what a test
# cluster on this machine needs whatever its shape -- Debian's SLURM and munge, a running munged,
# and the slurm.conf settings both clusters use.

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

# The state directory of a test cluster (slurm.conf, pid files, spool, the daemons' binaries):
# root runs daemons from it, and its default is a fixed path in the shared temp directory, where
# anyone could have put a directory, file or symlink first. Created private (mode 700) where it
# does not exist; used only if it is a real directory of the invoking user that nobody else can
# write. Otherwise one line and exit 2, before anything is written or started.
ensure_state_dir() {  # DIR VARIABLE (the environment variable that chooses DIR, for the message)
  local dir="$1" var="$2" me owner mode
  local refuse="${0##*/}"; refuse="${refuse%.sh}: refusing state directory $dir:"
  me="$(id -u)"
  if [ ! -e "$dir" ] && [ ! -L "$dir" ]; then
    mkdir -p -- "$(dirname -- "$dir")" 2>/dev/null || true
    # No -p for the directory itself: if someone creates it first, mkdir fails and the checks
    # below judge what is there.
    mkdir -m 700 -- "$dir" 2>/dev/null || [ -e "$dir" ] || [ -L "$dir" ] ||
      { echo "$refuse cannot create it (set $var to a directory of your own)" >&2; exit 2; }
  fi
  if [ -L "$dir" ]; then
    echo "$refuse it is a symbolic link (remove it, or set $var to a directory of your own)" >&2; exit 2
  fi
  if [ ! -d "$dir" ]; then
    echo "$refuse it is not a directory (remove it, or set $var to a directory of your own)" >&2; exit 2
  fi
  read -r owner mode < <(stat -c '%u %a' -- "$dir")
  if [ "$owner" != "$me" ]; then
    echo "$refuse it belongs to uid $owner, not to uid $me (remove it, or set $var to a directory of your own)" >&2
    exit 2
  fi
  if (( 8#$mode & 8#022 )); then
    echo "$refuse others can write to it (mode $mode; chmod go-w it, or set $var to a directory of your own)" >&2
    exit 2
  fi
}

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
