"""`hvd-rl sweep worker`: takes trials from a study until its budget is reached.

A trial is one real `hvd-rl train` per (env, seed) of the sweep, on `ranks` ranks (`mpirun` on this
machine, or the SLURM templates' launcher: an `srun` step of the worker's allocation), each in its
own run directory under the trial's, always with `--resume auto`. While a run trains, the worker
reads its episodes and reports the running objective at fixed fractions of the step budget (so
trials with different batch sizes are compared at the same env steps); when Optuna's pruner says
so, the worker writes `prune.request` into the run directory and the ranks stop together at the
next iteration (the runtime's collective stop, hvd_rl/runtime/preemption.py) and exit 0: the trial
is `pruned`.

What a worker does when things go wrong:
- SIGTERM/SIGUSR1/SIGINT (SLURM preemption, the time limit, Ctrl-C): writes `stop.request`, the
  ranks checkpoint and stop; the trial goes back to WAITING (the same trial number and
  parameters) and the worker exits 75; whichever worker takes it next resumes its run directory.
- SIGKILL, a lost node: the trial's heartbeat stops; another worker fails it after the grace
  period and Optuna enqueues a retry of the same parameters, which resumes the dead trial's run
  directory (hvd_rl/cluster/sweeps/storage.py). The launcher dies with the worker (PDEATHSIG).
- A point `validate()` refuses, a run that exits 2 or 3, no episode finished: the trial is FAIL
  with the reason in its `failed_because` attribute, and the study goes on.
"""
from __future__ import annotations

import ctypes
import json
import signal
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.storages import fail_stale_trials
from optuna.storages._heartbeat import get_heartbeat_thread
from optuna.trial import FrozenTrial, TrialState

from hvd_rl import CHECKOUT
from hvd_rl.cluster.launch import mpi_env
from hvd_rl.cluster.sweeps.storage import Study, origin_number
from hvd_rl.runtime.metrics import EPISODES_FILE, read_jsonl
from hvd_rl.runtime.preemption import PREEMPTED_MARKER, PRUNE_FILE, PRUNED_MARKER, STOP_FILE

EXIT_PREEMPTED = 75
POLL_SECONDS = 1.0
LAUNCHERS = ("local", "slurm")
SURPLUS = "surplus: the study's budget was taken by lower-numbered trials"
# The worker runs Optuna's heartbeat thread around each trial itself (ask/tell, not optimize).
warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")


def run_name(env_id: str, seed: int) -> str:
    return f"{env_id.replace('/', '_')}-seed{seed}"


def mean_last(returns: list[float], n: int) -> float | None:
    tail = returns[-n:]
    return sum(tail) / len(tail) if tail else None


def episode_returns(run_dir: Path, up_to_step: int | None = None, rows: list[dict] | None = None) -> list[float]:
    """Returns of the run's finished episodes (up to a global step); `rows`: episodes.jsonl already read."""
    rows = read_jsonl(run_dir / EPISODES_FILE) if rows is None else rows
    return [float(r["return"]) for r in rows if up_to_step is None or r["global_step"] <= up_to_step]


def _die_with_parent() -> None:
    """In the launcher's process: SIGTERM when the worker dies, even by SIGKILL (Linux prctl)."""
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def launch_command(launcher: str, ranks: int, train_args: list[str]) -> tuple[list[str], dict[str, str]]:
    """The command and environment that start one run: `mpirun -np N` here, or under SLURM the
    templates' `hvd_rl_launch` (srun --mpi=pmix, mpirun or horovodrun; containers) as a step."""
    env = mpi_env()
    hvd_rl = [str(Path(sys.executable).parent / "hvd-rl"), *train_args]
    if launcher == "local":
        if ranks == 1:
            return hvd_rl, env
        # A preempted run says so by preempted.json; exit 75 would make mpirun abort the others
        env["HVD_RL_PREEMPTED_EXIT_CODE"] = "0"
        return ["mpirun", "-np", str(ranks), "--oversubscribe", "--bind-to", "none", *hvd_rl], env
    env.update(HVD_RL_SRUN_ARGS=f"--ntasks={ranks}", HVD_RL_NP=str(ranks), LAUNCHER=env.get("LAUNCHER", "srun"),
               HVD_RL_HOME=env.get("HVD_RL_HOME", str(CHECKOUT)))
    return ["bash", "-c", 'source "$HVD_RL_HOME/slurm/lib.sh" && hvd_rl_launch "$@"', "hvd_rl_launch",
            *train_args], env


def start_train(launcher: str, ranks: int, config: Path, run_dir: Path, overrides: list[str]) -> subprocess.Popen:
    """`hvd-rl train --resume auto` of one run (a trial's or a seed study's), its output appended to
    RUN_DIR.log beside the run directory; the launcher dies with this process."""
    train_args = ["train", "--config", str(config), "--run-dir", str(run_dir), "--resume", "auto"]
    for text in overrides:
        train_args += ["--set", text]
    run_dir.mkdir(parents=True, exist_ok=True)
    command, env = launch_command(launcher, ranks, train_args)
    with open(run_dir.with_name(run_dir.name + ".log"), "a") as log:
        return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)


