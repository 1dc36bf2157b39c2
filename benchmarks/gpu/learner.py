"""The PPO learner alone on one device: samples per second through full updates (4 epochs of 4
minibatches, clipping, Adam) of the Atari preset's Nature CNN, for each minibatch size and
precision. Synthetic frames, no envs: what the learner can take if the rollout kept up.

    python benchmarks/gpu/learner.py --device cuda --minibatches 256 1024 4096 --amp off bf16 --out learner.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from throughput import learner_samples_per_s  # noqa: E402

from hvd_rl.config import load_config  # noqa: E402


def measure(config: str, device_name: str, minibatch: int, amp: str, updates: int) -> dict:
    import numpy as np
    import torch

    from hvd_rl.envs.vector import RankEnvs
    from hvd_rl.algorithms.models import build_model
    from hvd_rl.runtime.precision import precision_for
    from hvd_rl.algorithms.rollout import RolloutBuffer

    cfg = load_config(config)
    envs_per_rank = cfg.env.num_envs
    cfg.env.num_envs = 1
    envs = RankEnvs(cfg.env, threads=1)  # only for the spaces: the preset's real observation shape
    obs_space, action_space = envs.single_observation_space, envs.single_action_space
    envs.close()
    # a rollout of envs_per_rank envs whose num_minibatches minibatches hold `minibatch` samples each
    cfg.env.num_envs = envs_per_rank
    cfg.ppo.num_steps = max(1, minibatch * cfg.ppo.num_minibatches // envs_per_rank)
    device = torch.device(device_name)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, obs_space, action_space).to(device)
    model.precision = precision_for(amp, device, len(obs_space.shape) == 3)
    buffer = RolloutBuffer(cfg.ppo.num_steps, cfg.env.num_envs, obs_space, action_space, device)
    rate = learner_samples_per_s(cfg, model, buffer.obs, action_space.n, np.random.default_rng(0), updates)
    return {"device": str(device), "minibatch": cfg.local_batch_size // cfg.ppo.num_minibatches,
            "local_batch": cfg.local_batch_size, "epochs": cfg.ppo.update_epochs, "amp": amp,
            "precision": model.precision.mode, "learner_samples_per_s": rate}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "atari_ppo.toml"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--minibatches", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--amp", nargs="+", default=["off", "bf16"])
    parser.add_argument("--updates", type=int, default=2, help="timed updates after one warm-up")
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args()
    from hvd_rl.runtime import distributed as dist

    dist.init()
    rows = []
    for amp in args.amp:
        for minibatch in args.minibatches:
            row = measure(args.config, args.device, minibatch, amp, args.updates)
            rows.append(row)
            print(f"learner {row['device']} {row['precision']:>4} minibatch {row['minibatch']:>5}: "
                  f"{row['learner_samples_per_s']:,.0f} samples/s", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
