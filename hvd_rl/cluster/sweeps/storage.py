"""Where a study lives: its directory, and the Optuna storage every worker of it shares.

    <study dir>/
      study.json        what `hvd-rl sweep create` decided: storage URL, study name, sweep file copy
      sweep.toml        the sweep file, as created (workers read this copy, not the original)
      journal.log       Optuna's journal (default storage): an append-only log on the shared filesystem
      trials/<NNNN>/    one directory per trial: params.json, one run directory per (env, seed)
      seeds/<label>/    seed studies of the best and the default config
      report/           `hvd-rl sweep report`

The journal file (Optuna's JournalFileBackend, locked by a symlink: NFS and Lustre take it) needs
no server, which suits a cluster whose only shared thing is the filesystem. An RDB URL (`sqlite:///`
on one node; `postgresql://` where a site runs a database) is the alternative for many hundreds of
concurrent workers. Both get heartbeats: a worker that dies without a word (SIGKILL, a lost node)
leaves a RUNNING trial whose heartbeat stops; the next worker to look fails it and enqueues a retry
of the same parameters (Optuna's RetryHeartbeatStaleTrialCallback), which resumes the dead trial's
run directory. Optuna's RDBStorage has heartbeats built in; the journal gets them here, in the
trial's system attributes.
"""
from __future__ import annotations

import json
import time
import warnings
from pathlib import Path
from typing import Any

import optuna
from optuna.storages import BaseStorage, JournalStorage, RDBStorage, RetryHeartbeatStaleTrialCallback
from optuna.storages._heartbeat import BaseHeartbeat
from optuna.storages.journal import JournalFileBackend
from optuna.trial import FrozenTrial, TrialState

from hvd_rl.cluster.sweeps.spec import SweepError, SweepSpec, load_sweep

STUDY_FILE = "study.json"
SWEEP_COPY = "sweep.toml"
JOURNAL_FILE = "journal.log"
HEARTBEAT_ATTR = "hvd_rl:heartbeat"
HEARTBEAT_SECONDS = 10  # a worker's trial is seen as dead after GRACE_SECONDS without one
GRACE_SECONDS = 60
MAX_RETRIES = 3  # a trial whose workers keep dying is retried this often, then left failed

warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
optuna.logging.set_verbosity(optuna.logging.WARNING)  # our own lines say what happens


class HeartbeatJournalStorage(JournalStorage, BaseHeartbeat):
    """Optuna's journal storage with the heartbeat its RDB storage has: each worker's thread
    writes the time into its trial every `interval` seconds (Optuna's HeartbeatThread); a RUNNING
    trial whose last beat (or start) is older than `grace` seconds is stale. Clocks of the nodes
    must agree within the grace period (NTP does far better)."""

    def __init__(self, path: Path, interval: int, grace: int, callback: Any) -> None:
        super().__init__(JournalFileBackend(str(path)))
        self._interval, self._grace, self._callback = interval, grace, callback

    def record_heartbeat(self, trial_id: int) -> None:
        self.set_trial_system_attr(trial_id, HEARTBEAT_ATTR, time.time())

    def _get_stale_trial_ids(self, study_id: int) -> list[int]:
        now = time.time()
        stale = []
        for trial in self.get_all_trials(study_id, deepcopy=False, states=(TrialState.RUNNING,)):
            started = trial.datetime_start.timestamp() if trial.datetime_start else now
            last = max(started, trial.system_attrs.get(HEARTBEAT_ATTR, 0.0))
            if now - last > self._grace:
                stale.append(trial._trial_id)
        return stale

    def get_heartbeat_interval(self) -> int:
        return self._interval

    def get_heartbeat_stale_trial_callback(self) -> Any:
        return self._callback


def retry_callback() -> RetryHeartbeatStaleTrialCallback:
    return RetryHeartbeatStaleTrialCallback(max_retry=MAX_RETRIES, inherit_intermediate_values=True)


def origin_number(trial: FrozenTrial) -> int:
    """The number of the trial this one retries (its run directory), else its own."""
    attrs = trial.system_attrs
    return attrs.get("failed_trial", trial.number)


def open_storage(study_dir: Path, url: str, heartbeat: int = HEARTBEAT_SECONDS,
                 grace: int = GRACE_SECONDS) -> BaseStorage:
    if url == "journal":
        return HeartbeatJournalStorage(study_dir / JOURNAL_FILE, heartbeat, grace, retry_callback())
    return RDBStorage(url, heartbeat_interval=heartbeat, grace_period=grace,
                      heartbeat_stale_trial_callback=retry_callback())


