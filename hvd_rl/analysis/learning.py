"""Learning curves from run directories, their mean and spread over seeds, and published
reference points to compare them with.

The curve of a run is the episodic return of whole games (raw score, as RecordEpisodeStatistics
reports it before reward clipping and life splitting), smoothed as the mean of the last 100
finished games, against global env steps: the statistic CleanRL's tables use (openrlbenchmark's
"episodic return in the last 100 episodes"), so the numbers are comparable.

Runs written before episodes.jsonl existed only have per-iteration means in metrics.jsonl; each
iteration then stands for `episodes` games that all scored its mean, which weights iterations by
their game counts exactly as the per-game data would.
"""
from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hvd_rl import CHECKOUT
from hvd_rl.runtime.metrics import read_episodes, read_metrics
from hvd_rl.analysis.study import read_summary

LAST_N = 100
REFERENCES_FILE = CHECKOUT / "benchmarks" / "reference" / "learning_references.toml"


# ---- one run --------------------------------------------------------------------------------

@dataclass
class Curve:
    steps: np.ndarray  # global env step after each iteration that finished a game
    values: np.ndarray  # mean of the last LAST_N games finished by then
    games: int  # games finished in the whole run
    final: float | None  # mean of the last LAST_N games (all of them when fewer)
    final_games: int  # games in `final` (< LAST_N: the run finished few games)
    source: str  # "episodes.jsonl" | "metrics.jsonl (iteration means)" | "none"


def smooth_last_n(steps: np.ndarray, returns: np.ndarray, n: int = LAST_N) -> tuple[np.ndarray, np.ndarray]:
    """Mean of the last `n` games at each distinct step, taken after the last game of that step.

    `steps` and `returns` are per game, in the order the games finished."""
    steps = np.asarray(steps, dtype=np.int64)
    returns = np.asarray(returns, dtype=np.float64)
    if len(steps) == 0:
        return steps, returns
    order = np.argsort(steps, kind="stable")  # rows are in order already; a resume keeps them so
    steps, returns = steps[order], returns[order]
    cumsum = np.concatenate([[0.0], np.cumsum(returns)])
    end = np.arange(1, len(returns) + 1)
    start = np.maximum(0, end - n)
    rolling = (cumsum[end] - cumsum[start]) / (end - start)
    last_of_step = np.flatnonzero(np.append(steps[1:] != steps[:-1], True))
    return steps[last_of_step], rolling[last_of_step]


def games(run_dir: str | Path) -> tuple[np.ndarray, np.ndarray, str]:
    """(global step, return) per finished game, and where they came from."""
    rows = read_episodes(run_dir)
    if rows:
        return (np.array([r["global_step"] for r in rows], dtype=np.int64),
                np.array([r["return"] for r in rows], dtype=np.float64), "episodes.jsonl")
    rows = [r for r in read_metrics(run_dir) if r.get("episodes") and r.get("episodic_return_mean") is not None]
    if rows:
        counts = [int(r["episodes"]) for r in rows]
        return (np.repeat([r["global_step"] for r in rows], counts).astype(np.int64),
                np.repeat([float(r["episodic_return_mean"]) for r in rows], counts),
                "metrics.jsonl (iteration means)")
    return np.zeros(0, dtype=np.int64), np.zeros(0), "none"


def run_curve(run_dir: str | Path, n: int = LAST_N) -> Curve:
    steps, returns, source = games(run_dir)
    smooth_steps, values = smooth_last_n(steps, returns, n)
    tail = returns[-n:]
    return Curve(steps=smooth_steps, values=values, games=len(returns),
                 final=float(tail.mean()) if len(tail) else None, final_games=len(tail), source=source)


@dataclass
class RunStats:
    status: str  # "completed" | "partial" | "not started"
    global_step: int  # steps trained so far (the last metrics row)
    planned_steps: int
    world_size: int | None
    wall_seconds: float | None  # summary.json: the launch that finished the run
    train_seconds: float  # sum of iteration times of the iterations behind the curve
    sps: float | None  # global_step / train_seconds

    @property
    def fraction(self) -> float:
        return self.global_step / self.planned_steps if self.planned_steps else 0.0


