"""A checkpoint's trained algorithm, rebuilt in one process: what `hvd-rl evaluate` runs, records
and exports. The checkpoint's own config decides the environment and the networks; overrides may
change the environment (e.g. env.max_episode_steps) but the networks must still fit it."""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from hvd_rl.algorithms import build_algorithm
from hvd_rl.algorithms.base import Algorithm
from hvd_rl.config import EnvConfig, TrainConfig, config_from_dict, parse_override, validate
from hvd_rl.envs.vector import RankEnvs
from hvd_rl.runtime import distributed as dist
from hvd_rl.runtime.checkpoint import CheckpointError, check_compatible, load_checkpoint


@dataclass
class Trained:
    cfg: TrainConfig
    algorithm: Algorithm
    state: dict[str, Any]
    path: Path

    @property
    def iteration(self) -> int:
        return int(self.state["iteration"])

    @property
    def global_step(self) -> int:
        return int(self.state["global_step"])


def checkpoint_config(path: str | Path, overrides: list[str] | None = None) -> tuple[TrainConfig, dict[str, Any]]:
    """The checkpoint's resolved config with `overrides` applied (validated), and the checkpoint."""
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
    return cfg, state


def load_trained(path: str | Path, envs: RankEnvs, cfg: TrainConfig, state: dict[str, Any]) -> Trained:
    """The algorithm of `state`, built for `envs`' spaces, its trained weights loaded (CPU)."""
    dist.init()  # a 1-process world: the algorithm's optimizer wrapper needs Horovod
    algorithm = build_algorithm(cfg, torch.device("cpu"), 1, envs.single_observation_space, envs.single_action_space)
    if state.get("algorithm", "ppo") != algorithm.name:
        raise CheckpointError(f"checkpoint algorithm {state.get('algorithm')!r} does not match its config's "
                              f"{algorithm.name!r}")
    check_compatible(state, algorithm.signature(), cfg.env.id)
    algorithm.load_state_dict(state["state"])
    return Trained(cfg, algorithm, state, Path(path))


def single_process_env(cfg: EnvConfig, num_envs: int) -> EnvConfig:
    """The environment config for one process: `num_envs` environments, no worker processes."""
    return replace(cfg, num_envs=num_envs, backend="sync" if cfg.backend == "async" else cfg.backend)
