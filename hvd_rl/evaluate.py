"""`hvd-rl evaluate`: run a checkpoint's policy on fresh episodes, in one process."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hvd_rl.checkpoint import check_compatible, load_checkpoint
from hvd_rl.config import ConfigError, config_from_dict, parse_override, validate
from hvd_rl.envs import RankEnvs
from hvd_rl.models import build_model, model_signature
from hvd_rl.rollout import sample_actions


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
        model = build_model(cfg.model, envs.single_observation_space, envs.single_action_space)
        check_compatible(state, model_signature(envs.single_observation_space,
                                                envs.single_action_space, model), cfg.env.id)
        model.load_state_dict(state["model"])
        model.eval()
        torch.manual_seed(seed)
        obs = envs.reset(list(range(seed, seed + env_cfg.num_envs)))
        returns: list[float] = []
        lengths: list[int] = []
        with torch.no_grad():
            while len(returns) < episodes:
                logits, _ = model(torch.from_numpy(obs))
                actions = logits.argmax(-1) if greedy else sample_actions(logits)[0]
                result = envs.step(actions.numpy())
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
