# The two commands a fresh machine needs (each runs the idempotent setup first):
#   make train   # the main job: Atari PPO preset on NP ranks with mpirun (resumable)
#   make test    # the test suite CI runs (real ranks, Horovod, SLURM, ALE), within 45 minutes on 2 cores
# More:
#   make test-long  # the long suite it leaves out (containers, GPU dry run, ...; tests/conftest.py LONG_TESTS)
#   make image   # the OCI image (containers/Containerfile) with podman; BASE=... IMAGE=...
#   make sif     # the Apptainer image from it (needs apptainer)
#   make docs    # the docs site (strict build); open docs/_build/html/docs/index.html
#   make doctor  # what is installed and a real 2-rank allreduce
VENV    ?= .venv
NP      ?= 2
CONFIG  ?= configs/atari_ppo.toml
RUN_DIR ?= runs/atari
SET     ?=
PYTEST_ARGS ?=

# Open MPI refuses to run as root unless told it is deliberate (containers, CI).
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1

IMAGE   ?= localhost/hvd-rl:cpu
BASE    ?=

.PHONY: setup setup-slurm train test test-long doctor image sif docs
setup:
	scripts/setup.sh

setup-slurm:
	scripts/setup.sh --slurm --containers

train: setup
	mpirun -np $(NP) --oversubscribe $(VENV)/bin/hvd-rl train --config $(CONFIG) \
		--run-dir $(RUN_DIR) --resume auto $(foreach s,$(SET),--set $(s))

test: setup-slurm
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

test-long: setup-slurm
	$(VENV)/bin/python -m pytest -m long $(PYTEST_ARGS)

doctor: setup
	$(VENV)/bin/hvd-rl doctor

# BASE: the base image (default: a local Debian 12 made with mmdebstrap, no registry needed);
# TORCH, HOROVOD_GPU_OPERATIONS, HOROVOD_BUILD_CUDA_CC_LIST as in containers/build_image.sh.
image:
	BASE="$(BASE)" IMAGE="$(IMAGE)" containers/build_image.sh

sif:
	@command -v apptainer >/dev/null || { echo "make sif: apptainer is not installed (see docs/deploy/apptainer.md)" >&2; exit 2; }
	mkdir -p build && containers/podman.sh save --format oci-archive -o build/hvd-rl.oci.tar $(IMAGE)
	cd build && apptainer build --force hvd-rl.sif ../containers/hvd_rl.def

docs: setup
	$(VENV)/bin/sphinx-build -W --keep-going -q -c docs . docs/_build/html
	@echo "docs: open docs/_build/html/docs/index.html"
