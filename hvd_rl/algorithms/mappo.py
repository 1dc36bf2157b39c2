"""MAPPO and IPPO: cooperative multi-agent PPO on the PPO machinery (hvd_rl/algorithms/ppo.py).

Centralised training, decentralised execution (CTDE): one actor shared by every agent (parameter
sharing, with a one-hot agent id in its input) acts on each agent's local observation alone; the
critic, used only in training, sees the global state (MAPPO: the environment's state, or every
agent's observation concatenated) or the agent's own observation (IPPO). Value targets are
normalised by running statistics (MAPPO's finding), GAE runs per agent, and agents that are done
while the others go on are masked out of the loss and of the advantage statistics.

Distributed exactly as PPO: every agent of every environment is a column of the rollout
(hvd_rl/algorithms/multiagent_rollout.py), minibatches are drawn per global column, and the
masked loss of each rank is its counted samples' share of the mean over all ranks' counted
samples (the counts of every minibatch ride in the advantage statistics' one allreduce), so N
ranks compute the update one process computes on the same environments. Gradients are averaged
by the same hvd.DistributedOptimizer, with the same compression, checkpoint and preemption paths.
"""
from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import torch
from torch import nn

from hvd_rl.algorithms.base import IterationContext, IterationReport
from hvd_rl.algorithms.models import build_multiagent_model
from hvd_rl.algorithms.multiagent_rollout import (InputRows, MultiAgentBuffer, MultiAgentCollector,
                                                  MultiAgentEpisodes)
from hvd_rl.algorithms.normalize import ValueNormalizer
from hvd_rl.algorithms.ppo import PPO, Batch, compute_gae, update_sums
from hvd_rl.config import TrainConfig
from hvd_rl.envs.multiagent import describe, make_multiagent_envs
from hvd_rl.envs.vector import EnvLayout


