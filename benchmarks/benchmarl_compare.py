"""hvd_rl MAPPO against BenchMARL's MAPPO on the same VMAS task and frame budget, one after the
other on this machine, learning curves on one plot and environment frames per second (issue 34).

    python benchmarks/benchmarl_compare.py --frames 300000 --out benchmarks/results/multiagent/benchmarl

BenchMARL (TorchRL) runs in its own virtual environment (--venv, made on first use with pinned
versions: torch 2.13.0 CPU, benchmarl 1.5.2, vmas 1.5.2) with its default experiment, algorithm
and model configurations (benchmarl/conf: base_experiment.yaml, mappo.yaml, layers/mlp.yaml,
task vmas/<scenario>.yaml, but with VMAS's own shared reward, as hvd_rl builds the scenario),
only max_n_frames set, loggers off and evaluation off (its
evaluation would be time hvd_rl does not spend); torch uses every core in its one process.
hvd_rl runs configs/vmas_<scenario>_mappo.toml under `mpirun -np --ranks` with the same frames.

A frame is one step of one environment (all its agents), the unit both count. The curves are
the mean team return (the mean over agents of each agent's episode return) of the episodes that
ended in each iteration, the statistic BenchMARL logs; the final return is the mean over the last
tenth of the iterations. Frames/s: frames over the wall-clock of the training loop (BenchMARL:
its collection + training timers; hvd_rl: the sum of its iteration times), and over the whole
process lifetime, start-up included.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BENCHMARL_PINS = ["torch==2.13.0", "benchmarl==1.5.2", "vmas==1.5.2"]
# BenchMARL's task file for navigation turns VMAS's shared reward off; hvd_rl builds the scenario
# with VMAS's own defaults, so BenchMARL's task is set back to them: one task for both.
TASK_AS_VMAS = {"navigation": {"shared_rew": True}}

# Runs inside BenchMARL's venv: its defaults, a callback writing one JSON line per iteration.
INSIDE = r'''
import json, sys, time
from benchmarl.algorithms import MappoConfig
from benchmarl.environments import VmasTask
from benchmarl.experiment import Callback, Experiment, ExperimentConfig
from benchmarl.models.mlp import MlpConfig

scenario, frames, seed, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]

open(out + "/iterations.jsonl", "w").close()

class Rows(Callback):  # BenchMARL pickles its callbacks: no open file in here
    def on_train_end(self, training_td, group):
        e = self.experiment
        with open(out + "/iterations.jsonl", "a") as f:
            f.write(json.dumps({"frames": e.total_frames, "mean_return": e.mean_return,
                                "train_seconds": e.total_time, "time": time.time()}) + "\n")

config = ExperimentConfig.get_from_yaml()
config.max_n_frames = frames
config.loggers = []
config.evaluation = False
config.render = False
config.create_json = False
config.checkpoint_at_end = False
config.save_folder = out
task = getattr(VmasTask, scenario.upper()).get_from_yaml()
task.config.update(json.loads(sys.argv[5]))
experiment = Experiment(task=task, algorithm_config=MappoConfig.get_from_yaml(), model_config=MlpConfig.get_from_yaml(),
                        critic_model_config=MlpConfig.get_from_yaml(), seed=seed, config=config, callbacks=[Rows()])
experiment.run()
'''


def ensure_venv(venv: Path) -> Path:
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", *BENCHMARL_PINS], check=True)
    return python


def run_benchmarl(python: Path, scenario: str, frames: int, seed: int, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    # the iteration's frames (6,000) must divide the budget, as BenchMARL's loop counts whole iterations
    start = time.time()
    task_args = json.dumps(TASK_AS_VMAS.get(scenario, {}))
    subprocess.run([str(python), "-c", INSIDE, scenario, str(frames), str(seed), str(out), task_args], check=True,
                   stdout=open(out / "log.txt", "w"), stderr=subprocess.STDOUT)
    wall = time.time() - start
    rows = [json.loads(line) for line in (out / "iterations.jsonl").read_text().splitlines()]
    return {"frames": rows[-1]["frames"], "wall_seconds": wall, "train_seconds": rows[-1]["train_seconds"],
            "curve": [(r["frames"], r["mean_return"]) for r in rows]}


def run_hvd_rl(scenario: str, frames: int, seed: int, ranks: int, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    run_dir = out / "run"
    config = REPO / "configs" / f"vmas_{scenario}_mappo.toml"
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    start = time.time()
    subprocess.run(["mpirun", "-np", str(ranks), "--oversubscribe", str(Path(sys.executable).parent / "hvd-rl"),
                    "train", "--config", str(config), "--run-dir", str(run_dir), "--resume", "auto",
                    "--set", f"seed={seed}", "--set", f"ppo.total_timesteps={frames}",
                    "--set", "logging.tensorboard=false", "--set", "logging.console=false"],
                   check=True, env=env, stdout=open(out / "log.txt", "w"), stderr=subprocess.STDOUT)
    wall = time.time() - start
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"frames": rows[-1]["global_step"], "wall_seconds": wall,
            "train_seconds": sum(r["time_iteration"] for r in rows),
            "curve": [(r["global_step"], r["episodic_return_mean"]) for r in rows if r.get("episodes")]}


def final_return(curve: list) -> float:
    values = [v for _, v in curve if v is not None and v == v]
    tail = values[-max(1, len(values) // 10):]
    return sum(tail) / len(tail)


def plot(results: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, r in results.items():
        xs, ys = zip(*[(f, v) for f, v in r["curve"] if v is not None and v == v])
        ax.plot(xs, ys, label=f"{name}: {r['train_fps']:.0f} frames/s")
    ax.set_xlabel("frames (environment steps)")
    ax.set_ylabel("mean team return per episode")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", default="navigation")
    parser.add_argument("--frames", type=int, default=300_000, help="a multiple of 6,000 (BenchMARL's iteration)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--venv", default=str(REPO / "runs" / "benchmarl-venv"))
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "multiagent" / "benchmarl"))
    args = parser.parse_args()
    if args.frames % 6000:
        parser.error("--frames must be a multiple of 6000 (BenchMARL's on_policy_collected_frames_per_batch)")
    out = Path(args.out)
    work = REPO / "runs" / "benchmarl_compare"
    python = ensure_venv(Path(args.venv))
    results = {"BenchMARL MAPPO (1 process, defaults)": run_benchmarl(python, args.scenario, args.frames, args.seed,
                                                                       work / "benchmarl"),
               f"hvd_rl MAPPO ({args.ranks} ranks)": run_hvd_rl(args.scenario, args.frames, args.seed, args.ranks,
                                                               work / "hvd_rl")}
    for r in results.values():
        r["train_fps"] = r["frames"] / r["train_seconds"]
        r["wall_fps"] = r["frames"] / r["wall_seconds"]
        r["final_return"] = final_return(r["curve"])
    bench, ours = results.values()
    summary = {"scenario": args.scenario, "frames": args.frames, "seed": args.seed, "ranks": args.ranks,
               "benchmarl_pins": BENCHMARL_PINS, "cpus": os.cpu_count(),
               "fps_ratio_train": ours["train_fps"] / bench["train_fps"],
               "fps_ratio_wall": ours["wall_fps"] / bench["wall_fps"],
               "final_return_ratio": ours["final_return"] / bench["final_return"] if bench["final_return"] else None,
               "runs": results}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"vmas_{args.scenario}.json").write_text(json.dumps(summary, indent=1))
    plot(results, out / f"vmas_{args.scenario}.png", f"VMAS {args.scenario}, MAPPO, {args.frames:,} frames")
    for name, r in results.items():
        print(f"{name:40s} final return {r['final_return']:9.3f}  frames/s {r['train_fps']:7.0f} (training loop), "
              f"{r['wall_fps']:7.0f} (whole process)")
    print(f"hvd_rl / BenchMARL frames/s: {summary['fps_ratio_train']:.2f} (loop), {summary['fps_ratio_wall']:.2f} (wall)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
