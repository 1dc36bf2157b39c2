#!/usr/bin/env bash
# Builds the hvd_rl image from containers/Containerfile with podman (make image).
#   containers/build_image.sh                       CPU image from a local Debian base (made once
#                                                   with mmdebstrap when missing: no registry needed)
#   BASE=docker.io/library/debian:bookworm containers/build_image.sh
#   BASE=<CUDA devel image> TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128" \
#     HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_BUILD_CUDA_CC_LIST=80,90 IMAGE=localhost/hvd-rl:gpu containers/build_image.sh
# Environment: BASE, IMAGE (tag, default localhost/hvd-rl:cpu), TORCH (pip requirement, may carry
# pip options), HOROVOD_GPU_OPERATIONS, HOROVOD_BUILD_CUDA_CC_LIST, HVD_RL_CACHE (the Horovod
# wheel cache scripts/setup.sh fills; a wheel for the image's key is reused, not rebuilt),
# HOST_PIP=0 (do not hand the host's pip configuration to the build), PODMAN_BUILD_ARGS (more
# `podman build` options). Prints the image's size last.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PODMAN="$REPO_ROOT/containers/podman.sh"
DEFAULT_BASE=localhost/hvd-rl-base:bookworm
BASE="${BASE:-$DEFAULT_BASE}"
IMAGE="${IMAGE:-localhost/hvd-rl:cpu}"
TORCH="${TORCH:-torch==2.13.0}"
CACHE="${HVD_RL_CACHE:-$HOME/.cache/hvd_rl}"
log() { printf '\033[1m[image]\033[0m %s\n' "$*" >&2; }

if [ "$BASE" = "$DEFAULT_BASE" ] && ! "$PODMAN" image exists "$BASE" 2>/dev/null; then
  log "no $BASE yet: making it from Debian packages"
  "$REPO_ROOT/containers/make_base.sh" "$BASE"
fi

# The Horovod wheel cache, so that a wheel built for the same key is not built again.
find "$REPO_ROOT/containers/cache" -mindepth 1 ! -name README.md -exec rm -rf {} + 2>/dev/null || true
for part in wheels sdist; do
  [ -d "$CACHE/$part" ] && cp -r "$CACHE/$part" "$REPO_ROOT/containers/cache/"
done

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
mounts=()
if [ "${HOST_PIP:-1}" != 0 ]; then
  mapfile -t mounts < <(python3 "$REPO_ROOT/containers/host_pip.py" "$WORK")
  [ ${#mounts[@]} -gt 0 ] && log "the host's pip configuration goes into the build (${#mounts[@]} mounts; HOST_PIP=0: none)"
fi
read -r -a extra <<< "${PODMAN_BUILD_ARGS:-}"
log "building $IMAGE from $BASE (torch: $TORCH${HOROVOD_GPU_OPERATIONS:+, Horovod with $HOROVOD_GPU_OPERATIONS})"
start=$SECONDS
# --network host: the build reaches the package indexes as the host does (a build's own network
# may not); --uts host with it, so that the build's hostname resolves: Horovod's Gloo ranks crash
# (SIGSEGV) where it does not, and the image's self-check runs them.
"$PODMAN" build --network host --uts host -f "$REPO_ROOT/containers/Containerfile" -t "$IMAGE" \
  --build-arg BASE="$BASE" --build-arg TORCH="$TORCH" \
  --build-arg HOROVOD_GPU_OPERATIONS="${HOROVOD_GPU_OPERATIONS:-}" \
  --build-arg HOROVOD_BUILD_CUDA_CC_LIST="${HOROVOD_BUILD_CUDA_CC_LIST:-}" \
  "${mounts[@]}" "${extra[@]}" "$REPO_ROOT"
size="$("$PODMAN" image inspect --format '{{.Size}}' "$IMAGE")"
log "built $IMAGE in $((SECONDS - start)) s: $(awk -v s="$size" 'BEGIN {printf "%.0f MB", s/1e6}')"
