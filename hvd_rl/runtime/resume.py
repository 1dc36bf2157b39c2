"""Continuing a run: what rank 0 finds in the run directory, and what every rank needs of it.

Rank 0 alone reads the run directory (`prepare_run_dir`) and the checkpoint; `ResumeInfo` is its
view, broadcast to every rank, so that every rank takes the same branch afterwards (a resumed,
already finished run must not checkpoint on one rank only). Nothing in the run directory is
changed until every check has passed (`prepare_run_files`).
"""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hvd_rl.config import TrainConfig
from hvd_rl.runtime.checkpoint import (CheckpointError, find_resumable, list_checkpoints, load_checkpoint,
                                      remove_stale_temporaries, warn)
from hvd_rl.runtime.metrics import METRICS_FILE, log_line, truncate_metrics
from hvd_rl.runtime.preemption import clear_stale_requests


@dataclass
class ResumeInfo:
    """Rank 0's view of the run directory (broadcast as a dict)."""

    path: str | None = None  # the checkpoint resumed, or None for a new run
    iteration: int = 0
    global_step: int = 0
    seed_offset: int = 0
    world_size: int | None = None  # the checkpoint's rank count
    env_counts: list[int] | None = None  # the checkpoint's layout
    layout_changed: bool = False  # the user changed num_envs / env_counts since the checkpoint
    summary_step: int | None = None  # global step of the run directory's summary.json
    numerics: dict[str, Any] | None = None
    legacy_rank_state: dict[str, Any] | None = field(default=None, repr=False)  # format 2: gathered RNG/compression

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def prepare_run_dir(run_dir: Path, resume: str | None) -> tuple[Path | None, dict | None]:
    """Rank 0: a writable run directory, and the checkpoint to resume (or None)."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=run_dir, prefix=".write_test"):
            pass
    except OSError as exc:
        raise OSError(f"cannot write to run directory {run_dir}: {exc.strerror or exc}") from None
    if resume is None:
        if list_checkpoints(run_dir) or (run_dir / METRICS_FILE).exists():
            raise CheckpointError(
                f"run directory {run_dir} already holds a run; pass --resume auto to continue "
                "it, or choose another --run-dir")
        return None, None
    if resume == "auto":
        path, state, warnings = find_resumable(run_dir)
        for message in warnings:
            warn(message)
        if path is None:
            log_line(f"no checkpoint in {run_dir}; starting a new run")
            return None, None
        return path, state
    return Path(resume), load_checkpoint(resume)


def resume_info(run_dir: Path, ckpt: dict | None, path: Path | None, cfg: TrainConfig) -> ResumeInfo:
    """Rank 0: what every rank needs from the checkpoint and the run directory."""
    summary_step = None
    try:
        summary_step = json.loads((run_dir / "summary.json").read_text())["global_step"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    if ckpt is None:
        return ResumeInfo(summary_step=summary_step)
    saved = ckpt.get("config", {})
    # An env_counts left out at resume is no change (the balancer's or the first run's layout
    # stays); a different num_envs, or a different env_counts given, is.
    layout_changed = (saved.get("env", {}).get("num_envs") != cfg.env.num_envs
                      or bool(cfg.distributed.env_counts)
                      and list(saved.get("distributed", {}).get("env_counts", [])) != list(cfg.distributed.env_counts))
    legacy = ({"rng": ckpt["rng"], "compression": ckpt.get("compression")} if "rng" in ckpt else None)
    return ResumeInfo(path=str(path), iteration=int(ckpt["iteration"]), global_step=int(ckpt["global_step"]),
                      seed_offset=int(ckpt["seed_offset"]), world_size=int(ckpt["world_size"]),
                      env_counts=list(ckpt["env_counts"]), layout_changed=layout_changed,
                      summary_step=summary_step, numerics=ckpt.get("numerics"), legacy_rank_state=legacy)


def prepare_run_files(run_dir: Path, info: ResumeInfo, cfg: TrainConfig, started_at: float) -> None:
    """Rank 0, once every check passed: only now are existing run files touched."""
    # Rows and TensorBoard events of iterations after the checkpoint will be produced again.
    truncate_metrics(run_dir, info.iteration, info.global_step)
    clear_stale_requests(run_dir, started_at)
    remove_stale_temporaries(run_dir)
    tmp = run_dir / ".config.toml.tmp"
    tmp.write_text(cfg.to_toml())
    os.replace(tmp, run_dir / "config.toml")


def resume_line(info: ResumeInfo, world_size: int, counts: list[int], global_batch, numerics: dict[str, Any]) -> str:
    """The log's line about what was resumed and what changed since (allowed, but said)."""
    line = f"resuming from {info.path} at iteration {info.iteration}, global step {info.global_step}"
    old_counts = info.env_counts or []
    if old_counts != counts:
        line += (f"; ranks {info.world_size} -> {world_size}, envs per rank "
                 f"{counts_text(old_counts)} -> {counts_text(counts)}")
        old, new = global_batch(sum(old_counts)), global_batch(sum(counts))
        if old is not None and old != new:
            line += f", global batch {old} -> {new}"
    saved = info.numerics or {}
    changed = [f"{key} {saved[key]} -> {numerics[key]}" for key in numerics if key in saved and saved[key] != numerics[key]]
    if changed:
        line += f"; since the checkpoint: {', '.join(changed)} (the Adam kernel follows the precision)"
    return line


def counts_text(counts: list[int]) -> str:
    """Environments per rank for the log: '8' when even, '6/10' when not."""
    return str(counts[0]) if len(set(counts)) == 1 else "/".join(map(str, counts))
