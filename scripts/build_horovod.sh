#!/usr/bin/env bash
# Builds (or finds in the cache) the patched Horovod 0.28.1 wheel for one Python + torch, and
# prints the wheel's path as the last line of stdout. The one copy of the build recipe: used by
# scripts/setup.sh, by benchmarks/gpu/run_on_device.sh (no network there) and by the container.
#
#   scripts/build_horovod.sh PYTHON CACHE_DIR [SDIST]
#
#   PYTHON     interpreter that has torch (Horovod compiles against it)
#   CACHE_DIR  wheels are kept in CACHE_DIR/wheels/horovod-0.28.1-<key>; the sdist in CACHE_DIR/sdist
#   SDIST      a local horovod-0.28.1.tar.gz (else downloaded once with pip into CACHE_DIR/sdist)
#
# Environment: HOROVOD_GPU_OPERATIONS=NCCL (with NCCL from HOROVOD_NCCL_HOME or, when unset, from
# torch's nvidia-nccl wheel), HOROVOD_BUILD_CUDA_CC_LIST (e.g. 90: CUDA 13 no longer builds
# Horovod's default list of old architectures). With mpicc on PATH the wheel has the MPI
# controller and Gloo; without it, Gloo alone (launch with horovodrun --gloo), and it says so.
# The key covers Horovod, torch, Python, MPI, the patch, the GPU options and the machine type.
set -euo pipefail

HOROVOD_VERSION=0.28.1
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PATCH="$REPO_ROOT/scripts/horovod-$HOROVOD_VERSION-cxx17.patch"
[ $# -ge 2 ] || { echo "usage: build_horovod.sh PYTHON CACHE_DIR [SDIST]" >&2; exit 2; }
PY="$1"; CACHE="$2"; SDIST="${3:-}"
log() { printf '\033[1m[build_horovod]\033[0m %s\n' "$*" >&2; }
quiet_pip() { grep -v "is ignored: it is neither a file nor a directory" >&2 || true; }

TORCH_VERSION="$("$PY" -c 'import torch; print(torch.__version__)')" \
  || { echo "build_horovod.sh: $PY cannot import torch (Horovod compiles against it)" >&2; exit 2; }
PY_VERSION="$("$PY" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')"
if command -v mpicc >/dev/null; then
  MPI_FLAGS=(HOROVOD_WITH_MPI=1)
  MPI_VERSION="$(mpirun --version 2>/dev/null | head -1 | tr -cd '[:alnum:]._ ')"
else
  MPI_FLAGS=(HOROVOD_WITHOUT_MPI=1)
  MPI_VERSION="none"
  log "no mpicc on PATH: building with Gloo alone (launch with horovodrun --gloo)"
fi
KEY_SRC="horovod=$HOROVOD_VERSION torch=$TORCH_VERSION python=$PY_VERSION mpi=$MPI_VERSION patch=$(sha256sum "$PATCH" | cut -c1-16) gpu=${HOROVOD_GPU_OPERATIONS:-none}${HOROVOD_BUILD_CUDA_CC_LIST:+ cc=$HOROVOD_BUILD_CUDA_CC_LIST} arch=$(uname -m)"
KEY="$(printf '%s' "$KEY_SRC" | sha256sum | cut -c1-16)"
WHEEL_DIR="$CACHE/wheels/horovod-$HOROVOD_VERSION-$KEY"
if ls "$WHEEL_DIR"/horovod-*.whl >/dev/null 2>&1; then
  log "Horovod wheel cache hit: $WHEEL_DIR"
  ls "$WHEEL_DIR"/horovod-*.whl
  exit 0
fi

log "building Horovod $HOROVOD_VERSION for $KEY_SRC (about 8 minutes on 2 cores)"
if [ -z "$SDIST" ]; then
  mkdir -p "$CACHE/sdist"
  SDIST="$CACHE/sdist/horovod-$HOROVOD_VERSION.tar.gz"
  [ -f "$SDIST" ] || "$PY" -m pip download -q --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" \
    -d "$CACHE/sdist" 2> >(quiet_pip)
fi
[ -f "$SDIST" ] || { echo "build_horovod.sh: no Horovod sdist at $SDIST" >&2; exit 2; }
BUILD="$(mktemp -d)"
trap 'rm -rf "$BUILD"' EXIT
tar xzf "$SDIST" -C "$BUILD"
(cd "$BUILD/horovod-$HOROVOD_VERSION" && patch -p1 -s < "$PATCH")
GPU_FLAGS=()
[ -n "${HOROVOD_GPU_OPERATIONS:-}" ] && GPU_FLAGS=(HOROVOD_GPU_OPERATIONS="$HOROVOD_GPU_OPERATIONS")
if [ "${HOROVOD_GPU_OPERATIONS:-}" = NCCL ] && [ -z "${HOROVOD_NCCL_HOME:-}" ]; then
  # CUDA torch wheels bring NCCL as the nvidia-nccl-cu* wheel: headers and libnccl.so.2, but
  # no unversioned libnccl.so for the linker. Point Horovod's CMake at a home that has both.
  NCCL_PKG="$("$PY" -c "import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__) or list(nvidia.nccl.__path__)[0])" 2>/dev/null || true)"
  if [ -n "$NCCL_PKG" ] && [ -f "$NCCL_PKG/lib/libnccl.so.2" ]; then
    mkdir -p "$BUILD/nccl/lib"
    ln -sf "$NCCL_PKG/include" "$BUILD/nccl/include"
    ln -sf "$NCCL_PKG/lib/libnccl.so.2" "$BUILD/nccl/lib/libnccl.so"
    ln -sf "$NCCL_PKG/lib/libnccl.so.2" "$BUILD/nccl/lib/libnccl.so.2"
    GPU_FLAGS+=(HOROVOD_NCCL_HOME="$BUILD/nccl" HOROVOD_NCCL_LINK=SHARED)
    log "NCCL from the nvidia-nccl wheel: $NCCL_PKG"
  else
    log "HOROVOD_GPU_OPERATIONS=NCCL but no HOROVOD_NCCL_HOME and no nvidia-nccl wheel: CMake searches the system"
  fi
fi
env HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 "${MPI_FLAGS[@]}" \
    HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
    MAKEFLAGS="-j$(nproc)" "${GPU_FLAGS[@]}" \
    "$PY" -m pip wheel -q --no-deps --no-build-isolation --no-index -w "$BUILD/dist" "$BUILD/horovod-$HOROVOD_VERSION" \
    2> >(quiet_pip)
mkdir -p "$WHEEL_DIR"
cp "$BUILD"/dist/horovod-*.whl "$WHEEL_DIR/"
printf '%s\n' "$KEY_SRC" > "$WHEEL_DIR/KEY"
ls "$WHEEL_DIR"/horovod-*.whl
