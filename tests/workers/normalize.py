"""Worker: running observation/return statistics merged over ranks equal one process's.

usage: normalize.py OUT.json. Every rank takes its share (by global env index, an uneven split on
2 ranks) of a fixed global data set over 3 "iterations", syncs after each, and rank 0 writes the
statistics every rank ended with.
"""
import json
import sys

import numpy as np

from hvd_rl.runtime import distributed as dist
from hvd_rl.algorithms.normalize import ReturnScaler, RunningNormalizer

out = sys.argv[1]
topo = dist.init()
ENVS, STEPS, DIM = 5, 40, 3
shares = {1: [range(0, 5)], 2: [range(0, 2), range(2, 5)]}[topo.size]
mine = list(shares[topo.rank])
rng = np.random.default_rng(0)
data = rng.normal(3.0, 2.0, size=(3, STEPS, ENVS, DIM)) * np.array([1.0, 10.0, 0.1])
rewards = rng.normal(1.0, 1.0, size=(3, STEPS, ENVS))
dones = rng.random((3, STEPS, ENVS)) < 0.05

normalizer = RunningNormalizer((DIM,), clip=10.0)
scaler = ReturnScaler(len(mine), gamma=0.99, clip=10.0)
for it in range(3):
    for t in range(STEPS):
        normalizer.observe(data[it, t, mine])
        scaler.scale(rewards[it, t, mine], dones[it, t, mine])
    normalizer.sync(f"test.obs.{it}")
    scaler.sync(f"test.ret.{it}")
states = dist.allgather_object({"obs": normalizer.state_dict(), "ret": scaler.state_dict()}, name="test.states")
if topo.rank == 0:
    json.dump({"states": states, "expected_mean": data.reshape(-1, DIM).mean(0).tolist(),
               "expected_var": data.reshape(-1, DIM).var(0).tolist()}, open(out, "w"))
