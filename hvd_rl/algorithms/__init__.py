"""The algorithms the runtime can run; `algorithm = "..."` in the config picks one.

Adding one: read hvd_rl/algorithms/base.py, write hvd_rl/algorithms/<name>.py, register it here.
"""
from __future__ import annotations

import gymnasium as gym
import torch

from hvd_rl.algorithms.base import Algorithm, UnsupportedSetup
from hvd_rl.config import TrainConfig


def algorithm_class(name: str) -> type[Algorithm]:
    if name == "ppo":
        from hvd_rl.algorithms.ppo import PPO

        return PPO
    if name == "dqn":
        from hvd_rl.algorithms.dqn import DQN

        return DQN
    if name in ("mappo", "ippo"):
        from hvd_rl.algorithms.mappo import IPPO, MAPPO

        return MAPPO if name == "mappo" else IPPO
    raise UnsupportedSetup(f"unknown algorithm {name!r}")


def build_algorithm(cfg: TrainConfig, device: torch.device, threads: int, observation_space: gym.Space,
                    action_space: gym.Space) -> Algorithm:
    """Constructs the configured algorithm; no collectives (see base.Algorithm)."""
    return algorithm_class(cfg.algorithm)(cfg, device, threads, observation_space, action_space)
