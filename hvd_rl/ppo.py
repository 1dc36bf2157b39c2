"""The PPO algorithm: GAE, minibatch layout, the clipped loss, and the distributed update epoch loop.

Exact N-rank == 1-rank math rests on three choices made here:
1. Minibatches are drawn per *global* environment: every environment's timesteps are shuffled
   with a generator keyed by (seed, iteration, epoch, global env index) and split evenly over the
   minibatches. Each rank's share of minibatch k is therefore the same size, and the union over
   ranks is exactly the minibatch one process would draw from the whole batch.
2. Advantages are normalised with allreduced minibatch statistics (ppo.global_advantage_norm),
   all minibatches of all epochs in one allreduce.
3. Gradients are averaged by hvd.DistributedOptimizer; the mean of equal-size rank means is the
   global mean, so clipping, Adam and every other step see the one-process gradient.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch import nn

from hvd_rl.config import PPOConfig
from hvd_rl import distributed as dist


class NonFiniteLossError(RuntimeError):
    """The loss or the averaged gradient became NaN/Inf; raised on every rank together."""


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


def logprob_and_entropy(logits: torch.Tensor, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    log_probs = torch.log_softmax(logits, dim=-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return log_probs.gather(-1, actions.unsqueeze(-1)).squeeze(-1), entropy


def ppo_loss(logits: torch.Tensor, new_values: torch.Tensor, actions: torch.Tensor,
             old_logprobs: torch.Tensor, old_values: torch.Tensor, advantages: torch.Tensor,
             returns: torch.Tensor, cfg: PPOConfig) -> LossTerms:
    """CleanRL's PPO loss: clipped surrogate, (optionally clipped) value loss, entropy bonus.

    `advantages` arrive already normalised when cfg.norm_adv is set.
    """
    new_logprobs, entropy = logprob_and_entropy(logits, actions)
    logratio = new_logprobs - old_logprobs
    ratio = logratio.exp()
    with torch.no_grad():
        approx_kl = ((ratio - 1) - logratio).mean()  # the low-variance k3 estimator
        old_approx_kl = (-logratio).mean()
        clipfrac = ((ratio - 1.0).abs() > cfg.clip_coef).float().mean()
    pg_loss = torch.max(-advantages * ratio,
                        -advantages * torch.clamp(ratio, 1 - cfg.clip_coef, 1 + cfg.clip_coef)).mean()
    if cfg.clip_vloss:
        v_unclipped = (new_values - returns) ** 2
        v_clipped = old_values + torch.clamp(new_values - old_values, -cfg.clip_coef, cfg.clip_coef)
        v_loss = 0.5 * torch.max(v_unclipped, (v_clipped - returns) ** 2).mean()
    else:
        v_loss = 0.5 * ((new_values - returns) ** 2).mean()
    entropy_mean = entropy.mean()
    total = pg_loss - cfg.ent_coef * entropy_mean + cfg.vf_coef * v_loss
    return LossTerms(total, pg_loss, v_loss, entropy_mean, approx_kl, old_approx_kl, clipfrac)


def advantage_statistics(advantages: torch.Tensor, plan: list[list[np.ndarray]],
                         global_stats: bool) -> np.ndarray:
    """(mean, std) of the advantages of every minibatch of every epoch, shape [epochs, M, 2].

    With global_stats the sums of all ranks' shares are combined in ONE allreduce for the whole
    update (not one per minibatch): the minibatch layout of every epoch is known in advance.
    std is the unbiased one, like torch.std in CleanRL.
    """
    adv = advantages.detach().double().cpu().numpy()
    sums = np.array([[[adv[mb].sum(), (adv[mb] ** 2).sum(), float(len(mb))] for mb in epoch]
                     for epoch in plan], dtype=np.float64)
    if global_stats:
        sums = dist.allreduce_sum(sums.reshape(-1), name="ppo.advantage_stats").reshape(sums.shape)
    total, total_sq, count = sums[..., 0], sums[..., 1], sums[..., 2]
    mean = total / count
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
               num_steps: int, stop_requested: Callable[[], bool] = lambda: False) -> UpdateStats:
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
        adv_stats = advantage_statistics(batch.advantages, plan, cfg.global_advantage_norm) if cfg.norm_adv else None
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
                    logits, new_values = self.model(batch.obs[idx])
                    terms = ppo_loss(logits, new_values, batch.actions[idx], batch.logprobs[idx],
                                     batch.values[idx], adv[part], batch.returns[idx], cfg)
                    loss = terms.total / micro
                    if self.loss_hook is not None:
                        loss = self.loss_hook(loss)
                    (self.scaler.scale(loss) if self.scaler else loss).backward()
                    with torch.no_grad():
                        weight = len(idx)
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
            approx_kl = float(kl_weighted / samples)
            stop = stop_votes > 0
            # Every rank got the same sums, so every rank takes the same branch.
            if stop or (cfg.target_kl > 0 and approx_kl > cfg.target_kl):
                break
        local_means = (sums[:6] / sums[6]).tolist()
        elapsed = time.perf_counter() - t_start
        blocked = t_sync + (dist.CLOCK.seconds - blocked_before)
        dist.CLOCK.add(gradient_allreduces, t_sync)
        return UpdateStats(
            policy_loss=local_means[0], value_loss=local_means[1], entropy=local_means[2],
            approx_kl=approx_kl, old_approx_kl=local_means[4], clipfrac=local_means[5],
            grad_norm=grad_norm, epochs_run=epochs_run, stop_requested=stop,
            time_update=elapsed - blocked, time_allreduce=blocked,
            gradient_allreduces=gradient_allreduces)
