#!/usr/bin/env bash
# The scaling study of benchmarks/results/: weak + strong sweeps of the Atari preset over 1, 2
# and 4 ranks (4 is oversubscribed on a 2-core machine and marked so), the allreduce and
# environment-throughput benchmarks, and the report. About 10 minutes on 2 cores.
#   benchmarks/run_study.sh [OUT_DIR] [RANKS...]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-benchmarks/results/study-$(hostname -s)}"
shift || true
RANKS=("${@:-1 2 4}")
PY=.venv/bin/python
mkdir -p "$OUT"
start=$(date +%s)
# shellcheck disable=SC2068
$PY benchmarks/scaling.py sweep --out "$OUT" --config configs/atari_ppo.toml --ranks ${RANKS[@]} \
    --modes weak strong --warmup 1 --iterations 3
$PY benchmarks/allreduce.py --np 2 --out "$OUT/allreduce.json"
$PY benchmarks/env_throughput.py --env ALE/Breakout-v5 --num-envs 1 4 8 16 --steps 100 \
    --out "$OUT/env_throughput.json"
.venv/bin/hvd-rl report "$OUT" --out "$OUT/report" --title "hvd_rl scaling study on $(hostname -s)"
echo "study done in $(( $(date +%s) - start )) s: $OUT/report/report.md"
