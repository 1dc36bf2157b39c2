"""Multi-agent rollouts: [T, E, A] storage and the collection loop, for MAPPO and IPPO.

Every agent of every environment is one column of the rollout (column e * A + a), so that GAE,
the minibatch plan and the exactness argument of the PPO learner (hvd_rl/algorithms/ppo.py) apply
per agent unchanged. An agent's input row is [its observation | one-hot id] for the actor and,
for MAPPO's centralised critic, [the global state | one-hot id] beside it.

Dead agents (done while the others go on): a step at which an agent does not act is stored with
mask 0, reward 0 and `terminated` set, so that nothing bootstraps through it and GAE restarts
cleanly at the agent's next episode; its action is sampled (the batch stays rectangular) but never
sent to the environment, and the learner's masked loss ignores the row.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import gymnasium as gym
import numpy as np
import torch

from hvd_rl.algorithms.models import InferencePolicy, MultiAgentActorCritic
from hvd_rl.algorithms.normalize import ValueNormalizer
from hvd_rl.algorithms.rollout import RolloutTimes
from hvd_rl.envs.multiagent import Episode, MultiAgentSpec


def input_widths(spec: MultiAgentSpec, agent_id: bool, centralised: bool) -> tuple[int, int]:
    """(actor columns, critic columns) of an agent's input row."""
    ids = spec.num_agents if agent_id else 0
    actor = int(np.prod(spec.observation_space.shape)) + ids
    return actor, (spec.state_dim + ids) if centralised else 0


class InputRows:
    """Builds agents' input rows from observations and states (numpy, float32)."""

    def __init__(self, spec: MultiAgentSpec, agent_id: bool, centralised: bool):
        self.spec, self.centralised = spec, centralised
        self.ids = np.eye(spec.num_agents, dtype=np.float32) if agent_id else None
        self.actor_width, self.critic_width = input_widths(spec, agent_id, centralised)

    @property
    def width(self) -> int:
        return self.actor_width + self.critic_width

    def __call__(self, obs: np.ndarray, state: np.ndarray) -> np.ndarray:
        """[E, A, D] observations and [E, S] states -> [E, A, width] rows."""
        E, A = obs.shape[:2]
        parts = [obs.reshape(E, A, -1)]
        ids = None if self.ids is None else np.broadcast_to(self.ids, (E, A, A))
        if ids is not None:
            parts.append(ids)
        if self.centralised:
            parts.append(np.broadcast_to(state[:, None, :], (E, A, state.shape[-1])))
            if ids is not None:
                parts.append(ids)
        return np.concatenate(parts, axis=-1).astype(np.float32, copy=False)


@dataclass
class MultiAgentEpisodes:
    team_returns: list[float] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    agent_returns: list[list[float]] = field(default_factory=list)
    stats: list[dict[str, float]] = field(default_factory=list)

    def add(self, episode: Episode) -> None:
        self.team_returns.append(episode.team_return)
        self.lengths.append(episode.length)
        self.agent_returns.append(episode.agent_returns)
        self.stats.append(episode.stats)


class MultiAgentBuffer:
    """[T, E, A] storage; `values` are in return units (for GAE), `raw_values` the critic's
    outputs (normalised units when value normalisation is on: the clipped value loss's anchor)."""

    def __init__(self, num_steps: int, num_envs: int, num_agents: int, width: int, action_space: gym.Space,
                 device: torch.device):
        self.num_steps, self.num_envs, self.num_agents = num_steps, num_envs, num_agents
        shape = (num_steps, num_envs, num_agents)
        self.rows = torch.zeros(shape + (width,), device=device)
        if isinstance(action_space, gym.spaces.Box):
            self.actions = torch.zeros(shape + tuple(action_space.shape), device=device)
        else:
            self.actions = torch.zeros(shape, dtype=torch.long, device=device)
        for name in ("logprobs", "values", "raw_values", "rewards", "terminated", "truncated",
                     "bootstrap_values", "mask"):
            setattr(self, name, torch.zeros(shape, device=device))

    @property
    def columns(self) -> int:
        return self.num_envs * self.num_agents


class MultiAgentCollector:
    def __init__(self, envs, model: MultiAgentActorCritic, rows: InputRows, buffer: MultiAgentBuffer,
                 device: torch.device, seeds: list[int], value_norm: ValueNormalizer | None):
        self.envs, self.rows, self.buffer, self.device = envs, rows, buffer, device
        self.policy = InferencePolicy(model)
        self.value_norm = value_norm
        space = envs.spec.action_space
        self.action_bounds = (space.low, space.high) if isinstance(space, gym.spaces.Box) else None
        obs, state, self.alive = envs.reset(seeds)
        self.next_rows = rows(obs, state)

    def _in_return_units(self, raw: torch.Tensor) -> torch.Tensor:
        return raw if self.value_norm is None else self.value_norm.denormalize(raw)

    @torch.no_grad()
    def collect(self, num_steps: int) -> tuple[torch.Tensor, RolloutTimes, MultiAgentEpisodes]:
        """Fills the first `num_steps` steps; returns V(last rows) [E, A] in return units, times and
        the episodes that finished."""
        buf, policy = self.buffer, self.policy
        policy.sync()
        times, episodes = RolloutTimes(), MultiAgentEpisodes()
        E, A = buf.num_envs, buf.num_agents
        clock = time.perf_counter
        for step in range(num_steps):
            t0 = clock()
            rows = buf.rows[step]
            rows.copy_(torch.from_numpy(self.next_rows))
            out, raw = policy(rows.reshape(E * A, -1))
            actions, logprobs = policy.sample(out)
            alive = torch.from_numpy(self.alive).to(self.device, buf.mask.dtype)
            buf.actions[step] = actions.reshape(buf.actions.shape[1:])
            buf.logprobs[step] = logprobs.reshape(E, A)
            buf.raw_values[step] = raw.reshape(E, A) * alive
            buf.values[step] = self._in_return_units(raw.reshape(E, A)) * alive
            buf.mask[step] = alive
            actions_np = buf.actions[step].cpu().numpy()
            if self.action_bounds is not None:  # the stored action stays the unclipped sample
                actions_np = np.clip(actions_np, *self.action_bounds)
            t1 = clock()
            result = self.envs.step(actions_np)
            t2 = clock()
            buf.rewards[step].copy_(torch.from_numpy(result.rewards) * alive)
            # A dead agent's step ends "its episode" again: nothing flows through it in GAE.
            buf.terminated[step].copy_(torch.from_numpy(result.terminated | ~self.alive))
            buf.truncated[step].copy_(torch.from_numpy(result.truncated & self.alive))
            buf.bootstrap_values[step].zero_()
            if result.final_obs is not None and result.truncated.any():
                final = torch.from_numpy(self.rows(result.final_obs, result.final_state)).to(self.device)
                boot = self._in_return_units(policy.value(final.reshape(E * A, -1))).reshape(E, A)
                buf.bootstrap_values[step] = boot * buf.truncated[step]
            for episode in result.episodes:
                episodes.add(episode)
            self.next_rows = self.rows(result.obs, result.state)
            self.alive = result.alive
            t3 = clock()
            times.inference += (t1 - t0) + (t3 - t2)
            times.env += t2 - t1
        t0 = clock()
        last = torch.from_numpy(self.next_rows).to(self.device, buf.rows.dtype).reshape(E * A, -1)
        last_value = self._in_return_units(policy.value(last)).reshape(E, A)
        times.inference += clock() - t0
        return last_value, times, episodes

    def close(self) -> None:
        self.envs.close()
