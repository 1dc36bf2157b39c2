"""The contract between the shared runtime (hvd_rl/runtime/trainer.py) and one RL algorithm.

To add an algorithm, read this file, subclass `Algorithm`, register it in
`hvd_rl/algorithms/__init__.py` and give it a config section in `hvd_rl/config.py`.

The runtime owns everything algorithms share: Horovod start-up and topology, the run directory,
resume, checkpoint cadence and files, the collective stop decisions (preemption, non-finite
losses), elastic state, environment seeds and layouts, and the metrics plumbing (one allgather
per iteration, metrics.jsonl, episodes.jsonl, TensorBoard). An algorithm owns its networks,
optimizer, environments' use, and what one iteration does.

Rules an algorithm must follow, because every rank runs the same code in lockstep:
- No collective in `__init__` (an elastic worker that joins late constructs the algorithm while
  the others are inside `hvd.elastic.run`); the runtime calls `broadcast` when it is time.
- Collectives inside `iterate` have explicit names and are called in the same order on every
  rank; every control-flow decision that could differ between ranks is agreed collectively.
- Gradients are averaged only through `hvd_rl.runtime.distributed.distributed_optimizer`.
- `iterate` reads `context.stop_requested()` where a collective already happens (at least once
  per optimisation epoch) and reports whether any rank asked to stop.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import gymnasium as gym
import torch

from hvd_rl.config import TrainConfig
from hvd_rl.envs.vector import EnvLayout


class UnsupportedSetup(ValueError):
    """This algorithm cannot run this configuration (action space, model, option)."""


class NonFiniteLossError(RuntimeError):
    """A loss or the averaged gradient became NaN/Inf; raised on every rank together."""


@dataclass
class IterationContext:
    """What the runtime tells an algorithm about the iteration it is about to run."""

    iteration: int  # 1-based number of the iteration being run
    global_step: int  # env steps of all ranks before this iteration
    env_steps: int  # steps per environment this iteration (from `rollout_length`)
    layout: EnvLayout  # how many environments each rank owns
    rank: int
    world_size: int
    stop_requested: Callable[[], bool]  # this rank's preemption flag


@dataclass
class IterationReport:
    """One iteration on this rank. The runtime gathers every rank's report in one collective.

    `metrics` values are averaged over ranks, `sums` summed; both must have the same keys in
    the same order on every rank. Keys starting with `time_` are seconds of this rank.
    `finite` names the metrics or sums that must be finite (a NaN/Inf in any rank stops all
    ranks). A mean that must weigh ranks by their samples goes in `sums` as value x samples.
    """

    metrics: dict[str, float]
    sums: dict[str, float] = field(default_factory=dict)
    episode_returns: list[float] = field(default_factory=list)  # whole games finished this iteration
    episode_lengths: list[int] = field(default_factory=list)
    stop_agreed: bool = False  # every rank saw a stop request during the iteration (collective)
    finite: tuple[str, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)  # identical on all ranks, logged as is


class Algorithm(ABC):
    """One algorithm, instantiated once per process by the runtime."""

    name: str = ""
    supports_uneven_layout: bool = False  # ranks may own different numbers of environments

    def __init__(self, cfg: TrainConfig, device: torch.device, threads: int,
                 observation_space: gym.Space, action_space: gym.Space):
        self.cfg, self.device, self.threads = cfg, device, threads
        self.observation_space, self.action_space = observation_space, action_space

    # ---- identity and state (checkpoints, resume, elastic) ---------------------------------

    @abstractmethod
    def signature(self) -> dict[str, Any]:
        """What a checkpoint must match to be loaded (spaces, parameter shapes)."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Everything to checkpoint, as tensors and plain containers (loaded with weights_only)."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """At resume (rank 0; `broadcast` then makes every rank agree) and at an elastic restore
        after a failure (every rank, from its last commit)."""

    @abstractmethod
    def broadcast(self) -> None:
        """Collective: every rank takes rank 0's networks, optimizer and statistics. Also how an
        elastic reset syncs a worker that just joined, so it must not assume a fresh start."""

    def distributed_optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers from `distributed_optimizer`: the runtime checkpoints and restores their
        gradient-compression state (hvd_rl/runtime/compression.py). Default: `self.optimizer`."""
        optimizer = getattr(self, "optimizer", None)
        return [optimizer] if optimizer is not None else []

    @abstractmethod
    def parameters_module(self) -> torch.nn.Module:
        """The network whose parameters must be identical on every rank (checked, digested)."""

    # ---- environments and iterations -------------------------------------------------------

    @abstractmethod
    def build_envs(self, layout: EnvLayout, rank: int, seeds: list[int]) -> None:
        """(Re)creates this rank's environments for a new layout; closes the old ones."""

    @abstractmethod
    def rollout_length(self, remaining_steps: int, layout: EnvLayout) -> int:
        """Steps per environment for the next iteration: the full length, or fewer so that the
        run ends exactly at total_timesteps; 0 when nothing more fits."""

    @abstractmethod
    def iterate(self, context: IterationContext) -> IterationReport:
        """Collects experience and learns from it, on every rank in lockstep."""

    def save_local(self, run_dir: Path, iteration: int, rank: int) -> None:
        """Every rank, at every checkpoint: state too large for rank 0's checkpoint file (a
        replay shard), written by the rank that owns it. Default: nothing."""

    def load_local(self, run_dir: Path, iteration: int, rank: int) -> bool:
        """After a resume onto the same layout, right after `build_envs`: restores what
        `save_local` wrote for that checkpoint. Returns False if there was nothing to restore."""
        return False

    def discard_local(self) -> None:
        """Some rank could not restore its local state: every rank starts it afresh."""

    def settle(self) -> None:
        """Before a checkpoint, on every rank: finish whatever runs beside the main thread (a
        sampler thread), so that the rank's recorded state does not depend on its timing."""

    def describe(self) -> str:
        """One line for the log: precision, batch sizes."""
        return ""

    def global_batch(self, total_envs: int) -> int | None:
        """Samples per update for this many environments in all (None: not batch-based)."""
        return None

    @abstractmethod
    def act(self, observations: Any, greedy: bool) -> Any:
        """Actions for a batch of raw observations (evaluation; after load_state_dict)."""

    def global_metrics(self, means: dict[str, float], sums: dict[str, float]) -> dict[str, Any]:
        """Metrics derived from the reduced values (e.g. explained variance from sums)."""
        return dict(means)

    @abstractmethod
    def close(self) -> None:
        """Releases environments (worker processes, threads)."""
