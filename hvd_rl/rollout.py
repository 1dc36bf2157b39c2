"""Rollout collection: the per-step hot path, kept free of avoidable copies and Python overhead.

Observations go straight from the environment's array into a preallocated buffer (one copy) and
the policy reads them from there; actions are sampled with the Gumbel-max trick; nothing on this
path allocates per-step Python objects beyond what the environments return.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from hvd_rl.envs import RankEnvs
from hvd_rl.models import ActorCritic, InferencePolicy
from hvd_rl.ppo import Batch, compute_gae


@dataclass
class RolloutTimes:
    env: float = 0.0
    inference: float = 0.0


@dataclass
class Episodes:
    returns: list[float] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)


class RolloutBuffer:
    """[T, E] storage for one rollout on this rank."""

    def __init__(self, num_steps: int, num_envs: int, obs_shape: tuple[int, ...],
                 obs_dtype: torch.dtype, device: torch.device):
        self.num_steps, self.num_envs = num_steps, num_envs
        shape = (num_steps, num_envs)
        self.obs = torch.zeros(shape + obs_shape, dtype=obs_dtype, device=device)
        self.actions = torch.zeros(shape, dtype=torch.long, device=device)
        self.logprobs = torch.zeros(shape, device=device)
        self.values = torch.zeros(shape, device=device)
        self.rewards = torch.zeros(shape, device=device)
        self.terminated = torch.zeros(shape, device=device)
        self.truncated = torch.zeros(shape, device=device)
        self.bootstrap_values = torch.zeros(shape, device=device)

    def to_batch(self, last_value: torch.Tensor, gamma: float, gae_lambda: float,
                 num_steps: int | None = None) -> Batch:
        """GAE over the first `num_steps` steps (all by default), flattened to t * E + e order."""
        T = num_steps or self.num_steps
        advantages, returns = compute_gae(self.rewards[:T], self.values[:T], self.terminated[:T],
                                          self.truncated[:T], self.bootstrap_values[:T], last_value,
                                          gamma, gae_lambda)
        flat = T * self.num_envs
        return Batch(
            obs=self.obs[:T].reshape((flat,) + tuple(self.obs.shape[2:])),
            actions=self.actions[:T].reshape(flat), logprobs=self.logprobs[:T].reshape(flat),
            values=self.values[:T].reshape(flat), advantages=advantages.reshape(flat),
            returns=returns.reshape(flat))


def sample_actions(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Categorical sampling via Gumbel-max; returns (actions, log-probabilities)."""
    log_probs = torch.log_softmax(logits, dim=-1)
    gumbel = -torch.log(-torch.log(torch.rand_like(log_probs).clamp_(min=1e-20)))
    actions = torch.argmax(log_probs + gumbel, dim=-1)
    return actions, log_probs.gather(-1, actions.unsqueeze(-1)).squeeze(-1)


class RolloutCollector:
    def __init__(self, envs: RankEnvs, model: ActorCritic, buffer: RolloutBuffer,
                 device: torch.device, seeds: list[int]):
        self.envs, self.buffer, self.device = envs, buffer, device
        self.policy = InferencePolicy(model)
        self.next_obs = envs.reset(seeds)
        self.on_cpu = device.type == "cpu"

    @torch.no_grad()
    def collect(self, num_steps: int | None = None) -> tuple[torch.Tensor, RolloutTimes, Episodes]:
        """Fills the buffer's first `num_steps` steps (all by default); returns V(last obs),
        times and the episodes that finished."""
        buf, model, envs = self.buffer, self.policy, self.envs
        model.sync()  # the weights the learner just produced
        times, episodes = RolloutTimes(), Episodes()
        clock = time.perf_counter
        for step in range(num_steps or buf.num_steps):
            t0 = clock()
            obs = buf.obs[step]
            obs.copy_(torch.from_numpy(self.next_obs), non_blocking=True)
            logits, value = model(obs)
            actions, logprobs = sample_actions(logits)
            buf.actions[step] = actions
            buf.logprobs[step] = logprobs
            buf.values[step] = value
            actions_np = actions.numpy() if self.on_cpu else actions.cpu().numpy()
            t1 = clock()
            result = envs.step(actions_np)
            t2 = clock()
            buf.rewards[step].copy_(torch.from_numpy(result.reward))
            buf.terminated[step].copy_(torch.from_numpy(result.terminated))
            buf.truncated[step].copy_(torch.from_numpy(result.truncated))
            if result.final_obs is not None:
                # Time-limit truncation: bootstrap from the value of the observation it ended on.
                rows = torch.from_numpy(np.flatnonzero(result.truncated)).to(self.device)
                final = torch.from_numpy(result.final_obs).to(self.device, buf.obs.dtype)
                boot = torch.zeros(buf.num_envs, device=self.device)
                boot[rows] = model.value(final)
                buf.bootstrap_values[step] = boot
            else:
                buf.bootstrap_values[step].zero_()
            if result.episode_returns:
                episodes.returns.extend(result.episode_returns)
                episodes.lengths.extend(result.episode_lengths)
            self.next_obs = result.obs
            t3 = clock()
            times.inference += (t1 - t0) + (t3 - t2)
            times.env += t2 - t1
        t0 = clock()
        last_obs = torch.from_numpy(self.next_obs).to(self.device, buf.obs.dtype)
        last_value = model.value(last_obs)
        times.inference += clock() - t0
        return last_value, times, episodes

    def close(self) -> None:
        self.envs.close()
