"""PPO (CleanRL's ppo_atari, ppo and ppo_continuous_action recipes), distributed with Horovod.

One iteration on every rank: collect `num_steps` steps of this rank's environments
(hvd_rl/algorithms/rollout.py), compute GAE, then `update_epochs` epochs over minibatches with gradients
averaged by Horovod. Discrete actions use a categorical policy, Box actions a diagonal Gaussian
with state-independent log-std (models.ActorCritic), with optional observation normalisation and
reward scaling whose statistics are merged over all ranks (hvd_rl/algorithms/normalize.py).

Exact N-rank == 1-process math rests on four choices made here:
1. Minibatches are drawn per *global* environment: every environment's timesteps are shuffled
   with a generator keyed by (seed, iteration, epoch, global env index) and split evenly over the
   minibatches, so the union over ranks of minibatch k is exactly the minibatch one process
   would draw from the whole batch, however the environments are spread over ranks.
2. Advantages are normalised with allreduced minibatch statistics (ppo.global_advantage_norm),
   all minibatches of all epochs in one allreduce.
3. Gradients are averaged by hvd.DistributedOptimizer after each rank's mean loss is scaled by its
   share of the minibatch (x world size), so uneven layouts give the global mean gradient too;
   clipping, Adam and every other step then see the one-process gradient.
4. KL early stopping and the stop flag use sums over all ranks, so every rank takes the same branch.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

import gymnasium as gym
import numpy as np
import torch
from torch import nn

from hvd_rl.runtime import distributed as dist
from hvd_rl.algorithms.base import Algorithm, IterationContext, IterationReport, NonFiniteLossError
from hvd_rl.config import PPOConfig, TrainConfig
from hvd_rl.envs.vector import EnvLayout, RankEnvs
from hvd_rl.algorithms.models import build_model, model_signature
from hvd_rl.algorithms.normalize import ReturnScaler, RunningNormalizer
from hvd_rl.runtime.precision import precision_for
from hvd_rl.algorithms.rollout import RolloutBuffer, RolloutCollector, take_rows
from hvd_rl.algorithms.sampler import OverlappedSampler, Rollout


# ---- GAE, minibatch layout, loss ----------------------------------------------------------------

def compute_gae(rewards: torch.Tensor, values: torch.Tensor, terminated: torch.Tensor,
                truncated: torch.Tensor, bootstrap_values: torch.Tensor, last_value: torch.Tensor,
                gamma: float, gae_lambda: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over a [T, E] rollout with SAME_STEP autoreset.

    terminated[t]: the episode ended at step t, nothing to bootstrap.
    truncated[t]: the episode was cut at step t; bootstrap from V(final_obs) = bootstrap_values[t].
    Either way, values[t + 1] belongs to the next episode and must not leak into step t.
    """
    num_steps = rewards.shape[0]
    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(last_value)
    ended = torch.maximum(terminated, truncated)
    for t in reversed(range(num_steps)):
        next_value = last_value if t == num_steps - 1 else values[t + 1]
        continues = 1.0 - ended[t]
        target = rewards[t] + gamma * (next_value * continues + bootstrap_values[t] * truncated[t])
        delta = target - values[t]
        running = delta + gamma * gae_lambda * continues * running
        advantages[t] = running
    return advantages, advantages + values


def minibatch_indices(seed: int, iteration: int, epoch: int, first_global_env: int,
                      local_envs: int, num_steps: int, num_minibatches: int) -> list[np.ndarray]:
    """Flat indices (t * local_envs + e) of this rank's share of each minibatch.

    Every environment's timesteps are shuffled by a generator keyed by (seed, iteration, epoch,
    global env index), so the order never depends on how envs are spread over ranks, and each
    rank draws only its own environments' rows (no rank touches the global batch).
    """
    order = np.stack([np.random.default_rng([seed, iteration, epoch, env]).permutation(num_steps)
                      for env in range(first_global_env, first_global_env + local_envs)])
    per_env = num_steps // num_minibatches
    env_index = np.arange(local_envs)[:, None]
    return [
        (order[:, k * per_env:(k + 1) * per_env] * local_envs + env_index).reshape(-1)
        for k in range(num_minibatches)
    ]


