"""One iteration's metrics from every rank: the iteration's one allgather, and the record it makes.

Every rank contributes its algorithm's metrics and sums, what the runtime measured around the
algorithm (blocked seconds, CPU seconds, page faults, compression compute, gradient bytes sent
and uncompressed) and its stop flag; every rank gets all of them back, so every rank computes
the same record and takes the same decisions (stop, non-finite loss, balance).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from hvd_rl.algorithms.base import IterationReport, NonFiniteLossError
from hvd_rl.envs.vector import EnvLayout
from hvd_rl.runtime import distributed as dist
from hvd_rl.runtime.heap import page_faults

RUNTIME_VALUES = ("blocked", "cpu", "faults", "compress", "sent", "dense")  # per rank, after the algorithm's


@dataclass
class RankMeter:
    """What the runtime measures on this rank around one `Algorithm.iterate` (the one clock,
    CPU time, page faults and the wall clock)."""

    wall_start: float
    cpu_start: float
    faults_start: int
    clock_start: dist.ClockReading

    @classmethod
    def start(cls) -> "RankMeter":
        return cls(time.perf_counter(), time.process_time(), page_faults(), dist.CLOCK.reading())

    def values(self) -> tuple[list[float], dist.ClockReading]:
        """[blocked, cpu, faults, compress, sent, dense] of this rank since `start`, and the clock's
        difference. Compression compute runs inside the gradient reduction, which the algorithm
        timed as collective time: it is this rank's work (time_compress), not communication."""
        used = dist.CLOCK.reading() - self.clock_start
        return ([used.blocked, time.process_time() - self.cpu_start, float(page_faults() - self.faults_start),
                 used.compression_seconds, float(used.bytes), float(used.dense_bytes)], used)


@dataclass
class Gathered:
    per_rank: np.ndarray  # [ranks, algorithm metrics... + RUNTIME_VALUES + stop]
    sums: dict[str, float]
    episodes: np.ndarray  # [games, 2]: return, length

    @property
    def stop_requested(self) -> bool:
        return bool(self.per_rank[:, -1].max() > 0)


def gather(report: IterationReport, runtime_values: list[float], stop: bool) -> Gathered:
    """ONE allgather per iteration: every rank's metrics, sums, finished games and stop flag.

    Rows are [kind, values...]: kind 0 holds a rank's [metrics..., sums..., runtime values, stop]
    (ranks in order), kind 1 a finished game (return, length).
    """
    values = list(report.metrics.values()) + list(report.sums.values()) + runtime_values + [1.0 if stop else 0.0]
    width = max(len(values), 2) + 1
    rows = np.zeros((1 + len(report.episode_returns), width), dtype=np.float64)
    rows[0, 1:1 + len(values)] = values
    if report.episode_returns:
        rows[1:, 0] = 1.0
        rows[1:, 1] = report.episode_returns
        rows[1:, 2] = report.episode_lengths
    gathered = dist.allgather_rows(rows, name="iteration.metrics")
    kinds = gathered[:, 0]
    ranks = gathered[kinds == 0, 1:1 + len(values)]
    n_metrics, n_sums = len(report.metrics), len(report.sums)
    sums = dict(zip(report.sums, ranks[:, n_metrics:n_metrics + n_sums].sum(axis=0).tolist()))
    per_rank = np.concatenate([ranks[:, :n_metrics], ranks[:, n_metrics + n_sums:]], axis=1)
    return Gathered(per_rank, sums, gathered[kinds == 1, 1:3])


def check_finite(report: IterationReport, gathered: Gathered, iteration: int) -> None:
    """Every rank sees every rank's values: a non-finite loss anywhere stops everyone alike."""
    keys = list(report.metrics)
    bad = [k for k in report.finite
           if not all(math.isfinite(v) for v in (gathered.per_rank[:, keys.index(k)] if k in keys
                                                 else [gathered.sums[k]]))]
    if bad:
        raise NonFiniteLossError(f"non-finite loss/gradient at iteration {iteration} ({', '.join(bad)}); "
                                 "stopping all ranks")


def iteration_record(report: IterationReport, gathered: Gathered, *, iteration: int, global_step: int,
                     world_size: int, layout: EnvLayout, env_steps: int, wall: float,
                     collectives: int, global_metrics) -> dict[str, Any]:
    """The row of metrics.jsonl (and TensorBoard, W&B, the console) for one iteration."""
    keys = list(report.metrics)
    per_rank, episodes = gathered.per_rank, gathered.episodes
    means = dict(zip(keys, per_rank[:, :len(keys)].mean(axis=0).tolist()))
    global_batch = layout.total * env_steps
    # Time blocked in collectives: the fastest rank's is communication (it never waited for
    # anybody); what the others spent beyond that was waiting for slower ranks.
    blocked, cpu, faults, compress, sent, dense = (per_rank[:, -1 - len(RUNTIME_VALUES) + i]
                                                   for i in range(len(RUNTIME_VALUES)))
    comm = float(blocked.min())
    waits = blocked - comm
    busy = per_rank[:, [i for i, k in enumerate(keys) if k.startswith("time_")]].sum(axis=1) + compress
    local_steps = np.asarray(layout.counts, dtype=np.float64) * env_steps
    record: dict[str, Any] = {
        "iteration": iteration, "global_step": global_step, "world_size": world_size,
        "sps": global_batch / wall, "sps_per_rank": global_batch / world_size / wall,
        "episodic_return_mean": float(episodes[:, 0].mean()) if len(episodes) else None,
        "episodic_length_mean": float(episodes[:, 1].mean()) if len(episodes) else None,
        "episodes": int(len(episodes)),
    }
    record.update(global_metrics(means, gathered.sums))
    record.update(report.extra)
    record.update({
        "collectives": collectives, "time_allreduce": comm, "time_wait": float(waits.mean()),
        # Gradient bytes each rank handed to the collectives (mean over ranks), the ratio to
        # the uncompressed fp32 gradients of the same reductions, and the compression compute.
        "comm_bytes": float(sent.mean()), "time_compress": float(compress.mean()),
        "compression_ratio": float(dense.sum() / sent.sum()) if sent.sum() else None,
        "time_iteration": wall, "env_counts": list(layout.counts),
        # Load monitoring, one value per rank: waiting at collectives, busy (compute) time,
        # speed (env steps per busy second) and CPU use (cores busy on average).
        "time_wait_by_rank": [float(w) for w in waits],
        "time_busy_by_rank": [float(b) for b in busy],
        "env_steps_per_busy_s_by_rank": [float(s) for s in local_steps / np.maximum(busy, 1e-9)],
        "cpu_util_by_rank": [float(c) for c in cpu / wall],
        # Memory touched anew (hvd_rl/runtime/heap.py): near 0 in steady state when freed memory is kept.
        "page_faults_by_rank": [int(f) for f in faults],
    })
    return record
