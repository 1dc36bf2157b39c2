"""Trainer throughput against the ceiling its parts imply, measured in one run on one machine.

    python benchmarks/throughput.py --config configs/atari_ppo.toml --np 2

On every rank, concurrently (as in training), with the configured model, envs and threads:
  env-only        random actions through this rank's vector env                 -> env steps/s
  inference-only  the rollout's per-step policy call (copy in, forward, sample)  -> env steps/s
  learner-only    PPO minibatch updates on a rollout-sized batch, gradients
                  averaged across ranks as in training                           -> samples/s
  trainer         the real Trainer, after warm-up iterations                     -> env steps/s
Rates are summed over ranks. One iteration needs one env step, one inference and `update_epochs`
learner passes per sample, so the ceiling is 1 / (1/env + epochs/learner + 1/inference) and the
script prints the trainer's SPS as a fraction of it.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hvd_rl import distributed as dist  # noqa: E402
from hvd_rl.config import load_config, validate  # noqa: E402
from hvd_rl.envs import RankEnvs, env_seeds  # noqa: E402
from hvd_rl.launch import launched, relaunch_under_mpirun  # noqa: E402
from hvd_rl.models import build_model  # noqa: E402
from hvd_rl.ppo import Batch, PPOLearner  # noqa: E402
from hvd_rl.rollout import sample_actions  # noqa: E402
from hvd_rl.trainer import Trainer  # noqa: E402

class EnvProbe:
    """Random actions through a vector env configured like the trainer's."""

    def __init__(self, cfg, threads: int, rank: int):
        self.envs = RankEnvs(cfg.env, threads=threads)
        self.envs.reset(env_seeds(cfg.seed + 7919, 0, rank, cfg.env.num_envs))
        self.rng = np.random.default_rng(rank)
        self.num_envs = cfg.env.num_envs

    def run(self, steps: int, warm: int) -> tuple[int, float]:
        n = self.envs.single_action_space.n
        actions = [self.rng.integers(0, n, size=self.num_envs) for _ in range(warm + steps)]
        for a in actions[:warm]:
            self.envs.step(a)
        start = time.perf_counter()
        for a in actions[warm:]:
            self.envs.step(a)
        return steps * self.num_envs, time.perf_counter() - start


class InferenceProbe:
    """The collector's per-step work without the env: copy obs in, forward, sample, copy out."""

    def __init__(self, cfg, model, obs_space):
        rng = np.random.default_rng(0)
        shape = (cfg.env.num_envs,) + tuple(obs_space.shape)
        self.frames = [rng.integers(0, 255, shape).astype(obs_space.dtype) for _ in range(4)]
        dtype = torch.uint8 if obs_space.dtype == np.uint8 else torch.float32
        self.buffer = torch.zeros((cfg.ppo.num_steps,) + shape, dtype=dtype)
        self.model, self.num_envs = model, cfg.env.num_envs

    @torch.no_grad()
    def run(self, steps: int, warm: int) -> tuple[int, float]:
        for step in range(warm + steps):
            if step == warm:
                start = time.perf_counter()
            slot = self.buffer[step % len(self.buffer)]
            slot.copy_(torch.from_numpy(self.frames[step % 4]))
            logits, _ = self.model(slot)
            sample_actions(logits)[0].numpy()
        return steps * self.num_envs, time.perf_counter() - start


