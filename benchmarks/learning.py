"""The learning benchmark: experiments x seeds trained one after the other, resumable, then a
report that compares the learning curves with published reference points.

    python benchmarks/learning.py run    --plan benchmarks/learning_atari_quick.toml
    python benchmarks/learning.py report --plan benchmarks/learning_atari_quick.toml
    python benchmarks/learning.py run    --plan P --only breakout --dry-run   # print the commands

Every (experiment, seed) is one run directory, <out>/<experiment>/seed<S>/ (out defaults to
runs/learning/<plan name>), trained by `make train`'s launch line with that run's values:

    mpirun -np N --oversubscribe <venv>/bin/hvd-rl train --config C --run-dir D --resume auto --set ...

(1 rank: no mpirun). Rerunning the same command continues an interrupted study: a run whose
summary.json says completed (to the planned steps) is skipped, any other resumes from its last
checkpoint. Ctrl-C (or SIGTERM) asks the running training to checkpoint and stops the study;
a second one kills it. Each run's output goes to <out>/<experiment>/seed<S>.log.

The report (<out>/report/report.md, one PNG per experiment and overview.png, report.json) is
written at the end of `run` and by `report` at any time: runs still going or interrupted show
their partial curves, marked. On a cluster, slurm/learning_array.sbatch runs one (experiment,
seed) per array element through `element` and refreshes the report after each.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hvd_rl.analysis.learning import (LAST_N, Aggregate, Curve, Reference, ReferenceData, RunStats,  # noqa: E402
                             aggregate, load_references, run_curve, run_stats)
from hvd_rl.runtime.metrics import format_duration, read_jsonl  # noqa: E402
from hvd_rl.analysis.study import (Experiment, Plan, PlanError, RunSpec, config_conflicts, is_completed,  # noqa: E402
                          is_started, load_plan)

VENV_BIN = Path(sys.executable).parent
LAUNCHES_FILE = "launches.jsonl"
EXIT_PREEMPTED = 75  # as `hvd-rl train`: checkpointed and stopped; rerun to continue


# ---- running --------------------------------------------------------------------------------

class Interrupts:
    """First SIGINT/SIGTERM: the running training checkpoints and exits (SIGUSR1, which mpirun
    forwards to every rank), and the study stops after it. Second: the training is killed.

    Trainings run in their own session, so a Ctrl-C in the terminal reaches only this process
    (mpirun would otherwise abort the ranks before they can checkpoint)."""

    def __init__(self) -> None:
        self.count = 0
        self.child: subprocess.Popen | None = None

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    @staticmethod
    def uninstall() -> None:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def _handle(self, signum: int, _frame) -> None:
        self.count += 1
        child = self.child
        if child is None or child.poll() is not None:
            return
        if self.count == 1:
            print(f"[learning] {signal.Signals(signum).name}: asking the training to checkpoint "
                  "(again to kill it)", flush=True)
            child.send_signal(signal.SIGUSR1)
        else:
            os.killpg(child.pid, signal.SIGKILL)


def validate_experiment(exp: Experiment, extra: list[str]) -> None:
    """The whole training config of an experiment, checked before hours are spent on it."""
    from hvd_rl.config import ConfigError, load_config, validate

    overrides = [*exp.overrides, *extra, *exp.derived_overrides(exp.seeds[0])]
    try:
        validate(load_config(exp.config_path, overrides))
    except ConfigError as exc:
        raise PlanError(f"experiment '{exp.name}': {exc}") from None


def launch(spec: RunSpec, out: Path, interrupts: Interrupts) -> int:
    """Runs one training to its end (or a signal); appends its output to the run's log file and
    a record of the launch to <out>/launches.jsonl."""
    cmd = spec.command(VENV_BIN)
    spec.run_dir.parent.mkdir(parents=True, exist_ok=True)
    started = time.time()
    with open(spec.log_file, "a") as log:
        log.write(f"\n[learning] {_now()} {shlex.join(cmd)}\n")
        log.flush()
        from hvd_rl.cluster.launch import mpi_env

        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=mpi_env(),
                                start_new_session=True)
        interrupts.child = proc
        code = proc.wait()
        interrupts.child = None
    if code != 0 and (spec.run_dir / "preempted.json").exists():
        code = EXIT_PREEMPTED  # launchers that do not pass the trainer's 75 through
    with open(out / LAUNCHES_FILE, "a") as f:
        f.write(json.dumps({"run": spec.label, "started": started, "seconds": time.time() - started,
                            "exit_code": code, "command": cmd}) + "\n")
    return code


def run_study(plan: Plan, out: Path, extra: list[str], only: list[str], dry_run: bool) -> int:
    specs = [s for s in plan.runs(out, extra) if not only or s.experiment.name in only]
    if not specs:
        raise PlanError(f"no experiment of {plan.path} is named {', '.join(only)}")
    for exp in {s.experiment.name: s.experiment for s in specs}.values():
        validate_experiment(exp, extra)
    if not dry_run:
        out.mkdir(parents=True, exist_ok=True)
        _copy_plan(plan, out)
    interrupts = Interrupts()
    interrupts.install()
    failed, stopped = [], False
    for spec in specs:
        if interrupts.count:
            stopped = True
            break
        steps = spec.experiment.steps
        if is_completed(spec.run_dir, steps):
            print(f"[learning] {spec.label}: completed ({steps:,} steps), skipped", flush=True)
            continue
        conflicts = config_conflicts(spec)
        if conflicts:
            print(f"[learning] {spec.label}: NOT resumed: {spec.run_dir} was trained with another "
                  "configuration than the plan asks for now:\n    " + "\n    ".join(conflicts) +
                  "\n  Restore the plan, or move the run directory away to train it afresh.", flush=True)
            failed.append(spec.label)
            continue
        verb = "resuming" if is_started(spec.run_dir) else "starting"
        cmd = spec.command(VENV_BIN)
        if dry_run:
            print(f"[learning] {spec.label}: would be {verb}: {shlex.join(cmd)}", flush=True)
            continue
        print(f"[learning] {spec.label}: {verb} ({steps:,} steps, {spec.experiment.ranks} rank(s)); "
              f"log: {spec.log_file}", flush=True)
        start = time.time()
        code = launch(spec, out, interrupts)
        print(f"[learning] {spec.label}: exit {code} after {format_duration(time.time() - start)}", flush=True)
        if code == EXIT_PREEMPTED or interrupts.count:  # also a SIGTERM sent to the ranks themselves
            stopped = True
            break
        if code != 0:
            failed.append(spec.label)
    interrupts.uninstall()
    if dry_run:
        return 0
    report = write_report(plan, out, extra=extra)
    print(f"[learning] report: {report}", flush=True)
    if stopped:
        print("[learning] interrupted: run the same command again to continue", flush=True)
        return EXIT_PREEMPTED
    if failed:
        print(f"[learning] not completed: {', '.join(failed)} (see their .log files)", flush=True)
        return 1
    return 0


def _copy_plan(plan: Plan, out: Path) -> None:
    """The plan as it was run, next to its results."""
    try:
        (out / "plan.toml").write_text(Path(plan.path).read_text())
    except OSError:
        pass


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


# ---- the report -----------------------------------------------------------------------------

@dataclass
class RunResult:
    spec: RunSpec
    curve: Curve
    stats: RunStats
    wall_seconds: float | None  # this runner's launches together, else summary.json's
    last_exit: int | None  # of this runner's last launch of the run


@dataclass
class ExperimentResult:
    experiment: Experiment
    env_id: str
    batch: tuple[int, int, int]  # ranks, envs per rank, steps per env (PPO's rollout)
    batch_text: tuple[str, str]  # the batch as the summary table and the section text say it
    runs: list[RunResult]
    aggregate: Aggregate | None
    references: list[Reference]

    @property
    def finals(self) -> list[float]:
        return [r.curve.final for r in self.runs if r.curve.final is not None]

    @property
    def all_completed(self) -> bool:
        return all(r.stats.status == "completed" for r in self.runs)

    def acceptance(self) -> list[tuple[str, bool | None]]:
        """(criterion, passed) per acceptance key of the plan; None while a seed has no result."""
        rules = self.experiment.acceptance
        finals = self.finals
        complete = len(finals) == len(self.runs)
        checks = []
        if "mean_at_least" in rules:
            ok = (sum(finals) / len(finals) >= rules["mean_at_least"]) if complete else None
            checks.append((f"mean over seeds of the last-{LAST_N}-games return >= {rules['mean_at_least']:g}", ok))
        if "each_above" in rules:
            ok = all(f > rules["each_above"] for f in finals) if complete else None
            checks.append((f"every seed > {rules['each_above']:g}", ok))
        return checks


def collect(plan: Plan, out: Path, refs: ReferenceData, extra: list[str] | tuple[str, ...] = ()) -> list[ExperimentResult]:
    from hvd_rl.config import load_config

    launches: dict[str, list[dict]] = {}
    for row in read_jsonl(out / LAUNCHES_FILE):
        launches.setdefault(row.get("run", ""), []).append(row)
    results = []
    for exp in plan.experiments:
        cfg = load_config(exp.config_path, [*exp.overrides, *extra, *exp.derived_overrides(exp.seeds[0])])
        env_id = cfg.env.id
        runs = []
        for spec in (s for s in plan.runs(out, extra) if s.experiment.name == exp.name):
            stats = run_stats(spec.run_dir, exp.steps)
            mine = launches.get(spec.label, [])
            wall = sum(r["seconds"] for r in mine) if mine else stats.wall_seconds
            runs.append(RunResult(spec, run_curve(spec.run_dir), stats, wall,
                                  mine[-1]["exit_code"] if mine else None))
        results.append(ExperimentResult(
            experiment=exp, env_id=env_id, batch=(exp.ranks, cfg.env.num_envs, cfg.ppo.num_steps),
            batch_text=_batch_text(exp.algorithm, exp.ranks, cfg), runs=runs,
            aggregate=aggregate([r.curve for r in runs]),
            references=refs.for_run(exp.algorithm, exp.reference_env or env_id)))
    return results


_REF_STYLES = [("crimson", "D"), ("darkviolet", "s"), ("saddlebrown", "^"), ("teal", "v"), ("olive", "P")]


def _x_limit(result: ExperimentResult) -> float:
    reached = max((r.stats.global_step for r in result.runs), default=0)
    return max(result.experiment.steps, reached) * 1.04


def _drawn(result: ExperimentResult, point_step: int) -> bool:
    return point_step <= _x_limit(result)


def plot_experiment(ax, result: ExperimentResult) -> None:
    """Seeds (dashed and x-marked where partial), their mean and min-max band, and the reference
    points inside the study's step range, all on the same axes."""
    from matplotlib.ticker import FuncFormatter

    exp = result.experiment
    for i, run in enumerate(result.runs):
        c = run.curve
        if not len(c.steps):
            continue
        partial = run.stats.status != "completed"
        label = f"seed {run.spec.seed}" + (f" (partial: {run.stats.fraction:.0%})" if partial else "")
        ax.plot(c.steps, c.values, drawstyle="steps-post", color=f"C{i}", lw=1.0, alpha=0.85,
                ls="--" if partial else "-", label=label)
        if partial:
            ax.plot(c.steps[-1], c.values[-1], "x", color=f"C{i}", ms=9, mew=2)
    agg = result.aggregate
    if agg is not None and agg.seeds > 1:
        ax.fill_between(agg.steps, agg.low, agg.high, step="post", color="gray", alpha=0.25,
                        label=f"min-max over {agg.seeds} seeds")
        ax.plot(agg.steps, agg.mean, drawstyle="steps-post", color="black", lw=2.0, label="mean over seeds")
    xmax = _x_limit(result)
    refs = [r for r in result.references if any(_drawn(result, p.step) for p in r.points)]
    for j, ref in enumerate(refs):
        color, marker = _REF_STYLES[j % len(_REF_STYLES)]
        points = [p for p in ref.points if _drawn(result, p.step)]
        shift = (j - (len(refs) - 1) / 2) * 0.012 * xmax  # side by side where they share a step
        xs = [p.step + shift for p in points]
        ys = [p.value for p in points]
        lower = [p.value - p.lower if p.lower is not None else 0.0 for p in points]
        upper = [p.upper - p.value if p.upper is not None else 0.0 for p in points]
        ax.errorbar(xs, ys, yerr=[lower, upper], fmt=marker, color=color, ms=6, capsize=4, lw=1.5,
                    label=ref.label, zorder=5)
        if len(points) > 1:
            ax.plot(xs, ys, ":", color=color, lw=1.0, zorder=4)
            if all(p.lower is not None for p in points):  # a curve's band between its points
                ax.fill_between(xs, [p.lower for p in points], [p.upper for p in points], color=color,
                                alpha=0.08, lw=0, zorder=1)
    if not any(len(r.curve.steps) for r in result.runs):
        ax.text(0.5, 0.5, "no finished games yet", transform=ax.transAxes, ha="center", va="center", color="gray")
    ax.set_xlim(0, xmax)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x / 1e6:g}M" if x else "0"))
    ax.set_xlabel("global env steps (agent steps; Atari: x4 frames)")
    ax.set_ylabel(f"return of whole games, mean of last {LAST_N}")
    ax.set_title(f"{exp.name}: {result.env_id}\n{result.batch_text[1]}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")


