"""`hvd-rl evaluate`: run a checkpoint's policy on fresh episodes, in one process."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from hvd_rl.config import ConfigError
from hvd_rl.envs.vector import RankEnvs
from hvd_rl.policy.trained import checkpoint_config, load_trained, single_process_env


def evaluate_checkpoint(path: str | Path, episodes: int = 10, num_envs: int = 0, seed: int = 10_000,
                        greedy: bool = False, overrides: list[str] | None = None) -> dict[str, Any]:
    if episodes <= 0:
        raise ConfigError(f"--episodes must be positive, got {episodes}")
    cfg, state = checkpoint_config(path, overrides)
    env_cfg = single_process_env(cfg.env, num_envs or min(episodes, 8))
    envs = RankEnvs(env_cfg, threads=max(1, torch.get_num_threads()))
    try:
        trained = load_trained(path, envs, cfg, state)
        torch.manual_seed(seed)
        obs = envs.reset(list(range(seed, seed + env_cfg.num_envs)))
        returns: list[float] = []
        lengths: list[int] = []
        while len(returns) < episodes:
            result = envs.step(trained.algorithm.act(obs, greedy))
            returns.extend(result.episode_returns)
            lengths.extend(result.episode_lengths)
            obs = result.obs
    finally:
        envs.close()
    returns, lengths = returns[:episodes], lengths[:episodes]
    return {
        "checkpoint": str(path), "env_id": cfg.env.id, "iteration": trained.iteration,
        "global_step": trained.global_step, "episodes": len(returns),
        "mean_return": float(np.mean(returns)), "std_return": float(np.std(returns)),
        "min_return": float(np.min(returns)), "max_return": float(np.max(returns)),
        "mean_length": float(np.mean(lengths)), "greedy": greedy,
    }
