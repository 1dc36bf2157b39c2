"""Experiment tracking with Weights & Biases (`[logging] wandb = true`), from rank 0 alone: the
scalars TensorBoard gets (same names, against `global_step`), the resolved config and the
topology, and at the end summary.json.

One W&B run per run directory: its id is written to <run dir>/wandb_run_id the first time, and
every later start in that directory (`--resume auto`, a SLURM requeue, an elastic restart) passes
it back with resume="allow", so the curves continue in the same W&B run. Iterations run again
after a resume are logged again at the same global steps (W&B cannot drop logged rows, as
TensorBoard's purge does); plot against `global_step`.

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


def run_id(run_dir: Path) -> str:
    """This run directory's W&B run id, made (and kept) the first time."""
    path = run_dir / RUN_ID_FILE
    if path.exists():
        text = path.read_text().strip()
        if text:
            return text
    new = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))  # W&B's id shape
    tmp = path.with_name(f".{RUN_ID_FILE}.tmp")
    tmp.write_text(new + "\n")
    os.replace(tmp, path)
    return new


class WandbTracker:
    """Rank 0's W&B run; other ranks never create one."""

    def __init__(self, run_dir: Path, logging_cfg: Any, config: dict[str, Any], topology: dict[str, Any]):
        import wandb

        self.run = wandb.init(
            project=logging_cfg.wandb_project, entity=logging_cfg.wandb_entity or None,
            group=logging_cfg.wandb_group or None, tags=list(logging_cfg.wandb_tags) or None,
            mode=logging_cfg.wandb_mode, id=run_id(run_dir), resume="allow", name=run_dir.name,
            dir=str(run_dir), config={**config, "topology": topology},
            settings=wandb.Settings(console="off", quiet=True, x_disable_stats=True))
        self.run.define_metric("global_step")
        self.run.define_metric("*", step_metric="global_step")

    def log(self, scalars: dict[str, float], global_step: int) -> None:
        self.run.log({**scalars, "global_step": global_step})

    def summary(self, data: dict[str, Any]) -> None:
        self.run.summary.update(data)

    def close(self) -> None:
        self.run.finish()
