"""Worker: the PPO algorithm's broadcast gives every rank rank 0's loss scale and statistics.

usage: scaler.py. Ranks start with different GradScaler states (as after a resume, where only
rank 0 read the checkpoint, or in an elastic sync) and print what they hold after broadcast().
"""
import json

import gymnasium as gym
import numpy as np
import torch

from hvd_rl.runtime import distributed as dist
from hvd_rl.algorithms.ppo import PPO
from hvd_rl.config import TrainConfig

topo = dist.init()
cfg = TrainConfig()
cfg.ppo.normalize_observations = True
algo = PPO(cfg, torch.device("cpu"), 1, gym.spaces.Box(-1, 1, (3,), np.float32), gym.spaces.Discrete(2))
algo.learner.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** (10 + topo.rank), growth_interval=7)
algo.learner.scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
algo.obs_normalizer.observe(np.full((4, 3), float(topo.rank)))
algo.obs_normalizer.stats = algo.obs_normalizer.stats.merge(algo.obs_normalizer.pending)
before = algo.learner.scaler.get_scale()
algo.broadcast()
result = {"rank": topo.rank, "before": before, "after": algo.learner.scaler.get_scale(),
          "obs_mean": algo.obs_normalizer.stats.mean.tolist()}
print("SCALER " + json.dumps(result), flush=True)