class MAPPO(PPO):
    name = "mappo"
    centralised = True  # the critic sees the global state
    supports_uneven_layout = False

    def __init__(self, cfg: TrainConfig, device: torch.device, threads: int,
                 observation_space: gym.Space, action_space: gym.Space):
        m = cfg.multiagent
        self.spec = describe(cfg.env.id, m.num_agents, cfg.env.max_episode_steps)
        self.inputs = InputRows(self.spec, m.agent_id, self.centralised)
        row_space = gym.spaces.Box(-np.inf, np.inf, (self.inputs.width,), np.float32)
        super().__init__(cfg, device, threads, row_space, self.spec.action_space)
        self.value_norm = ValueNormalizer() if m.value_normalization else None
        self.ma_collector: MultiAgentCollector | None = None
        self.ma_buffer: MultiAgentBuffer | None = None
        self.stat_names: tuple[str, ...] = ()

    def _build_model(self) -> nn.Module:
        return build_multiagent_model(self.cfg.model, self.inputs.actor_width, self.inputs.critic_width,
                                      self.spec.action_space, self.centralised)

    # ---- identity and state ----

    def signature(self) -> dict[str, Any]:
        return {**super().signature(), "agents": list(self.spec.agents)}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "value_norm": self.value_norm.state_dict() if self.value_norm else {}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if self.value_norm is not None and state.get("value_norm"):
            self.value_norm.load_state_dict(state["value_norm"])

    def broadcast(self) -> None:
        super().broadcast()
        if self.value_norm is not None:
            from hvd_rl.runtime import distributed as dist

            self.value_norm.load_state_dict(dist.broadcast_object(self.value_norm.state_dict(),
                                                                  name=f"{self.name}.value_norm"))

    def parameters_module(self) -> nn.Module:
        """The networks and the value-normalisation statistics, checked identical on every rank."""
        if self.value_norm is None:
            return self.model
        statistics = nn.Module()
        stats = self.value_norm.stats
        for field_name, value in (("count", stats.count), ("mean", stats.mean), ("m2", stats.m2)):
            statistics.register_buffer(f"value_{field_name}", torch.as_tensor(np.asarray(value)))
        return nn.ModuleDict({"model": self.model, "statistics": statistics})

    def describe(self) -> str:
        p = self.cfg.ppo
        critic = "centralised critic (global state)" if self.centralised else "critic on own observation"
        return (f"{self.spec.num_agents} agents per env, shared actor, {critic}, "
                f"value normalisation {'on' if self.value_norm else 'off'}, precision {self.precision.mode}, "
                f"{p.num_steps} steps x {self.cfg.env.num_envs} envs per rank, "
                f"{p.num_minibatches} minibatches x {p.update_epochs} epochs")

    # ---- environments ----

    def build_envs(self, layout: EnvLayout, rank: int, seeds: list[int]) -> None:
        if self.ma_collector is not None:
            self.ma_collector.close()
        num_envs = layout.counts[rank]
        m, e = self.cfg.multiagent, self.cfg.env
        envs = make_multiagent_envs(e.id, num_envs, m.num_agents, e.max_episode_steps)
        self.stat_names = tuple(getattr(envs, "stat_names", ()))
        self.ma_buffer = MultiAgentBuffer(self.cfg.ppo.num_steps, num_envs, self.spec.num_agents,
                                          self.inputs.width, self.spec.action_space, self.device)
        self.ma_collector = MultiAgentCollector(envs, self.model, self.inputs, self.ma_buffer, self.device,
                                                seeds, self.value_norm)

    # ---- one iteration ----

    def iterate(self, context: IterationContext) -> IterationReport:
        cfg = self.cfg
        lr = self._anneal_learning_rate(context)
        steps, layout, rank = context.env_steps, context.layout, context.rank
        A = self.spec.num_agents

        last_value, times, episodes = self.ma_collector.collect(steps)
        batch = self._batch(last_value, steps)
        inject = cfg.debug.nan_at_iteration == context.iteration and cfg.debug.nan_rank == rank
        self.learner.loss_hook = (lambda loss: loss * float("nan")) if inject else None
        stats = self.learner.update(batch, context.iteration, layout.first(rank) * A, layout.counts[rank] * A,
                                    steps, stop_requested=context.stop_requested)

        return IterationReport(
            metrics={"time_env": times.env, "time_inference": times.inference, "time_update": stats.time_update},
            sums={**update_sums(stats, batch.returns, batch.values, batch.mask), **self._episode_sums(episodes)},
            episode_returns=episodes.team_returns, episode_lengths=episodes.lengths,
            stop_agreed=stats.stop_requested, finite=("policy_loss", "value_loss"),
            extra={"approx_kl": stats.approx_kl, "learning_rate": lr, "epochs_run": stats.epochs_run,
                   "grad_norm": stats.grad_norm, "precision": self.precision.mode})

    def _batch(self, last_value: torch.Tensor, steps: int) -> Batch:
        """GAE per agent column in return units; then the value statistics take this batch's
        counted targets (all ranks), and the critic learns targets in normalised units."""
        buf, p = self.ma_buffer, self.cfg.ppo
        T, C = steps, buf.columns

        def flat(x: torch.Tensor) -> torch.Tensor:
            return x[:T].reshape((T, C) + tuple(x.shape[3:]))

        advantages, returns = compute_gae(flat(buf.rewards), flat(buf.values), flat(buf.terminated),
                                          flat(buf.truncated), flat(buf.bootstrap_values),
                                          last_value.reshape(C), p.gamma, p.gae_lambda)
        mask = flat(buf.mask).reshape(-1)
        advantages, returns = advantages.reshape(-1) * mask, returns.reshape(-1) * mask
        old_values = flat(buf.raw_values).reshape(-1)
        if self.value_norm is not None:
            counted = returns[mask > 0].double().cpu().numpy()
            self.value_norm.update(counted, name=f"{self.name}.value_statistics")
            returns = self.value_norm.normalize(returns) * mask
        actions = flat(buf.actions).reshape((T * C,) + tuple(buf.actions.shape[3:]))
        return Batch(obs=flat(buf.rows).reshape(T * C, -1), actions=actions, logprobs=flat(buf.logprobs).reshape(-1),
                     values=old_values, advantages=advantages, returns=returns, mask=mask)

    def _episode_sums(self, episodes: MultiAgentEpisodes) -> dict[str, float]:
        """Per-agent returns and per-episode statistics, summed here and over ranks (every rank
        sends the same keys: the agents and the family's statistic names)."""
        sums = {"episodes": float(len(episodes.team_returns))}
        agent_totals = np.sum(np.asarray(episodes.agent_returns, np.float64).reshape(-1, self.spec.num_agents), axis=0)
        for agent, total in zip(self.spec.agents, agent_totals):
            sums[f"return_{agent}"] = float(total)
        for name in self.stat_names:
            sums[f"episode_{name}"] = float(sum(s.get(name, 0.0) for s in episodes.stats))
        return sums

    def global_metrics(self, means: dict[str, float], sums: dict[str, float]) -> dict[str, Any]:
        out = super().global_metrics(means, sums)
        n = sums["episodes"]
        for agent in self.spec.agents:
            out[f"return_{agent}"] = sums[f"return_{agent}"] / n if n else None
        for name in self.stat_names:  # a rate is already per episode (a count is not)
            key = name if name.endswith("_rate") else f"{name}_per_episode"
            out[key] = sums[f"episode_{name}"] / n if n else None
        return out

    @torch.no_grad()
    def act(self, observations: np.ndarray, greedy: bool) -> np.ndarray:
        """Actions for [E, A, D] local observations (the actor needs no state: decentralised
        execution; the critic's columns are left zero)."""
        E, A = observations.shape[:2]
        state = np.zeros((E, self.spec.state_dim), np.float32)
        rows = torch.from_numpy(self.inputs(np.asarray(observations, np.float32), state)).to(self.device)
        policy, _ = self.model(rows.reshape(E * A, -1))
        actions = self.model.mode(policy) if greedy else self.model.sample(policy)[0]
        actions = actions.cpu().numpy().reshape((E, A) + tuple(self.spec.action_space.shape))
        if isinstance(self.spec.action_space, gym.spaces.Box):
            actions = np.clip(actions, self.spec.action_space.low, self.spec.action_space.high)
        return actions

    def close(self) -> None:
        if self.ma_collector is not None:
            self.ma_collector.close()
            self.ma_collector = None


class IPPO(MAPPO):
    """Independent PPO with parameter sharing: the critic sees only the agent's own observation."""

    name = "ippo"
    centralised = False
