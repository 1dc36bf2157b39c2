"""Worker: PPO update on a fixed global rollout batch; each rank takes its slice of environments.

usage: equivalence.py OUT.pt {mlp|cnn} {global|local} [compression] [backward_passes_per_step] [amp] [counts] [iterations] [dtype]
counts: environments per rank, e.g. "3,5" (uneven shares; the 1-process run takes their sum).
dtype: float32 (default) or float64: network, batch, gradients, allreduce and Adam in float64.
Rank 0 saves the updated parameters; the test compares 1 process with 2 ranks.
"""
import sys

import gymnasium as gym
import numpy as np
import torch

from hvd_rl.runtime import distributed as dist
from hvd_rl.config import ModelConfig, PPOConfig
from hvd_rl.envs.vector import EnvLayout
from hvd_rl.algorithms.models import build_model
from hvd_rl.algorithms.ppo import Batch, PPOLearner
from hvd_rl.runtime.precision import Precision

out, kind, norm = sys.argv[1], sys.argv[2], sys.argv[3]
compression = sys.argv[4] if len(sys.argv) > 4 else "none"
micro_batches = int(sys.argv[5]) if len(sys.argv) > 5 else 1
amp = sys.argv[6] if len(sys.argv) > 6 else "off"
spec = [c for c in sys.argv[7].split(",") if c] if len(sys.argv) > 7 else []
weighted = "unweighted" not in spec  # the control experiment: every rank weighted alike
counts = [int(c) for c in spec if c.isdigit()] or None
iterations = int(sys.argv[8]) if len(sys.argv) > 8 else 2
dtype = getattr(torch, sys.argv[9]) if len(sys.argv) > 9 else torch.float32
topo = dist.init()
torch.set_num_threads(1)
T = 16
E_GLOBAL = sum(counts) if counts else 4
layout = EnvLayout(tuple(counts)) if counts and topo.size > 1 else EnvLayout.even(topo.size, E_GLOBAL // topo.size)
local, first = layout.counts[topo.rank], layout.first(topo.rank)
if kind == "cnn":
    obs_space = gym.spaces.Box(0, 255, (4, 84, 84), np.uint8)
else:
    obs_space = gym.spaces.Box(-5, 5, (4,), np.float32)
action_space = gym.spaces.Discrete(4)

torch.manual_seed(0)
torch.set_default_dtype(dtype)  # the network is created in this dtype
model = build_model(ModelConfig(kind="nature_cnn" if kind == "cnn" else "mlp"), obs_space, action_space)
model.precision = Precision(amp, "cpu")
cfg = PPOConfig(num_steps=T, num_minibatches=4, update_epochs=3, clip_coef=0.1, max_grad_norm=0.5,
                global_advantage_norm=(norm == "global"), learning_rate=1e-3,
                backward_passes_per_step=micro_batches)
optimizer = dist.distributed_optimizer(model.precision.adam(model.parameters(), lr=cfg.learning_rate, eps=1e-5),
                                       model, reduction="average", compression=compression,
                                       backward_passes_per_step=micro_batches)
dist.broadcast_state(model, optimizer, has_optimizer_state=False)
initial = {k: v.clone() for k, v in model.state_dict().items()}

# The fixed global batch, [T, E_GLOBAL, ...], identical on every rank.
rng = np.random.default_rng(123)
if kind == "cnn":
    obs = torch.from_numpy(rng.integers(0, 256, (T, E_GLOBAL, 4, 84, 84), dtype=np.uint8))
else:
    obs = torch.from_numpy(rng.normal(size=(T, E_GLOBAL, 4)).astype(np.float32)).to(dtype)
actions = torch.from_numpy(rng.integers(0, 4, (T, E_GLOBAL)))
with torch.no_grad():
    logits, values = model(obs.reshape((T * E_GLOBAL,) + obs.shape[2:]))
    logp = torch.log_softmax(logits, -1).gather(-1, actions.reshape(-1, 1)).reshape(T, E_GLOBAL)
    values = values.reshape(T, E_GLOBAL)
advantages = torch.from_numpy(rng.normal(2.0, 3.0, (T, E_GLOBAL)).astype(np.float32)).to(dtype)
returns = values + advantages


def mine(x):
    part = x[:, first:first + local]
    return part.reshape((T * local,) + tuple(x.shape[2:]))


batch = Batch(obs=mine(obs), actions=mine(actions), logprobs=mine(logp), values=mine(values),
              advantages=mine(advantages), returns=mine(returns))
learner = PPOLearner(model, optimizer, cfg, seed=5)
for iteration in range(1, iterations + 1):
    stats = learner.update(batch, iteration, first, local, T,
                           share=local * layout.world_size / layout.total if weighted else 1.0)
agree, _ = dist.parameters_agree(model, "final")
assert agree, "ranks disagree"
if topo.rank == 0:
    torch.save({"params": model.state_dict(), "initial": initial, "kl": stats.approx_kl}, out)
