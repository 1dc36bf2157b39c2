# Shared by the hvd_rl SLURM templates (sourced from the batch script). Not meant to be edited:
# site settings go in slurm/site_env.sh, job settings in the template or `hvd-rl slurm render`.

# Exit code of `hvd-rl train` when it checkpointed after a preemption signal (see docs/outputs.md).
HVD_RL_PREEMPTED=75

hvd_rl_prepare() {
  # shellcheck disable=SC1091
  source "$HVD_RL_HOME/slurm/site_env.sh"
  cd "$HVD_RL_HOME"
  # One compute thread per allocated CPU of the task. Since SLURM 22.05 srun does not inherit
  # --cpus-per-task from the allocation, so pass it on explicitly.
  export OMP_NUM_THREADS="${SLURM_CPUS_PER_TASK:-1}"
  export SRUN_CPUS_PER_TASK="${SLURM_CPUS_PER_TASK:-1}"
  if [ "$(id -u)" = 0 ]; then  # containers and test clusters run jobs as root
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  fi
  echo "[hvd_rl] job ${SLURM_JOB_ID} restart ${SLURM_RESTART_COUNT:-0} on ${SLURM_JOB_NODELIST}:" \
       "${SLURM_NTASKS} task(s), ${SLURM_CPUS_PER_TASK:-1} cpu(s)/task, launcher ${LAUNCHER}"
}

hvd_rl_container_command() {
  # HVD_RL_CMD: what each rank runs for `hvd-rl`. With CONTAINER set, the image's hvd-rl: under
  # Apptainer (the default runtime) `apptainer exec` with the submit directory bound at the same
  # path (--nv on GPU templates); under pyxis srun itself enters the image (hvd_rl_launch). The
  # ranks still get their PMIx/MPI wiring from srun or mpirun on the host.
  HVD_RL_CMD=(hvd-rl)
  [ -n "${CONTAINER:-}" ] || return 0
  case "${CONTAINER_RUNTIME:-apptainer}" in
    apptainer)
      local nv=()
      [ "${CONTAINER_GPU:-0}" = 1 ] && nv=(--nv)
      HVD_RL_CMD=(apptainer exec ${nv[@]+"${nv[@]}"} --bind "$PWD" --pwd "$PWD" ${HVD_RL_APPTAINER_ARGS:-}
                  "$CONTAINER" hvd-rl) ;;
    pyxis)
      if [ "$LAUNCHER" != srun ]; then
        echo "[hvd_rl] CONTAINER_RUNTIME=pyxis needs LAUNCHER=srun (pyxis is an srun plugin)" >&2; return 2
      fi ;;
    *)
      echo "[hvd_rl] unknown CONTAINER_RUNTIME '$CONTAINER_RUNTIME' (apptainer or pyxis)" >&2; return 2 ;;
  esac
}

hvd_rl_launch() {
  # Replaces the calling (background) subshell with the launcher, so that a signal sent to
  # "$!" reaches srun/mpirun/horovodrun itself; the arguments are those of `hvd-rl`.
  hvd_rl_container_command || return 2
  if [ -n "${CONTAINER:-}" ] && [ "$LAUNCHER" = horovodrun ]; then
    echo "[hvd_rl] CONTAINER needs LAUNCHER=srun or mpirun (horovodrun would run on the host)" >&2; return 2
  fi
  case "$LAUNCHER" in
    srun)
      local container_args=()
      [ -n "${CONTAINER:-}" ] && [ "${CONTAINER_RUNTIME:-apptainer}" = pyxis ] && container_args=(
        --container-image="$CONTAINER" --container-mounts="$PWD:$PWD" --container-workdir="$PWD")
      exec srun --mpi=pmix --kill-on-bad-exit=1 --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}" \
           ${container_args[@]+"${container_args[@]}"} ${HVD_RL_SRUN_ARGS:-} "${HVD_RL_CMD[@]}" "$@" ;;
    mpirun)
      # Open MPI reads the SLURM allocation itself (one slot per task); the trainer sizes its
      # threads from SLURM_CPUS_PER_TASK, so no binding is imposed here.
      # - mpirun answers SIGTERM (SLURM's preemption) by terminating the ranks and SIGKILLs them
      #   odls_base_sigkill_timeout seconds later (default 1): give them time to checkpoint.
      # - a rank exiting non-zero makes mpirun abort the job, and the abort waits that timeout per
      #   rank: after a checkpointed preemption the ranks exit 0 instead (HVD_RL_PREEMPTED_EXIT_CODE)
      #   and the requeue below goes by the preempted.json marker.
      exec mpirun -np "${HVD_RL_NP:-$SLURM_NTASKS}" --bind-to none -x PATH -x LD_LIBRARY_PATH -x OMP_NUM_THREADS \
             -x SLURM_CPUS_PER_TASK -x HVD_RL_PREEMPTED_EXIT_CODE=0 \
             --mca odls_base_sigkill_timeout "${HVD_RL_TERM_GRACE:-30}" ${HVD_RL_MPIRUN_ARGS:-} "${HVD_RL_CMD[@]}" "$@" ;;
    horovodrun)
      # Gloo over ssh between nodes (horovodrun --gloo); slots per node from the allocation.
      local hosts
      hosts="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed "s/\$/:${SLURM_TASKS_PER_NODE%%(*}/" | paste -sd,)"
      exec horovodrun --gloo -np "${HVD_RL_NP:-$SLURM_NTASKS}" -H "$hosts" ${HVD_RL_HOROVODRUN_ARGS:-} hvd-rl "$@" ;;
    *)
      echo "[hvd_rl] unknown LAUNCHER '$LAUNCHER' (srun, mpirun or horovodrun)" >&2; return 2 ;;
  esac
}

hvd_rl_train_requeueable() {
  # Runs `hvd-rl train "$@" --resume auto` and requeues the job when it was preempted.
  # SLURM signals only this shell ahead of the time limit (--signal=B:USR1@N), and every process
  # of the job on preemption (SIGTERM). Either way this shell writes <run_dir>/stop.request: rank
  # 0 looks for it at least once per optimisation epoch, so every launcher works the same (srun
  # would forward USR1, but horovodrun dies of it and mpirun kills the job on SIGTERM). The ranks
  # agree to checkpoint, write preempted.json and exit 75; then the job requeues itself and the
  # next run resumes from that checkpoint. Ranks that get SIGTERM/SIGUSR1 directly do the same.
  local run_dir="$1"; shift
  local child rc
  mkdir -p "$run_dir"
  # A marker or stop request left by an earlier run is stale now; only this run's may requeue.
  rm -f "$run_dir/preempted.json" "$run_dir/stop.request"
  trap 'echo "[hvd_rl] USR1: asking the ranks to checkpoint"; touch "$run_dir/stop.request"' USR1
  trap 'echo "[hvd_rl] TERM: asking the ranks to checkpoint"; touch "$run_dir/stop.request"' TERM
  hvd_rl_launch train --run-dir "$run_dir" --resume auto "$@" &
  child=$!
  while true; do
    wait "$child"
    rc=$?
    kill -0 "$child" 2>/dev/null || break  # wait was interrupted by a trapped signal
  done
  trap - USR1 TERM
  if [ "$rc" -eq "$HVD_RL_PREEMPTED" ] || [ -f "$run_dir/preempted.json" ]; then
    echo "[hvd_rl] preempted and checkpointed: requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID"
    return 0
  fi
  echo "[hvd_rl] training exited with $rc"
  return "$rc"
}
