"""Experiment tracking with Weights & Biases (`[logging] wandb = true`), from rank 0 alone: the
scalars TensorBoard gets (same names, against `global_step`), the resolved config and the
topology, and at the end summary.json.

One W&B run per run directory, on one step axis: its id is written to <run dir>/wandb_run_id the
first time, and every later start in that directory (`--resume auto`, a SLURM requeue, an elastic
restart) passes it back with resume="allow", so the curves continue in the same W&B run. Each row
is logged with `step=global_step`: offline, W&B's own step counter restarts at 0 in every process
(no server tells it where the run stopped), and `wandb sync` keeps the `_step` a row was logged
with, so the counter would put a resumed start's rows on top of the first start's.

W&B cannot replace or drop a logged row (TensorBoard's purge does): iterations that a rerun after
a crash runs again, up to the last global step already logged (<run dir>/wandb_last_step), are not
logged to W&B again; the run's steps rise strictly, as `wandb sync` and the server need.

The W&B run is opened at the first row or summary: a rerun of a finished run, which has nothing to
log, leaves no empty offline-run folder behind.

mode = "offline" (the default: compute nodes rarely reach the internet) writes the run under
<run dir>/wandb/; `wandb sync <run dir>/wandb/offline-run-*` uploads it later from any machine.
"""
from __future__ import annotations

import os
import secrets
import string
from pathlib import Path
from typing import Any

RUN_ID_FILE = "wandb_run_id"
LAST_STEP_FILE = "wandb_last_step"  # the highest global step this run directory's W&B run holds


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def run_id(run_dir: Path) -> str:
    """This run directory's W&B run id, made (and kept) the first time."""
    path = run_dir / RUN_ID_FILE
    if path.exists():
        text = path.read_text().strip()
        if text:
            return text
    new = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))  # W&B's id shape
    _write_atomically(path, new + "\n")
    return new


def last_logged_step(run_dir: Path) -> int | None:
    """The highest global step an earlier start logged to this run directory's W&B run, if any."""
    try:
        return int((run_dir / LAST_STEP_FILE).read_text().strip())
    except (OSError, ValueError):
        return None


class WandbTracker:
    """Rank 0's W&B run; other ranks never create one. Opened at the first row or summary."""

    def __init__(self, run_dir: Path, logging_cfg: Any, config: dict[str, Any], topology: dict[str, Any]):
        self._run_dir = run_dir
        self._logging_cfg = logging_cfg
        self._config = {**config, "topology": topology}
        self.logged_through = last_logged_step(run_dir)
        self.run: Any = None

    def _opened(self) -> Any:
        if self.run is None:
            import wandb

            cfg = self._logging_cfg
            self.run = wandb.init(
                project=cfg.wandb_project, entity=cfg.wandb_entity or None, group=cfg.wandb_group or None,
                tags=list(cfg.wandb_tags) or None, mode=cfg.wandb_mode, id=run_id(self._run_dir),
                resume="allow", name=self._run_dir.name, dir=str(self._run_dir), config=self._config,
                settings=wandb.Settings(console="off", quiet=True, x_disable_stats=True))
            self.run.define_metric("global_step")
            self.run.define_metric("*", step_metric="global_step")
        return self.run

    def log(self, scalars: dict[str, float], global_step: int) -> bool:
        """Logs one iteration's row at `global_step`; False (nothing logged) where the W&B run
        already holds that step from before a rerun."""
        if self.logged_through is not None and global_step <= self.logged_through:
            return False
        self._opened().log({**scalars, "global_step": global_step}, step=global_step)
        self.logged_through = global_step
        _write_atomically(self._run_dir / LAST_STEP_FILE, f"{global_step}\n")
        return True

    def summary(self, data: dict[str, Any]) -> None:
        self._opened().summary.update(data)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
