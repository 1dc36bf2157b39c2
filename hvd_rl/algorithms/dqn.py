"""DQN with experience replay (CleanRL's dqn.py and dqn_atari.py), distributed with Horovod.

Every rank steps its own environments with an epsilon-greedy policy and keeps their transitions
in its own replay shard (hvd_rl/algorithms/replay.py: frames stored once). Updates follow the *global* env
step, which every rank knows, so all ranks take the same decisions without talking:
- a gradient update each time the global step crosses a multiple of `train_frequency`: every
  rank draws its share of `batch_size` from its shard, Horovod averages the gradients, so one
  update sees `batch_size` samples as in the single-process recipe. Updates per global env step
  (the replay ratio) stay 1/train_frequency, however many ranks there are;
- the target network is updated when the global step crosses a multiple of
  `target_network_frequency`, at the same step on every rank;
- epsilon anneals with the global step, or (Ape-X) each global environment i of N explores with
  its own fixed eps^(1 + alpha i / (N - 1)).
Learning starts once `learning_starts` global steps have run and the shards hold
`learning_starts` transitions over all ranks (each rank its share, capped at its shard's
capacity: `buffer_size // world` may not divide evenly), which also refills them after a resume
that could not restore them (`dqn.checkpoint_replay = false`). Every rank owns the same number
of environments and the shards are started, refilled and restored together, so every rank's
shard holds the same number of transitions and the start is decided alike on every rank.
Until the first update, `td_loss` and `q_values` are NaN (null in metrics.jsonl).
"""
from __future__ import annotations

import copy
import math
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hvd_rl.runtime import distributed as dist
from hvd_rl.algorithms.base import Algorithm, IterationContext, IterationReport, NonFiniteLossError, UnsupportedSetup
from hvd_rl.runtime.checkpoint import save_rank_file, verified_rank_file, warn
from hvd_rl.config import TrainConfig
from hvd_rl.envs.vector import EnvLayout, RankEnvs
from hvd_rl.algorithms.models import build_q_network, model_signature
from hvd_rl.runtime.precision import precision_for
from hvd_rl.algorithms.replay import ReplayShard

REPLAY_DIR = "replay"  # <run_dir>/replay/rank<r>.npz: each rank's shard, when checkpointed


def linear_schedule(start: float, end: float, duration: float, t: int) -> float:
    return max(end, start + (end - start) * t / duration) if duration > 0 else end


def crossings(before: int, after: int, period: int) -> int:
    """How many multiples of `period` lie in (before, after]."""
    return after // period - before // period


