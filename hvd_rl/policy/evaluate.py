"""`hvd-rl evaluate`: run a checkpoint's policy on fresh episodes, in one process.

Each environment plays a fixed quota of episodes (the quotas sum to --episodes) and only its first
that many count. Keeping the first N episodes to finish across all environments instead would
over-represent short ones: while one environment plays a long game, the others finish several short
ones, and the long game may never be kept."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hvd_rl.config import MULTIAGENT_ALGORITHMS, ConfigError, TrainConfig
from hvd_rl.envs.multiagent import Episode, make_multiagent_envs
from hvd_rl.envs.vector import RankEnvs
from hvd_rl.policy.trained import checkpoint_config, load_trained, single_process_env


def episode_quotas(episodes: int, num_envs: int) -> list[int]:
    """Episodes each environment plays: `episodes` split as evenly as it goes, the first ones one more."""
    return [episodes // num_envs + (1 if i < episodes % num_envs else 0) for i in range(num_envs)]


def return_statistics(returns: list[float]) -> dict[str, float | None]:
    """Mean, sample standard deviation and standard error of the mean (None for one episode)."""
    n = len(returns)
    std = float(np.std(returns, ddof=1)) if n > 1 else None
    return {"mean_return": float(np.mean(returns)), "std_return": std,
            "stderr_return": std / math.sqrt(n) if std is not None else None,
            "min_return": float(np.min(returns)), "max_return": float(np.max(returns))}


def evaluate_checkpoint(path: str | Path, episodes: int = 10, num_envs: int = 0, seed: int = 10_000,
                        greedy: bool = False, overrides: list[str] | None = None) -> dict[str, Any]:
    if episodes <= 0:
        raise ConfigError(f"--episodes must be positive, got {episodes}")
    if num_envs < 0:
        raise ConfigError(f"--num-envs must be >= 0, got {num_envs}")
    cfg, state = checkpoint_config(path, overrides)
    if cfg.algorithm in MULTIAGENT_ALGORITHMS:
        return _evaluate_multiagent(path, cfg, state, episodes, min(num_envs or 8, episodes), seed, greedy)
    env_cfg = single_process_env(cfg.env, min(num_envs or 8, episodes))  # no environment without a quota
    quotas = episode_quotas(episodes, env_cfg.num_envs)
    returns: list[list[float]] = [[] for _ in quotas]
    lengths: list[list[int]] = [[] for _ in quotas]
    envs = RankEnvs(env_cfg, threads=max(1, torch.get_num_threads()))
    try:
        trained = load_trained(path, envs, cfg, state)
        torch.manual_seed(seed)
        obs = envs.reset(list(range(seed, seed + env_cfg.num_envs)))
        while any(len(kept) < quota for kept, quota in zip(returns, quotas)):
            result = envs.step(trained.algorithm.act(obs, greedy))
            for env, episode_return, length in zip(result.episode_envs, result.episode_returns,
                                                   result.episode_lengths):
                if len(returns[env]) < quotas[env]:  # an environment past its quota plays on, uncounted
                    returns[env].append(episode_return)
                    lengths[env].append(length)
            obs = result.obs
    finally:
        envs.close()
    every_return = [r for kept in returns for r in kept]
    return {
        "checkpoint": str(path), "env_id": cfg.env.id, "iteration": trained.iteration,
        "global_step": trained.global_step, "episodes": len(every_return), "num_envs": env_cfg.num_envs,
        **return_statistics(every_return),
        "mean_length": float(np.mean([n for kept in lengths for n in kept])), "greedy": greedy,
        "returns_by_env": returns, "lengths_by_env": lengths,
    }


def _evaluate_multiagent(path: str | Path, cfg: TrainConfig, state: dict[str, Any], episodes: int, num_envs: int,
                         seed: int, greedy: bool) -> dict[str, Any]:
    """The same per-environment quotas for a multi-agent checkpoint: the shared actor acts on each
    agent's own observation (decentralised execution); team and per-agent returns, and the task's
    per-episode statistics (collisions, arrivals) where it has them."""
    quotas = episode_quotas(episodes, num_envs)
    kept: list[list[Episode]] = [[] for _ in quotas]
    envs = make_multiagent_envs(cfg.env.id, num_envs, cfg.multiagent.num_agents, cfg.env.max_episode_steps)
    try:
        trained = load_trained(path, envs, cfg, state)
        torch.manual_seed(seed)
        obs, _, _ = envs.reset(list(range(seed, seed + num_envs)))
        while any(len(k) < quota for k, quota in zip(kept, quotas)):
            result = envs.step(trained.algorithm.act(obs, greedy))
            for episode in result.episodes:
                if len(kept[episode.env]) < quotas[episode.env]:
                    kept[episode.env].append(episode)
            obs = result.obs
    finally:
        envs.close()
    every = [e for k in kept for e in k]
    agents = list(envs.spec.agents)
    stats = sorted({name for e in every for name in e.stats})
    return {
        "checkpoint": str(path), "env_id": cfg.env.id, "algorithm": cfg.algorithm, "iteration": trained.iteration,
        "global_step": trained.global_step, "episodes": len(every), "num_envs": num_envs,
        **return_statistics([e.team_return for e in every]),
        "mean_length": float(np.mean([e.length for e in every])), "greedy": greedy,
        "agents": agents, "mean_return_by_agent": np.mean([e.agent_returns for e in every], axis=0).tolist(),
        **{f"mean_{name}": float(np.mean([e.stats.get(name, 0.0) for e in every])) for name in stats},
        "returns_by_env": [[e.team_return for e in k] for k in kept],
    }
