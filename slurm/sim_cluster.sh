#!/usr/bin/env bash
# A simulated multi-node cluster on this machine: N "nodes" (network namespaces on a Linux bridge,
# each with its own IP, hostname and node-local temp directory) running one slurmd each, one
# slurmctld on a "head" namespace, and an ssh stand-in so mpirun and horovodrun reach the nodes.
# Real SLURM (Debian slurm-wlm + munge), real TCP between the nodes; the CPUs are this machine's.
#
#   slurm/sim_cluster.sh start N [--rate 1gbit] [--cpus C] [--slurm KEY=VALUE]...
#                                                           # N = 2..8 nodes node1..nodeN
#   eval "$(slurm/sim_cluster.sh env)"                      # SLURM_CONF, PATH (ssh), Open MPI over TCP
#   slurm/sim_cluster.sh status
#   slurm/sim_cluster.sh exec node1 hostname                # run a command on a node
#   slurm/sim_cluster.sh rate 10gbit [node1 ...]            # per-link bandwidth limit (tc tbf); 'off'
#   slurm/sim_cluster.sh link node2 down|up                 # take a node's link down / bring it back
#   slurm/sim_cluster.sh pids node2                         # every process running on a node
#   slurm/sim_cluster.sh crash node2                        # SIGKILL every process on a node (slurmd too)
#   slurm/sim_cluster.sh boot node2                         # start a crashed node again (link up, slurmd)
#   slurm/sim_cluster.sh check                              # can namespaces be used here? (exit 3: no)
#   slurm/sim_cluster.sh stop                               # everything goes; only the logs stay
#
# State, config and logs under $HVD_RL_SIMCLUSTER_DIR (default /tmp/hvd_rl_simcluster; created mode
# 700, and refused if it is a symlink or someone else's or writable by others); addresses
# $HVD_RL_SIMCLUSTER_NET.0/24 (default 10.77.0: node K = .K, head = .100, this host = .254);
# SLURM ports 6917 (slurmctld) and 6918 (slurmd), so slurm/local_cluster.sh can run beside it.
# One simulated cluster per machine. Needs root. See slurm/README.md.
set -Eeuo pipefail

SELF="$(readlink -f "${BASH_SOURCE[0]}")"
HERE="$(dirname "$SELF")"
# shellcheck source=slurm/cluster_common.sh
source "$HERE/cluster_common.sh"
STATE="${HVD_RL_SIMCLUSTER_DIR:-/tmp/hvd_rl_simcluster}"
NET="${HVD_RL_SIMCLUSTER_NET:-10.77.0}"
CONF="$STATE/slurm.conf"
PREFIX=hvdrl
# The bridge on this host and each node's interface share one name: horovodrun picks the NICs
# whose names all hosts (and the launching host) have in common.
NIC="${PREFIX}0"
HEAD_IP="$NET.100"
HOST_IP="$NET.254"
CTLD_PORT=6917
SLURMD_PORT=6918
MAX_NODES=8

die() { echo "sim_cluster: $*" >&2; exit 1; }
note() { echo "[sim_cluster] $*"; }

# ---- what exists -------------------------------------------------------------------------------