@dataclass
class Batch:
    """A flattened rollout on this rank ([T * E] leading dimension)."""

    obs: torch.Tensor
    actions: torch.Tensor
    logprobs: torch.Tensor
    values: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    # 1 for a sample that counts, 0 for one that does not (a dead agent's step, hvd_rl/algorithms/mappo.py):
    # the loss is then the mean over the counted samples of all ranks. None: every sample counts.
    mask: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.actions.shape[0]


@dataclass
class LossTerms:
    total: torch.Tensor
    policy: torch.Tensor
    value: torch.Tensor
    entropy: torch.Tensor
    approx_kl: torch.Tensor
    old_approx_kl: torch.Tensor
    clipfrac: torch.Tensor


def ppo_loss(new_logprobs: torch.Tensor, entropy: torch.Tensor, new_values: torch.Tensor,
             old_logprobs: torch.Tensor, old_values: torch.Tensor, advantages: torch.Tensor,
             returns: torch.Tensor, cfg: PPOConfig, mask: torch.Tensor | None = None,
             weights: torch.Tensor | None = None) -> LossTerms:
    """CleanRL's PPO loss: clipped surrogate, (optionally clipped) value loss, entropy bonus.

    `advantages` arrive already normalised when cfg.norm_adv is set. With a `mask`, `total` is
    the sum of the samples' terms times `weights` (each counted sample's share of the mean over
    all ranks' counted samples, hence 0 for the others); the terms reported beside it are means
    over this part's counted samples.
    """
    logratio = new_logprobs - old_logprobs
    ratio = logratio.exp()

    def mean(x: torch.Tensor) -> torch.Tensor:
        return x.mean() if mask is None else (x * mask).sum() / mask.sum().clamp(min=1.0)

    with torch.no_grad():
        approx_kl = mean((ratio - 1) - logratio)  # the low-variance k3 estimator
        old_approx_kl = mean(-logratio)
        clipfrac = mean(((ratio - 1.0).abs() > cfg.clip_coef).to(ratio.dtype))
    pg = torch.max(-advantages * ratio, -advantages * torch.clamp(ratio, 1 - cfg.clip_coef, 1 + cfg.clip_coef))
    if cfg.clip_vloss:
        v_unclipped = (new_values - returns) ** 2
        v_clipped = old_values + torch.clamp(new_values - old_values, -cfg.clip_coef, cfg.clip_coef)
        v = 0.5 * torch.max(v_unclipped, (v_clipped - returns) ** 2)
    else:
        v = 0.5 * ((new_values - returns) ** 2)
    if mask is None:
        pg_loss, v_loss, entropy_mean = pg.mean(), v.mean(), entropy.mean()
        total = pg_loss - cfg.ent_coef * entropy_mean + cfg.vf_coef * v_loss
        return LossTerms(total, pg_loss, v_loss, entropy_mean, approx_kl, old_approx_kl, clipfrac)
    total = (weights * (pg - cfg.ent_coef * entropy + cfg.vf_coef * v)).sum()
    with torch.no_grad():
        return LossTerms(total, mean(pg), mean(v), mean(entropy), approx_kl, old_approx_kl, clipfrac)


# ---- the update epochs -------------------------------------------------------------------------

def minibatch_sums(advantages: torch.Tensor, plan: list[list[np.ndarray]],
                   mask: torch.Tensor | None = None) -> np.ndarray:
    """This rank's (sum, sum of squares, count) of the counted advantages of every minibatch of
    every epoch, shape [epochs, M, 3]: the minibatch layout of every epoch is known in advance."""
    adv = advantages.detach().double().cpu().numpy()
    weight = np.ones_like(adv) if mask is None else mask.detach().double().cpu().numpy()
    return np.array([[[(adv[mb] * weight[mb]).sum(), (adv[mb] ** 2 * weight[mb]).sum(), weight[mb].sum()]
                      for mb in epoch] for epoch in plan], dtype=np.float64)