class WorkerSignals:
    """Preemption of the worker: remembered, and passed to the running training as its stop file."""

    def __init__(self) -> None:
        self.requested = False
        self.run_dir: Path | None = None

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame: Any) -> None:
        self.requested = True
        if self.run_dir is not None:
            (self.run_dir / STOP_FILE).touch()


@dataclass
class RunOutcome:
    kind: str  # done | pruned | preempted | failed
    mean_return: float | None = None
    reason: str = ""
    global_step: int = 0


class TrialPreempted(Exception):
    """The worker was asked to stop; its trial went back to WAITING."""


class Worker:
    def __init__(self, study: Study, launcher: str = "local", ranks: int | None = None,
                 log: Any = sys.stdout) -> None:
        self.study = study
        self.spec = study.spec
        self.launcher = launcher
        self.ranks = ranks or self.spec.ranks
        self.signals = WorkerSignals()
        self.log = log

    def say(self, message: str) -> None:
        print(f"[sweep {self.spec.name}] {message}", file=self.log, flush=True)

    # ---- the budget ---------------------------------------------------------------------------

    def _state(self) -> tuple[int, int, int, int]:
        """(finished, running, waiting, failed) trials; failed counts real failures only (a dead
        worker's trial is retried, a surplus trial never ran)."""
        trials = self.study.trials()
        finished = sum(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in trials)
        running = sum(t.state == TrialState.RUNNING for t in trials)
        waiting = sum(t.state == TrialState.WAITING for t in trials)
        failed = sum(t.state == TrialState.FAIL and "failed_because" in t.user_attrs
                     and t.user_attrs["failed_because"] != SURPLUS for t in trials)
        return finished, running, waiting, failed

    def _frozen(self, trial: optuna.Trial) -> FrozenTrial:
        return self.study.storage.get_trial(trial._trial_id)

    def _surplus(self, trial: optuna.Trial) -> bool:
        """A fresh trial asked for while the last slots were being taken by another worker."""
        if "trial_dir" in trial.user_attrs or "failed_trial" in self._frozen(trial).system_attrs:
            return False  # a preempted or retried trial: it replaces one that counts
        live = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING, TrialState.WAITING)
        ahead = sum(t.number < trial.number and t.state in live for t in self.study.trials())
        return ahead >= self.spec.trials

    def work(self, max_trials: int | None = None) -> int:
        """Takes trials until the study has `trials` complete or pruned ones. Returns the exit
        code: 0 done, 75 preempted (a trial put back), 1 too many failed trials."""
        self.signals.install()
        taken = 0
        while True:
            if self.signals.requested:
                self.say("asked to stop between trials")
                return EXIT_PREEMPTED
            fail_stale_trials(self.study.optuna)
            finished, running, waiting, failed = self._state()
            if finished >= self.spec.trials:
                self.say(f"study complete: {finished} trial(s) complete or pruned, {failed} failed")
                return 0
            if failed >= self.spec.failure_budget():
                self.say(f"stopping: {failed} trial(s) failed (the sweep's limit); see hvd-rl sweep status")
                return 1
            if max_trials is not None and taken >= max_trials:
                return 0
            if finished + running >= self.spec.trials and not waiting:
                time.sleep(5 * POLL_SECONDS)  # the last trials run elsewhere: wait in case one dies
                continue
            trial = self.study.optuna.ask()
            if self._surplus(trial):
                trial.set_user_attr("failed_because", SURPLUS)
                self.study.optuna.tell(trial, state=TrialState.FAIL)
                continue
            taken += 1
            try:
                with get_heartbeat_thread(trial._trial_id, self.study.storage):
                    self._trial(trial)
            except TrialPreempted:
                return EXIT_PREEMPTED

    # ---- one trial ------------------------------------------------------------------------------

    def _fail(self, trial: optuna.Trial, reason: str) -> None:
        self.say(f"trial {trial.number} failed: {reason}")
        trial.set_user_attr("failed_because", reason[:500])
        self.study.optuna.tell(trial, state=TrialState.FAIL)

    def _trial(self, trial: optuna.Trial) -> None:
        spec = self.spec
        params = {dim.key: dim.suggest(trial) for dim in spec.space}
        origin = origin_number(self._frozen(trial))
        trial_dir = self.study.trial_dir(origin)
        trial_dir.mkdir(parents=True, exist_ok=True)
        (trial_dir / "params.json").write_text(json.dumps(params, indent=1) + "\n")
        trial.set_user_attr("trial_dir", str(trial_dir.relative_to(self.study.dir)))
        trial.set_user_attr("ranks", self.ranks)
        resumed = f" (retry of trial {origin})" if origin != trial.number else ""
        self.say(f"trial {trial.number}{resumed}: {json.dumps(params)}")
        for env_id, seed in spec.runs():
            why = spec.refusal(params, env_id, seed, ranks=self.ranks)
            if why:
                return self._fail(trial, f"refused by validate(): {why}")
        scores: list[float] = []
        steps = 0
        for index, (env_id, seed) in enumerate(spec.runs()):
            outcome = self._run(trial, index, trial_dir / run_name(env_id, seed), params, env_id, seed, scores)
            steps += outcome.global_step
            if outcome.kind == "preempted":
                self.study.storage.set_trial_state_values(trial._trial_id, TrialState.WAITING)
                self.say(f"trial {trial.number} checkpointed and back in the queue (preempted)")
                raise TrialPreempted
            if outcome.kind == "failed":
                return self._fail(trial, outcome.reason)
            if outcome.kind == "pruned":
                self._note_speed(trial, steps)
                self.say(f"trial {trial.number} pruned")
                self.study.optuna.tell(trial, state=TrialState.PRUNED)
                return
            scores.append(spec.objective.score(env_id, outcome.mean_return))
        self._note_speed(trial, steps)
        value = sum(scores) / len(scores)
        trial.set_user_attr("run_scores", scores)
        self.study.optuna.tell(trial, value)
        self.say(f"trial {trial.number} complete: {value:.4g}")

    def _note_speed(self, trial: optuna.Trial, steps: int) -> None:
        wall = float(trial.user_attrs.get("wall_seconds", 0.0))
        trial.set_user_attr("global_steps", steps)
        trial.set_user_attr("sps", steps / wall if wall else None)

    def _run(self, trial: optuna.Trial, index: int, run_dir: Path, params: dict[str, Any], env_id: str, seed: int,
             done_scores: list[float]) -> RunOutcome:
        """One `hvd-rl train` of the trial: launched, watched, reported, maybe pruned."""
        spec = self.spec
        overrides = spec.run_overrides(params, env_id, seed)
        total = spec.base_config(overrides).total_timesteps
        for stale in (STOP_FILE, PRUNE_FILE, PREEMPTED_MARKER, PRUNED_MARKER):
            (run_dir / stale).unlink(missing_ok=True)
        start = time.time()
        proc = start_train(self.launcher, self.ranks, spec.config_path, run_dir, overrides)
        self.signals.run_dir = run_dir
        if self.signals.requested:
            (run_dir / STOP_FILE).touch()
        pruning = False
        while True:
            try:
                code = proc.wait(timeout=POLL_SECONDS)
                break
            except subprocess.TimeoutExpired:
                pass
            if not pruning and self._report(trial, index, run_dir, env_id, total, done_scores):
                (run_dir / PRUNE_FILE).touch()
                pruning = True
        self.signals.run_dir = None
        trial.set_user_attr("wall_seconds", float(trial.user_attrs.get("wall_seconds", 0.0)) + time.time() - start)
        returns = episode_returns(run_dir)
        steps = _last_step(run_dir)
        if (run_dir / PRUNED_MARKER).exists() and code == 0:
            return RunOutcome("pruned", global_step=steps)
        if (run_dir / PREEMPTED_MARKER).exists() or code == EXIT_PREEMPTED:
            return RunOutcome("preempted", global_step=steps)
        if code != 0:
            return RunOutcome("failed", reason=f"hvd-rl train exited {code}: {_last_error(run_dir)}")
        if not pruning:
            self._report(trial, index, run_dir, env_id, total, done_scores)  # the reports it missed
        if not returns:
            return RunOutcome("failed", reason=f"no episode finished in {total} steps ({run_dir.name})")
        return RunOutcome("done", mean_last(returns, spec.objective.last_episodes), global_step=steps)

    def _report(self, trial: optuna.Trial, index: int, run_dir: Path, env_id: str, total: int,
                done_scores: list[float]) -> bool:
        """Reports each newly reached fraction of the run's steps once (the episodes up to that
        step, so the value does not depend on when the worker looked); True: prune it."""
        spec = self.spec
        step_now = _last_step(run_dir)
        reported = self._frozen(trial).intermediate_values
        rows = None
        prune = False
        for k in range(1, spec.reports_per_run + 1):
            at_step = total * k // spec.reports_per_run
            step = index * spec.reports_per_run + k
            if at_step > step_now or step in reported:
                continue
            if rows is None:  # read once per look, whatever the number of reports it makes
                rows = read_jsonl(run_dir / EPISODES_FILE)
            running = mean_last(episode_returns(run_dir, at_step, rows), spec.objective.last_episodes)
            if running is None:
                continue
            value = (sum(done_scores) + spec.objective.score(env_id, running)) / (len(done_scores) + 1)
            trial.report(value, step)
            prune = trial.should_prune()
        return prune


def _last_step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    rows = read_jsonl(path)
    return int(rows[-1]["global_step"]) if rows else 0


def _last_error(run_dir: Path) -> str:
    log = run_dir.with_name(run_dir.name + ".log")
    lines = [line for line in log.read_text(errors="replace").splitlines() if "error" in line.lower()] if log.exists() else []
    return lines[-1].strip()[:300] if lines else f"see {log}"
