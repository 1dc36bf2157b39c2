"""hvd_rl: distributed deep reinforcement learning (PPO, DQN) with Horovod, as an HPC batch job.

Where things are:
  cli.py, config.py      the `hvd-rl` command; run configuration (TOML, --set, validation)
  combinations.py        what combines with what, derived from config.validate()'s rules
  runtime/               one training run on every rank: trainer.py (the loop), distributed.py
                         (collectives; gradients are averaged in distributed_optimizer),
                         compression.py, checkpoint.py, metrics.py, balance.py, precision.py, ...
  algorithms/            ppo.py and dqn.py behind base.py's contract; models, rollout, replay
  envs/                  per-rank vector environments (vector.py; seeds in env_seeds) and env ids
  policy/                using a trained policy: evaluate
  analysis/              scaling reports, the projection, learning curves and study plans
  cluster/               launching ranks, doctor, SLURM / Kubernetes / AWS Batch tooling
"""
from pathlib import Path

__version__ = "0.1.0"

# The checkout (or the image's copy of it) this package runs from: the SLURM templates, configs,
# deploy/ and containers/ files live beside the package, not inside it.
CHECKOUT = Path(__file__).resolve().parent.parent