class DQN(Algorithm):
    name = "dqn"

    def __init__(self, cfg: TrainConfig, device: torch.device, threads: int,
                 observation_space: gym.Space, action_space: gym.Space):
        super().__init__(cfg, device, threads, observation_space, action_space)
        if not isinstance(action_space, gym.spaces.Discrete):
            raise UnsupportedSetup(f"algorithm 'dqn' needs discrete actions, but {cfg.env.id} has "
                                   f"{action_space}; use algorithm = 'ppo' for continuous control")
        q, d = cfg.dqn, cfg.distributed
        self.q_network = build_q_network(cfg.model, observation_space, action_space).to(device)
        self.precision = precision_for(d.amp, device, convolutional=len(observation_space.shape) == 3)
        self.precision_mode = self.precision.mode
        self.q_network.precision = self.precision
        self.target_network = copy.deepcopy(self.q_network)
        self.target_network.requires_grad_(False)
        base = self.precision.adam(self.q_network.parameters(), lr=q.learning_rate, eps=q.adam_eps)
        self.optimizer = dist.distributed_optimizer(base, self.q_network, reduction=d.reduction,
                                                    compression=d.compression, backward_passes_per_step=1,
                                                    powersgd_rank=d.powersgd_rank, topk_ratio=d.topk_ratio,
                                                    seed=cfg.seed)
        # Adasum: Horovod's optimizer steps on each rank's own gradient in the backward hooks and
        # Adasum-combines the steps in `step()` (no synchronize/skip_synchronize, no clipping:
        # validate() refuses dqn.max_grad_norm > 0 with it).
        self.adasum = d.reduction == "adasum"
        self.envs: RankEnvs | None = None
        self.replay: ReplayShard | None = None
        self.obs: np.ndarray | None = None
        self.rng = np.random.default_rng(cfg.seed)
        self.env_epsilons: np.ndarray | None = None  # Ape-X: fixed per environment
        self.local_batch = q.batch_size
        self.replay_capacity = q.buffer_size
        self.learning_needs = q.learning_starts  # transitions in this rank's shard before learning
        self.world_size = 1

    # ---- identity and state ----

    def signature(self) -> dict[str, Any]:
        return model_signature(self.observation_space, self.action_space, self.q_network)

    def state_dict(self) -> dict[str, Any]:
        return {"q_network": self.q_network.state_dict(), "target_network": self.target_network.state_dict(),
                "optimizer": self.optimizer.state_dict(), "precision": self.precision.mode}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.q_network.load_state_dict(state["q_network"])
        self.target_network.load_state_dict(state["target_network"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.precision.keep_adam_kernel(self.optimizer)

    def broadcast(self) -> None:
        has_state = dist.broadcast_object(len(self.optimizer.state) > 0, name="dqn.has_optimizer_state")
        dist.broadcast_state(self.q_network, self.optimizer, has_optimizer_state=has_state)
        dist.broadcast_module(self.target_network, name="dqn.target")

    def parameters_module(self) -> nn.Module:
        return self.q_network

    def describe(self) -> str:
        q = self.cfg.dqn
        return (f"precision {self.precision.mode}, replay {q.buffer_size} transitions over all ranks, "
                f"batch {q.batch_size}, one update per {q.train_frequency} global env steps")

    # ---- replay shards on disk (optional) ----

    def save_local(self, run_dir: Path, iteration: int, rank: int) -> None:
        """This rank's replay shard, written the way every per-rank file is (checkpoint.save_rank_file:
        atomic rename, manifest with the checkpoint's iteration and the file's sha256)."""
        if not self.cfg.dqn.checkpoint_replay or self.replay is None:
            return
        state = self.replay.state()
        save_rank_file(Path(run_dir) / REPLAY_DIR / f"rank{rank:05d}.npz",
                       lambda f: np.savez(f, iteration=np.array(iteration), **state), iteration)

    def load_local(self, run_dir: Path, iteration: int, rank: int) -> bool:
        """Restores this rank's shard if one was saved with the checkpoint being resumed."""
        path = Path(run_dir) / REPLAY_DIR / f"rank{rank:05d}.npz"
        if not self.cfg.dqn.checkpoint_replay or self.replay is None or not path.exists():
            return False
        problem = verified_rank_file(path, iteration)
        if problem is not None:
            if "iteration" not in problem:  # another checkpoint's shard is expected after a rollback
                warn(f"rank {rank}: replay shard {path} is unreadable ({problem}); discarding it")
                self.discard_local()
            return False
        try:
            with np.load(path) as data:
                self.replay.load({k: data[k] for k in data.files if k != "iteration"})
        except Exception as exc:  # noqa: BLE001 - unreadable despite its manifest (BadZipFile, zlib, EOF...)
            # Reported as "not restored": the runtime's allreduce makes every rank refill.
            warn(f"rank {rank}: replay shard {path} is unreadable ({type(exc).__name__}: {exc}); "
                 "discarding it")
            self.discard_local()
            return False
        self.replay.start(self.obs)  # the rebuilt environments' first observations
        return True

    def discard_local(self) -> None:
        space = self.envs.single_observation_space
        self.replay = ReplayShard(self.replay_capacity, len(self.obs), tuple(space.shape), space.dtype,
                                  self.cfg.env.frame_stack)
        self.replay.start(self.obs)

    # ---- environments ----

    def build_envs(self, layout: EnvLayout, rank: int, seeds: list[int]) -> None:
        if not layout.is_even:
            raise UnsupportedSetup("algorithm 'dqn' needs the same number of environments on every rank")
        self.close()
        q = self.cfg.dqn
        num_envs = layout.counts[rank]
        self.envs = RankEnvs(replace(self.cfg.env, num_envs=num_envs), threads=self.threads)
        space = self.envs.single_observation_space
        self.replay_capacity = max(q.buffer_size // layout.world_size, num_envs)
        self.replay = ReplayShard(self.replay_capacity, num_envs, tuple(space.shape), space.dtype,
                                  self.cfg.env.frame_stack)
        # This rank's share of learning_starts, capped at what its shard can hold (3 ranks share
        # 10000 as 3 x 3333): the same number on every rank (the layout is even).
        self.learning_needs = min(math.ceil(q.learning_starts / layout.world_size), self.replay.capacity)
        self.world_size = layout.world_size
        self.obs = self.envs.reset(seeds)
        self.replay.start(self.obs)
        self.rng = np.random.default_rng(seeds[0])
        self.local_batch = max(1, q.batch_size // layout.world_size)
        if q.apex_epsilon:
            n = layout.total
            index = np.arange(layout.first(rank), layout.first(rank) + num_envs)
            self.env_epsilons = q.apex_base_epsilon ** (1 + q.apex_alpha * index / max(1, n - 1))

    def rollout_length(self, remaining_steps: int, layout: EnvLayout) -> int:
        per_iteration = max(1, self.cfg.dqn.steps_per_iteration // layout.total)
        return min(per_iteration, remaining_steps // layout.total)

    # ---- one iteration ----

    def _epsilon(self, global_step: int) -> np.ndarray | float:
        if self.env_epsilons is not None:
            return self.env_epsilons
        q = self.cfg.dqn
        return linear_schedule(q.start_e, q.end_e, q.exploration_fraction * q.total_timesteps, global_step)

    def iterate(self, context: IterationContext) -> IterationReport:
        q = self.cfg.dqn
        total_envs = context.layout.total
        step = context.global_step
        times = {"env": 0.0, "inference": 0.0, "update": 0.0}
        losses, q_values = [], []
        returns: list[float] = []
        lengths: list[int] = []
        updates = 0
        stop = False
        clock = time.perf_counter
        for _ in range(context.env_steps):
            t0 = clock()
            actions = self._epsilon_greedy(self.obs, self._epsilon(step))
            t1 = clock()
            result = self.envs.step(actions)
            t2 = clock()
            final = {int(e): result.final_obs[i] for i, e in enumerate(np.flatnonzero(result.truncated))} \
                if result.final_obs is not None else {}
            self.replay.add(actions, result.reward, result.terminated, result.obs, final)
            self.obs = result.obs
            returns += result.episode_returns
            lengths += result.episode_lengths
            before, step = step, step + total_envs
            times["inference"] += t1 - t0
            times["env"] += t2 - t1
            if step >= q.learning_starts and len(self.replay) >= self.learning_needs:
                for _ in range(crossings(before, step, q.train_frequency)):
                    t3 = clock()
                    blocked = dist.CLOCK.seconds
                    loss, q_mean, stop_votes = self._update(context.iteration, context.stop_requested())
                    losses.append(loss)
                    q_values.append(q_mean)
                    updates += 1
                    # compute only: the allreduce waits are in dist.CLOCK (time_allreduce/time_wait)
                    times["update"] += clock() - t3 - (dist.CLOCK.seconds - blocked)
                    stop = stop or stop_votes  # rides along with the gradient allreduce
            if crossings(before, step, q.target_network_frequency):
                self._update_target()
        # No update this iteration (the shards are still filling): NaN, written as null, and not
        # checked for finiteness. `updates` is the same on every rank (a function of the global
        # step and of shard sizes that are equal everywhere), so is the `finite` tuple.
        return IterationReport(
            metrics={"td_loss": float(np.mean(losses)) if losses else math.nan,
                     "q_values": float(np.mean(q_values)) if q_values else math.nan,
                     "time_env": times["env"], "time_inference": times["inference"],
                     "time_update": max(0.0, times["update"])},
            sums={"replay_size": float(len(self.replay))},
            episode_returns=returns, episode_lengths=lengths, stop_agreed=stop,
            finite=("td_loss",) if updates else (),
            extra={"epsilon": float(np.mean(self._epsilon(step))), "updates": updates,
                   "updates_per_env_step": updates / max(1, context.env_steps * total_envs),
                   # what was drawn: each rank's share (batch_size // world) on every rank
                   "samples_per_env_step": updates * self.local_batch * self.world_size
                   / max(1, context.env_steps * total_envs),
                   "learning_rate": q.learning_rate, "precision": self.precision.mode})

    def _epsilon_greedy(self, observations: np.ndarray, epsilon: np.ndarray | float) -> np.ndarray:
        """Random actions where a draw falls below epsilon, greedy ones elsewhere; the Q-network
        runs only when some environment acts greedily (early in a run, almost none does)."""
        n = len(observations)
        explore = self.rng.random(n) < epsilon
        random_actions = self.rng.integers(0, self.action_space.n, n)
        if explore.all():
            return random_actions
        with torch.no_grad():
            greedy = self.q_network(torch.from_numpy(observations).to(self.device)).argmax(-1).cpu().numpy()
        return np.where(explore, random_actions, greedy)

    def _update(self, iteration: int, stop_requested: bool) -> tuple[float, float, bool]:
        """One gradient step on `batch_size` samples over all ranks (this rank draws its share).
        Returns the loss, the mean Q-value and whether any rank asked to stop."""
        q = self.cfg.dqn
        batch = self.replay.sample(self.local_batch, self.rng)
        to = lambda x: torch.from_numpy(x).to(self.device)  # noqa: E731
        obs, next_obs = to(batch.obs), to(batch.next_obs)
        with torch.no_grad():
            target_max = self.target_network(next_obs).max(dim=1).values
            td_target = to(batch.rewards) + q.gamma * target_max * (1.0 - to(batch.dones))
        values = self.q_network(obs).gather(1, to(batch.actions).long().view(-1, 1)).squeeze(1)
        loss = F.mse_loss(values, td_target)
        self.optimizer.zero_grad()
        loss.backward()
        control = dist.allreduce_sum_async([1.0 if stop_requested else 0.0], name="dqn.control")
        if self.adasum:
            t0 = time.perf_counter()
            self.optimizer.step()  # combines the ranks' steps (Adasum), identical on every rank
            dist.CLOCK.add(1, time.perf_counter() - t0)
            # The combined parameters are identical on every rank, so is this decision.
            if not all(torch.isfinite(p).all() for p in self.q_network.parameters()):
                raise NonFiniteLossError(f"non-finite loss/gradient at iteration {iteration}; stopping all ranks")
            return float(loss.detach()), float(values.detach().mean()), bool(dist.wait_sum(control)[0] > 0)
        t0 = time.perf_counter()
        self.optimizer.synchronize()
        dist.CLOCK.add(1, time.perf_counter() - t0)
        norm = torch.nn.utils.clip_grad_norm_(self.q_network.parameters(),
                                              q.max_grad_norm if q.max_grad_norm > 0 else float("inf"))
        if not torch.isfinite(norm):  # the averaged gradient is identical on every rank
            raise NonFiniteLossError(f"non-finite loss/gradient at iteration {iteration}; stopping all ranks")
        with self.optimizer.skip_synchronize():
            self.optimizer.step()
        return float(loss.detach()), float(values.detach().mean()), bool(dist.wait_sum(control)[0] > 0)

    def _update_target(self) -> None:
        tau = self.cfg.dqn.tau
        with torch.no_grad():
            for target, online in zip(self.target_network.parameters(), self.q_network.parameters()):
                target.mul_(1.0 - tau).add_(online, alpha=tau) if tau < 1.0 else target.copy_(online)

    def act(self, observations: np.ndarray, greedy: bool) -> np.ndarray:
        """Evaluation: greedy, or with CleanRL's dqn evaluation epsilon (0.05)."""
        return self._epsilon_greedy(np.asarray(observations), 0.0 if greedy else 0.05)

    def close(self) -> None:
        if self.envs is not None:
            self.envs.close()
            self.envs = None
