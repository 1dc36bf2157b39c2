"""Load balancing: give each rank a number of environments in proportion to its speed.

With synchronous data parallelism every iteration waits for the slowest rank, so a rank on a
slow or busy node holds the whole job back. Each rank's busy time (env stepping, inference and its
share of the learner; not the time it waits in collectives) is close to proportional to the
number of environments it owns, so its cost per environment, busy / envs, measures its speed.
Giving rank r a share of the global environment count proportional to 1 / cost_r equalises the
busy times, which removes the waiting. The global count (hence the global batch and the learning
math, see algorithms/ppo.py) stays the same.

Decisions are taken every `every` iterations from the median costs over that window, only when
the slowest rank's predicted busy time drops by more than `threshold` (hysteresis: no thrashing
on noise), by rank 0 alone and broadcast, so every rank applies the same layout at the same
iteration. `static` decides once, after the first window; `dynamic` keeps following the load.
Whether a decision is due is a function of the iteration alone, so every rank enters the
broadcast together (a flag set by the deciding rank only would send the others into it alone).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Decision:
    counts: tuple[int, ...]
    reason: str


def proportional_counts(total: int, speeds: np.ndarray, minimum: int) -> tuple[int, ...]:
    """Integer counts summing to `total`, as close as possible to proportional to `speeds`, each
    at least `minimum` (rounding goes to the ranks furthest below their ideal share)."""
    n = len(speeds)
    if total < minimum * n:
        raise ValueError(f"{total} environments cannot give {n} ranks {minimum} each")
    ideal = total * np.asarray(speeds, dtype=np.float64) / np.sum(speeds)
    counts = np.maximum(np.floor(ideal).astype(int), minimum)
    while counts.sum() < total:
        counts[np.argmax(ideal - counts)] += 1
    while counts.sum() > total:
        above = np.where(counts > minimum, ideal - counts, np.inf)
        counts[np.argmin(above)] -= 1
    return tuple(int(c) for c in counts)


@dataclass
class Balancer:
    mode: str  # off | static | dynamic
    every: int = 5
    threshold: float = 0.05
    min_envs: int = 1
    _costs: list[np.ndarray] = field(default_factory=list)  # busy seconds per env, per rank

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def observe(self, counts: tuple[int, ...], busy_seconds: np.ndarray) -> None:
        """One iteration's busy seconds of every rank, with the layout it ran."""
        if len(self._costs) and len(self._costs[-1]) != len(counts):
            self._costs.clear()  # the world changed size (elastic): start measuring afresh
        self._costs.append(np.asarray(busy_seconds, dtype=np.float64) / np.asarray(counts, dtype=np.float64))

    def due(self, iteration: int) -> bool:
        """Every rank knows when a decision is due: static after the first window of the run
        (a resumed run keeps the layout its checkpoint holds), dynamic after every window."""
        if self.mode == "static":
            return iteration == self.every
        return self.mode == "dynamic" and iteration % self.every == 0

    def decide(self, counts: tuple[int, ...]) -> Decision | None:
        """The new layout, or None to keep the current one. Rank 0 calls it; others get the result."""
        window = self._costs[-self.every:]
        self._costs.clear()  # the next window measures the layout chosen now
        if len(window) < self.every or any(len(c) != len(counts) for c in window):
            return None
        cost = np.median(np.stack(window), axis=0)
        if not np.all(np.isfinite(cost)) or np.any(cost <= 0):
            return None
        current = np.asarray(counts) * cost
        proposal = proportional_counts(sum(counts), 1.0 / cost, self.min_envs)
        predicted = np.asarray(proposal) * cost
        gain = 1.0 - predicted.max() / current.max()
        if proposal == tuple(counts) or gain < self.threshold:
            return None
        reason = (f"busy s/iteration by rank {_fmt(current)} -> predicted {_fmt(predicted)} "
                  f"(slowest rank {gain:.0%} faster)")
        return Decision(proposal, reason)


def _fmt(values: np.ndarray) -> str:
    return "/".join(f"{v:.2f}" for v in values)


def agree_on_layout(balancer: Balancer, iteration: int, counts: tuple[int, ...],
                    busy_seconds: np.ndarray) -> Decision | None:
    """Collective, after every iteration: feeds the balancer; when a decision is due, rank 0
    decides and every rank receives the same one (or None: keep the layout)."""
    from hvd_rl.runtime import distributed as dist

    if not balancer.enabled:
        return None
    balancer.observe(counts, busy_seconds)
    if not balancer.due(iteration):
        return None
    decision = balancer.decide(counts) if dist.topology().rank == 0 else None
    agreed = dist.broadcast_object(decision and (decision.counts, decision.reason), name="balance.decision")
    return None if agreed is None else Decision(tuple(agreed[0]), agreed[1])
