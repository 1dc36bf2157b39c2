"""`hvd-rl evaluate`: run a checkpoint's policy on fresh episodes, in one process."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hvd_rl import distributed as dist
from hvd_rl.algorithms import build_algorithm
from hvd_rl.checkpoint import CheckpointError, check_compatible, load_checkpoint
from hvd_rl.config import ConfigError, config_from_dict, parse_override, validate
from hvd_rl.envs import RankEnvs


def evaluate_checkpoint(path: str | Path, episodes: int = 10, num_envs: int = 0, seed: int = 10_000,
                        greedy: bool = False, overrides: list[str] | None = None) -> dict[str, Any]:
    if episodes <= 0:
        raise ConfigError(f"--episodes must be positive, got {episodes}")
    state = load_checkpoint(path)
    data = state["config"]
    for text in overrides or []:
        override = parse_override(text)
        for section, values in override.items():
            if isinstance(values, dict):
                data.setdefault(section, {}).update(values)
            else:
                data[section] = values
    cfg = config_from_dict(data)
    validate(cfg)
    env_cfg = replace(cfg.env, num_envs=num_envs or min(episodes, 8),
                      backend="sync" if cfg.env.backend == "async" else cfg.env.backend)
    envs = RankEnvs(env_cfg, threads=max(1, torch.get_num_threads()))
    try:
        dist.init()  # a 1-process world: the algorithm's optimizer wrapper needs Horovod
        algorithm = build_algorithm(cfg, torch.device("cpu"), 1, envs.single_observation_space,
                                    envs.single_action_space)
        if state.get("algorithm", "ppo") != algorithm.name:
            raise CheckpointError(f"checkpoint algorithm {state.get('algorithm')!r} does not match "
                                  f"its config's {algorithm.name!r}")
        check_compatible(state, algorithm.signature(), cfg.env.id)
        algorithm.load_state_dict(state["state"])
        torch.manual_seed(seed)
        obs = envs.reset(list(range(seed, seed + env_cfg.num_envs)))
        returns: list[float] = []
        lengths: list[int] = []
        while len(returns) < episodes:
            result = envs.step(algorithm.act(obs, greedy))
            returns.extend(result.episode_returns)
            lengths.extend(result.episode_lengths)
            obs = result.obs
    finally:
        envs.close()
    returns, lengths = returns[:episodes], lengths[:episodes]
    return {
        "checkpoint": str(path), "env_id": cfg.env.id, "iteration": int(state["iteration"]),
        "global_step": int(state["global_step"]), "episodes": len(returns),
        "mean_return": float(np.mean(returns)), "std_return": float(np.std(returns)),
        "min_return": float(np.min(returns)), "max_return": float(np.max(returns)),
        "mean_length": float(np.mean(lengths)), "greedy": greedy,
    }