class LearnerProbe:
    """Full PPO updates (all epochs and minibatches, gradients averaged across ranks) on a
    synthetic rollout-sized batch."""

    def __init__(self, cfg, model, obs_space, topo):
        n = cfg.local_batch_size
        rng = np.random.default_rng(topo.rank)
        obs = torch.from_numpy(rng.integers(0, 255, (n,) + tuple(obs_space.shape)).astype(obs_space.dtype))
        with torch.no_grad():
            num_actions = model(obs[:1])[0].shape[-1]
        self.batch = Batch(obs=obs, actions=torch.from_numpy(rng.integers(0, num_actions, n)),
                           logprobs=torch.full((n,), -1.4), values=torch.zeros(n),
                           advantages=torch.from_numpy(rng.normal(size=n).astype(np.float32)),
                           returns=torch.from_numpy(rng.normal(size=n).astype(np.float32)))
        optimizer = dist.distributed_optimizer(
            torch.optim.Adam(model.parameters(), lr=cfg.ppo.learning_rate, eps=cfg.ppo.adam_eps), model,
            reduction=cfg.distributed.reduction, compression=cfg.distributed.compression,
            backward_passes_per_step=cfg.ppo.backward_passes_per_step)
        self.learner = PPOLearner(model, optimizer, cfg.ppo, cfg.seed)
        self.layout = (topo.rank * cfg.env.num_envs, cfg.env.num_envs, topo.size * cfg.env.num_envs,
                       cfg.ppo.num_steps)
        self.n, self.calls = n, 0

    def run(self) -> tuple[int, float]:
        self.calls += 1
        start = time.perf_counter()
        stats = self.learner.update(self.batch, self.calls, *self.layout)
        return self.n * stats.epochs_run, time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(REPO / "configs" / "atari_ppo.toml"))
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--np", type=int, default=2, help="ranks (the script starts mpirun itself)")
    parser.add_argument("--steps", type=int, default=128, help="env-only and inference-only steps per round")
    parser.add_argument("--warm-steps", type=int, default=32, help="untimed steps before each probe block")
    parser.add_argument("--warmup", type=int, default=1, help="warm-up rounds")
    parser.add_argument("--rounds", type=int, default=4, help="measured rounds (probes + one trainer iteration)")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    if not launched() and args.np > 1:
        return relaunch_under_mpirun(args.np)

    cfg = load_config(args.config, args.overrides)
    validate(cfg)
    topo = dist.init()
    threads = dist.configure_threads(topo, cfg.distributed.threads_per_rank)
    probe = RankEnvs(cfg.env.__class__(**{**cfg.env.__dict__, "num_envs": 1}), threads=1)
    obs_space, action_space = probe.single_observation_space, probe.single_action_space
    probe.close()
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, obs_space, action_space)

    # Rounds interleave the probe blocks with trainer iterations, so that slow drifts of this
    # machine (other tenants, frequency changes) hit the ceiling and the trainer alike.
    probes = {"env": EnvProbe(cfg, threads, topo.rank), "inference": InferenceProbe(cfg, model, obs_space),
              "learner": LearnerProbe(cfg, model, obs_space, topo)}
    trainer_cfg = load_config(args.config, args.overrides)
    totals = {k: [0, 0.0] for k in ("env", "inference", "learner")}
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        trainer_cfg.run_dir = dist.broadcast_object(os.path.join(tmp, "trainer") if topo.rank == 0 else None,
                                                    name="bench.run_dir")
        trainer_cfg.ppo.total_timesteps = 10 ** 12
        trainer_cfg.logging.tensorboard = trainer_cfg.logging.console = False
        trainer = Trainer(trainer_cfg)
        for round_ in range(args.warmup + args.rounds):
            # Each probe block warms up first: the probes measure each part running on its own.
            measured = {"env": probes["env"].run(args.steps, args.warm_steps),
                        "inference": probes["inference"].run(args.steps, args.warm_steps),
                        "learner": probes["learner"].run()}
            record = trainer.iterate()
            if round_ >= args.warmup:
                records.append(record)
                for key, (count, seconds) in measured.items():
                    totals[key][0] += count
                    totals[key][1] += seconds
        trainer.close()
    # Per-rank rates summed over ranks: ranks run concurrently, as in training.
    rates = {k: float(dist.allreduce_sum([c / s], name=f"bench.{k}")[0]) for k, (c, s) in totals.items()}
    if topo.rank != 0:
        return 0
    epochs = cfg.ppo.update_epochs
    ceiling = 1.0 / (1.0 / rates["env"] + epochs / rates["learner"] + 1.0 / rates["inference"])
    wall = sum(r["time_iteration"] for r in records)
    trainer_sps = sum(cfg.global_batch_size(topo.size) for _ in records) / wall
    phases = {k: float(np.mean([r[k] for r in records]))
              for k in ("time_env", "time_inference", "time_update", "time_allreduce", "time_iteration")}
    result = {
        "config": args.config, "overrides": args.overrides, "ranks": topo.size,
        "threads_per_rank": threads, "envs_per_rank": cfg.env.num_envs, "backend": cfg.env.backend,
        "env_sps": rates["env"], "inference_sps": rates["inference"], "learner_samples_per_s": rates["learner"],
        "update_epochs": epochs, "ceiling_sps": ceiling, "trainer_sps": trainer_sps,
        "fraction_of_ceiling": trainer_sps / ceiling, "trainer_phases_s": phases, "rounds": args.rounds,
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                    "python": platform.python_version(), "torch": torch.__version__},
    }
    print(f"ranks {topo.size} x {threads} thread(s), {cfg.env.num_envs} envs/rank, {cfg.env.id} ({cfg.env.backend})")
    print(f"  env-only          {rates['env']:10.0f} env steps/s")
    print(f"  inference-only    {rates['inference']:10.0f} env steps/s")
    print(f"  learner-only      {rates['learner']:10.0f} samples/s  (x{epochs} epochs per sample)")
    print(f"  ceiling           {ceiling:10.0f} env steps/s  = 1/(1/env + {epochs}/learner + 1/inference)")
    print(f"  trainer           {trainer_sps:10.0f} env steps/s")
    print(f"  trainer / ceiling {trainer_sps / ceiling:10.2f}")
    print("  trainer phases per iteration: " + ", ".join(
        f"{k[5:]} {v:.2f}s" for k, v in phases.items() if k != "time_iteration")
        + f" (iteration {phases['time_iteration']:.2f}s)")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