def _batch_text(algorithm: str, ranks: int, cfg) -> tuple[str, str]:
    """PPO learns from each rollout (ranks x envs x steps); DQN from replay batches."""
    envs = cfg.env.num_envs
    if algorithm == "dqn":
        q = cfg.dqn
        return (f"{q.batch_size} (replay)", f"{ranks} rank(s) x {envs} env(s), replay batch {q.batch_size} "
                f"per update, one update per {q.train_frequency} global steps")
    steps = cfg.ppo.num_steps
    return (f"{ranks}x{envs}x{steps} = {ranks * envs * steps:,}",
            f"{ranks} rank(s) x {envs} envs x {steps} steps = global batch {ranks * envs * steps:,}")


def _figure(results: list[ExperimentResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(3, len(results))
    rows = math.ceil(len(results) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.2 * cols, 4.6 * rows), squeeze=False)
    for ax, result in zip(axes.flat, results):
        plot_experiment(ax, result)
    for ax in list(axes.flat)[len(results):]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _num(value: float | None, digits: int = 2) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def _status(run: RunResult) -> str:
    s = run.stats
    if s.status == "completed":
        return "completed"
    if s.status == "not started":
        return "not started"
    text = f"**partial**: {s.global_step:,} of {s.planned_steps:,} steps ({s.fraction:.0%})"
    if run.last_exit == EXIT_PREEMPTED:
        text += ", interrupted"
    elif run.last_exit not in (None, 0):
        text += f", last launch exited {run.last_exit}"
    return text


def _ref_at(result: ExperimentResult, step: int) -> str:
    texts = []
    for ref in result.references:
        for p in ref.points:
            if p.step == step:
                spread = p.spread_text()
                texts.append(f"{p.value:g}" + (f" ({spread})" if spread else "") + f" [{ref.label}]")
    return "; ".join(texts) or "—"


def _verdict(ok: bool | None) -> str:
    return "pending" if ok is None else ("PASS" if ok else "**MISS**")


def _markdown(plan: Plan, out: Path, results: list[ExperimentResult], refs_path: Path,
              clips: dict[str, str | None] | None = None) -> str:
    lines = [f"# Learning benchmark: {plan.name}", ""]
    if plan.description:
        lines += [plan.description, ""]
    lines += [f"Plan `{_rel(plan.path)}` (copied to `plan.toml`), runs under `{_rel(out)}`, report written "
              f"{_now()} on {socket.gethostname()} ({os.cpu_count()} CPUs).", "",
              f"Curves: episodic return of whole games (raw score), the mean of the last {LAST_N} finished "
              "games, against global env steps (all ranks). Each seed is one run; the black line and grey "
              "band are the mean and min-max over seeds, where every seed has reached the step. Dashed "
              "lines ending in x are runs still going or interrupted. Coloured markers with error bars are "
              f"published reference points (`{_rel(refs_path)}`): ranges read off a figure, or ± std over "
              "seeds of a table. Wall time: this tool's launches of the run together (for runs it did not "
              "launch, e.g. under SLURM: the finishing launch's `wall_seconds` from summary.json); train "
              "time: the iterations behind the curve (metrics.jsonl); SPS = global steps / train time.", "",
              "![all experiments](overview.png)", "", "## Summary", "",
              "| experiment | env | global batch | steps | seeds done | last-100 return: mean (min-max) "
              "| reference at these steps | acceptance |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        finals = r.finals
        mean = (f"{sum(finals) / len(finals):.2f} ({min(finals):.2f} to {max(finals):.2f})" if finals else "—")
        done = sum(run.stats.status == "completed" for run in r.runs)
        verdicts = ", ".join(_verdict(ok) for _, ok in r.acceptance()) or "—"
        if verdicts != "—" and not r.all_completed:
            verdicts += " (provisional)"
        lines.append(f"| [{r.experiment.name}](#{r.experiment.name.lower()}) | {r.env_id} | {r.batch_text[0]} "
                     f"| {r.experiment.steps:,} | {done}/{len(r.runs)} | {mean} | "
                     f"{_ref_at(r, r.experiment.steps)} | {verdicts} |")
    lines.append("")
    for r in results:
        exp = r.experiment
        lines += [f"## {exp.name}", "",
                  f"{r.env_id}, {exp.algorithm}, config `{exp.config}`"
                  + (f" with `{' '.join(exp.overrides)}`" if exp.overrides else "")
                  + f"; {r.batch_text[1]}; "
                  f"{exp.steps:,} global steps per seed.", "", f"![{exp.name}]({exp.name}.png)", ""]
        if (clips or {}).get(exp.name):
            lines += [f"![{exp.name}: the final policy]({exp.name}-agent.gif)", "", clips[exp.name], ""]
        lines += [f"| seed | status | global steps | games | last-{LAST_N} return | wall time | train time | SPS "
                  "| curve from |", "|---|---|---|---|---|---|---|---|---|"]
        for run in r.runs:
            c, s = run.curve, run.stats
            final = _num(c.final) + (f" ({c.final_games} games)" if c.final is not None and c.final_games < LAST_N else "")
            lines.append(f"| {run.spec.seed} | {_status(run)} | {s.global_step:,} | {c.games:,} | {final} | "
                         f"{format_duration(run.wall_seconds) if run.wall_seconds else '—'} | "
                         f"{format_duration(s.train_seconds) if s.train_seconds else '—'} | {_num(s.sps, 0)} | "
                         f"{c.source} |")
        finals = r.finals
        if finals:
            sps = [run.stats.sps for run in r.runs if run.stats.sps]
            partial = sum(run.stats.status != "completed" and run.curve.final is not None for run in r.runs)
            lines.append(f"| mean | {len(finals)} seeds" + (f" ({partial} partial)" if partial else "") +
                         f" | | | **{sum(finals) / len(finals):.2f}** "
                         f"({min(finals):.2f} to {max(finals):.2f}) | | | "
                         f"{_num(sum(sps) / len(sps), 0) if sps else '—'} | |")
        lines.append("")
        checks = r.acceptance()
        if checks:
            note = "" if r.all_completed else " (provisional: not every seed has completed)"
            lines += [f"Acceptance{note}: " + "; ".join(f"{text}: {_verdict(ok)}" for text, ok in checks), ""]
        if r.references:
            lines += ["| reference | step | return | spread | drawn |", "|---|---|---|---|---|"]
            for ref in r.references:
                for p in ref.points:
                    drawn = "yes" if _drawn(r, p.step) else "no (beyond this study's steps)"
                    lines.append(f"| {ref.label} | {p.step:,} | {p.value:g} | {p.spread_text() or '—'} | {drawn} |")
            lines.append("")
            lines += [f"- {ref.label}: {ref.obtained}. Source: <{ref.source}>" + (f" ({ref.note})" if ref.note else "")
                      for ref in r.references]
            lines.append("")
        else:
            lines += [f"No reference points for ({exp.algorithm}, {exp.reference_env or r.env_id}) in "
                      f"`{_rel(refs_path)}`.", ""]
    return "\n".join(lines)


def _rel(path: Path | str) -> str:
    path = Path(path).resolve()
    try:
        return str(path.relative_to(REPO))
    except ValueError:
        return str(path)


def _json(results: list[ExperimentResult]) -> dict:
    def run_json(run: RunResult) -> dict:
        c, s = run.curve, run.stats
        return {"seed": run.spec.seed, "run_dir": _rel(run.spec.run_dir), "status": s.status,
                "global_step": s.global_step, "planned_steps": s.planned_steps, "games": c.games,
                "final_return": c.final, "final_games": c.final_games, "curve_source": c.source,
                "wall_seconds": run.wall_seconds, "train_seconds": s.train_seconds, "sps": s.sps,
                "world_size": s.world_size, "last_exit": run.last_exit,
                "curve": {"steps": c.steps.tolist(), "values": c.values.tolist()}}

    out = []
    for r in results:
        finals = r.finals
        agg = r.aggregate
        out.append({
            "experiment": r.experiment.name, "env_id": r.env_id, "algorithm": r.experiment.algorithm,
            "steps": r.experiment.steps, "batch": {"ranks": r.batch[0], "envs_per_rank": r.batch[1],
                                                   "steps_per_env": r.batch[2]},
            "runs": [run_json(run) for run in r.runs],
            "final_mean": sum(finals) / len(finals) if finals else None,
            "final_min": min(finals) if finals else None, "final_max": max(finals) if finals else None,
            "aggregate": None if agg is None else {"seeds": agg.seeds, "steps": agg.steps.tolist(),
                                                   "mean": agg.mean.tolist(), "low": agg.low.tolist(),
                                                   "high": agg.high.tolist()},
            "acceptance": [{"criterion": text, "passed": ok} for text, ok in r.acceptance()],
            "references": [{"key": ref.key, "label": ref.label, "source": ref.source,
                            "points": [{"step": p.step, "value": p.value, "lower": p.lower, "upper": p.upper,
                                        "drawn": _drawn(r, p.step)} for p in ref.points]}
                           for ref in r.references]})
    return {"kind": "hvd_rl.learning_report", "experiments": out}


CLIP_FRAMES = 300  # 20 s of Atari at 15 frames/s


def _clip(result: ExperimentResult, report: Path) -> str | None:
    """A GIF of one greedy game (its first CLIP_FRAMES frames) of the final policy of the first
    completed seed whose checkpoint is here: <experiment>-agent.gif beside the plots. Kept from an
    earlier report where the checkpoints are gone (committed results keep no checkpoints).
    Returns the caption, or None when there is no clip."""
    from hvd_rl.policy.video import record_checkpoint

    gif = report / f"{result.experiment.name}-agent.gif"
    caption_file = gif.with_suffix(".txt")
    for run in result.runs:
        checkpoint = run.spec.run_dir / "checkpoints" / "latest.pt"
        if run.stats.status != "completed" or not checkpoint.exists():
            continue
        try:
            clip = record_checkpoint(checkpoint, gif=gif, episodes=1, max_frames=CLIP_FRAMES)
        except Exception as exc:  # noqa: BLE001 - a report without its clip beats no report
            print(f"[learning] {result.experiment.name}: no clip ({type(exc).__name__}: {exc})", flush=True)
            return None
        game = (f"a whole game, return {clip['returns'][0]:g}" if clip["complete"]
                else f"the first {clip['frames']} frames of a game")
        caption = f"The final policy of seed {run.spec.seed} (global step {clip['global_step']:,}), greedy: {game}."
        caption_file.write_text(caption + "\n")
        return caption
    return caption_file.read_text().strip() if gif.exists() and caption_file.exists() else None


def write_report(plan: Plan, out: Path, refs_path: Path | None = None, extra: list[str] | tuple[str, ...] = ()) -> Path:
    from hvd_rl.analysis.learning import REFERENCES_FILE

    refs_path = Path(refs_path or REFERENCES_FILE)
    results = collect(plan, out, load_references(refs_path), extra)
    report = out / "report"
    report.mkdir(parents=True, exist_ok=True)
    clips = {}
    for result in results:
        _figure([result], report / f"{result.experiment.name}.png")
        clips[result.experiment.name] = _clip(result, report)
    _figure(results, report / "overview.png")
    (report / "report.md").write_text(_markdown(plan, out, results, refs_path, clips) + "\n")
    (report / "report.json").write_text(json.dumps(_json(results), indent=1) + "\n")
    return report / "report.md"


# ---- SLURM array elements -------------------------------------------------------------------

def element_shell(plan: Plan, out: Path, extra: list[str], index: int) -> str:
    """Bash assignments describing array element `index` (slurm/learning_array.sbatch evals them)."""
    specs = plan.runs(out, extra)
    if not 0 <= index < len(specs):
        raise PlanError(f"array index {index} is outside the plan's {len(specs)} (experiment, seed) elements "
                        f"(0-{len(specs) - 1}); render the script again with --plan {plan.path}")
    spec = specs[index]
    validate_experiment(spec.experiment, extra)
    done = is_completed(spec.run_dir, spec.experiment.steps)
    if not done:
        conflicts = config_conflicts(spec)
        if conflicts:
            raise PlanError(f"{spec.label}: {spec.run_dir} was trained with another configuration than the plan "
                            "asks for now: " + "; ".join(conflicts))
    out.mkdir(parents=True, exist_ok=True)
    _copy_plan(plan, out)
    args = spec.config_args()  # hvd_rl_train_requeueable adds train, --run-dir and --resume auto
    return "\n".join([
        f"ELEMENT_NAME={shlex.quote(spec.label)}",
        f"ELEMENT_RUN_DIR={shlex.quote(str(spec.run_dir))}",
        f"ELEMENT_RANKS={spec.experiment.ranks}",
        f"ELEMENT_DONE={int(done)}",
        f"ELEMENT_OUT={shlex.quote(str(out))}",
        "ELEMENT_TRAIN_ARGS=(" + " ".join(shlex.quote(a) for a in args) + ")",
    ]) + "\n"


# ---- command line ---------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--plan", required=True, help="the study's TOML plan (e.g. benchmarks/learning_atari.toml)")
        p.add_argument("--out", help="study directory (default: <run root>/learning/<plan name>)")
        p.add_argument("--run-root", default="runs", help="parent of learning/<plan name> (default: runs)")

    run = sub.add_parser("run", help="train every (experiment, seed) not yet completed, then report")
    common(run)
    run.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                     help="config override for every run (after the plan's)")
    run.add_argument("--only", nargs="+", default=[], metavar="EXPERIMENT", help="train only these experiments")
    run.add_argument("--dry-run", action="store_true", help="print what would be launched")
    report = sub.add_parser("report", help="write the report from whatever the runs have written so far")
    common(report)
    report.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="the overrides the runs were given on the command line, if any")
    report.add_argument("--references", help="reference-points TOML (default: benchmarks/reference/...)")
    element = sub.add_parser("element", help="bash assignments for one SLURM array element")
    common(element)
    element.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    element.add_argument("--index", type=int, required=True, help="SLURM_ARRAY_TASK_ID")
    count = sub.add_parser("count", help="print the number of (experiment, seed) elements")
    count.add_argument("--plan", required=True)

    args = parser.parse_args(argv)
    try:
        plan = load_plan(args.plan)
        if args.command == "count":
            print(sum(len(e.seeds) for e in plan.experiments))
            return 0
        out = Path(args.out).resolve() if args.out else plan.default_out(args.run_root)
        if args.command == "run":
            return run_study(plan, out, args.set, args.only, args.dry_run)
        if args.command == "report":
            print(write_report(plan, out, args.references, args.set))
            return 0
        sys.stdout.write(element_shell(plan, out, args.set, args.index))
        return 0
    except PlanError as exc:
        print(f"learning.py: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
