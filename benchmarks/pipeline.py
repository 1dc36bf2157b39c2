"""Overlapped sampling against synchronous sampling on this machine's cores (issue 36).

    python benchmarks/pipeline.py --rounds 3 --out benchmarks/results/throughput/pipeline_<cpu>.json

The real trainer (configs/atari_ppo.toml unless --config), each layout with ppo.pipeline = sync and
= overlap, in rotated rounds, SPS over the iterations after --warmup:
  2 ranks   `make train`'s launch (mpirun -np 2, one core each): overlap can only share a core
            between a rank's sampler and learner, so it should give nothing here
  1 rank    one process on all cores (no mpirun binding): sync runs the learner on every core
            and steps the environments on every core in turn; overlap gives the sampler thread a
            core and the learner the rest, so sampling and learning run at once
Ratios are formed within a round (the machine's speed drifts); the summary gives medians and the
spread over rounds. Run it with nothing else on the machine.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO))

from learner_profile import cpu_description  # noqa: E402
from throughput import measure_run, repo_relative, train_command  # noqa: E402

LAYOUTS = {"2 ranks": 2, "1 rank": 1}
PIPELINES = ("sync", "overlap")


def command(config: str, overrides: list[str], ranks: int, pipeline: str, run_dir: Path, iterations: int) -> list[str]:
    train = train_command(config, [*overrides, f"ppo.pipeline={pipeline}"], ranks, run_dir, iterations)
    if ranks == 1:
        return train  # hvd-rl alone: Horovod's single process, every core in its affinity
    return [shutil.which("mpirun") or "mpirun", "-np", str(ranks), "--oversubscribe", *train]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "atari_ppo.toml"))
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--out")
    args = parser.parse_args()
    runs = [(layout, pipeline) for layout in LAYOUTS for pipeline in PIPELINES]
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = runs[r % len(runs):] + runs[:r % len(runs)]
            row = {}
            for layout, pipeline in order:
                run_dir = Path(tmp) / f"r{r}-{LAYOUTS[layout]}-{pipeline}"
                cmd = command(args.config, args.overrides, LAYOUTS[layout], pipeline, run_dir, args.iterations)
                result = measure_run(cmd, run_dir, args.warmup, args.timeout)
                row[f"{layout}, {pipeline}"] = result["sps"]
                row[f"{layout}, {pipeline}: phases_s"] = result["phases_s"]
                shutil.rmtree(run_dir)
            ratios = {f"{layout}: overlap / sync": row[f"{layout}, overlap"] / row[f"{layout}, sync"] for layout in LAYOUTS}
            ratios["1 rank overlap / 2 ranks sync"] = row["1 rank, overlap"] / row["2 ranks, sync"]
            row.update(ratios)
            rounds.append(row)
            print(json.dumps({k: round(v, 3) for k, v in row.items() if not isinstance(v, dict)}), flush=True)
    numbers = [k for k, v in rounds[0].items() if not isinstance(v, dict)]
    result = {"config": repo_relative(args.config), "overrides": args.overrides, "iterations": args.iterations,
              "warmup": args.warmup, "cpu": cpu_description(), "rounds": rounds,
              "median": {k: statistics.median(r[k] for r in rounds) for k in numbers},
              "spread": {k: [min(r[k] for r in rounds), max(r[k] for r in rounds)] for k in numbers},
              "machine": {"cpus": os.cpu_count(), "python": platform.python_version()}}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({"median": result["median"], "spread": result["spread"]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