def advantage_statistics(sums: np.ndarray) -> np.ndarray:
    """(mean, std) of the advantages from minibatch_sums, shape [epochs, M, 2]; std is the
    unbiased one, like torch.std in CleanRL."""
    total, total_sq, count = sums[..., 0], sums[..., 1], sums[..., 2]
    mean = total / np.maximum(count, 1.0)
    var = np.maximum(total_sq - count * mean * mean, 0.0) / np.maximum(count - 1.0, 1.0)
    return np.stack([mean, np.sqrt(var)], axis=-1)


@dataclass
class UpdateStats:
    policy_loss: float
    value_loss: float
    entropy: float
    approx_kl: float  # over all ranks, mean over the minibatches of the last epoch run
    old_approx_kl: float
    clipfrac: float
    grad_norm: float
    epochs_run: int
    stop_requested: bool  # some rank asked to stop (preemption); epochs were cut short
    time_update: float  # seconds of compute (forward, backward, optimizer step)
    time_allreduce: float  # seconds blocked in gradient and statistics collectives
    gradient_allreduces: int  # minibatch gradient reductions (one Horovod round each)


class PPOLearner:
    """Runs the update epochs for one rollout; identical control flow on every rank.

    Collectives per update: one for the advantage statistics of every minibatch of every epoch,
    one gradient allreduce per minibatch, and per epoch a small sum (KL for early stopping, the
    stop flag for preemption) issued beside the epoch's last gradient allreduce so that it rides
    in the same Horovod cycle.
    """

    def __init__(self, model: nn.Module, optimizer, cfg: PPOConfig, seed: int,
                 scaler: torch.amp.GradScaler | None = None, device: torch.device = torch.device("cpu"),
                 adasum: bool = False):
        self.model = model
        self.optimizer = optimizer  # an hvd.DistributedOptimizer
        # Adasum's optimizer is a "delta" optimizer: each rank steps on its own gradient inside
        # the backward hooks and Horovod combines the parameter deltas in step().
        self.adasum = adasum
        self.cfg = cfg
        self.seed = seed
        self.device = device
        self.scaler = scaler  # fp16 loss scaling (precision.Precision.grad_scaler)
        self.loss_hook: Callable[[torch.Tensor], torch.Tensor] | None = None  # fault injection

    def update(self, batch: Batch, iteration: int, first_global_env: int, local_envs: int,
               num_steps: int, stop_requested: Callable[[], bool] = lambda: False,
               share: float = 1.0) -> UpdateStats:
        """`share` = this rank's fraction of the global batch x world size (1 when all ranks own
        the same number of environments): Horovod averages rank gradients, so scaling each
        rank's mean loss by its share makes the result the mean over all samples."""
        cfg = self.cfg
        params = [p for p in self.model.parameters()]
        micro = cfg.backward_passes_per_step
        max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")
        t_start = time.perf_counter()
        blocked_before = dist.CLOCK.seconds
        t_sync = 0.0
        plan = [minibatch_indices(self.seed, iteration, epoch, first_global_env, local_envs,
                                  num_steps, cfg.num_minibatches)
                for epoch in range(cfg.update_epochs)]
        # Statistics of all ranks' shares of every minibatch of every epoch in ONE allreduce for the
        # whole update: the advantages' (global normalisation) and, with a mask, the counted samples.
        adv_stats, counted = None, None
        if cfg.norm_adv or batch.mask is not None:
            local = minibatch_sums(batch.advantages, plan, batch.mask)
            total = local
            if cfg.global_advantage_norm or batch.mask is not None:
                total = dist.allreduce_sum(local.reshape(-1), name="ppo.advantage_stats").reshape(local.shape)
            if cfg.norm_adv:
                adv_stats = advantage_statistics(total if cfg.global_advantage_norm else local)
            counted = total[..., 2]
        world = dist.world_size()
        # Per-epoch sums over minibatches, each term weighted by the local sample count:
        # policy loss, value loss, entropy, approx KL, old approx KL, clipfrac, samples.
        sums = torch.zeros(7, dtype=torch.float64, device=self.device)
        grad_norm = 0.0
        epochs_run = 0
        approx_kl = 0.0
        gradient_allreduces = 0
        stop = False
        for epoch, minibatches in enumerate(plan):
            sums.zero_()
            control = None
            for mb_index, mb in enumerate(minibatches):
                mb = torch.from_numpy(mb).to(self.device)
                adv = batch.advantages[mb]
                if adv_stats is not None:
                    mean, std = adv_stats[epoch, mb_index]
                    adv = (adv - mean) / (std + 1e-8)
                self.optimizer.zero_grad()
                for part in torch.chunk(torch.arange(len(mb), device=self.device), micro):
                    idx = mb[part]
                    policy, new_values = self.model(take_rows(batch.obs, idx))
                    new_logprobs, entropy = self.model.log_prob_entropy(policy, batch.actions[idx])
                    mask = weights = None
                    if batch.mask is not None:
                        # Horovod averages over ranks: world / counted makes the sum the global mean.
                        mask = batch.mask[idx]
                        weights = mask * (world / max(float(counted[epoch, mb_index]), 1.0))
                    terms = ppo_loss(new_logprobs, entropy, new_values, batch.logprobs[idx],
                                     batch.values[idx], adv[part], batch.returns[idx], cfg, mask, weights)
                    if mask is not None:
                        loss = terms.total
                    else:
                        loss = terms.total * (share / micro) if share != 1.0 else terms.total / micro
                    if self.loss_hook is not None:
                        loss = self.loss_hook(loss)
                    (self.scaler.scale(loss) if self.scaler else loss).backward()
                    with torch.no_grad():
                        weight = len(idx) if mask is None else float(mask.sum())
                        sums += torch.stack([terms.policy, terms.value, terms.entropy, terms.approx_kl,
                                             terms.old_approx_kl, terms.clipfrac,
                                             torch.ones((), device=self.device)]).double() * weight
                if mb_index == len(minibatches) - 1:
                    # Beside the epoch's last gradient allreduce: [KL x samples, samples, stop flag].
                    local = sums[[3, 6]].tolist() + [1.0 if stop_requested() else 0.0]
                    control = dist.allreduce_sum_async(local, name=f"ppo.epoch_control.{epoch}")
                gradient_allreduces += 1
                if self.adasum:
                    t0 = time.perf_counter()
                    self.optimizer.step()
                    t_sync += time.perf_counter() - t0
                    # The combined parameters are identical on every rank, so is this decision.
                    if not all(torch.isfinite(p).all() for p in params):
                        raise NonFiniteLossError(
                            f"non-finite loss/gradient at iteration {iteration} (epoch {epoch}, "
                            f"minibatch {mb_index}); stopping all ranks")
                    continue
                t0 = time.perf_counter()
                self.optimizer.synchronize()  # wait for the averaged gradients
                t_sync += time.perf_counter() - t0
                if self.scaler:
                    self.scaler.unscale_(self.optimizer)
                norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
                # The averaged gradient is bit-identical on every rank, so this decision is too.
                if not torch.isfinite(norm) and self.scaler is None:
                    raise NonFiniteLossError(
                        f"non-finite loss/gradient at iteration {iteration} (epoch {epoch}, "
                        f"minibatch {mb_index}); stopping all ranks")
                grad_norm = float(norm)
                with self.optimizer.skip_synchronize():
                    if self.scaler:
                        self.scaler.step(self.optimizer)
                        self.scaler.update()
                    else:
                        self.optimizer.step()
            epochs_run += 1
            kl_weighted, samples, stop_votes = dist.wait_sum(control)
            approx_kl = float(kl_weighted / max(samples, 1.0))
            stop = stop_votes > 0
            # Every rank got the same sums, so every rank takes the same branch.
            if stop or (cfg.target_kl > 0 and approx_kl > cfg.target_kl):
                break
        local_means = (sums[:6] / sums[6].clamp(min=1.0)).tolist()
        elapsed = time.perf_counter() - t_start
        blocked = t_sync + (dist.CLOCK.seconds - blocked_before)
        dist.CLOCK.add(gradient_allreduces, t_sync)
        return UpdateStats(
            policy_loss=local_means[0], value_loss=local_means[1], entropy=local_means[2],
            approx_kl=approx_kl, old_approx_kl=local_means[4], clipfrac=local_means[5],
            grad_norm=grad_norm, epochs_run=epochs_run, stop_requested=stop,
            time_update=elapsed - blocked, time_allreduce=blocked,
            gradient_allreduces=gradient_allreduces)


