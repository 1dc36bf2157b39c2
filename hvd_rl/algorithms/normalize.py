"""Running statistics of observations and returns, identical on every rank.

CleanRL's ppo_continuous_action normalises observations (NormalizeObservation) and scales rewards
by the standard deviation of the discounted return (NormalizeReward), each with statistics that
the wrapper updates at every step. With N ranks each rank sees different data, so here every rank
accumulates the moments of its own rollout, and once per iteration the ranks merge them with
Chan et al.'s parallel-variance formula over one allgather: the combination is done in rank
order on every rank, so every rank holds bit-identical statistics and normalises identically.
During a rollout the statistics stay frozen (the only way to stay identical without a collective
per step); they therefore lag CleanRL's by at most one rollout.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hvd_rl.runtime import distributed as dist


@dataclass
class Moments:
    """count, mean and M2 (sum of squared deviations) of a stream of vectors."""

    count: float = 0.0
    mean: np.ndarray = field(default_factory=lambda: np.zeros(()))
    m2: np.ndarray = field(default_factory=lambda: np.zeros(()))

    @classmethod
    def of(cls, batch: np.ndarray) -> "Moments":
        batch = np.asarray(batch, dtype=np.float64)
        if len(batch) == 0:
            return cls(0.0, np.zeros(batch.shape[1:]), np.zeros(batch.shape[1:]))
        mean = batch.mean(axis=0)
        return cls(float(len(batch)), mean, ((batch - mean) ** 2).sum(axis=0))

    def merge(self, other: "Moments") -> "Moments":
        """Chan, Golub & LeVeque's pairwise update: exact, and stable for large counts."""
        if other.count == 0:
            return self
        if self.count == 0:
            return Moments(other.count, other.mean.copy(), other.m2.copy())
        count = self.count + other.count
        delta = other.mean - self.mean
        mean = self.mean + delta * (other.count / count)
        m2 = self.m2 + other.m2 + delta * delta * (self.count * other.count / count)
        return Moments(count, mean, m2)

    @property
    def var(self) -> np.ndarray:
        return self.m2 / self.count if self.count > 0 else np.ones_like(self.m2)

    def to_dict(self) -> dict[str, Any]:
        return {"count": self.count, "mean": np.asarray(self.mean).tolist(), "m2": np.asarray(self.m2).tolist()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Moments":
        return cls(float(data["count"]), np.asarray(data["mean"], dtype=np.float64),
                   np.asarray(data["m2"], dtype=np.float64))


def merge_over_ranks(local: Moments, name: str) -> Moments:
    """Every rank's moments combined in rank order (one allgather); identical on all ranks."""
    shape = np.shape(local.mean)
    row = np.concatenate([[local.count], np.ravel(local.mean), np.ravel(local.m2)])[None, :]
    rows = dist.allgather_rows(row, name=name)
    size = int(np.prod(shape)) if shape else 1
    total = Moments(0.0, np.zeros(shape), np.zeros(shape))
    for r in rows:
        total = total.merge(Moments(float(r[0]), r[1:1 + size].reshape(shape), r[1 + size:].reshape(shape)))
    return total


class RunningNormalizer:
    """Observation normalisation: (x - mean) / sqrt(var + eps), clipped (CleanRL's wrappers).

    Starts like Gymnasium's RunningMeanStd (count epsilon, mean 0, var 1).
    """

    EPS = 1e-8

    def __init__(self, shape: tuple[int, ...], clip: float):
        self.stats = Moments(1e-4, np.zeros(shape), np.ones(shape) * 1e-4)
        self.pending = Moments(0.0, np.zeros(shape), np.zeros(shape))
        self.clip = clip
        self._refresh()

    def _refresh(self) -> None:
        self._mean = self.stats.mean.astype(np.float32)
        self._scale = (1.0 / np.sqrt(self.stats.var + self.EPS)).astype(np.float32)

    def observe(self, batch: np.ndarray) -> None:
        """Adds raw values seen by this rank (applied at the next `sync`)."""
        self.pending = self.pending.merge(Moments.of(batch))

    def affine(self) -> tuple[np.ndarray, np.ndarray]:
        """(mean, scale) as `normalize` applies them: clip((x - mean) * scale, -clip, clip)."""
        return self._mean, self._scale

    def normalize(self, batch: np.ndarray) -> np.ndarray:
        return np.clip((np.asarray(batch, dtype=np.float32) - self._mean) * self._scale,
                       -self.clip, self.clip)

    def sync(self, name: str) -> None:
        """Collective: merges every rank's pending moments into the statistics."""
        self.stats = self.stats.merge(merge_over_ranks(self.pending, name))
        self.pending = Moments(0.0, np.zeros_like(self.stats.mean), np.zeros_like(self.stats.mean))
        self._refresh()

    def state_dict(self) -> dict[str, Any]:
        return self.stats.to_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stats = Moments.from_dict(state)
        self._refresh()


class ReturnScaler:
    """Reward scaling by the running std of each env's discounted return (NormalizeReward)."""

    def __init__(self, num_envs: int, gamma: float, clip: float):
        self.gamma, self.clip = gamma, clip
        self.returns = np.zeros(num_envs, dtype=np.float64)
        self.normalizer = RunningNormalizer((), clip=np.inf)

    def reset_envs(self, num_envs: int) -> None:
        """New environments (rebuild): their discounted returns start at zero."""
        self.returns = np.zeros(num_envs, dtype=np.float64)

    def scale(self, rewards: np.ndarray, done: np.ndarray) -> np.ndarray:
        self.returns = self.returns * self.gamma + rewards
        self.normalizer.observe(self.returns)
        self.returns[done] = 0.0
        scaled = rewards / np.sqrt(self.normalizer.stats.var + RunningNormalizer.EPS)
        return np.clip(scaled, -self.clip, self.clip).astype(np.float32)

    def sync(self, name: str) -> None:
        self.normalizer.sync(name)

    def state_dict(self) -> dict[str, Any]:
        return self.normalizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.normalizer.load_state_dict(state)


class ValueNormalizer:
    """MAPPO's value normalisation (Yu et al., 2022): the critic predicts value targets in units of
    their running mean and std, so rewards of any scale give the critic targets of order one.
    Every rank's targets are merged in rank order once per iteration (identical statistics on every
    rank); the variance is floored at 1e-2 as in MAPPO's ValueNorm."""

    MIN_VAR = 1e-2

    def __init__(self) -> None:
        self.stats = Moments(0.0, np.zeros(()), np.zeros(()))

    def _mean_std(self) -> tuple[float, float]:
        if self.stats.count == 0:
            return 0.0, 1.0
        return float(self.stats.mean), float(np.sqrt(max(float(self.stats.var), self.MIN_VAR)))

    def update(self, targets: np.ndarray, name: str) -> None:
        """Collective: adds every rank's value targets (the counted samples only)."""
        self.stats = self.stats.merge(merge_over_ranks(Moments.of(np.asarray(targets, np.float64)), name))

    def normalize(self, values: Any) -> Any:
        mean, std = self._mean_std()
        return (values - mean) / std

    def denormalize(self, values: Any) -> Any:
        mean, std = self._mean_std()
        return values * std + mean

    def state_dict(self) -> dict[str, Any]:
        return self.stats.to_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stats = Moments.from_dict(state)
