#!/usr/bin/env bash
# One-command, idempotent setup of a fresh machine for hvd_rl.
#
#   scripts/setup.sh            # OpenMPI (apt, if mpirun is missing), .venv, torch, Horovod, hvd_rl
#   scripts/setup.sh --slurm    # also the Debian SLURM + munge packages used by the SLURM tests
#   scripts/setup.sh --containers  # also podman, runc and mmdebstrap (make image, the container tests)
#   scripts/setup.sh --plan     # print what a run would install or rebuild, change nothing
#
# Environment knobs:
#   HVD_RL_VENV             virtual environment to create/use            (default: <repo>/.venv)
#   HVD_RL_PYTHON           interpreter that creates the venv            (default: python3)
#   HVD_RL_TORCH            pip requirement for PyTorch                  (default: torch==2.13.0, the CPU
#                           build on local disk here; on a GPU cluster pass the site's CUDA build)
#   HVD_RL_CACHE            cache for the Horovod sdist and built wheels (default: ~/.cache/hvd_rl)
#   HOROVOD_GPU_OPERATIONS  set to NCCL on GPU nodes to build Horovod with NCCL
#
# Horovod 0.28.1 is the latest release but does not compile against PyTorch >= 2.1 as published:
# its CMake asks for C++14 and PyTorch's headers need C++17. scripts/build_horovod.sh builds the
# sdist with the small patch in scripts/horovod-0.28.1-cxx17.patch and caches the wheel, keyed by
# Horovod, torch and Python versions, the patch and the GPU options, so every later setup takes seconds.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${HVD_RL_VENV:-$REPO_ROOT/.venv}"
PYTHON="${HVD_RL_PYTHON:-python3}"
TORCH_REQ="${HVD_RL_TORCH:-torch==2.13.0}"
CACHE="${HVD_RL_CACHE:-$HOME/.cache/hvd_rl}"
HOROVOD_VERSION=0.28.1
PATCH="$REPO_ROOT/scripts/horovod-$HOROVOD_VERSION-cxx17.patch"
WITH_SLURM=0
WITH_CONTAINERS=0
PLAN_ONLY=0
for arg in "$@"; do
  case "$arg" in
    --slurm) WITH_SLURM=1 ;;
    --containers) WITH_CONTAINERS=1 ;;
    --plan) PLAN_ONLY=1 ;;
    -h|--help) sed -n '2,20p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "setup.sh: unknown option '$arg' (try --help)" >&2; exit 2 ;;
  esac
done

log() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

apt_install() {
  # Installs only the Debian packages that are missing; apt-get update only when needed.
  local missing=()
  for pkg in "$@"; do dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  command -v apt-get >/dev/null || { echo "setup.sh: need ${missing[*]} but apt-get is unavailable; install them (or 'module load' them) first" >&2; exit 1; }
  log "apt-get install ${missing[*]}"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
}

