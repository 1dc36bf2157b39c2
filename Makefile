# The two commands a fresh machine needs (each runs the idempotent setup first):
#   make train   # the main job: Atari PPO preset on NP ranks with mpirun (resumable)
#   make test    # the whole test suite (real ranks, real Horovod, real SLURM, real ALE)
VENV    ?= .venv
NP      ?= 2
CONFIG  ?= configs/atari_ppo.toml
RUN_DIR ?= runs/atari
SET     ?=
PYTEST_ARGS ?=

# Open MPI refuses to run as root unless told it is deliberate (containers, CI).
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1

.PHONY: setup setup-slurm train test doctor
setup:
	scripts/setup.sh

setup-slurm:
	scripts/setup.sh --slurm

train: setup
	mpirun -np $(NP) --oversubscribe $(VENV)/bin/hvd-rl train --config $(CONFIG) \
		--run-dir $(RUN_DIR) --resume auto $(foreach s,$(SET),--set $(s))

test: setup-slurm
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

doctor: setup
	$(VENV)/bin/hvd-rl doctor
