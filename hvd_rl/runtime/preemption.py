"""Preemption: a signal or a stop file asks every rank to checkpoint at the same iteration and exit 75.
A prune file (written by a sweep worker, hvd_rl/cluster/sweeps/worker.py) stops the run the same
way but ends it: pruned.json instead of preempted.json, and exit 0 on every rank.

The request is local (a signal on one rank, a file rank 0 sees); acting on it is collective: the
flag rides on the iteration's one allgather (hvd_rl/runtime/iteration_metrics.py), so every rank
learns it at the same iteration, checkpoints, and only then may any rank exit.
"""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from hvd_rl.runtime import distributed as dist

EXIT_PREEMPTED = 75  # checkpointed after SIGTERM/SIGUSR1; rerun with --resume auto (EX_TEMPFAIL)
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
PREEMPTED_MARKER = "preempted.json"  # written by rank 0 next to the checkpoint when preempted
STOP_FILE = "stop.request"  # created by a batch script (any launcher) to ask for a checkpoint + exit 75
PRUNE_FILE = "prune.request"  # created by a sweep worker: the trial is pruned, stop for good (exit 0)
PRUNED_MARKER = "pruned.json"


class Preempted(Exception):
    """All ranks agreed to stop after a preemption signal; a checkpoint was written."""


class Pruned(Exception):
    """All ranks agreed to stop because the sweep pruned this trial; a checkpoint was written."""


def preempted_exit_code() -> int:
    """75, unless HVD_RL_PREEMPTED_EXIT_CODE says otherwise: the SLURM template sets 0 under
    mpirun, which would otherwise abort the job at the first rank's exit 75 and kill the others
    (it requeues on preempted.json instead)."""
    value = os.environ.get("HVD_RL_PREEMPTED_EXIT_CODE", "")
    return int(value) if value.isdigit() else EXIT_PREEMPTED


class PreemptionFlag:
    """SIGTERM/SIGUSR1, or a stop file in the run directory, acted on collectively.

    The signal handler only records the signal: it may run between any two bytecodes, where a
    print can raise a reentrant-call error and Horovod may be mid-reset. Rank 0 also looks for
    the stop file (at most once a second), which works whatever the launcher does with signals
    (horovodrun does not forward SIGUSR1; mpirun answers SIGTERM by killing the job).
    """

    def __init__(self, stop_file: Path | None = None, prune_file: Path | None = None) -> None:
        self.signum: int | None = None
        self.stop_file = stop_file
        self.prune_file = prune_file
        self._file_seen = False
        self.prune_seen = False
        self._next_file_check = 0.0

    def install(self) -> None:
        for sig in PREEMPTION_SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame: Any) -> None:
        if self.signum is None:
            self.signum = signum

    @property
    def raised(self) -> bool:
        if self.signum is not None or self._file_seen:
            return True
        if self.stop_file is not None and time.monotonic() >= self._next_file_check:
            self._next_file_check = time.monotonic() + 1.0
            self.prune_seen = self.prune_file is not None and self.prune_file.exists()
            self._file_seen = self.prune_seen or self.stop_file.exists()
        return self._file_seen

    def describe(self) -> str:
        if self.signum is not None:
            return f"received {signal.Signals(self.signum).name}"
        if self.prune_seen:
            return f"found {self.prune_file}"
        return f"found {self.stop_file}" if self._file_seen else "another rank asked to stop"


def clear_stale_requests(run_dir: Path, started_at: float) -> None:
    """Rank 0 at the start of a run: the last run's marker goes, and a stop file older than this
    process (left by an earlier run) too; a new request stays."""
    (run_dir / PREEMPTED_MARKER).unlink(missing_ok=True)
    (run_dir / PRUNED_MARKER).unlink(missing_ok=True)
    for name in (STOP_FILE, PRUNE_FILE):
        request = run_dir / name
        if request.exists() and request.stat().st_mtime < started_at:
            request.unlink(missing_ok=True)


def stop_after_checkpoint(run_dir: Path, iteration: int, global_step: int, flag: PreemptionFlag) -> None:
    """Collective, once the checkpoint of `iteration` is written: the marker, then (after every
    rank knows it is down) Preempted on every rank, or Pruned if rank 0 found the prune file
    (rank 0 decides; the sum tells the others)."""
    pruned_here = dist.topology().rank == 0 and flag.prune_seen
    if dist.topology().rank == 0:
        # For launchers that do not pass exit code 75 through (horovodrun returns 1). Written
        # before any rank exits: srun --kill-on-bad-exit kills the others at the first exit.
        marker = PRUNED_MARKER if pruned_here else PREEMPTED_MARKER
        (run_dir / marker).write_text(json.dumps({"iteration": iteration, "global_step": global_step}) + "\n")
        (run_dir / STOP_FILE).unlink(missing_ok=True)  # acted on
    pruned = dist.allreduce_sum([1.0 if pruned_here else 0.0], name="preempted.marker_written")[0] > 0
    if pruned:
        raise Pruned(f"pruned at iteration {iteration}, global step {global_step} ({flag.describe()})")
    raise Preempted(f"preempted at iteration {iteration}, global step {global_step} "
                    f"({flag.describe()}); resume with --resume auto")
