"""Worker: ranks build differently-initialised models; after broadcast_state they must agree."""
import json
import sys

import gymnasium as gym
import numpy as np
import torch

from hvd_rl.runtime import distributed as dist
from hvd_rl.config import ModelConfig
from hvd_rl.algorithms.models import build_model

topo = dist.init()
torch.manual_seed(100 + topo.rank)  # deliberately different on every rank
model = build_model(ModelConfig(kind="mlp"), gym.spaces.Box(-1, 1, (4,), np.float32), gym.spaces.Discrete(2))
optimizer = dist.distributed_optimizer(torch.optim.Adam(model.parameters(), lr=1e-3 * (topo.rank + 1)),
                                       model, reduction="average", compression="none",
                                       backward_passes_per_step=1)
before = dist.parameters_agree(model, "before")[0]
dist.broadcast_state(model, optimizer, has_optimizer_state=False)
after = dist.parameters_agree(model, "after")[0]
lr = dist.allgather_object(optimizer.param_groups[0]["lr"], name="lr")
# Rank-dependent data; averaged gradients keep parameters identical.
for step in range(3):
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(step * 10 + topo.rank))
    logits, value = model(x)
    optimizer.zero_grad()
    (logits.pow(2).mean() + value.pow(2).mean()).backward()
    optimizer.step()
trained = dist.parameters_agree(model, "trained")
# Optimizer state (Adam moments) travels too: perturb rank 1's and broadcast it.
if topo.rank == 1:
    for state in optimizer.state.values():
        state["exp_avg"].add_(1.0)
dist.broadcast_state(model, optimizer, has_optimizer_state=True)
moments = dist.allgather_object(float(sum(s["exp_avg"].sum() for s in optimizer.state.values())), name="m")
if topo.rank == 0:
    sys.stdout.write(json.dumps({"before": before, "after": after, "lr": lr, "trained": trained[0],
                      "moments": moments}) + "\n")
    sys.stdout.flush()
sys.exit(0)