class WorkerGridSampler(optuna.samplers.GridSampler):
    """Optuna's grid sampler, without its `study.stop()` once the grid is used up (allowed only
    inside `Study.optimize`): workers end a study at its budget, which the sweep file keeps within
    the grid's size (spec.py)."""

    def after_trial(self, study: Any, trial: FrozenTrial, state: TrialState, values: Any) -> None:
        return None


def sampler_of(spec: SweepSpec) -> optuna.samplers.BaseSampler:
    if spec.sampler == "grid":
        return WorkerGridSampler(spec.grid_space())
    if spec.sampler == "random":
        return optuna.samplers.RandomSampler()
    return optuna.samplers.TPESampler(n_startup_trials=spec.startup_trials)


def pruner_of(spec: SweepSpec) -> optuna.pruners.BasePruner:
    if spec.pruner == "none":
        return optuna.pruners.NopPruner()
    if spec.pruner == "hyperband":  # ASHA-style successive halving over the run's reports
        return optuna.pruners.HyperbandPruner(min_resource=spec.warmup_reports,
                                              max_resource=spec.reports_per_run * len(spec.runs()))
    return optuna.pruners.MedianPruner(n_startup_trials=spec.startup_trials, n_warmup_steps=spec.warmup_reports)


class Study:
    """A study directory opened by one process (worker, report, status)."""

    def __init__(self, study_dir: str | Path) -> None:
        self.dir = Path(study_dir).resolve()
        meta_path = self.dir / STUDY_FILE
        try:
            self.meta = json.loads(meta_path.read_text())
        except FileNotFoundError:
            raise SweepError(f"{self.dir} is not a study directory (no {STUDY_FILE}): "
                             "create it with hvd-rl sweep create") from None
        except (OSError, ValueError) as exc:
            raise SweepError(f"{meta_path}: unreadable: {exc}") from None
        self.spec = load_sweep(self.dir / SWEEP_COPY)
        self.storage = open_storage(self.dir, self.meta["storage"], self.meta["heartbeat"], self.meta["grace"])
        self.optuna = optuna.load_study(study_name=self.meta["study_name"], storage=self.storage,
                                        sampler=sampler_of(self.spec), pruner=pruner_of(self.spec))

    def trial_dir(self, number: int) -> Path:
        return self.dir / "trials" / f"{number:04d}"

    def trials(self, states: tuple[TrialState, ...] | None = None) -> list[FrozenTrial]:
        return self.optuna.get_trials(deepcopy=False, states=states)

    def counts(self) -> dict[str, int]:
        counts = {state.name.lower(): 0 for state in TrialState}
        for trial in self.trials():
            counts[trial.state.name.lower()] += 1
        return counts


def create_study(sweep_path: str | Path, study_dir: str | Path, storage: str = "journal",
                 heartbeat: int = HEARTBEAT_SECONDS, grace: int = GRACE_SECONDS) -> Study:
    """Checks the sweep file, then writes the study directory and the Optuna study. Creating an
    existing study directory again with the same sweep file is a no-op (a resubmitted job)."""
    spec = load_sweep(sweep_path)
    study_dir = Path(study_dir).resolve()
    text = Path(sweep_path).read_text()
    meta_path = study_dir / STUDY_FILE
    if meta_path.exists():
        if (study_dir / SWEEP_COPY).read_text() != text:
            raise SweepError(f"{study_dir} holds a study of a different sweep file: use a new directory")
        return Study(study_dir)
    if storage != "journal" and not storage.startswith(("sqlite:///", "postgresql", "mysql")):
        raise SweepError(f"--storage must be 'journal' or an RDB URL (sqlite:///..., postgresql://...), got {storage!r}")
    study_dir.mkdir(parents=True, exist_ok=True)
    (study_dir / SWEEP_COPY).write_text(text)
    optuna.create_study(study_name=spec.name, storage=open_storage(study_dir, storage, heartbeat, grace),
                        direction="maximize", load_if_exists=True)
    meta = {"study_name": spec.name, "storage": storage, "sweep_file": str(Path(sweep_path).resolve()),
            "heartbeat": heartbeat, "grace": grace, "created": time.time()}
    tmp = meta_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(meta, indent=1) + "\n")
    tmp.replace(meta_path)  # last: a study directory with study.json is complete
    return Study(study_dir)
