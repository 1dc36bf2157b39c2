#!/usr/bin/env bash
# podman, with the settings this host needs and nothing where it needs none. Used by
# containers/build_image.sh (make image) and the container tests; the image itself knows nothing
# of them. Detected, each said once on stderr:
#  - a process without CAP_SYS_RESOURCE (nested or restricted hosts) cannot raise or re-set a
#    resource limit, and podman sets its default ulimits on every container: they are replaced by
#    limits below the current ones (nofile 1024, nproc 4096);
#  - crun refuses hybrid (cgroup v1) hierarchies: runc is used there when it is installed.
# The settings are layered on the host's configuration, never instead of it: Podman 4.4 and later
# read them as CONTAINERS_CONF_OVERRIDE (after every other containers.conf; one the caller set is
# merged under them); older Podman has only CONTAINERS_CONF, which replaces all the other files,
# so there it is given the files it would read itself, merged, with these settings last
# (containers/layer_conf.py).
# Usage: containers/podman.sh ARGS...   (the arguments of podman). HVD_RL_PODMAN_QUIET=1: no notes.
set -euo pipefail
PODMAN="${PODMAN:-podman}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
command -v "$PODMAN" >/dev/null || { echo "containers/podman.sh: $PODMAN is not installed (Debian: apt-get install podman runc)" >&2; exit 2; }
note() { [ "${HVD_RL_PODMAN_QUIET:-0}" = 1 ] || echo "containers/podman.sh: $*" >&2; }

cap_eff="$(awk '/^CapEff:/ {print $2}' /proc/self/status 2>/dev/null || echo ffffffffff)"
conf_lines=()
if (( (16#$cap_eff >> 24) & 1 )); then :; else
  nofile=$(( $(ulimit -Sn) > 1024 ? 1024 : $(ulimit -Sn) - 1 ))
  nproc_soft="$(ulimit -Su)"; [ "$nproc_soft" = unlimited ] && nproc_soft=100000
  nproc=$(( nproc_soft > 4096 ? 4096 : nproc_soft - 1 ))
  conf_lines+=("[containers]" "default_ulimits = [\"nofile=$nofile:$nofile\", \"nproc=$nproc:$nproc\"]")
  note "no CAP_SYS_RESOURCE: containers get nofile=$nofile, nproc=$nproc"
fi
if [ "$(stat -fc %T /sys/fs/cgroup 2>/dev/null)" != cgroup2fs ] && command -v runc >/dev/null; then
  conf_lines+=("[engine]" "runtime = \"runc\"")
  note "cgroup v1/hybrid hierarchy: runtime runc"
fi
if [ ${#conf_lines[@]} -eq 0 ]; then
  exec "$PODMAN" "$@"
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
printf '%s\n' "${conf_lines[@]}" > "$work/ours.conf"

version="$("$PODMAN" version --format '{{.Client.Version}}' 2>/dev/null || true)"
IFS=. read -r major minor _ <<< "${version:-0.0}"
if (( ${major:-0} > 4 || (${major:-0} == 4 && ${minor%%[!0-9]*} >= 4) )); then
  override="$work/ours.conf"
  if [ -n "${CONTAINERS_CONF_OVERRIDE:-}" ]; then  # the caller's own override stays, under ours
    python3 "$HERE/layer_conf.py" "$work/override.conf" "$CONTAINERS_CONF_OVERRIDE" "$work/ours.conf"
    override="$work/override.conf"
  fi
  CONTAINERS_CONF_OVERRIDE="$override" "$PODMAN" "$@"
  exit
fi
# Podman before 4.4: the files it reads itself (containers.conf(5)), in its order, then ours.
if [ -n "${CONTAINERS_CONF:-}" ]; then
  host_files=("$CONTAINERS_CONF")
else
  host_files=(/usr/share/containers/containers.conf /etc/containers/containers.conf)
  host_files+=(/etc/containers/containers.conf.d/*.conf)
  if [ "$(id -u)" != 0 ]; then  # rootless only: the user's own
    user_conf="${XDG_CONFIG_HOME:-$HOME/.config}/containers/containers.conf"
    host_files+=("$user_conf" "$user_conf".d/*.conf)
  fi
fi
python3 "$HERE/layer_conf.py" "$work/containers.conf" "${host_files[@]}" "$work/ours.conf"
CONTAINERS_CONF="$work/containers.conf" "$PODMAN" "$@"
