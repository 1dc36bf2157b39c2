"""`hvd-rl sweep status` and `hvd-rl sweep report`: what a researcher reads of a study.

report/ in the study directory:
  report.md                  best trial, the table of all trials, the plots, the seed study if run
  best.toml                  the best trial's full config, ready for `hvd-rl train --config`
  trials.csv                 number, state, value, params, wall seconds, SPS, why it failed
  history.png                optimisation history (Optuna's plot)
  importances.png            parameter importances (Optuna's fANOVA), with 2+ complete trials
  parallel.png               parallel coordinates of the parameters against the value
  curves.png                 the learning curves (episodic return) of the top trials
"""
from __future__ import annotations

import csv
import json
import time
from pathlib import Path
from typing import Any

from optuna.trial import FrozenTrial, TrialState

from hvd_rl.cluster.sweeps.storage import Study, origin_number
from hvd_rl.cluster.sweeps.worker import run_name
from hvd_rl.runtime.metrics import read_jsonl

REPORT_DIR = "report"
TOP_CURVES = 5


def status_lines(study: Study) -> list[str]:
    counts = study.counts()
    finished = counts["complete"] + counts["pruned"]
    lines = [f"study {study.spec.name!r} ({study.dir}): {finished}/{study.spec.trials} finished "
             f"({counts['complete']} complete, {counts['pruned']} pruned), {counts['running']} running, "
             f"{counts['waiting']} waiting, {counts['fail']} failed"]
    now = time.time()
    for trial in study.trials():
        if trial.state == TrialState.RUNNING:
            age = now - trial.datetime_start.timestamp() if trial.datetime_start else 0
            last = max(trial.intermediate_values) if trial.intermediate_values else None
            lines.append(f"  running: trial {trial.number} for {age:.0f} s, last report "
                         f"{'none' if last is None else f'{trial.intermediate_values[last]:.4g} at report {last}'}")
        elif trial.state == TrialState.FAIL and "failed_because" in trial.user_attrs:
            lines.append(f"  failed: trial {trial.number}: {trial.user_attrs['failed_because']}")
    best = _best(study)
    if best is not None:
        lines.append(f"best: trial {best.number}, value {best.value:.4g}, {json.dumps(best.params)}")
    return lines


def _best(study: Study) -> FrozenTrial | None:
    complete = study.trials((TrialState.COMPLETE,))
    return max(complete, key=lambda t: t.value) if complete else None


def best_config_toml(study: Study, trial: FrozenTrial) -> str:
    spec = study.spec
    env_id, seed = spec.runs()[0]
    cfg = spec.base_config(spec.run_overrides(trial.params, env_id, seed))
    cfg.run_dir = f"runs/{spec.name}-best"
    header = (f"# Best trial of sweep {spec.name!r}: trial {trial.number}, objective {trial.value:.6g}\n"
              f"# from {spec.config} with {json.dumps(trial.params)}\n")
    return header + cfg.to_toml()


def _rows(study: Study) -> list[dict[str, Any]]:
    rows = []
    for t in study.trials():
        wall = t.user_attrs.get("wall_seconds")
        rows.append({"number": t.number, "state": t.state.name.lower(), "value": t.value,
                     "retry_of": t.system_attrs.get("failed_trial"), **{f"param:{k}": v for k, v in t.params.items()},
                     "wall_seconds": round(wall, 1) if wall else None, "sps": t.user_attrs.get("sps"),
                     "reports": len(t.intermediate_values), "failed_because": t.user_attrs.get("failed_because", "")})
    return rows


def _plots(study: Study, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from optuna.visualization import matplotlib as ov

    made = []
    complete = study.trials((TrialState.COMPLETE,))
    plots = [("history.png", ov.plot_optimization_history, 1), ("importances.png", ov.plot_param_importances, 2),
             ("parallel.png", ov.plot_parallel_coordinate, 2)]
    for name, plot, needed in plots:
        if len(complete) < needed:
            continue
        try:
            ax = plot(study.optuna)
        except (ValueError, RuntimeError, ZeroDivisionError) as exc:  # e.g. one distinct value only
            print(f"[sweep report] {name}: not drawn ({exc})")
            continue
        fig = ax.figure if hasattr(ax, "figure") else ax.flat[0].figure
        fig.set_size_inches(8, 4.5)
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
        made.append(name)
    top = sorted(complete, key=lambda t: t.value, reverse=True)[:TOP_CURVES]
    if top:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        env_id, seed = study.spec.runs()[0]
        for t in top:
            run_dir = study.trial_dir(origin_number(t)) / run_name(env_id, seed)
            rows = read_jsonl(run_dir / "episodes.jsonl")
            if rows:
                window = study.spec.objective.last_episodes
                returns = [r["return"] for r in rows]
                smooth = [sum(returns[max(0, i - window + 1):i + 1]) / len(returns[max(0, i - window + 1):i + 1])
                          for i in range(len(returns))]
                ax.plot([r["global_step"] for r in rows], smooth, label=f"trial {t.number}: {t.value:.4g}")
        ax.set_xlabel("global env steps")
        ax.set_ylabel(f"episodic return (mean of last {study.spec.objective.last_episodes})")
        ax.set_title(f"{study.spec.name}: top {len(top)} trials, {env_id} seed {seed}")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "curves.png", dpi=100)
        plt.close(fig)
        made.append("curves.png")
    return made


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def write_report(study: Study) -> Path:
    out = study.dir / REPORT_DIR
    out.mkdir(exist_ok=True)
    rows = _rows(study)
    keys = list(dict.fromkeys(k for row in rows for k in row))
    with open(out / "trials.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)
    best = _best(study)
    spec = study.spec
    lines = [f"# Sweep `{spec.name}`", "", spec.description, "",
             f"Base config `{spec.config}`, {spec.ranks} rank(s) per trial, runs per trial: "
             f"{', '.join(f'{e} seed {s}' for e, s in spec.runs())}; objective: mean of the last "
             f"{spec.objective.last_episodes} episodic returns{' (normalised per env)' if spec.objective.normalize else ''}; "
             f"sampler {spec.sampler}, pruner {spec.pruner}.", "", *status_lines(study)[:1], ""]
    if best is not None:
        (out / "best.toml").write_text(best_config_toml(study, best))
        lines += [f"**Best: trial {best.number}, objective {best.value:.4g}** with "
                  + ", ".join(f"`{k} = {v:.4g}`" if isinstance(v, float) else f"`{k} = {v}`"
                              for k, v in best.params.items()) + " ([best.toml](best.toml)).", ""]
    plots = _plots(study, out)
    lines += [f"![{name}]({name})" for name in plots] + [""]
    shown = [k for k in keys if k not in ("failed_because",)]
    lines += ["| " + " | ".join(k.removeprefix("param:") for k in shown) + " |",
              "|" + " --- |" * len(shown)]
    lines += ["| " + " | ".join(_cell(row.get(k)) for k in shown) + " |" for row in rows]
    failed = [row for row in rows if row["failed_because"]]
    if failed:
        lines += ["", "Failed trials:", ""] + [f"- trial {row['number']}: {row['failed_because']}" for row in failed]
    seeds = out / "seeds.md"
    if seeds.exists():
        lines += ["", "#" + seeds.read_text()]  # its title one level down
    (out / "report.md").write_text("\n".join(lines) + "\n")
    return out / "report.md"

