#!/usr/bin/env bash
# The hvd_rl image's entry point.
#   <image> train --config ...          hvd-rl train ... (any hvd-rl subcommand or option)
#   <image> mpirun -np 2 hvd-rl train   any command on PATH, as it is
#   <image> hvd-rl-sshd                 an ssh server for mpirun from another container
#                                       (Kubernetes MPIJob workers, the two-container test)
# On AWS Batch multi-node parallel jobs (AWS_BATCH_JOB_NUM_NODES set) every node runs
# `hvd-rl aws-batch -- COMMAND`: the main node runs COMMAND under mpirun across all nodes and
# every node exits with its code (hvd_rl/cluster/aws_batch.py). It is exec'd, so it is PID 1 and
# receives AWS Batch's SIGTERM (a stop, a Spot interruption) itself: it handles it (the ranks
# checkpoint, the main node exits 75); the kernel would ignore SIGTERM for a PID 1 without a handler.
set -euo pipefail
if [ $# -gt 0 ] && [[ "$1" != -* ]] && command -v -- "$1" >/dev/null 2>&1; then
  command=("$@")
else
  command=(hvd-rl "$@")
fi
if [ -n "${AWS_BATCH_JOB_NUM_NODES:-}" ] && [ "${command[0]}" != hvd-rl-sshd ]; then
  exec hvd-rl aws-batch -- "${command[@]}"
fi
exec "${command[@]}"
