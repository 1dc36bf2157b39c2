"""Worker: a MAPPO update on a fixed multi-agent batch with dead agents; each rank takes its envs.

usage: multiagent_equivalence.py OUT.pt {masked|unmasked}
The global batch is [T, 4 envs, 3 agents] in float64 with agents dead for stretches of steps,
more of them in envs 0-1 (rank 0's on 2 ranks) than in envs 2-3, so ranks count different numbers
of live samples. `unmasked` (the control) counts the dead agents' rows like live ones.
Rank 0 saves the updated parameters; the test compares 1 process with 2 ranks.
"""
import sys

import gymnasium as gym
import numpy as np
import torch

from hvd_rl.algorithms.models import build_multiagent_model
from hvd_rl.algorithms.ppo import Batch, PPOLearner
from hvd_rl.config import ModelConfig, PPOConfig
from hvd_rl.runtime import distributed as dist

out, variant = sys.argv[1], sys.argv[2]
topo = dist.init()
torch.set_num_threads(1)
torch.set_default_dtype(torch.float64)
T, E, A, OBS, STATE = 16, 4, 3, 5, 9
local = E // topo.size
first = topo.rank * local
actor_width, critic_width = OBS + A, STATE + A
torch.manual_seed(0)
model = build_multiagent_model(ModelConfig(hidden_sizes=[32, 32]), actor_width, critic_width,
                               gym.spaces.Discrete(4), centralised=True)
cfg = PPOConfig(num_steps=T, num_minibatches=4, update_epochs=3, clip_coef=0.1, max_grad_norm=0.5,
                learning_rate=1e-3)
optimizer = dist.distributed_optimizer(torch.optim.Adam(model.parameters(), lr=cfg.learning_rate, eps=1e-5),
                                       model, reduction="average", compression="none",
                                       backward_passes_per_step=1)
dist.broadcast_state(model, optimizer, has_optimizer_state=False)
initial = {k: v.clone() for k, v in model.state_dict().items()}

rng = np.random.default_rng(7)
rows = torch.from_numpy(rng.normal(size=(T, E, A, actor_width + critic_width)))
mask = torch.ones(T, E, A)
mask[3:9, 0, 1] = 0.0   # env 0: agent 1 dead for 6 steps, agent 2 for 10
mask[5:15, 0, 2] = 0.0
mask[0:12, 1, 0] = 0.0  # env 1: agent 0 dead for 12
mask[10:14, 3, 2] = 0.0  # env 3: agent 2 dead for 4 (rank 1 on 2 ranks counts far more samples)
actions = torch.from_numpy(rng.integers(0, 4, (T, E, A)))
with torch.no_grad():
    logits, values = model(rows.reshape(T * E * A, -1))
    logp = torch.log_softmax(logits, -1).gather(-1, actions.reshape(-1, 1)).reshape(T, E, A)
    values = values.reshape(T, E, A)
advantages = torch.from_numpy(rng.normal(1.0, 2.0, (T, E, A))) * mask
returns = (values + advantages) * mask


def mine(x):
    part = x[:, first:first + local]
    return part.reshape((T * local * A,) + tuple(x.shape[3:]))


batch = Batch(obs=mine(rows), actions=mine(actions), logprobs=mine(logp), values=mine(values * mask),
              advantages=mine(advantages), returns=mine(returns),
              mask=mine(mask) if variant == "masked" else None)
learner = PPOLearner(model, optimizer, cfg, seed=5)
for iteration in (1, 2):
    stats = learner.update(batch, iteration, first * A, local * A, T)
agree, _ = dist.parameters_agree(model, "final")
assert agree, "ranks disagree"
if topo.rank == 0:
    torch.save({"params": model.state_dict(), "initial": initial, "kl": stats.approx_kl,
                "live": float(mask.sum())}, out)