ns_of() { echo "$PREFIX-$1"; }            # node1 -> hvdrl-node1, head -> hvdrl-head
veth_of() {                                # host end of a node's link: hvdrl0-n1, hvdrl0-hd
  case "$1" in head) echo "$NIC-hd" ;; node*) echo "$NIC-n${1#node}" ;; esac
}
node_count() { [ -f "$STATE/cluster.env" ] && sed -n 's/^NODES=//p' "$STATE/cluster.env" || echo 0; }
node_names() { local n; n="$(node_count)"; [ "$n" -gt 0 ] && seq -f "node%g" 1 "$n" || true; }
our_namespaces() { ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^$PREFIX-(head|node[0-9]+)$" || true; }
holder_pid() {  # PID of the process that holds a node's UTS and mount namespaces; empty if gone
  local f="$STATE/run/$1.holder" pid
  [ -f "$f" ] || return 0
  pid="$(cat "$f")"
  if alive "$pid" &&
     [ "$(stat -L -c %i "/proc/$pid/ns/net" 2>/dev/null)" = "$(stat -L -c %i "/run/netns/$(ns_of "$1")" 2>/dev/null)" ]; then
    echo "$pid"
  fi
}
running() { [ -n "$(our_namespaces)" ] || [ -e "/sys/class/net/$NIC" ] || [ -d "$STATE/run" ]; }
owner() { cat "/sys/class/net/$NIC/ifalias" 2>/dev/null || true; }  # state dir of the running cluster
refuse_foreign() {  # another state dir's cluster still running here: leave it alone
  local dir f; dir="$(owner)"
  [ -n "$dir" ] && [ "$dir" != "$STATE" ] || return 0
  for f in "$dir"/run/*.holder; do
    if [ -f "$f" ] && alive "$(cat "$f")"; then
      die "the simulated cluster running here has its state in $dir (one per machine); stop it with: HVD_RL_SIMCLUSTER_DIR=$dir $SELF stop"
    fi
  done
}
up() {  # all holders and daemons of a started cluster alive
  local n name
  n="$(node_count)"
  [ "$n" -gt 0 ] || return 1
  for name in head $(node_names); do [ -n "$(holder_pid "$name")" ] || return 1; done
  pid_alive "$STATE/run/slurmctld.pid" || return 1
  for name in $(node_names); do pid_alive "$STATE/run/slurmd.$name.pid" || return 1; done
}
pid_alive() { [ -f "$1" ] && alive "$(cat "$1")"; }
alive() { ps -o stat= -p "$1" 2>/dev/null | grep -qv '^Z'; }  # a zombie is not alive

# Runs a command inside a node's namespaces (network, hostname, mount), in the current directory.
in_node() {
  local name="$1" pid; shift
  pid="$(holder_pid "$name")"
  [ -n "$pid" ] || die "no node '$name' is running (see: $0 status)"
  nsenter -t "$pid" --net --uts --mount --wd="$PWD" -- "$@"
}

# ---- can it run here? --------------------------------------------------------------------------

support_problem() {  # prints a one-line reason when namespaces cannot be used here
  local probe="$PREFIX-probe$$" err
  [ "$(id -u)" = 0 ] || { echo "needs root: network namespaces, veth pairs and a bridge need CAP_SYS_ADMIN and CAP_NET_ADMIN"; return; }
  for tool in ip nsenter unshare tc; do
    command -v "$tool" >/dev/null || { echo "'$tool' is not installed (iproute2, util-linux)"; return; }
  done
  if ! err="$(ip netns add "$probe" 2>&1)"; then
    echo "network namespaces are not permitted here (ip netns add: ${err//$'\n'/ })"; return
  fi
  if ! err="$(ip netns exec "$probe" unshare --uts --mount true 2>&1)"; then
    ip netns del "$probe" 2>/dev/null || true
    echo "UTS/mount namespaces are not permitted here (unshare: ${err//$'\n'/ })"; return
  fi
  if ! err="$(ip link add "$PREFIX-probe" type veth peer name "$PREFIX-probe1" netns "$probe" 2>&1)"; then
    ip netns del "$probe" 2>/dev/null || true
    echo "veth pairs cannot be created here (${err//$'\n'/ })"; return
  fi
  ip link del "$PREFIX-probe" 2>/dev/null || true
  ip netns del "$probe" 2>/dev/null || true
}

install_packages() { install_slurm_packages || die "cannot install SLURM and munge"; }

# ---- start -------------------------------------------------------------------------------------

write_config() {  # N CPUS [KEY=VALUE...]: the extra settings replace or add slurm.conf lines
  local n="$1" cpus="$2" mem_mb name k setting; shift 2
  mem_mb="$(awk -v n="$n" '/MemTotal/ {printf "%d", $2 / 1024 * 0.9 / n}' /proc/meminfo)"
  cat > "$CONF" <<EOF
# Written by slurm/sim_cluster.sh: $n simulated nodes on $(hostname -s); do not edit (regenerated).
ClusterName=hvdrlsim
SlurmctldHost=head($HEAD_IP)
$(slurm_conf_common)
# Every node has all of this machine's cores; --cpus may declare another count.
SlurmdParameters=config_overrides
FirstJobId=$(( $(date +%s) % 1000000 + 3000000 ))
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool/%n
# Node-local temporary space: each node's mount namespace binds its own directory here.
TmpFS=$STATE/tmp
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd.%n.pid
SlurmctldLogFile=$STATE/logs/slurmctld.log
SlurmdLogFile=$STATE/logs/slurmd.%n.log
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
JobCompLoc=$STATE/logs/jobcomp.log
EOF
  for setting in "$@"; do
    sed -i "/^${setting%%=*}=/d" "$CONF"
    echo "$setting" >> "$CONF"
  done
  for k in $(seq 1 "$n"); do
    echo "NodeName=node$k NodeAddr=$NET.$k CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN" >> "$CONF"
  done
  echo "PartitionName=sim Nodes=node[1-$n] Default=YES MaxTime=INFINITE State=UP" >> "$CONF"
  # Name resolution inside the nodes, as a cluster's DNS would give it (Gloo in Horovod 0.28.1
  # resolves the hostname when it builds a process set, whatever HOROVOD_GLOO_IFACE says).
  { cat /etc/hosts; echo "# simulated cluster (slurm/sim_cluster.sh)"; echo "$HEAD_IP head"
    for k in $(seq 1 "$n"); do echo "$NET.$k node$k"; done; } > "$STATE/hosts"
  {
    echo "NODES=$n"; echo "CPUS=$cpus"; echo "NET=$NET"
    for name in $(seq -f "node%g" 1 "$n"); do echo "ADDR_$name=$NET.${name#node}"; done
  } > "$STATE/cluster.env"
}

add_host() {  # a namespace with its link to the bridge, its hostname and node-local temp dir
  local name="$1" ip="$2" ns veth
  ns="$(ns_of "$name")"; veth="$(veth_of "$name")"
  ip netns add "$ns"
  ip link add "$veth" type veth peer name "$NIC" netns "$ns"
  ip link set "$veth" master "$NIC" up
  ip -n "$ns" link set lo up
  ip -n "$ns" addr add "$ip/24" dev "$NIC"
  ip -n "$ns" link set "$NIC" up
  mkdir -p "$STATE/nodes/$name/tmp"
  start_holder "$name"
}

start_holder() {  # the process that owns a node's hostname and mounts (see add_host)
  local name="$1" ns
  ns="$(ns_of "$name")"
  # The holder: a sleeping process inside the node's network namespace that owns a new UTS
  # namespace (hostname) and mount namespace: its own $STATE/tmp, and an /etc/hosts that names
  # the nodes (seen only inside the nodes; this host's file is untouched). Everything on the node
  # is started with nsenter into the holder's namespaces.
  setsid nsenter --net="/run/netns/$ns" -- unshare --uts --mount --propagation slave -- /bin/sh -c \
    "echo \$\$ > '$STATE/run/$name.holder'; hostname '$name' && mount --bind '$STATE/nodes/$name/tmp' '$STATE/tmp' && mount --bind '$STATE/hosts' /etc/hosts && exec sleep infinity" \
    </dev/null >>"$STATE/logs/holders.log" 2>&1 &
  local i
  for i in $(seq 1 50); do [ -n "$(holder_pid "$name")" ] && return 0; sleep 0.1; done
  die "the namespace holder of $name did not start (see $STATE/logs/holders.log)"
}

set_rate() {  # rate on both directions of each named link; 'off' removes the limit
  local rate="$1" name veth ns; shift
  for name in "$@"; do
    veth="$(veth_of "$name")"; ns="$(ns_of "$name")"
    if [ "$rate" = off ]; then
      tc qdisc del dev "$veth" root 2>/dev/null || true
      ip netns exec "$ns" tc qdisc del dev "$NIC" root 2>/dev/null || true
    else
      # burst >= the largest (GSO) packet a veth passes on, latency bounds the queue.
      tc qdisc replace dev "$veth" root tbf rate "$rate" burst 256kb latency 50ms
      ip netns exec "$ns" tc qdisc replace dev "$NIC" root tbf rate "$rate" burst 256kb latency 50ms
    fi
  done
  sed -i '/^RATE_/d' "$STATE/cluster.env"
  for name in $(node_names); do
    echo "RATE_$name=$(link_rate "$name")" >> "$STATE/cluster.env"
  done
}

link_rate() {  # the tbf rate on a node's link, or 'unlimited'
  tc qdisc show dev "$(veth_of "$1")" 2>/dev/null | sed -n 's/.*tbf .*rate \([^ ]*\).*/\1/p' | head -1 | grep . || echo unlimited
}

wait_idle() {
  local n="$1" i idle
  export SLURM_CONF="$CONF"
  for i in $(seq 1 60); do
    idle="$(sinfo -h -N -o '%N %T' 2>/dev/null | awk '$2 == "idle"' | wc -l)"
    [ "$idle" -ge "$n" ] && return 0
    scontrol update nodename="node[1-$n]" state=resume >/dev/null 2>&1 || true
    sleep 1
  done
  echo "sim_cluster: SLURM did not come up; see $STATE/logs" >&2
  tail -n 5 "$STATE"/logs/slurm*.log >&2 || true
  return 1
}

start() {
  local n="" rate="" cpus slurm_settings=()
  cpus="$(nproc --all)"
  while [ $# -gt 0 ]; do
    case "$1" in
      --slurm) [[ "${2:-}" =~ ^[A-Za-z]+=.+$ ]] || die "--slurm needs KEY=VALUE (a slurm.conf line)"
               slurm_settings+=("$2"); shift 2 ;;
      --rate) rate="${2:?--rate needs a value such as 1gbit}"; shift 2 ;;
      --rate=*) rate="${1#--rate=}"; shift ;;
      --cpus) cpus="${2:?--cpus needs a number}"; shift 2 ;;
      --cpus=*) cpus="${1#--cpus=}"; shift ;;
      *) [ -z "$n" ] || die "unexpected argument '$1'"; n="$1"; shift ;;
    esac
  done
  [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -ge 2 ] && [ "$n" -le "$MAX_NODES" ] || die "start N: N must be 2..$MAX_NODES nodes"
  [[ "$cpus" =~ ^[1-9][0-9]*$ ]] || die "--cpus must be a positive number"
  [[ "$NET" =~ ^[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}$ ]] || die "HVD_RL_SIMCLUSTER_NET must be the first three octets of a /24, e.g. 10.77.0"
  local problem; problem="$(support_problem)"
  [ -z "$problem" ] || die "$problem"
  ensure_state_dir "$STATE" HVD_RL_SIMCLUSTER_DIR
  refuse_foreign
  if running; then
    if up && [ "$(node_count)" = "$n" ]; then
      [ -z "$rate" ] || set_rate "$rate" $(node_names)
      note "already running: $n nodes"; status_line; return 0
    fi
    up && die "a cluster of $(node_count) nodes is running; '$0 stop' it first"
    note "cleaning up what a previous cluster left behind"; stop >/dev/null
  fi
  install_packages
  trap 'echo "sim_cluster: start failed; cleaning up" >&2; stop >/dev/null 2>&1' ERR
  mkdir -p "$STATE/run" "$STATE/logs" "$STATE/ctld" "$STATE/spool" "$STATE/tmp" "$STATE/bin" "$STATE/nodes"
  # Daemons run under their own names so that slurm/local_cluster.sh (pgrep/pkill -x slurmd,
  # slurmctld) neither mistakes them for its own nor stops them.
  ln -sf /usr/sbin/slurmctld "$STATE/bin/simslurmctld"
  ln -sf /usr/sbin/slurmd "$STATE/bin/simslurmd"
  ln -sf "$HERE/sim_ssh" "$STATE/bin/ssh"
  write_config "$n" "$cpus" "${slurm_settings[@]}"

  ip link add "$NIC" type bridge
  ip link set "$NIC" alias "$STATE"  # whose cluster this is (see refuse_foreign)
  ip addr add "$HOST_IP/24" dev "$NIC"
  ip link set "$NIC" up
  add_host head "$HEAD_IP"
  local k
  for k in $(seq 1 "$n"); do add_host "node$k" "$NET.$k"; done
  set_rate "${rate:-off}" $(node_names)

  start_munge
  local clean=(env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root)
  (cd / && in_node head "${clean[@]}" "$STATE/bin/simslurmctld" -f "$CONF" -i)
  for k in $(seq 1 "$n"); do start_slurmd "node$k"; done
  wait_idle "$n"
  trap - ERR
  status_line
}