def run_stats(run_dir: str | Path, planned_steps: int) -> RunStats:
    rows = read_metrics(run_dir)
    summary = read_summary(Path(run_dir))
    step = int(rows[-1]["global_step"]) if rows else int(summary.get("global_step", 0))
    completed = summary.get("status") == "completed" and int(summary.get("global_step", 0)) >= planned_steps
    status = "completed" if completed else ("partial" if rows else "not started")
    train = float(sum(r.get("time_iteration", 0.0) for r in rows))
    return RunStats(status=status, global_step=step, planned_steps=planned_steps,
                    world_size=(rows[-1].get("world_size") if rows else summary.get("world_size")),
                    wall_seconds=summary.get("wall_seconds") if completed else None,
                    train_seconds=train, sps=step / train if train > 0 else None)


# ---- seeds together -------------------------------------------------------------------------

@dataclass
class Aggregate:
    steps: np.ndarray  # every step at which some seed's curve changes, within the common range
    mean: np.ndarray
    low: np.ndarray  # min over seeds
    high: np.ndarray  # max over seeds
    seeds: int


def aggregate(curves: list[Curve]) -> Aggregate | None:
    """Mean and min-max over seeds, where every seed has a value: from the step at which the
    last seed finished its first game to the step the shortest (e.g. still running) seed reached.

    Each curve holds its value until its next point (the last-100 mean changes only when games
    finish), so no interpolation is invented between iterations."""
    curves = [c for c in curves if len(c.steps)]
    if not curves:
        return None
    first = max(int(c.steps[0]) for c in curves)
    last = min(int(c.steps[-1]) for c in curves)
    if first > last:
        return None
    grid = np.unique(np.concatenate([c.steps[(c.steps >= first) & (c.steps <= last)] for c in curves]))
    table = np.stack([c.values[np.searchsorted(c.steps, grid, side="right") - 1] for c in curves])
    return Aggregate(steps=grid, mean=table.mean(axis=0), low=table.min(axis=0), high=table.max(axis=0),
                     seeds=len(curves))


# ---- reference points -----------------------------------------------------------------------

@dataclass
class RefPoint:
    step: int
    value: float
    low: float | None = None  # a range read off a figure (min-max band over seeds)
    high: float | None = None
    std: float | None = None  # a table's "mean ± std" over seeds

    @property
    def lower(self) -> float | None:
        return self.low if self.low is not None else (self.value - self.std if self.std is not None else None)

    @property
    def upper(self) -> float | None:
        return self.high if self.high is not None else (self.value + self.std if self.std is not None else None)

    def spread_text(self) -> str:
        if self.low is not None and self.high is not None:
            return f"{self.low:g} to {self.high:g}"
        if self.std is not None:
            return f"± {self.std:g}"
        return ""


@dataclass
class Reference:
    key: str
    algorithm: str
    envs: list[str]  # env ids it applies to (published id first)
    label: str
    source: str  # URL of the page the numbers are on
    obtained: str  # how: a table's cell, read off a figure, ...
    points: list[RefPoint]
    seeds: int | None = None
    metric: str = ""
    note: str = ""
    figure: str = ""


@dataclass
class ReferenceData:
    references: list[Reference]
    not_found: list[dict[str, Any]] = field(default_factory=list)

    def for_run(self, algorithm: str, env_id: str) -> list[Reference]:
        return [r for r in self.references if r.algorithm == algorithm and env_id in r.envs]


def load_references(path: str | Path = REFERENCES_FILE) -> ReferenceData:
    data = tomllib.loads(Path(path).read_text())
    refs = []
    for raw in data.get("reference", []):
        points = [RefPoint(step=int(p["step"]), value=float(p["value"]), low=p.get("low"), high=p.get("high"),
                           std=p.get("std")) for p in raw["points"]]
        refs.append(Reference(key=raw["key"], algorithm=raw["algorithm"], envs=list(raw["envs"]),
                              label=raw["label"], source=raw["source"], obtained=raw["obtained"], points=points,
                              seeds=raw.get("seeds"), metric=raw.get("metric", ""), note=raw.get("note", ""),
                              figure=raw.get("figure", "")))
    return ReferenceData(references=refs, not_found=list(data.get("not_found", [])))
