"""The multi-agent benchmark (issue 34): MAPPO against IPPO against simple policies, from a
learning study's runs (benchmarks/learning.py, plans learning_spread.toml and
learning_intersection.toml).

    python benchmarks/learning.py run --plan benchmarks/learning_spread.toml
    python benchmarks/multiagent.py --plan benchmarks/learning_spread.toml --out benchmarks/results/multiagent

For each experiment (an algorithm on a task, over seeds): the final score of a seed is the mean
team return of its last 100 training episodes (CleanRL's statistic, as the learning report); the
experiment's score is the interquartile mean (IQM, rliable's statistic) of every seed's last 100
episodes pooled, with a 95% confidence interval from a two-level bootstrap (seeds resampled, then
episodes within each), so the interval carries the spread between seeds, which with 3 seeds is
most of the uncertainty. Task statistics (collision and arrival rates) are averaged over the same
last iterations. Baselines play the same task in one process: `random` (uniform actions) and, for
the intersection, `idle` (every vehicle keeps its speed: highway-env's IDLE action) and
`staggered`, a hand-written coordination to show what is reachable: vehicle i brakes for its first
2i+1 decisions, then accelerates, so the four cross one after another (it knows the clock and
its index; a learned policy sees neither, only the vehicles around it). Each over
--baseline-episodes episodes with the IQM and the same kind of interval.

Writes <out>/<plan name>.json, .md (the table) and .png (mean curves over seeds, min-max bands,
the baselines as lines).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hvd_rl.analysis.aggregate import iqm_interval  # noqa: E402
from hvd_rl.analysis.learning import LAST_N, aggregate, games, run_curve, run_stats  # noqa: E402
from hvd_rl.analysis.study import load_plan  # noqa: E402
from hvd_rl.envs.multiagent import make_multiagent_envs  # noqa: E402
from hvd_rl.runtime.metrics import read_jsonl  # noqa: E402

SLOWER, IDLE, FASTER = 0, 1, 2  # highway-env's DiscreteMetaAction speed commands


def play_baseline(env_id: str, num_agents: int, max_steps: int, policy: str, episodes: int,
                  seed: int = 10_000) -> dict:
    """Team returns (and statistics) of a simple policy over `episodes` episodes, 8 environments."""
    envs = make_multiagent_envs(env_id, 8, num_agents, max_steps)
    rng = np.random.default_rng(seed)
    space = envs.spec.action_space
    finished = []
    try:
        envs.reset(list(range(seed, seed + 8)))
        shape = (envs.num_envs, envs.spec.num_agents)
        clock = np.zeros(envs.num_envs, int)  # decisions since each environment's reset
        start_after = 2 * np.arange(envs.spec.num_agents) + 1
        while len(finished) < episodes:
            if policy == "idle":
                actions = np.full(shape, IDLE)
            elif policy == "staggered":
                actions = np.where(clock[:, None] < start_after[None, :], SLOWER, FASTER)
            elif hasattr(space, "n"):
                actions = rng.integers(0, space.n, shape)
            else:
                actions = rng.uniform(space.low, space.high, shape + space.shape).astype(np.float32)
            ended = envs.step(actions).episodes
            clock += 1
            for episode in ended:
                clock[episode.env] = 0
            finished.extend(ended)
    finally:
        envs.close()
    finished = finished[:episodes]
    returns = np.array([e.team_return for e in finished])
    point, low, high = iqm_interval([returns])  # one group: an episode bootstrap
    names = sorted({k for e in finished for k in e.stats})
    return {"policy": policy, "episodes": len(finished), "iqm": point, "ci": [low, high],
            "mean": float(returns.mean()),
            **{name: float(np.mean([e.stats[name] for e in finished])) for name in names}}


def experiment_result(exp, specs: list) -> dict:
    seeds, curves, tails = [], [], []
    for spec in specs:
        _, returns, _ = games(spec.run_dir)
        if not len(returns):
            continue
        curve = run_curve(spec.run_dir)
        st = run_stats(spec.run_dir, exp.steps)
        rows = [r for r in read_jsonl(spec.run_dir / "metrics.jsonl") if r.get("episodes")]
        last = rows[-max(1, len(rows) // 10):]  # the last tenth of the iterations
        rates = {k: float(np.mean([r[k] for r in last if r.get(k) is not None]))
                 for k in ("collision_rate", "arrival_rate", "collisions_per_episode") if rows and k in rows[-1]}
        seeds.append({"seed": spec.seed, "status": st.status, "global_step": st.global_step,
                      "final": curve.final, "sps": st.sps, **rates})
        curves.append(curve)
        tails.append(returns[-LAST_N:])
    result = {"experiment": exp.name, "algorithm": exp.algorithm, "env": exp.env, "steps": exp.steps,
              "ranks": exp.ranks, "seeds": seeds}
    if tails:
        point, low, high = iqm_interval(tails)
        result.update(iqm=point, ci=[low, high],
                      mean_of_seed_finals=float(np.mean([s["final"] for s in seeds])),
                      sps=float(np.median([s["sps"] for s in seeds if s["sps"]])))
        for k in ("collision_rate", "arrival_rate", "collisions_per_episode"):
            if all(k in s for s in seeds):
                result[k] = float(np.mean([s[k] for s in seeds]))
    result["_curves"] = curves
    return result


def plot(results: list[dict], baselines: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in results:
        agg = aggregate(r["_curves"])
        if agg is None:
            continue
        line, = ax.plot(agg.steps, agg.mean, label=f"{r['experiment']} ({agg.seeds} seeds)")
        ax.fill_between(agg.steps, agg.low, agg.high, color=line.get_color(), alpha=0.2)
    for b, style in zip(baselines, (":", "--", "-.")):
        ax.axhline(b["mean"], color="grey", linestyle=style, label=f"{b['policy']} policy (mean)")
    ax.set_xlabel("global environment steps")
    ax.set_ylabel(f"team return (mean of last {LAST_N} episodes)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(plan_name: str, results: list[dict], baselines: list[dict]) -> str:
    lines = [f"# {plan_name}", "",
             f"Team return: IQM of every seed's last {LAST_N} training episodes pooled, 95% CI by a two-level "
             "bootstrap (seeds, then episodes); baselines: IQM over their episodes (episode bootstrap).", "",
             "| policy | seeds | steps | IQM | 95% CI | mean of seed finals | rates (last tenth of iterations) | SPS (median) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "iqm" not in r:
            lines.append(f"| {r['experiment']} | 0 | {r['steps']:,} | not run | | | | |")
            continue
        rates = ", ".join(f"{k} {r[k]:.3f}" for k in ("collision_rate", "arrival_rate", "collisions_per_episode")
                          if k in r) or "—"
        partial = "" if all(s["status"] == "completed" for s in r["seeds"]) else " (partial)"
        lines.append(f"| {r['experiment']} ({r['algorithm']}) | {len(r['seeds'])}{partial} | "
                     f"{min(s['global_step'] for s in r['seeds']):,} | {r['iqm']:.2f} | "
                     f"[{r['ci'][0]:.2f}, {r['ci'][1]:.2f}] | {r['mean_of_seed_finals']:.2f} | {rates} | {r['sps']:.0f} |")
    for b in baselines:
        rates = ", ".join(f"{k} {b[k]:.3f}" for k in ("collision_rate", "arrival_rate", "collisions") if k in b) or "—"
        lines.append(f"| {b['policy']} policy | — | {b['episodes']} episodes | {b['iqm']:.2f} | "
                     f"[{b['ci'][0]:.2f}, {b['ci'][1]:.2f}] | {b['mean']:.2f} | {rates} | — |")
    lines.append("")
    lines.append("Per seed: " + "; ".join(
        f"{r['experiment']} " + ", ".join(f"seed {s['seed']} {s['final']:.2f}" for s in r["seeds"])
        for r in results if r["seeds"]))
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plan", required=True)
    parser.add_argument("--study", help="the study directory (default: runs/learning/<plan name>)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "multiagent"))
    parser.add_argument("--baseline-episodes", type=int, default=400)
    args = parser.parse_args()
    plan = load_plan(args.plan)
    study = Path(args.study) if args.study else plan.default_out()
    runs = plan.runs(study)
    results = [experiment_result(exp, [r for r in runs if r.experiment is exp]) for exp in plan.experiments]
    first = plan.experiments[0]
    from hvd_rl.config import load_config

    cfg = load_config(first.config_path, list(first.overrides))
    env_id = first.env or cfg.env.id
    policies = ["random", "idle", "staggered"] if env_id.startswith("highway/") else ["random"]
    baselines = [play_baseline(env_id, cfg.multiagent.num_agents, cfg.env.max_episode_steps, p,
                               args.baseline_episodes) for p in policies]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plot(results, baselines, out / f"{plan.name}.png", f"{plan.name}: {env_id}, {first.ranks} ranks")
    text = markdown(plan.name, results, baselines)
    (out / f"{plan.name}.md").write_text(text)
    for r in results:
        r.pop("_curves")
    (out / f"{plan.name}.json").write_text(json.dumps({"plan": str(Path(args.plan)), "env": env_id,
                                                       "results": results, "baselines": baselines}, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
