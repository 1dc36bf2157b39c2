"""`hvd-rl sweep seeds`: the best trial's config on N fresh seeds, against the sweep's base config
(the defaults) on the same seeds, reported the way rliable reports Atari results.

The seeds start at 1000 by default, away from the seeds the trials were chosen on: the best
trial's own score is biased upwards (it won a selection), fresh seeds are not. Runs live in
<study>/seeds/<best|defaults>/<env>-seed<S>/, each `hvd-rl train --resume auto`, so rerunning the
command continues an interrupted seed study. Writes report/seeds.{md,json,png} (and report.md
picks seeds.md up).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from hvd_rl.analysis.aggregate import iqm_interval
from hvd_rl.analysis.learning import load_references
from hvd_rl.cluster.sweeps.report import REPORT_DIR, _best, best_config_toml
from hvd_rl.cluster.sweeps.spec import SweepError
from hvd_rl.cluster.sweeps.storage import Study
from hvd_rl.cluster.sweeps.worker import (EXIT_PREEMPTED, WorkerSignals, episode_returns, mean_last, run_name,
                                          start_train)


def _train(run_dir: Path, overrides: list[str], ranks: int, launcher: str,
           signals: WorkerSignals, config: Path) -> int:
    proc = start_train(launcher, ranks, config, run_dir, overrides)
    signals.run_dir = run_dir
    code = proc.wait()
    signals.run_dir = None
    return code


def run_seed_study(study: Study, seeds: int, first_seed: int, ranks: int | None, launcher: str,
                   with_defaults: bool = True) -> Path:
    spec = study.spec
    best = _best(study)
    if best is None:
        raise SweepError(f"{study.dir}: no complete trial yet: run workers first")
    ranks = ranks or spec.ranks
    labels: dict[str, dict[str, Any]] = {"best": best.params}
    if with_defaults:
        labels["defaults"] = {}
    signals = WorkerSignals()
    signals.install()
    out = study.dir / REPORT_DIR
    out.mkdir(exist_ok=True)
    (out / "best.toml").write_text(best_config_toml(study, best))
    results: dict[str, dict[str, Any]] = {}
    for label, params in labels.items():
        scores, per_seed = [], {}
        for seed in range(first_seed, first_seed + seeds):
            env_scores = []
            for env_id in spec.env_ids():
                run_dir = study.dir / "seeds" / label / run_name(env_id, seed)
                code = _train(run_dir, spec.run_overrides(params, env_id, seed), ranks, launcher, signals,
                              spec.config_path)
                if code == EXIT_PREEMPTED or (run_dir / "preempted.json").exists() or signals.requested:
                    raise SystemExit(EXIT_PREEMPTED)  # checkpointed: rerunning the command resumes
                if code != 0:
                    raise SweepError(f"seed study run {run_dir} exited {code}: see {run_dir}.log")
                value = mean_last(episode_returns(run_dir), spec.objective.last_episodes)
                if value is None:
                    raise SweepError(f"seed study run {run_dir}: no episode finished")
                env_scores.append(spec.objective.score(env_id, value))
            per_seed[seed] = sum(env_scores) / len(env_scores)
            scores.append(per_seed[seed])
        values = np.asarray(scores, np.float64)
        point, low, high = iqm_interval([values[i:i + 1] for i in range(len(values))])
        results[label] = {"params": params, "per_seed": per_seed, "mean": float(values.mean()),
                          "std": float(values.std(ddof=1)) if len(values) > 1 else 0.0,
                          "iqm": point, "iqm_low": low, "iqm_high": high}
    references = _references(spec)
    (out / "seeds.json").write_text(json.dumps({"seeds": list(range(first_seed, first_seed + seeds)), "ranks": ranks,
                                                "best_trial": best.number, "results": results,
                                                "references": references}, indent=1) + "\n")
    _plot(spec, results, references, out / "seeds.png")
    (out / "seeds.md").write_text(_markdown(spec, best.number, results, references, seeds, first_seed))
    return out / "seeds.md"


def _references(spec) -> list[dict[str, Any]]:
    """Published end points on the sweep's env and algorithm (CleanRL's tables), if any."""
    if len(spec.env_ids()) != 1:
        return []
    cfg = spec.base_config()
    refs = load_references().for_run(cfg.algorithm, spec.env_ids()[0])
    out = []
    for ref in refs:
        if ref.points:
            end = ref.points[-1]
            out.append({"label": ref.label, "step": end.step, "value": end.value, "source": ref.source})
    return out


def _plot(spec, results: dict, references: list, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for i, (label, r) in enumerate(results.items()):
        values = list(r["per_seed"].values())
        ax.scatter([i] * len(values), values, alpha=0.6, label=f"{label}: seeds")
        ax.errorbar([i + 0.15], [r["iqm"]], yerr=[[r["iqm"] - r["iqm_low"]], [r["iqm_high"] - r["iqm"]]],
                    fmt="s", capsize=5, label=f"{label}: IQM, 95% CI")
    for ref in references:
        ax.axhline(ref["value"], ls="--", color="grey", label=f"{ref['label']} ({ref['step']:,} steps)")
    ax.set_xticks(range(len(results)), list(results))
    ax.set_ylabel(f"mean of the last {spec.objective.last_episodes} episodic returns")
    ax.set_title(f"{spec.name}: seed study")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _markdown(spec, best_number: int, results: dict, references: list, seeds: int, first_seed: int) -> str:
    lines = [f"# Seed study: {seeds} seeds ({first_seed}-{first_seed + seeds - 1}, not the trials' seeds)", "",
             "| config | mean | std | IQM [95% CI] | per seed |", "| --- | --- | --- | --- | --- |"]
    for label, r in results.items():
        name = f"best (trial {best_number})" if label == "best" else "defaults (the sweep's base config)"
        per = ", ".join(f"{v:.4g}" for v in r["per_seed"].values())
        lines.append(f"| {name} | {r['mean']:.4g} | {r['std']:.3g} | {r['iqm']:.4g} [{r['iqm_low']:.4g}, "
                     f"{r['iqm_high']:.4g}] | {per} |")
    for ref in references:
        lines.append(f"\nReference: {ref['label']}: {ref['value']:.4g} at {ref['step']:,} steps ({ref['source']}).")
    lines += ["", "![seed study](seeds.png)", ""]
    return "\n".join(lines)
