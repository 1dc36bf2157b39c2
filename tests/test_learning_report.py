"""Learning benchmark: curves, seed statistics, references and the report on synthetic runs; the
plan parser; resumability on a real tiny CartPole study; a SLURM array element run without SLURM."""
import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from conftest import BIN, CARTPOLE, PYTHON, REPO, check, finish, launch_env, read_jsonl, run, start, wait_for_iterations
from hvd_rl.analysis.learning import Curve, aggregate, load_references, run_curve
from hvd_rl.analysis.study import PlanError, load_plan, parse_plan

SCRIPT = REPO / "benchmarks" / "learning.py"
_spec = importlib.util.spec_from_file_location("learning_benchmark", SCRIPT)
bench = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = bench  # dataclasses look their module up there
_spec.loader.exec_module(bench)

ATARI_CLEANRL = REPO / "configs" / "atari_ppo_cleanrl.toml"


def fake_run(run_dir: Path, games: list[list[float]], batch: int = 1000, completed: bool = True,
             episodes_file: bool = True, seconds: float = 2.0) -> None:
    """A run directory as rank 0 writes it: one list of finished-game returns per iteration."""
    run_dir.mkdir(parents=True)
    metrics, episodes = [], []
    for i, returns in enumerate(games, start=1):
        step = i * batch
        metrics.append({"iteration": i, "global_step": step, "world_size": 2, "sps": batch / seconds,
                        "time_iteration": seconds, "episodes": len(returns),
                        "episodic_return_mean": float(np.mean(returns)) if returns else None})
        episodes += [{"global_step": step, "return": r, "length": 100} for r in returns]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))
    if episodes_file:
        (run_dir / "episodes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in episodes))
    if completed:
        (run_dir / "summary.json").write_text(json.dumps({
            "status": "completed", "global_step": len(games) * batch, "wall_seconds": len(games) * seconds + 5,
            "world_size": 2, "topology": {"ranks": 2}}))


# ---- curves ---------------------------------------------------------------------------------

def test_last_100_games_smoothing_matches_a_hand_computation(tmp_path):
    # 15 iterations of 10 games scoring 0, 1, ..., 149 in order; iteration 6 finishes none
    games = [[float(10 * i + j) for j in range(10)] for i in range(15)]
    games.insert(5, [])
    fake_run(tmp_path / "run", games)
    curve = run_curve(tmp_path / "run")
    assert curve.source == "episodes.jsonl" and curve.games == 150
    assert 6000 not in curve.steps.tolist()  # no game finished there: the curve holds its value
    at = dict(zip(curve.steps.tolist(), curve.values.tolist()))
    assert at[1000] == pytest.approx(np.mean(range(10)))  # fewer than 100 games: all of them
    assert at[5000] == pytest.approx(np.mean(range(50)))  # 24.5
    assert at[13000] == pytest.approx(np.mean(range(20, 120)))  # 120 games done: the last 100
    assert at[16000] == pytest.approx(99.5)
    assert curve.final == pytest.approx(np.mean(range(50, 150))) and curve.final_games == 100


def test_without_episodes_file_iterations_count_as_their_games(tmp_path):
    fake_run(tmp_path / "old", [[10.0] * 60, [], [20.0] * 60], episodes_file=False)
    curve = run_curve(tmp_path / "old")
    assert curve.source.startswith("metrics.jsonl")
    assert curve.steps.tolist() == [1000, 3000]
    # the last 100 games: 40 of the first iteration's 60 and all 60 of the third
    assert curve.values.tolist() == pytest.approx([10.0, (40 * 10 + 60 * 20) / 100])
    assert curve.final == pytest.approx(16.0) and curve.games == 120


def test_mean_and_min_max_over_seeds_where_all_seeds_have_values():
    def curve(steps, values):
        return Curve(np.array(steps), np.array(values, dtype=float), len(steps), values[-1], len(steps), "test")

    a = curve([1000, 2000, 3000, 4000], [1, 2, 3, 4])
    b = curve([2000, 3000, 5000], [10, 20, 30])  # first game only at 2000
    c = curve([1000, 2500], [5, 7])  # still running: reached 2500
    agg = aggregate([a, b, c])
    assert agg.seeds == 3 and agg.steps.tolist() == [2000, 2500]
    assert agg.mean.tolist() == pytest.approx([(2 + 10 + 5) / 3, (2 + 10 + 7) / 3])
    assert agg.low.tolist() == [2, 2] and agg.high.tolist() == [10, 10]
    full = aggregate([a, b])
    assert full.steps.tolist() == [2000, 3000, 4000]
    assert full.mean.tolist() == pytest.approx([6, 11.5, 12]) and full.high.tolist() == [10, 20, 20]
    assert aggregate([Curve(np.zeros(0), np.zeros(0), 0, None, 0, "none")]) is None  # no games yet


# ---- the report -----------------------------------------------------------------------------

REPORT_PLAN = f"""
name = "synthetic"
config = "{ATARI_CLEANRL}"
ranks = 2
global_envs = 8
steps = 2_000_000
seeds = [1, 2, 3]

[[experiment]]
name = "breakout"
env = "ALE/Breakout-v5"
acceptance = {{ mean_at_least = 16.0, each_above = 10.0 }}

[[experiment]]
name = "pong"
env = "ALE/Pong-v5"
seeds = [1]
"""


def test_report_marks_partial_runs_places_references_and_writes_png_and_markdown(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plan = parse_plan(REPORT_PLAN, tmp_path / "plan.toml")
    out = tmp_path / "study"
    batch = 100_000
    # seed 1: 120 games per 20 iterations scoring 1..20 by iteration; seed 2 the same plus 4;
    # seed 3 stopped (interrupted) at 1M steps
    fake_run(out / "breakout" / "seed1", [[float(i)] * 6 for i in range(1, 21)], batch=batch)
    fake_run(out / "breakout" / "seed2", [[float(i + 4)] * 6 for i in range(1, 21)], batch=batch)
    fake_run(out / "breakout" / "seed3", [[float(i)] * 6 for i in range(1, 11)], batch=batch, completed=False)
    (out / bench.LAUNCHES_FILE).write_text(json.dumps({"run": "breakout/seed3", "started": 0, "seconds": 30.0,
                                                       "exit_code": 75, "command": []}) + "\n")
    report = bench.write_report(plan, out)

    data = json.loads((out / "report" / "report.json").read_text())
    breakout, pong = data["experiments"]
    seeds = {r["seed"]: r for r in breakout["runs"]}
    # last 100 games of 120: iterations 4..20 scoring 4 (4 of its 6 games) and 5..20 (all 6)
    expected1 = (4 * 4 + sum(6 * i for i in range(5, 21))) / 100
    assert seeds[1]["final_return"] == pytest.approx(expected1)
    assert seeds[2]["final_return"] == pytest.approx(expected1 + 4)
    assert seeds[3]["final_return"] == pytest.approx(sum(6 * i for i in range(1, 11)) / 60)
    assert seeds[3]["status"] == "partial" and seeds[3]["global_step"] == 1_000_000
    assert seeds[1]["status"] == "completed" and seeds[1]["sps"] == pytest.approx(batch / 2.0)
    assert breakout["final_mean"] == pytest.approx(np.mean([expected1, expected1 + 4, 5.5]))
    assert breakout["aggregate"]["steps"][-1] == 1_000_000  # the mean stops where seed 3 stopped
    assert breakout["batch"] == {"ranks": 2, "envs_per_rank": 4, "steps_per_env": 128}
    assert breakout["acceptance"] == [
        {"criterion": "mean over seeds of the last-100-games return >= 16", "passed": False},
        {"criterion": "every seed > 10", "passed": False}]
    curve_ref = next(r for r in breakout["references"] if r["key"] == "cleanrl-ppo_atari-curve-breakout")
    assert [(p["step"], p["value"], p["lower"], p["upper"], p["drawn"]) for p in curve_ref["points"]] == [
        (1_000_000, 19.3, 16.0, 22.0, True), (2_000_000, 48.8, 34.0, 68.0, True),
        (5_000_000, 203.0, 138.0, 269.0, False), (10_000_000, 412.0, 379.0, 452.0, False)]
    assert pong["runs"][0]["status"] == "not started" and pong["final_mean"] is None

    text = report.read_text()
    assert "| 3 | **partial**: 1,000,000 of 2,000,000 steps (50%), interrupted |" in text
    assert "| 1 | completed | 2,000,000 | 120 |" in text and "| 1 | not started |" in text
    assert "| CleanRL ppo_atari.py, curve (3 seeds) | 1,000,000 | 19.3 | 16 to 22 | yes |\n" in text
    assert "| CleanRL ppo_atari.py, curve (3 seeds) | 5,000,000 | 203 | 138 to 269 | no (beyond this study's steps) |" in text
    assert "| CleanRL ppo_atari.py, final table (3 seeds) | 10,000,000 | 414.66 | ± 28.09 |" in text
    assert "48.8 (34 to 68) [CleanRL ppo_atari.py, curve (3 seeds)]" in text  # the summary, at 2M steps
    assert "- CleanRL ppo_atari.py, curve (3 seeds): read off the learning-curve figure" in text
    assert "Source: <https://docs.cleanrl.dev/rl-algorithms/ppo/#ppo_ataripy>" in text
    assert "| mean | 3 seeds (1 partial) | | | **" in text and "PASS" not in text
    assert "Acceptance (provisional: not every seed has completed)" in text and "**MISS**" in text
    for png in ("breakout.png", "pong.png", "overview.png"):
        assert (out / "report" / png).stat().st_size > 10_000
    assert "![breakout](breakout.png)" in text and "![all experiments](overview.png)" in text

    # What the plot draws: the partial seed dashed and labelled, references at their points.
    result = bench.collect(plan, out, load_references())[0]
    fig, ax = plt.subplots()
    bench.plot_experiment(ax, result)
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert lines["seed 3 (partial: 50%)"].get_linestyle() == "--" and lines["seed 1"].get_linestyle() == "-"
    assert lines["mean over seeds"].get_xdata()[-1] == 1_000_000
    bars = {c.get_label(): c for c in ax.containers}
    xs, ys = bars["CleanRL ppo_atari.py, curve (3 seeds)"].lines[0].get_data()
    assert list(ys) == [19.3, 48.8] and np.allclose(xs, [1e6, 2e6], rtol=0.05)
    assert "CleanRL ppo_atari.py, final table (3 seeds)" not in bars  # 10M only: beyond 2M
    assert ax.get_xlim()[1] >= 2_000_000
    plt.close(fig)


# ---- plans ----------------------------------------------------------------------------------

GOOD = f"""
name = "p"
config = "{CARTPOLE}"
steps = 1000
[[experiment]]
name = "x"
"""


@pytest.mark.parametrize("text, message", [
    ("name = ", "invalid TOML"),
    (f'name = "p"\nconfig = "{CARTPOLE}"\nsteps = 1', "no [[experiment]] tables"),
    (GOOD + "seed = 3\n", "experiment 1: unknown key 'seed'"),
    ("step = 5\n" + GOOD, "unknown key 'step'"),
    (GOOD + "seeds = [1, 1]\n", "seeds must be a non-empty list of distinct integers"),
    (GOOD.replace("steps = 1000", ""), "steps (global env steps per run) is missing"),
    (GOOD.replace("steps = 1000", "steps = 0"), "steps must be a positive integer, got 0"),
    (GOOD + "ranks = 3\nglobal_envs = 8\n", "global_envs = 8 does not split over 3 ranks"),
    (GOOD + 'overrides = ["seed=2"]\n', "seed is set by the plan (seeds)"),
    (GOOD + 'overrides = ["ppo.total_timesteps=5"]\n', "ppo.total_timesteps is set by the plan (steps)"),
    (GOOD + 'overrides = ["nonsense"]\n', "expected 'section.key=value'"),
    (GOOD + 'env = "CartPole-v1"\noverrides = ["env.id=x"]\n', "set either env or an env.id override"),
    (GOOD + 'config = "configs/nope.toml"\n', "config file not found"),
    (GOOD + '[[experiment]]\nname = "x"\n', "two experiments are named 'x'"),
    (GOOD.replace('name = "x"', 'name = "a b"'), "name must be letters"),
    (GOOD + "acceptance = { mean = 3 }\n", "unknown key 'mean'"),
])
def test_plan_parser_rejects_bad_plans_with_one_clear_error(text, message):
    with pytest.raises(PlanError) as info:
        parse_plan(text, "bad.toml")
    assert message in str(info.value) and str(info.value).startswith("plan bad.toml")
    assert "\n" not in str(info.value)


def test_plan_defaults_overrides_and_launch_line():
    plan = parse_plan(GOOD + 'env = "CartPole-v1"\nseeds = [4, 5]\nranks = 2\nglobal_envs = 4\n'
                      'overrides = ["ppo.num_steps=64"]\n', "ok.toml")
    (exp,) = plan.experiments
    assert exp.num_envs == 2 and exp.seeds == (4, 5) and exp.steps == 1000
    spec = plan.runs(Path("/tmp/study"))[1]
    assert spec.run_dir == Path("/tmp/study/x/seed5") and spec.label == "x/seed5"
    assert spec.command(Path("/venv/bin")) == [
        "mpirun", "-np", "2", "--oversubscribe", "/venv/bin/hvd-rl", "train", "--config", str(CARTPOLE),
        "--run-dir", "/tmp/study/x/seed5", "--resume", "auto", "--set", "ppo.num_steps=64", "--set", "seed=5",
        "--set", "ppo.total_timesteps=1000", "--set", 'env.id="CartPole-v1"', "--set", "env.num_envs=2"]
    one = parse_plan(GOOD, "one.toml").runs(Path("/s"))[0]
    assert one.command(Path("/v"))[:2] == ["/v/hvd-rl", "train"]  # one rank: no mpirun


def test_multiagent_plans_say_which_trainer_runs_and_own_the_algorithm():
    """MAPPO and IPPO share a config: the plan's algorithm is set on the run, PPO's step budget
    counts, and an override of the algorithm is refused."""
    spread = REPO / "configs" / "mpe_spread_mappo.toml"
    text = f'name = "m"\nconfig = "{spread}"\nsteps = 640\n[[experiment]]\nname = "i"\nalgorithm = "ippo"\n'
    (spec,) = parse_plan(text, "m.toml").runs(Path("/s"))
    assert spec.command(Path("/v"))[-4:] == ["--set", "ppo.total_timesteps=640", "--set", "algorithm=ippo"]
    with pytest.raises(PlanError, match="algorithm is set by the plan"):
        parse_plan(text.replace('name = "i"', 'name = "i"\noverrides = ["algorithm=mappo"]'), "m.toml")


def test_shipped_plans_presets_and_references_fit_together():
    from hvd_rl.config import load_config

    refs = load_references()
    for ref in refs.references:
        assert ref.source.startswith("https://") and ref.obtained and ref.points and ref.envs, ref.key
    curve = next(r for r in refs.for_run("ppo", "ALE/Breakout-v5") if r.key == "cleanrl-ppo_atari-curve-breakout")
    assert [(p.step, p.value, p.low, p.high) for p in curve.points] == [
        (1_000_000, 19.3, 16, 22), (2_000_000, 48.8, 34, 68), (5_000_000, 203, 138, 269), (10_000_000, 412, 379, 452)]
    table = {r.key: r.points[0] for r in refs.references if len(r.points) == 1}
    assert (table["cleanrl-ppo_atari-table-breakout"].value, table["cleanrl-ppo_atari-table-breakout"].std) == (414.66, 28.09)
    assert (table["cleanrl-ppo_atari-table-pong"].value, table["cleanrl-ppo_atari-table-pong"].std) == (20.36, 0.20)
    assert table["cleanrl-dqn_atari-table-breakout"].value == 366.928
    assert refs.for_run("ppo", "ALE/Pong-v5")[0].points[-1].value == 20.6
    assert refs.for_run("dqn", "CartPole-v1")[0].points[0].value == 488.69
    assert refs.for_run("ppo", "Hopper-v4") and refs.for_run("ppo", "HalfCheetah-v4")
    assert any("39-52" in item["what"] for item in refs.not_found)  # asked for, not found: said so

    # The preset is CleanRL's global batch on make train's 2 ranks; the plans keep it at any N.
    cfg = load_config(ATARI_CLEANRL)
    assert cfg.global_batch_size(2) == 8 * 128 and cfg.ppo.clip_coef == 0.1
    for path in sorted((REPO / "benchmarks").glob("learning_*.toml")):
        plan = load_plan(path)
        for exp in plan.experiments:
            if exp.global_envs:
                assert exp.ranks * exp.num_envs == exp.global_envs
            if "atari" in plan.name:  # CleanRL's recipes: ppo_atari 8 envs, dqn_atari 1 env (per rank here)
                envs = 8 if exp.algorithm == "ppo" else exp.ranks
                assert exp.global_envs == envs and refs.for_run(exp.algorithm, exp.env), (path, exp.name)
    full = load_plan(REPO / "benchmarks" / "learning_atari.toml")
    assert sum(len(e.seeds) for e in full.experiments) == 9 and {e.steps for e in full.experiments} == {10_000_000}


# ---- a real study: skip, resume, refuse ----------------------------------------------------

TINY = ["logging.tensorboard=false", "ppo.num_steps=32", "ppo.num_minibatches=2", "ppo.update_epochs=2",
        "checkpoint.every=1"]


def tiny_plan(path: Path, steps_a: int = 512, ranks: int = 2) -> Path:
    """Experiment a: 4 iterations of 2 ranks x 2 envs x 32 steps; b: 30 slowed-down ones."""
    path.write_text(f"""
name = "tiny"
config = "{CARTPOLE}"
ranks = {ranks}
global_envs = {2 * ranks}
overrides = {json.dumps(TINY)}

[[experiment]]
name = "a"
steps = {steps_a}
seeds = [1]

[[experiment]]
name = "b"
steps = {30 * 128}
seeds = [2]
overrides = ["debug.iteration_sleep=0.15"]
""")
    return path


def study(plan: Path, out: Path, *extra: str) -> list:
    return [PYTHON, SCRIPT, "run", "--plan", plan, "--out", out, *extra]


def test_study_skips_completed_runs_and_resumes_an_interrupted_one(tmp_path):
    plan, out = tiny_plan(tmp_path / "plan.toml"), tmp_path / "study"
    proc = start(study(plan, out))
    wait_for_iterations(out / "b" / "seed2", 3, proc, timeout=180)
    os.kill(proc.pid, signal.SIGTERM)  # to the runner only: it asks the training to checkpoint
    code, text = finish(proc, timeout=120)
    assert code == bench.EXIT_PREEMPTED, text
    assert "asking the training to checkpoint" in text and "run the same command again" in text
    a, b = out / "a" / "seed1", out / "b" / "seed2"
    assert json.loads((a / "summary.json").read_text())["status"] == "completed"
    assert not (b / "summary.json").exists() and list((b / "checkpoints").glob("ckpt_*.pt"))
    stopped_at = len(read_jsonl(b / "metrics.jsonl"))
    assert 3 <= stopped_at < 30
    assert [(r["run"], r["exit_code"]) for r in read_jsonl(out / "launches.jsonl")] == [("a/seed1", 0), ("b/seed2", 75)]
    assert "**partial**" in (out / "report" / "report.md").read_text()
    summary_a = (a / "summary.json").read_bytes()

    text = check(run(study(plan, out), timeout=240))
    assert "a/seed1: completed (512 steps), skipped" in text and "b/seed2: resuming" in text
    launches = read_jsonl(out / "launches.jsonl")
    assert [(r["run"], r["exit_code"]) for r in launches] == [("a/seed1", 0), ("b/seed2", 75), ("b/seed2", 0)]
    assert launches[-1]["command"][:4] == ["mpirun", "-np", "2", "--oversubscribe"]
    assert launches[-1]["command"][5:12] == ["train", "--config", str(CARTPOLE), "--run-dir", str(b), "--resume", "auto"]
    rows = read_jsonl(b / "metrics.jsonl")
    assert [r["iteration"] for r in rows] == list(range(1, 31)) and rows[-1]["global_step"] == 30 * 128
    assert "resuming from" in (out / "b" / "seed2.log").read_text()
    assert (a / "summary.json").read_bytes() == summary_a  # skipped: not touched
    games = read_jsonl(b / "episodes.jsonl")
    assert games and all(g["global_step"] <= 30 * 128 for g in games)
    data = json.loads((out / "report" / "report.json").read_text())
    assert [r["status"] for e in data["experiments"] for r in e["runs"]] == ["completed", "completed"]
    assert data["experiments"][1]["runs"][0]["final_return"] == pytest.approx(np.mean([g["return"] for g in games][-100:]))
    # each experiment's final policy, recorded from a completed seed's checkpoint, beside its curve
    report = (out / "report" / "report.md").read_text()
    for name, seed in (("a", 1), ("b", 2)):
        assert f"![{name}: the final policy]({name}-agent.gif)" in report
        assert f"The final policy of seed {seed} (global step" in report
        with Image.open(out / "report" / f"{name}-agent.gif") as clip:
            assert clip.n_frames > 1 and clip.size == (600, 400)

    text = check(run(study(plan, out), timeout=120))  # nothing left to do
    assert text.count("skipped") == 2 and len(read_jsonl(out / "launches.jsonl")) == 3

    # The plan now asks for more steps than run a was trained (and annealed) for: refused.
    result = run(study(tiny_plan(tmp_path / "longer.toml", steps_a=1024), out, "--only", "a"), timeout=120)
    assert result.returncode == 1, result.stdout
    assert "a/seed1: NOT resumed" in result.stdout and "ppo.total_timesteps: 512 in the run, 1024 in the plan" in result.stdout
    assert len(read_jsonl(out / "launches.jsonl")) == 3


def test_bad_training_config_fails_before_anything_runs(tmp_path):
    plan = tmp_path / "plan.toml"
    plan.write_text(GOOD + 'overrides = ["ppo.num_stepz=3"]\n')
    result = run([PYTHON, SCRIPT, "run", "--plan", plan, "--out", tmp_path / "out"], timeout=120)
    assert result.returncode == 2 and "experiment 'x'" in result.stdout and "ppo.num_stepz" in result.stdout
    assert not (tmp_path / "out").exists()


# ---- SLURM: the array template, rendered, one element run by bash without SLURM -------------

def test_learning_array_renders_from_the_plan_and_runs_an_element(tmp_path):
    plan = tmp_path / "plan.toml"
    plan.write_text(f"""
name = "tiny-array"
config = "{CARTPOLE}"
ranks = 1
steps = 256
seeds = [1, 2]
overrides = {json.dumps(TINY)}
[[experiment]]
name = "cart"
""")
    script = tmp_path / "learning.sbatch"
    check(run([BIN / "hvd-rl", "slurm", "render", "--template", "learning", "--plan", plan, "--launcher", "mpirun",
               "--run-root", tmp_path / "runs", "--cpus-per-task", "1", "-o", script], timeout=60))
    text = script.read_text()
    assert "#SBATCH --array=0-1" in text and "#SBATCH --ntasks-per-node=1" in text
    assert f"PLAN={plan}" in text and "LAUNCHER=mpirun" in text and "#SBATCH --requeue" in text
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0

    env = launch_env({"SLURM_ARRAY_TASK_ID": "0", "SLURM_ARRAY_JOB_ID": "77", "SLURM_JOB_ID": "77",
                      "SLURM_NTASKS": "1", "SLURM_CPUS_PER_TASK": "1", "SLURM_JOB_NODELIST": "localhost",
                      "SLURM_SUBMIT_DIR": str(REPO)})
    log = check(run(["bash", script], timeout=240, env=env, cwd=tmp_path))
    study_dir = tmp_path / "runs" / "learning" / "tiny-array"
    assert "cart/seed1: 1 rank(s)" in log
    assert json.loads((study_dir / "cart" / "seed1" / "summary.json").read_text())["global_step"] == 256
    report = (study_dir / "report" / "report.md").read_text()
    assert "| 1 | completed | 256 |" in report and "| 2 | not started |" in report
    assert (study_dir / "plan.toml").read_text() == plan.read_text()

    again = check(run(["bash", script], timeout=120, env=env, cwd=tmp_path))  # resubmitted: skipped
    assert "cart/seed1: already completed, skipped" in again
    outside = run(["bash", script], timeout=60, env={**env, "SLURM_ARRAY_TASK_ID": "5"}, cwd=tmp_path)
    assert outside.returncode == 2 and "outside the plan's 2 (experiment, seed) elements" in outside.stdout


def test_multiagent_benchmark_scores_by_iqm_over_seeds_against_a_random_policy(tmp_path):
    """benchmarks/multiagent.py: the IQM of every seed's last 100 episodes pooled (hand-computed),
    an interval that is a point when nothing varies, and a random policy played on the real task."""
    spec = importlib.util.spec_from_file_location("multiagent_benchmark", REPO / "benchmarks" / "multiagent.py")
    ma = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ma)
    from hvd_rl.analysis.aggregate import iqm, iqm_interval

    assert iqm(np.arange(1.0, 9.0)) == 4.5  # the middle four of 1..8
    assert iqm_interval([np.full(10, 2.0)] * 3) == (2.0, 2.0, 2.0)
    spread = REPO / "configs" / "mpe_spread_mappo.toml"
    plan = tmp_path / "spread.toml"
    plan.write_text(f'name = "spread"\nconfig = "{spread}"\nsteps = 3000\n[[experiment]]\nname = "mappo"\n'
                    f'algorithm = "mappo"\nseeds = [1, 2]\n[[experiment]]\nname = "ippo"\nalgorithm = "ippo"\n'
                    f'seeds = [1]\n')
    study = tmp_path / "study"
    fake_run(study / "mappo" / "seed1", [[-30.0] * 5, [-20.0] * 5, [-10.0] * 5])
    fake_run(study / "mappo" / "seed2", [[-20.0] * 5, [-10.0] * 5, [0.0] * 5])
    fake_run(study / "ippo" / "seed1", [[-40.0] * 5, [-35.0] * 5, [-30.0] * 5], completed=False)
    out = tmp_path / "out"
    check(run([PYTHON, REPO / "benchmarks" / "multiagent.py", "--plan", plan, "--study", study, "--out", out,
               "--baseline-episodes", "16"], timeout=120))
    result = json.loads((out / "spread.json").read_text())
    mappo, ippo = result["results"]
    # 30 pooled returns, 7 trimmed from each end: eight -20s and eight -10s remain
    assert mappo["iqm"] == -15.0 and mappo["ci"][0] <= -15.0 <= mappo["ci"][1]
    assert [s["final"] for s in mappo["seeds"]] == [-20.0, -10.0] and mappo["mean_of_seed_finals"] == -15.0
    assert ippo["iqm"] == -35.0 and ippo["seeds"][0]["status"] == "partial"
    (random_policy,) = result["baselines"]
    assert random_policy["policy"] == "random" and random_policy["episodes"] == 16 and random_policy["iqm"] < 0
    table = (out / "spread.md").read_text()
    assert "| mappo (mappo) | 2 |" in table and "| ippo (ippo) | 1 (partial) |" in table and "random policy" in table
    assert Image.open(out / "spread.png").size[0] > 500
