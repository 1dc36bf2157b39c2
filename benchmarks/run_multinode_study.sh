#!/usr/bin/env bash
# The multi-node scaling study of benchmarks/results/multinode-2sim: a simulated 2-node cluster
# (slurm/sim_cluster.sh: network namespaces, a slurmd per node, MPI over TCP between them), and on
# it, once with unlimited links and once with every link shaped to 1 Gbit/s (tc tbf):
#   - the SLURM scaling sweep (slurm/scaling_sweep.sbatch, weak scaling of the Atari preset):
#     1 node x 1 rank and 2 nodes x 1 rank, one array element at a time;
#   - the allreduce benchmark (benchmarks/allreduce.py) across the 2 nodes, for the cost model;
# plus the allreduce benchmark with 2 ranks within one node (separates Horovod's per-collective
# overhead from the network latency), then `hvd-rl report` with the projection to 8..1024 ranks.
#
#   sudo benchmarks/run_multinode_study.sh [OUT_DIR]        # ~8 minutes on 2 cores
#
# Environment: HVD_RL_STUDY_RATES (default "off 1gbit"), HVD_RL_STUDY_RANKS / _NODES (default
# "1 2" / "1 2"; the cluster gets the largest node count), HVD_RL_STUDY_ITERATIONS (measured
# iterations per point, default 3), HVD_RL_STUDY_CONFIG (default configs/atari_ppo.toml) and
# HVD_RL_STUDY_SETS (space-separated SECTION.KEY=VALUE for every run, e.g.
# "distributed.compression=powersgd"): the multi-agent study of benchmarks/results/multiagent runs
#   HVD_RL_STUDY_CONFIG=configs/mpe_spread_mappo.toml HVD_RL_STUDY_RANKS="1 2 4" HVD_RL_STUDY_NODES="1 2 4" ...
# HVD_RL_STUDY_PAUSE / HVD_RL_STUDY_RESUME: commands run around the timed part (e.g. to pause other
# work on the machine; RESUME runs whatever happens). Needs root (namespaces); refuses otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"
OUT="${1:-benchmarks/results/multinode-2sim}"
read -r -a RATES <<< "${HVD_RL_STUDY_RATES:-off 1gbit}"
RANKS="${HVD_RL_STUDY_RANKS:-1 2}"
NODES="${HVD_RL_STUDY_NODES:-1 2}"
ITERATIONS="${HVD_RL_STUDY_ITERATIONS:-3}"
CONFIG="${HVD_RL_STUDY_CONFIG:-configs/atari_ppo.toml}"
read -r -a SETS <<< "${HVD_RL_STUDY_SETS:-}"
SET_ARGS=()
for s in "${SETS[@]}"; do SET_ARGS+=(--set "$s"); done
MAX_NODES="$(tr ' ' '\n' <<< "$NODES" | sort -n | tail -1)"
[ "$MAX_NODES" -ge 2 ] || MAX_NODES=2
BIN="$REPO/.venv/bin"
CLUSTER="$REPO/slurm/sim_cluster.sh"
export HVD_RL_SIMCLUSTER_DIR="${HVD_RL_SIMCLUSTER_DIR:-/tmp/hvd_rl_simcluster}"

