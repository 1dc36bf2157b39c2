#!/usr/bin/env bash
# A Debian 12 base image with Python, made locally from Debian packages (no registry needed):
# mmdebstrap's minimal system plus python3, python3-venv and the CA certificates, imported into
# podman. make image uses it when no BASE= is given.
#   containers/make_base.sh [TAG]        (default localhost/hvd-rl-base:bookworm)
# HVD_RL_DEBIAN_MIRROR: the Debian mirror (default http://deb.debian.org/debian).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
TAG="${1:-localhost/hvd-rl-base:bookworm}"
MIRROR="${HVD_RL_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
command -v mmdebstrap >/dev/null || { echo "containers/make_base.sh: needs mmdebstrap (Debian: apt-get install mmdebstrap)" >&2; exit 2; }
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
echo "[make_base] mmdebstrap bookworm from $MIRROR" >&2
mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,ca-certificates \
  bookworm "$WORK/base.tar" "$MIRROR"
"$HERE/podman.sh" import --change 'CMD ["/bin/bash"]' "$WORK/base.tar" "$TAG" >/dev/null
echo "[make_base] $TAG: $("$HERE/podman.sh" image inspect --format '{{.Size}}' "$TAG" | awk '{printf "%.0f MB", $1/1e6}')" >&2