start_slurmd() {
  (cd / && in_node "$1" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root "$STATE/bin/simslurmd" -f "$CONF")
}

# ---- faults ------------------------------------------------------------------------------------

crash() {  # every process running on a node dies at once (SIGKILL), slurmd and job steps included.
  # The node's kernel stays: its peers see their TCP connections reset (take the link down as
  # well for a node that goes silent). The holder of its namespaces is kept for 'boot'.
  local name="$1" holder p pids i
  ip netns list 2>/dev/null | grep -q "^$(ns_of "$name")\b" || die "no node '$name' is running"
  holder="$(holder_pid "$name")"
  for i in $(seq 1 20); do
    pids=""
    for p in $(ip netns pids "$(ns_of "$name")" 2>/dev/null); do [ "$p" = "$holder" ] || pids+=" $p"; done
    [ -n "$pids" ] || break
    kill -KILL $pids 2>/dev/null || true
    sleep 0.1
  done
  rm -f "$STATE/run/slurmd.$name.pid"
  note "$name crashed: every process on it killed"
}

boot() {  # a crashed node comes back: link up, namespaces, slurmd (SLURM returns it to service)
  local name="$1"
  ip netns list 2>/dev/null | grep -q "^$(ns_of "$name")\b" || die "no node '$name' in this cluster"
  ip link set "$(veth_of "$name")" up
  [ -n "$(holder_pid "$name")" ] || start_holder "$name"
  # What a reboot's fresh /run and /tmp would do: the killed steps' UNIX sockets (slurmstepd, PMIx),
  # PMIx directories and the node's temporary files go. A requeued job keeps its id, and a stale
  # socket or PMIx directory of the same step id makes the new step fail to launch ("Address
  # already in use", "File exists").
  find "$STATE/spool/$name" -type s -delete 2>/dev/null || true
  find "$STATE/spool/$name" -mindepth 1 -maxdepth 1 -type d -name 'pmix.*' -exec rm -rf {} + 2>/dev/null || true
  find "$STATE/nodes/$name/tmp" -mindepth 1 -delete 2>/dev/null || true
  pid_alive "$STATE/run/slurmd.$name.pid" || start_slurmd "$name"
  local i
  for i in $(seq 1 50); do pid_alive "$STATE/run/slurmd.$name.pid" && break; sleep 0.1; done
  pid_alive "$STATE/run/slurmd.$name.pid" || die "slurmd did not start on $name (see $STATE/logs/slurmd.$name.log)"
  note "$name booted"
}