"$CLUSTER" check >/dev/null || { "$CLUSTER" check; exit 1; }
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
start=$(date +%s)
paused=0
cleanup() {
  local rc=$?
  if [ "$paused" = 1 ] && [ -n "${HVD_RL_STUDY_RESUME:-}" ]; then
    echo "[study] resume: $HVD_RL_STUDY_RESUME"; bash -c "$HVD_RL_STUDY_RESUME" || true
  fi
  "$CLUSTER" stop >/dev/null 2>&1 || true
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

"$CLUSTER" start "$MAX_NODES"
eval "$("$CLUSTER" env)"
export PATH="$BIN:$PATH" OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONUNBUFFERED=1

wait_job() {  # until SLURM has no pending or running element of the job
  local job="$1" deadline=$(( $(date +%s) + ${2:-1800} ))
  while squeue -h -j "$job" 2>/dev/null | grep -q .; do
    [ "$(date +%s)" -lt "$deadline" ] || { echo "[study] job $job still running: cancelled" >&2; scancel "$job"; return 1; }
    sleep 2
  done
}

label_of() { [ "$1" = off ] && echo unlimited || echo "$1"; }

# Render every sweep before the quiet window (rendering imports torch).
for rate in "${RATES[@]}"; do
  label="$(label_of "$rate")"
  rm -rf "${OUT:?}/$label"
  mkdir -p "$OUT/$label"
  "$BIN/hvd-rl" slurm render --template scaling --job-name "sweep-$label" --ranks "$RANKS" --sweep-nodes "$NODES" \
      --mode weak --ntasks-per-node 1 --cpus-per-task 1 --iterations "$ITERATIONS" --time 00:30:00 \
      --config "$CONFIG" "${SET_ARGS[@]}" --run-root "$OUT/$label" --out "$OUT/$label/sweep.sbatch" >/dev/null
done

if [ -n "${HVD_RL_STUDY_PAUSE:-}" ]; then
  echo "[study] pause: $HVD_RL_STUDY_PAUSE"; paused=1; bash -c "$HVD_RL_STUDY_PAUSE"
fi
quiet_start=$(date +%s)

# Within one node: 2 ranks on node1 (shared memory), the overhead every collective pays.
srun -N1 -n2 -w node1 --mpi=pmix --cpus-per-task=1 "$BIN/python" benchmarks/allreduce.py \
    --max-size $((64 << 20)) --reps 5 --out "$OUT/allreduce-1node.json"
for rate in "${RATES[@]}"; do
  label="$(label_of "$rate")"
  "$CLUSTER" rate "$rate"
  # One array element at a time (%1): the points must not share the cores.
  job="$(cd "$OUT/$label" && sbatch --parsable --array="0-$(( $(wc -w <<< "$RANKS") - 1 ))%1" sweep.sbatch)"
  echo "[study] $label: sweep job $job"
  wait_job "$job"
  srun -N2 --ntasks-per-node=1 --mpi=pmix --cpus-per-task=1 "$BIN/python" benchmarks/allreduce.py \
      --max-size $((64 << 20)) --reps 5 --out "$OUT/allreduce-2nodes-$label.json"
done
"$CLUSTER" rate off >/dev/null
quiet_s=$(( $(date +%s) - quiet_start ))
if [ "$paused" = 1 ] && [ -n "${HVD_RL_STUDY_RESUME:-}" ]; then
  echo "[study] resume: $HVD_RL_STUDY_RESUME"; bash -c "$HVD_RL_STUDY_RESUME"; paused=0
fi
echo "[study] measurements took ${quiet_s} s"

sweeps=()
for rate in "${RATES[@]}"; do sweeps+=("$OUT/$(label_of "$rate")"/sweep-*); done
"$BIN/hvd-rl" report "${sweeps[@]}" "$OUT"/allreduce-*.json --out "$OUT/report" \
    --title "hvd_rl multi-node study: 2 simulated nodes on $(hostname -s), unlimited and 1 Gbit/s links"

# What is committed: no checkpoints or event files, paths relative to the repository.
find "$OUT" -depth \( -name checkpoints -o -name tb \) -type d -exec rm -rf {} +
grep -rlI --exclude=*.png -e "$REPO" "$OUT" | xargs -r sed -i -e "s|$REPO/||g" -e "s|$REPO|.|g"
{
  echo "machine: $(hostname -s), $(nproc) cores; $(uname -r)"
  echo "rates: ${RATES[*]}; ranks: $RANKS; nodes: $NODES; measured iterations per point: $ITERATIONS"
  echo "config: $CONFIG; settings: ${SETS[*]:-none}"
  echo "measurement window: ${quiet_s} s; paused meanwhile: ${HVD_RL_STUDY_PAUSE:-nothing}"
  echo "command: benchmarks/run_multinode_study.sh $(realpath --relative-to="$REPO" "$OUT")"
} > "$OUT/study.txt"
echo "[study] done in $(( $(date +%s) - start )) s: $OUT/report/report.md"
