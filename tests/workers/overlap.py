"""Worker: which weights sampled each rollout the learner gets, in ppo.pipeline sync or overlap.

usage: overlap.py {sync|overlap} ITERATIONS
One process runs the real PPO algorithm (collector, sampler thread, learner) on CartPole. For each
iteration it records the batch the learner receives and the weights held just before that update;
then it recomputes every batch's log-probabilities of the stored actions under each recorded set
of weights and prints, per iteration, the largest difference to the stored ones (JSON lines).
"""
import copy
import json
import sys
from pathlib import Path

import torch

from hvd_rl.algorithms import build_algorithm
from hvd_rl.algorithms.base import IterationContext
from hvd_rl.config import load_config
from hvd_rl.envs.vector import EnvLayout, env_seeds
from hvd_rl.runtime import distributed as dist
from hvd_rl.runtime.trainer import probe_spaces

pipeline, iterations = sys.argv[1], int(sys.argv[2])
config = Path(__file__).resolve().parents[2] / "configs" / "cartpole_ppo.toml"
cfg = load_config(config, [f"ppo.pipeline={pipeline}", "env.num_envs=2", "ppo.num_steps=32",
                           "ppo.num_minibatches=2", "ppo.update_epochs=2", "ppo.learning_rate=0.01"])
dist.init()
torch.manual_seed(cfg.seed)
algo = build_algorithm(cfg, torch.device("cpu"), 1, *probe_spaces(cfg))
layout = EnvLayout.even(1, cfg.env.num_envs)
algo.build_envs(layout, 0, env_seeds(cfg.seed, 0, 0, cfg.env.num_envs))

records = []
update = algo.learner.update


def recording_update(batch, iteration, *args, **kwargs):
    records.append({"obs": batch.obs.clone(), "actions": batch.actions.clone(), "logprobs": batch.logprobs.clone(),
                    "weights": copy.deepcopy(algo.model.state_dict())})
    return update(batch, iteration, *args, **kwargs)


algo.learner.update = recording_update
step = 0
for iteration in range(1, iterations + 1):
    algo.iterate(IterationContext(iteration=iteration, global_step=step, env_steps=cfg.ppo.num_steps, layout=layout,
                                  rank=0, world_size=1, stop_requested=lambda: False))
    step += layout.total * cfg.ppo.num_steps
algo.close()

probe = copy.deepcopy(algo.model)
for k, record in enumerate(records):
    gaps = []
    for weights in (r["weights"] for r in records):
        probe.load_state_dict(weights)
        with torch.no_grad():
            logits, _ = probe(record["obs"])
            logprobs, _ = probe.log_prob_entropy(logits, record["actions"])
        gaps.append(float((logprobs - record["logprobs"]).abs().max()))
    # gaps[j]: the stored log-probabilities against those under the weights before update j + 1
    print(json.dumps({"iteration": k + 1, "gaps": gaps}), flush=True)