status_line() {
  local name parts=()
  for name in $(node_names); do parts+=("$name=$NET.${name#node}($(link_rate "$name"))"); done
  note "up: ${parts[*]}; head=$HEAD_IP; SLURM_CONF=$CONF"
}

# ---- stop --------------------------------------------------------------------------------------

kill_namespace() {  # every process whose network namespace is ours: TERM, then KILL
  local ns="$1" pids seen="" i
  for i in $(seq 1 30); do
    pids="$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ')"
    [ -n "${pids// /}" ] || break
    seen+=" $pids"
    if [ "$i" -le 10 ]; then kill -TERM $pids 2>/dev/null || true; else kill -KILL $pids 2>/dev/null || true; fi
    sleep 0.3
  done
  [ -z "${pids// /}" ] || echo "sim_cluster: processes left in $ns: $pids" >&2
  # A process that is exiting has already left the namespace: wait until it is really gone.
  local p state
  for i in $(seq 1 50); do
    state=""
    for p in $seen; do state+="$(ps -o stat= -p "$p" 2>/dev/null | grep -v '^Z' || true)"; done
    [ -z "$state" ] && return 0
    sleep 0.1
  done
}

stop() {
  if [ -f "$CONF" ] && pid_alive "$STATE/run/slurmctld.pid"; then
    # Cancel what still runs, so no job outlives the cluster (its srun clients on this host end too).
    SLURM_CONF="$CONF" timeout 10 scancel --full --quiet --state=RUNNING,PENDING,SUSPENDED 2>/dev/null || true
    local i
    for i in $(seq 1 10); do
      [ -z "$(SLURM_CONF="$CONF" timeout 5 squeue -h 2>/dev/null)" ] && break
      sleep 1
    done
  fi
  local ns
  for ns in $(our_namespaces); do
    case "$ns" in *-head) ;; *) kill_namespace "$ns" ;; esac
  done
  for ns in $(our_namespaces); do kill_namespace "$ns"; done
  for ns in $(our_namespaces); do ip netns del "$ns" 2>/dev/null || true; done  # takes the veths along
  ip link show "$NIC" >/dev/null 2>&1 && ip link del "$NIC"
  local link
  for link in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | sed 's/@.*//' | grep -E "^$NIC-(hd|n[0-9]+)$" || true); do
    ip link del "$link" 2>/dev/null || true
  done
  # Everything but the logs (read them after a failure; 'stop --purge' removes them too).
  if [ -d "$STATE" ]; then
    find "$STATE" -mindepth 1 -maxdepth 1 ! -name logs -exec rm -rf {} +
    [ "${1:-}" = --purge ] && rm -rf "$STATE"
  fi
  note "stopped"
}

