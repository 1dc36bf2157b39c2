#!/usr/bin/env bash
# The whole GPU check in one command, for the few minutes a GPU machine is lent (issue 26). Run it
# from the repository root with the bundle of benchmarks/gpu/make_bundle.sh in .whl/:
#
#   benchmarks/gpu/run_on_device.sh                    # on the GPU machine ($OUT: what comes back)
#   benchmarks/gpu/run_on_device.sh --cpu-dry-run      # here: the same steps on CPU, tiny sizes
#   ... --steps train,sweep                            # only these steps (info, horovod, install,
#                                                      # doctor run always: every later step needs them)
#
# Steps, each bounded by `timeout`, each timed, a failed one recorded and passed: info, horovod (a
# wheel from the bundle, or built by scripts/build_horovod.sh: NCCL first, then without GPU
# operations if that fails), install (the bundle's wheels, Horovod and hvd_rl into a prefix, no
# network), doctor,
# train (the Atari preset on cuda, 1 and 2 ranks sharing the GPU, amp off and bf16; then the
# 2-rank bf16 run resumed with --resume auto for more iterations), compression (PowerSGD and top-k,
# 2 ranks, stopped and resumed from each rank's residual file; compression_check.py), sweep (2 ranks x 16/32/64 envs
# stepped by ale_vector threads on all cores), learner (benchmarks/gpu/learner.py: minibatch
# 256/1024/4096, off and bf16), summary. Everything is written under $OUT (default runs/gpu-out),
# at most 8 files: log.txt, steps.jsonl, summary.json, table.txt, runs.tar.gz (metrics, configs,
# summaries; no checkpoints) and the Horovod wheel built there (carry it back in .whl/ next time).
# Launcher: mpirun when there is one and Horovod has MPI, else horovodrun --gloo
# (HVD_RL_GPU_LAUNCHER=mpirun|gloo chooses).
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO"
DRY=0
STEPS="info,horovod,install,doctor,train,compression,sweep,learner,summary"
BUNDLE="$REPO/.whl"
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu-dry-run) DRY=1; shift ;;
    --steps) STEPS="info,horovod,install,doctor,$2,summary"; shift 2 ;;
    --bundle) BUNDLE="$(cd "$2" && pwd)"; shift 2 ;;
    -h|--help) sed -n '2,22p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "run_on_device.sh: unknown option '$1' (try --help)" >&2; exit 2 ;;
  esac
done
OUT="${OUT:-$REPO/runs/gpu-out}"
mkdir -p "$OUT"
WORK="$(mktemp -d /tmp/hvd_rl_gpu.XXXXXX)"
RUNS="$WORK/runs"
PREFIX="$WORK/site"
LOG="$OUT/log.txt"
STEP_LOG="$OUT/steps.jsonl"
: > "$LOG"; : > "$STEP_LOG"
export PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

if [ "$DRY" = 1 ]; then
  # CPU, tiny sizes, this checkout's venv interpreter (its torch; the bundle still goes into a prefix)
  PY="${HVD_RL_GPU_PYTHON:-$REPO/.venv/bin/python}"
  DEVICE=cpu; CORES=2
  ENVS=2; NUM_STEPS=16; ITERS=3; MORE=2; CITERS=2; SWEEP_ENVS="2 4"; SWEEP_ITERS=2; MINIBATCHES="16 32"
  STEP_LIMIT=300; BUILD_LIMIT=900
  unset HOROVOD_GPU_OPERATIONS
else
  PY="${HVD_RL_GPU_PYTHON:-python3}"
  DEVICE=cuda; CORES="$(nproc)"
  ENVS=8; NUM_STEPS=128; ITERS=20; MORE=4; CITERS=6; SWEEP_ENVS="16 32 64"; SWEEP_ITERS=6; MINIBATCHES="256 1024 4096"
  STEP_LIMIT=150; BUILD_LIMIT=330
fi
export PY PREFIX

