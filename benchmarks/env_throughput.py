"""Environment steps/s per vector backend, versus number of envs and threads (one process).

    python benchmarks/env_throughput.py --env ALE/Breakout-v5 --out results/env_throughput.json

Backends: Gymnasium SyncVectorEnv and AsyncVectorEnv (with the Atari wrappers of the recipe) and
ale-py's C++ AtariVectorEnv (preprocessing in C++; `threads` is its worker pool). Random
actions; the timing covers step() only, after reset and a warm-up.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hvd_rl.config import EnvConfig  # noqa: E402
from hvd_rl.envs.ids import is_atari  # noqa: E402
from hvd_rl.envs.vector import RankEnvs  # noqa: E402


def measure(cfg: EnvConfig, threads: int, steps: int) -> float:
    envs = RankEnvs(cfg, threads=threads)
    envs.reset(list(range(cfg.num_envs)))
    rng = np.random.default_rng(0)
    actions = rng.integers(0, envs.single_action_space.n, size=(steps + 10, cfg.num_envs))
    for a in actions[:10]:
        envs.step(a)
    start = time.perf_counter()
    for a in actions[10:]:
        envs.step(a)
    elapsed = time.perf_counter() - start
    envs.close()
    return steps * cfg.num_envs / elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env", default="ALE/Breakout-v5")
    parser.add_argument("--backends", nargs="+", default=["sync", "async", "ale_vector"])
    parser.add_argument("--num-envs", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=200, help="vector steps per measurement")
    parser.add_argument("--out")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    base = EnvConfig(id=args.env)
    rows = []
    for backend in args.backends:
        if backend == "ale_vector" and not is_atari(args.env):
            continue
        for threads in (args.threads if backend == "ale_vector" else [1]):
            for num_envs in args.num_envs:
                sps = measure(replace(base, backend=backend, num_envs=num_envs), threads, args.steps)
                rows.append({"backend": backend, "num_envs": num_envs, "threads": threads, "steps_per_s": sps})
                print(f"{backend:>10s}  envs {num_envs:3d}  threads {threads}  {sps:9.0f} steps/s", flush=True)
    result = {"kind": "hvd_rl.env_throughput", "env": args.env, "rows": rows,
              "machine": {"hostname": platform.node(), "cpus": os.cpu_count()}}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
