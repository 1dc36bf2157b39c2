#!/usr/bin/env bash
# podman, with the settings this host needs and nothing where it needs none. Used by
# containers/build_image.sh (make image) and the container tests; the image itself knows nothing
# of them. Detected, each said once on stderr:
#  - a process without CAP_SYS_RESOURCE (nested or restricted hosts) cannot raise or re-set a
#    resource limit, and podman sets its default ulimits on every container: they are replaced by
#    limits below the current ones (nofile 1024, nproc 4096);
#  - crun refuses hybrid (cgroup v1) hierarchies: runc is used there when it is installed.
# Usage: containers/podman.sh ARGS...   (the arguments of podman). HVD_RL_PODMAN_QUIET=1: no notes.
set -euo pipefail
PODMAN="${PODMAN:-podman}"
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
conf="$(mktemp)"
trap 'rm -f "$conf"' EXIT
# Settings of the host's own containers.conf stay; these lines come after them and win.
[ -n "${CONTAINERS_CONF:-}" ] && [ -f "$CONTAINERS_CONF" ] && cat "$CONTAINERS_CONF" > "$conf"
printf '%s\n' "${conf_lines[@]}" >> "$conf"
CONTAINERS_CONF="$conf" "$PODMAN" "$@"