stamp() { date -u +%H:%M:%S; }
note() { echo "[$(stamp)] $*" | tee -a "$LOG"; }
# step NAME LIMIT_S CMD...: runs CMD under timeout, output to the log, one line to steps.jsonl.
step() {
  local name="$1" limit="$2"; shift 2
  local start rc
  start="$(date +%s%N)"
  note "step $name (limit ${limit}s): $*"
  # bash -c: the command may be one of this script's exported functions; timeout signals its group
  timeout -k 10 "$limit" bash -c '"$@"' step "$@" >> "$LOG" 2>&1
  rc=$?
  local ms=$(( ($(date +%s%N) - start) / 1000000 ))
  note "step $name: rc=$rc in $((ms / 1000)).$(printf '%03d' $((ms % 1000)))s"
  printf '{"step": "%s", "rc": %d, "seconds": %d.%03d, "limit": %d}\n' "$name" "$rc" $((ms / 1000)) $((ms % 1000)) "$limit" >> "$STEP_LOG"
  return $rc
}
wanted() { [[ ",$STEPS," == *",$1,"* ]]; }

# ---- info, install, horovod, doctor -------------------------------------------------------------
wanted info && step info 60 bash -c "nvidia-smi || echo 'no nvidia-smi'; nproc; lscpu | grep 'Model name';
  $PY -c 'import sys, torch; print(sys.version); print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda,
  \"available\", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else \"\")';
  command -v mpirun && mpirun --version | head -1 || echo 'no mpirun'; command -v nvcc && nvcc --version | tail -2 || true"

# Horovod first: a wheel carried in the bundle (built by an earlier run: it comes back in $OUT), or
# built here against this interpreter's torch by the project's one build recipe.
build_horovod_wheel() {
  set -e
  local wheel
  wheel="$(ls "$BUNDLE"/horovod-0.28.1-cp*.whl 2>/dev/null | head -1 || true)"
  if [ -n "$wheel" ]; then
    echo "Horovod wheel from the bundle: $wheel"
  else
    wheel="$("$REPO/scripts/build_horovod.sh" "$PY" "$CACHE" "$BUNDLE/horovod-0.28.1.tar.gz" | tail -1)"
    cp "$wheel" "$OUT/"
  fi
  echo "$wheel" > "$WORK/horovod_wheel"
}
export -f build_horovod_wheel
export BUNDLE REPO WORK OUT CACHE="${HVD_RL_CACHE:-$HOME/.cache/hvd_rl}"
if [ "$DRY" = 0 ]; then
  # NCCL first (compute capability 9.0: the H200); if that build fails, Horovod without GPU operations
  # (allreduce through host memory) and the log says so.
  HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_BUILD_CUDA_CC_LIST=90 step horovod "$BUILD_LIMIT" build_horovod_wheel \
    || { note "NCCL build failed: Horovod without GPU operations"; step horovod_no_nccl "$BUILD_LIMIT" build_horovod_wheel; }
else
  step horovod "$BUILD_LIMIT" build_horovod_wheel
fi