# ---- the rest ----------------------------------------------------------------------------------

status() {
  if ! running; then note "not running"; return 3; fi
  local name state
  for name in head $(node_names); do
    state="down"; [ -n "$(holder_pid "$name")" ] && state="namespaces up"
    case "$name" in
      head) pid_alive "$STATE/run/slurmctld.pid" && state+=", slurmctld" ; echo "head   $HEAD_IP  $state" ;;
      *) pid_alive "$STATE/run/slurmd.$name.pid" && state+=", slurmd"
         echo "$name  $NET.${name#node}  $state, link $(ip -o link show "$(veth_of "$name")" 2>/dev/null | grep -q 'state UP' && echo up || echo down), rate $(link_rate "$name")" ;;
    esac
  done
  SLURM_CONF="$CONF" timeout 10 sinfo -N || true
  SLURM_CONF="$CONF" timeout 10 squeue || true
  up || return 1
}

print_env() {
  cat <<EOF
export HVD_RL_SIMCLUSTER_DIR=$STATE
export SLURM_CONF=$CONF
export PATH=$STATE/bin:\${PATH}
export OMPI_MCA_plm_rsh_agent=$STATE/bin/ssh
export OMPI_MCA_btl=self,vader,tcp
export OMPI_MCA_btl_tcp_if_include=$NET.0/24
export OMPI_MCA_oob_tcp_if_include=$NET.0/24
EOF
}