# ---- the algorithm behind the runtime ----------------------------------------------------------

LOSS_METRICS = ("policy_loss", "value_loss", "entropy", "old_approx_kl", "clipfrac")  # sample-weighted


def update_sums(stats: UpdateStats, returns: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """What an update adds to the iteration's sums over ranks, over this rank's counted samples
    (mask 1): loss terms weighted by the samples (ranks with more samples weigh more, so the logged
    loss is the mean over all samples, as one process would log it) and the value-fit moments."""
    counted = mask.double()
    returns, values = returns.double() * counted, values.double() * counted
    residual = returns - values
    samples = float(counted.sum())
    return {**{name: getattr(stats, name) * samples for name in LOSS_METRICS},
            "returns": float(returns.sum()), "returns_sq": float((returns ** 2).sum()),
            "residual": float(residual.sum()), "residual_sq": float((residual ** 2).sum()), "samples": samples}

class PPO(Algorithm):
    name = "ppo"
    supports_uneven_layout = True

    def __init__(self, cfg: TrainConfig, device: torch.device, threads: int,
                 observation_space: gym.Space, action_space: gym.Space):
        super().__init__(cfg, device, threads, observation_space, action_space)
        p, d = cfg.ppo, cfg.distributed
        self.model = self._build_model().to(device)
        self.precision = precision_for(d.amp, device, convolutional=len(observation_space.shape) == 3)
        self.precision_mode = self.precision.mode
        self.model.precision = self.precision
        base = self.precision.adam(self.model.parameters(), lr=p.learning_rate, eps=p.adam_eps)
        self.optimizer = dist.distributed_optimizer(
            base, self.model, reduction=d.reduction, compression=d.compression,
            backward_passes_per_step=p.backward_passes_per_step, powersgd_rank=d.powersgd_rank,
            topk_ratio=d.topk_ratio, seed=cfg.seed)
        self.learner = PPOLearner(self.model, self.optimizer, p, cfg.seed, scaler=self.precision.grad_scaler(),
                                  device=device, adasum=d.reduction == "adasum")
        shape = tuple(observation_space.shape)
        self.obs_normalizer = RunningNormalizer(shape, p.observation_clip) if p.normalize_observations else None
        self.reward_scaler = ReturnScaler(0, p.gamma, p.reward_clip) if p.normalize_rewards else None
        self.collector: RolloutCollector | None = None
        self.buffer: RolloutBuffer | None = None
        self.sampler: OverlappedSampler | None = None  # ppo.pipeline = "overlap"
        if p.pipeline == "overlap" and threads > 1:
            # the sampler thread takes one of the rank's cores, the learner the rest
            torch.set_num_threads(threads - 1)

    def _build_model(self) -> nn.Module:
        return build_model(self.cfg.model, self.observation_space, self.action_space)

    # ---- identity and state ----

    def signature(self) -> dict[str, Any]:
        return model_signature(self.observation_space, self.action_space, self.model)

    def state_dict(self) -> dict[str, Any]:
        scaler = self.learner.scaler
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scaler": scaler.state_dict() if scaler is not None else {},
                "obs_normalizer": self.obs_normalizer.state_dict() if self.obs_normalizer else {},
                "reward_scaler": self.reward_scaler.state_dict() if self.reward_scaler else {},
                "precision": self.precision.mode}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.precision.keep_adam_kernel(self.optimizer)
        if self.learner.scaler is not None and state.get("scaler"):
            self.learner.scaler.load_state_dict(state["scaler"])
        if self.obs_normalizer is not None and state.get("obs_normalizer"):
            self.obs_normalizer.load_state_dict(state["obs_normalizer"])
        if self.reward_scaler is not None and state.get("reward_scaler"):
            self.reward_scaler.load_state_dict(state["reward_scaler"])

    def broadcast(self) -> None:
        """Rank 0's network, optimizer, loss scale and normalisation statistics everywhere.

        The GradScaler's scale must agree too: ranks unscale the averaged gradient with it, and
        different scales would let the replicas drift apart silently."""
        has_state = dist.broadcast_object(len(self.optimizer.state) > 0, name="ppo.has_optimizer_state")
        dist.broadcast_state(self.model, self.optimizer, has_optimizer_state=has_state)
        extra = dist.broadcast_object({k: v for k, v in self.state_dict().items()
                                       if k in ("scaler", "obs_normalizer", "reward_scaler")},
                                      name="ppo.statistics")
        if self.learner.scaler is not None and extra["scaler"]:
            self.learner.scaler.load_state_dict(extra["scaler"])
        if self.obs_normalizer is not None:
            self.obs_normalizer.load_state_dict(extra["obs_normalizer"])
        if self.reward_scaler is not None:
            self.reward_scaler.load_state_dict(extra["reward_scaler"])

    def parameters_module(self) -> nn.Module:
        """The network, plus the normalisation statistics as buffers, so that the check that all
        ranks agree (and its digest in summary.json) covers both."""
        normalizers = {"observations": self.obs_normalizer,
                       "returns": self.reward_scaler.normalizer if self.reward_scaler else None}
        if not any(normalizers.values()):
            return self.model
        statistics = nn.Module()
        for name, normalizer in normalizers.items():
            if normalizer is not None:
                stats = normalizer.stats
                for field_name, value in (("count", stats.count), ("mean", stats.mean), ("m2", stats.m2)):
                    statistics.register_buffer(f"{name}_{field_name}", torch.as_tensor(np.asarray(value)))
        return nn.ModuleDict({"model": self.model, "statistics": statistics})

    def describe(self) -> str:
        p = self.cfg.ppo
        pipeline = ", overlapped sampling (one-update policy lag)" if p.pipeline == "overlap" else ""
        return (f"precision {self.precision.mode}, {p.num_steps} steps x {self.cfg.env.num_envs} envs "
                f"per rank, {p.num_minibatches} minibatches x {p.update_epochs} epochs{pipeline}")

    def global_batch(self, total_envs: int) -> int | None:
        return total_envs * self.cfg.ppo.num_steps

    # ---- environments ----

    def build_envs(self, layout: EnvLayout, rank: int, seeds: list[int]) -> None:
        self.close()
        num_envs = layout.counts[rank]
        envs = RankEnvs(replace(self.cfg.env, num_envs=num_envs), threads=self.threads)

        def buffer() -> RolloutBuffer:
            return RolloutBuffer(self.cfg.ppo.num_steps, num_envs, envs.single_observation_space,
                                 envs.single_action_space, self.device)

        self.buffer = buffer()
        if self.reward_scaler is not None:
            self.reward_scaler.reset_envs(num_envs)
        overlap = self.cfg.ppo.pipeline == "overlap"
        self.collector = RolloutCollector(envs, self.model, self.buffer, self.device, seeds,
                                          self.obs_normalizer, self.reward_scaler, separate_policy=overlap)
        if overlap:
            self.sampler = OverlappedSampler(self.collector, spare=buffer())

    def rollout_length(self, remaining_steps: int, layout: EnvLayout) -> int:
        """num_steps, or fewer for the last iteration so that the run ends exactly at
        total_timesteps, in whole minibatches (each rank's share splitting evenly into
        backward_passes_per_step micro-batches). 0: nothing fits."""
        p = self.cfg.ppo
        steps = min(p.num_steps, remaining_steps // layout.total)
        per_minibatch = 1  # steps per env per minibatch must be a multiple of this
        for count in layout.counts:
            need = p.backward_passes_per_step // math.gcd(count, p.backward_passes_per_step)
            per_minibatch = per_minibatch * need // math.gcd(per_minibatch, need)
        granule = p.num_minibatches * per_minibatch
        return steps - steps % granule

    # ---- one iteration ----

    def _anneal_learning_rate(self, context: IterationContext) -> float:
        p = self.cfg.ppo
        lr = p.learning_rate
        if p.anneal_lr:  # by global step, so a resume with another rank count keeps the schedule
            lr *= max(0.0, 1.0 - context.global_step / (p.anneal_timesteps or p.total_timesteps))
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def iterate(self, context: IterationContext) -> IterationReport:
        cfg, p = self.cfg, self.cfg.ppo
        lr = self._anneal_learning_rate(context)
        steps, layout, rank = context.env_steps, context.layout, context.rank

        if self.sampler is None:
            rollout = Rollout(self.buffer, *self.collector.collect(steps))
        else:
            rollout = self.sampler.take(steps)
        times, episodes = rollout.times, rollout.episodes
        if self.obs_normalizer is not None:  # statistics merged over ranks, frozen during rollouts
            self.obs_normalizer.sync("ppo.obs_statistics")
        if self.reward_scaler is not None:
            self.reward_scaler.sync("ppo.return_statistics")
        batch = rollout_batch(rollout.buffer, rollout.last_value, p.gamma, p.gae_lambda, steps)
        if self.sampler is not None:
            # the next rollout, with the weights from before this update, while it runs
            after = context.global_step + layout.total * steps
            next_steps = self.rollout_length(cfg.total_timesteps - after, layout)
            if next_steps > 0:
                self.sampler.start(next_steps)
        inject = cfg.debug.nan_at_iteration == context.iteration and cfg.debug.nan_rank == rank
        self.learner.loss_hook = (lambda loss: loss * float("nan")) if inject else None
        share = layout.counts[rank] * layout.world_size / layout.total
        stats = self.learner.update(batch, context.iteration, layout.first(rank), layout.counts[rank], steps,
                                    stop_requested=context.stop_requested, share=share)

        metrics = {"time_env": times.env, "time_inference": times.inference, "time_update": stats.time_update}
        if self.sampler is not None:
            metrics["time_sampler_wait"] = rollout.waited  # the learner idle, waiting for the sampler
        return IterationReport(
            metrics=metrics,
            sums=update_sums(stats, batch.returns, batch.values, torch.ones_like(batch.returns)),
            episode_returns=episodes.returns, episode_lengths=episodes.lengths,
            stop_agreed=stats.stop_requested, finite=("policy_loss", "value_loss"),
            extra={"approx_kl": stats.approx_kl, "learning_rate": lr, "epochs_run": stats.epochs_run,
                   "grad_norm": stats.grad_norm, "precision": self.precision.mode})

    def global_metrics(self, means: dict[str, float], sums: dict[str, float]) -> dict[str, Any]:
        out = dict(means)
        n = sums["samples"]
        out.update({name: sums[name] / n for name in LOSS_METRICS})
        var_y = sums["returns_sq"] / n - (sums["returns"] / n) ** 2
        var_res = sums["residual_sq"] / n - (sums["residual"] / n) ** 2
        out["explained_variance"] = float(1.0 - var_res / var_y) if var_y > 0 else None
        return out

    @torch.no_grad()
    def act(self, observations: np.ndarray, greedy: bool) -> np.ndarray:
        obs = observations
        if self.obs_normalizer is not None:
            obs = self.obs_normalizer.normalize(obs)
        policy, _ = self.model(torch.from_numpy(np.asarray(obs)).to(self.device))
        actions = self.model.mode(policy) if greedy else self.model.sample(policy)[0]
        actions = actions.cpu().numpy()
        if isinstance(self.action_space, gym.spaces.Box):
            actions = np.clip(actions, self.action_space.low, self.action_space.high)
        return actions

    def settle(self) -> None:
        if self.sampler is not None:
            self.sampler.settle()

    def close(self) -> None:
        if self.sampler is not None:
            self.sampler.close()
            self.sampler = None
        if self.collector is not None:
            self.collector.close()
            self.collector = None


def rollout_batch(buf: RolloutBuffer, last_value: torch.Tensor, gamma: float, gae_lambda: float,
                  num_steps: int) -> Batch:
    """GAE over the first `num_steps` steps of the buffer, flattened to t * E + e order."""
    T = num_steps
    advantages, returns = compute_gae(buf.rewards[:T], buf.values[:T], buf.terminated[:T],
                                      buf.truncated[:T], buf.bootstrap_values[:T], last_value,
                                      gamma, gae_lambda)
    flat = T * buf.num_envs
    return Batch(
        obs=buf.obs[:T].reshape((flat,) + tuple(buf.obs.shape[2:])),
        actions=buf.actions[:T].reshape((flat,) + tuple(buf.actions.shape[2:])),
        logprobs=buf.logprobs[:T].reshape(flat), values=buf.values[:T].reshape(flat),
        advantages=advantages.reshape(flat), returns=returns.reshape(flat))