# One pip call for everything (separate --target installs would replace each other's bin/).
install_bundle() {
  set -e
  local wheels=()
  for w in "$BUNDLE"/*.whl; do [[ "$(basename "$w")" == horovod-* ]] || wheels+=("$w"); done
  "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-build-isolation --no-compile \
    --target "$PREFIX" "${wheels[@]}" "$(cat "$WORK/horovod_wheel")" "$REPO"
  PYTHONPATH="$PREFIX" "$PY" -c "import gymnasium, ale_py, hvd_rl, horovod.torch as h
print('gymnasium', gymnasium.__version__, 'ale-py', ale_py.__version__)
print('horovod: mpi', h.mpi_built(), 'gloo', h.gloo_built(), 'nccl', h.nccl_built())"
  PYTHONPATH="$PREFIX" "$PREFIX/bin/horovodrun" --check-build
}
export -f install_bundle
step install "$STEP_LIMIT" install_bundle
export PYTHONPATH="$PREFIX${PYTHONPATH:+:$PYTHONPATH}" PATH="$PREFIX/bin:$PATH"
step doctor 120 hvd-rl doctor

LAUNCHER="${HVD_RL_GPU_LAUNCHER:-auto}"
if [ "$LAUNCHER" = auto ]; then
  if command -v mpirun > /dev/null && "$PY" -c "import sys, horovod.torch as h; sys.exit(not h.mpi_built())" 2>/dev/null; then
    LAUNCHER=mpirun
  else
    LAUNCHER=gloo
  fi
fi
note "launcher: $LAUNCHER, device: $DEVICE, python: $PY"
launch() {  # launch RANKS ARGS...
  local ranks="$1"; shift
  if [ "$LAUNCHER" = mpirun ]; then
    mpirun -np "$ranks" --oversubscribe --bind-to none "$@"
  else
    horovodrun --gloo -np "$ranks" -H "localhost:$ranks" "$@"
  fi
}
export -f launch
export LAUNCHER
# train NAME RANKS ENVS ITERATIONS AMP [SET...]: the Atari preset, a fixed number of iterations.
train() {
  local name="$1" ranks="$2" envs="$3" iters="$4" amp="$5"; shift 5
  local sets=()
  for s in "distributed.device=\"$DEVICE\"" "distributed.amp=\"$amp\"" "env.num_envs=$envs" "ppo.num_steps=$NUM_STEPS" \
           "ppo.total_timesteps=$((iters * ranks * envs * NUM_STEPS))" "logging.tensorboard=false" "$@"; do
    sets+=(--set "$s")
  done
  step "train:$name" "$STEP_LIMIT" launch "$ranks" hvd-rl train --config configs/atari_ppo.toml \
    --run-dir "$RUNS/$name" --resume auto "${sets[@]}"
}

# ---- train: 1 and 2 ranks, off and bf16; resume -------------------------------------------------
if wanted train; then
  for amp in off bf16; do
    for ranks in 1 2; do
      train "r${ranks}_${amp}" "$ranks" "$ENVS" "$ITERS" "$amp"
    done
  done
  # the 2-rank bf16 run again, longer: --resume auto continues from its final checkpoint
  cp -r "$RUNS/r2_bf16" "$RUNS/r2_bf16_resumed" 2>/dev/null
  train r2_bf16_resumed 2 "$ENVS" "$((ITERS + MORE))" bf16
fi

# ---- compression: PowerSGD and top-k on the device, stopped and resumed from the per-rank files -----
# Each compressed 2-rank run ends at CITERS iterations (its checkpoint: rank 0's file and each rank's
# residuals/Q), then a copy resumes with --resume auto for MORE iterations: the residuals must come
# back onto the GPU (a CPU residual added to a CUDA gradient would crash it), the ranks must stay
# bitwise identical every iteration (verify_every=1: top-k's fixed-order sum), and
# compression_check.py loads every rank's saved state onto the device and back.
if wanted compression; then
  for c in powersgd topk; do
    train "c_${c}" 2 "$ENVS" "$CITERS" bf16 "distributed.compression=\"$c\"" "distributed.verify_every=1"
    cp -r "$RUNS/c_${c}" "$RUNS/c_${c}_resumed" 2>/dev/null
    train "c_${c}_resumed" 2 "$ENVS" "$((CITERS + MORE))" bf16 "distributed.compression=\"$c\"" \
      "distributed.verify_every=1"
  done
  step compression_state "$STEP_LIMIT" "$PY" benchmarks/gpu/compression_check.py --device "$DEVICE" \
    --runs "$RUNS" --out "$WORK/compression.json"
fi

# ---- sweep: envs per rank on all cores ----------------------------------------------------------
if wanted sweep; then
  for envs in $SWEEP_ENVS; do
    train "sweep_2x${envs}" 2 "$envs" "$SWEEP_ITERS" bf16 "env.env_threads=$((CORES / 2))"
  done
fi

# ---- learner alone ------------------------------------------------------------------------------
# shellcheck disable=SC2086
wanted learner && step learner "$STEP_LIMIT" "$PY" benchmarks/gpu/learner.py --device "$DEVICE" \
  --minibatches $MINIBATCHES --amp off bf16 --out "$WORK/learner.json"

# ---- summary and what comes back ----------------------------------------------------------------
step summary 60 "$PY" benchmarks/gpu/summarize.py --runs "$RUNS" --learner "$WORK/learner.json" \
  --steps "$STEP_LOG" --resumed r2_bf16_resumed --resumed-from r2_bf16 \
  --compression "$WORK/compression.json" --out "$OUT/summary.json" --table "$OUT/table.txt"
(cd "$RUNS" 2>/dev/null && tar czf "$OUT/runs.tar.gz" --exclude=checkpoints --exclude=tb . ) || true
cat "$OUT/table.txt" 2>/dev/null
rm -rf "$WORK"
note "done; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
