# Site environment for every hvd_rl SLURM template: the ONE place to edit for your cluster.
# Sourced by the batch script on the first node; srun/mpirun pass the environment to all ranks.
#
# Option A (default): the virtual environment made by scripts/setup.sh in the project checkout.
# Option B: conda      ->  source "$HOME/miniforge3/bin/activate" hvd_rl
# Option C: modules    ->  module purge
#                          module load gcc/12 openmpi/4.1 python/3.11 cuda/12.4
#                          source "$HOME/venvs/hvd_rl/bin/activate"
# With modules, build the environment once on a login/compute node with the same modules loaded:
#   HVD_RL_VENV=$HOME/venvs/hvd_rl HOROVOD_GPU_OPERATIONS=NCCL scripts/setup.sh
if [ -f "$HVD_RL_HOME/.venv/bin/activate" ]; then
  # shellcheck disable=SC1091
  source "$HVD_RL_HOME/.venv/bin/activate"
fi