cmd="${1:-}"; [ $# -gt 0 ] && shift
case "$cmd" in
  start) start "$@" ;;
  stop) [ "$(id -u)" = 0 ] || die "needs root"
        if [ -e "$STATE" ] || [ -L "$STATE" ]; then ensure_state_dir "$STATE" HVD_RL_SIMCLUSTER_DIR; fi
        refuse_foreign; stop "$@" ;;
  status) status ;;
  env) print_env ;;
  check) problem="$(support_problem)"; if [ -n "$problem" ]; then echo "$problem"; exit 3; fi; echo ok ;;
  exec)
    [ $# -ge 2 ] || die "exec NODE COMMAND..."
    node="$1"; shift; in_node "$node" "$@" ;;
  pids) [ $# -eq 1 ] || die "pids NODE"; ip netns pids "$(ns_of "$1")" ;;
  crash) [ $# -eq 1 ] && [[ "$1" =~ ^node[0-9]+$ ]] || die "crash NODE"; crash "$1" ;;
  boot) [ $# -eq 1 ] && [[ "$1" =~ ^node[0-9]+$ ]] || die "boot NODE"; boot "$1" ;;
  link)
    [ $# -eq 2 ] && [[ "$2" =~ ^(up|down)$ ]] || die "link NODE up|down"
    ip link show "$(veth_of "$1")" >/dev/null 2>&1 || die "no node '$1' is running"
    ip link set "$(veth_of "$1")" "$2" ;;
  rate)
    [ $# -ge 1 ] || die "rate RATE|off [NODE...]"
    up || die "the cluster is not running"
    r="$1"; shift
    if [ $# -gt 0 ]; then set_rate "$r" "$@"; else set_rate "$r" $(node_names); fi
    status_line ;;
  *) sed -n '2,23p' "$SELF"; exit 2 ;;
esac