# What an existing environment needs: the torch the caller asked for, and a Horovod built for it
# (with NCCL when HOROVOD_GPU_OPERATIONS=NCCL). A venv made for CPUs is not "done" for a GPU build.
TORCH_SPEC_FILE="${VENV}/.hvd_rl_torch_spec"
torch_action() {
  # Names every reason, so a user sees all that is wrong with the venv at once.
  if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then echo "install"; return; fi
  local reasons=()
  if [ -f "$TORCH_SPEC_FILE" ] && [ "$(cat "$TORCH_SPEC_FILE")" != "$TORCH_REQ" ]; then reasons+=("HVD_RL_TORCH changed"); fi
  if [ -n "${HOROVOD_GPU_OPERATIONS:-}" ] && ! "$VENV/bin/python" -c "import sys, torch; sys.exit(torch.version.cuda is None)" 2>/dev/null; then
    reasons+=("HOROVOD_GPU_OPERATIONS=$HOROVOD_GPU_OPERATIONS but the installed torch has no CUDA")
  fi
  if [ ${#reasons[@]} -eq 0 ]; then echo "keep"; return; fi
  local joined; joined="$(printf '%s; ' "${reasons[@]}")"
  echo "reinstall (${joined%; })"
}
horovod_action() {
  local want_nccl=0
  [ "${HOROVOD_GPU_OPERATIONS:-}" = NCCL ] && want_nccl=1
  if ! "$VENV/bin/python" -c "
import sys, horovod, horovod.torch as hvd
assert horovod.__version__ == '0.28.1'
assert hvd.mpi_built() and hvd.gloo_built()
assert hvd.nccl_built() or $want_nccl == 0" 2>/dev/null; then
    echo "build or install (missing, or without the requested NCCL)"; return
  fi
  echo "keep"
}
if [ "$PLAN_ONLY" = 1 ]; then
  echo "venv:    $([ -x "$VENV/bin/python" ] && echo "keep $VENV" || echo "create $VENV")"
  echo "torch:   $(torch_action) ($TORCH_REQ)"
  echo "horovod: $([ "$(torch_action)" = keep ] && horovod_action || echo "rebuild (torch changes)")"
  exit 0
fi

# 1. MPI: a site's module usually provides it; otherwise Debian's OpenMPI.
if ! command -v mpirun >/dev/null || ! command -v mpicc >/dev/null; then
  apt_install openmpi-bin libopenmpi-dev
fi
# Off-screen OpenGL (Mesa's EGL) for MuJoCo's pictures in `hvd-rl evaluate --video`; small, and
# skipped where apt-get is missing (then set MUJOCO_GL to what the site has).
if command -v apt-get >/dev/null; then apt_install libegl1 libgl1-mesa-dri; fi
if [ "$WITH_SLURM" = 1 ]; then
  apt_install slurm-wlm munge slurm-wlm-basic-plugins libpmix-dev
fi
if [ "$WITH_CONTAINERS" = 1 ]; then
  # podman builds and runs the image without a daemon; runc for hosts whose cgroups crun refuses;
  # mmdebstrap makes the local Debian base (no registry needed); openssh-client for the tests' keys.
  apt_install podman runc mmdebstrap uidmap openssh-client
fi

# 2. Virtual environment and PyTorch first (Horovod compiles against it).
if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
pip_install() {
  # pip's own noise about this machine's unused local index entries is dropped; errors are kept.
  "$PY" -m pip install -q --disable-pip-version-check "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

# Fast path: nothing changed since the last complete setup.
STAMP="$VENV/.hvd_rl_setup"
STAMP_KEY="$(cat "$REPO_ROOT/setup.py" "$0" "$REPO_ROOT/scripts/build_horovod.sh" "$PATCH" | sha256sum | cut -c1-16) torch=$TORCH_REQ gpu=${HOROVOD_GPU_OPERATIONS:-none}"
if [ -f "$STAMP" ] && [ -f "$VENV/.hvd_rl_check_build" ] && [ "$(cat "$STAMP")" = "$STAMP_KEY" ] && "$PY" -c "import hvd_rl, horovod.torch" 2>/dev/null; then
  log "up to date ($VENV); horovodrun --check-build, as recorded by the last full setup:"
  cat "$VENV/.hvd_rl_check_build"
  exit 0
fi

TORCH_ACTION="$(torch_action)"
if [ "$TORCH_ACTION" != keep ]; then
  log "torch: $TORCH_ACTION: $TORCH_REQ"
  read -r -a TORCH_ARGS <<< "$TORCH_REQ"  # may carry pip options, e.g. --index-url for CUDA builds
  pip_install --upgrade "${TORCH_ARGS[@]}" numpy
  "$PY" -m pip uninstall -q -y horovod 2>/dev/null || true  # built against the old torch
fi
printf '%s' "$TORCH_REQ" > "$TORCH_SPEC_FILE"
pip_install setuptools wheel packaging psutil pyyaml cloudpickle cffi
command -v cmake >/dev/null || pip_install "cmake>=3.13,<4"

# 3. Horovod from a cached wheel, or built from the patched sdist once.
if [ "$(horovod_action)" = keep ]; then
  log "Horovod $HOROVOD_VERSION already installed"
else
  WHEEL="$("$REPO_ROOT/scripts/build_horovod.sh" "$PY" "$CACHE" | tail -1)"
  pip_install --force-reinstall --no-deps "$WHEEL"
  pip_install "$WHEEL"
fi

if [ "${HOROVOD_GPU_OPERATIONS:-}" = NCCL ] && ! "$PY" -c "import sys, horovod.torch as h; sys.exit(not h.nccl_built())"; then
  echo "setup.sh: Horovod was built without NCCL although HOROVOD_GPU_OPERATIONS=NCCL: check CUDA (nvcc)" \
       "and NCCL (HOROVOD_NCCL_HOME, or the nvidia-nccl wheel of a CUDA torch)" >&2
  exit 1
fi

# 4. The project itself, with the extras: test (the suite), tools (W&B, videos, ONNX export), docs.
log "installing hvd_rl (editable)"
pip_install -e "$REPO_ROOT[test,tools,docs]"

log "horovodrun --check-build"
"$VENV/bin/horovodrun" --check-build | tee "$VENV/.hvd_rl_check_build"
printf '%s' "$STAMP_KEY" > "$STAMP"
log "done: activate with 'source $VENV/bin/activate'"
