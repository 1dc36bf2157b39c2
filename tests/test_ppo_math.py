"""GAE, the PPO loss and the minibatch layout against straightforward references."""
import gymnasium as gym
import numpy as np
import pytest
import torch

from hvd_rl.config import ModelConfig
from hvd_rl.algorithms.models import build_model
from hvd_rl.config import PPOConfig
from hvd_rl.algorithms.ppo import compute_gae, minibatch_indices, ppo_loss


def reference_gae(rewards, values, terminated, truncated, boot, last_value, gamma, lam):
    """Per-environment, per-episode, written the slow obvious way."""
    T, E = rewards.shape
    adv = np.zeros((T, E))
    for e in range(E):
        for t in range(T):
            total, discount = 0.0, 1.0
            for k in range(t, T):
                if terminated[k, e]:
                    next_v = 0.0
                elif truncated[k, e]:
                    next_v = boot[k, e]
                else:
                    next_v = values[k + 1, e] if k + 1 < T else last_value[e]
                delta = rewards[k, e] + gamma * next_v - values[k, e]
                total += discount * delta
                if terminated[k, e] or truncated[k, e]:
                    break
                discount *= gamma * lam
            adv[t, e] = total
    return adv


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gae_matches_reference_with_terminations_and_truncations(seed):
    rng = np.random.default_rng(seed)
    T, E = 12, 3
    rewards = rng.normal(size=(T, E))
    values = rng.normal(size=(T, E))
    terminated = rng.random((T, E)) < 0.15
    truncated = (rng.random((T, E)) < 0.15) & ~terminated
    boot = rng.normal(size=(T, E)) * truncated
    last = rng.normal(size=E)
    t = lambda a: torch.tensor(a, dtype=torch.float64)
    adv, ret = compute_gae(t(rewards), t(values), t(terminated * 1.0), t(truncated * 1.0), t(boot),
                           t(last), 0.99, 0.95)
    expected = reference_gae(rewards, values, terminated, truncated, boot, last, 0.99, 0.95)
    np.testing.assert_allclose(adv.numpy(), expected, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(ret.numpy(), expected + values, rtol=1e-10, atol=1e-10)


def test_truncation_bootstraps_but_termination_does_not():
    one = lambda v: torch.tensor([[v]], dtype=torch.float64)
    kwargs = dict(rewards=one(1.0), values=one(0.0), bootstrap_values=one(10.0), last_value=torch.tensor([5.0], dtype=torch.float64), gamma=0.9, gae_lambda=1.0)
    adv_term, _ = compute_gae(terminated=one(1.0), truncated=one(0.0), **kwargs | {"bootstrap_values": one(0.0)})
    adv_trunc, _ = compute_gae(terminated=one(0.0), truncated=one(1.0), **kwargs)
    adv_cont, _ = compute_gae(terminated=one(0.0), truncated=one(0.0), **kwargs | {"bootstrap_values": one(0.0)})
    assert adv_term.item() == pytest.approx(1.0)  # nothing after a termination
    assert adv_trunc.item() == pytest.approx(1.0 + 0.9 * 10.0)  # V(final_obs), not the next episode's value
    assert adv_cont.item() == pytest.approx(1.0 + 0.9 * 5.0)  # V(next obs)


def reference_loss(logits, values, actions, old_logp, old_values, adv, returns, clip, ent_coef, vf_coef, clip_vloss):
    logp_all = torch.log_softmax(logits, -1)
    logp = logp_all[torch.arange(len(actions)), actions]
    ratio = torch.exp(logp - old_logp)
    pg = torch.mean(torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - clip, 1 + clip)))
    if clip_vloss:
        clipped = old_values + torch.clamp(values - old_values, -clip, clip)
        v = 0.5 * torch.mean(torch.maximum((values - returns) ** 2, (clipped - returns) ** 2))
    else:
        v = 0.5 * torch.mean((values - returns) ** 2)
    entropy = torch.distributions.Categorical(logits=logits).entropy().mean()
    return pg - ent_coef * entropy + vf_coef * v, pg, v, entropy


@pytest.mark.parametrize("clip_vloss", [True, False])
def test_ppo_loss_matches_reference(clip_vloss):
    g = torch.Generator().manual_seed(0)
    n, a = 64, 5
    logits = torch.randn(n, a, generator=g, dtype=torch.float64)
    values = torch.randn(n, generator=g, dtype=torch.float64)
    actions = torch.randint(0, a, (n,), generator=g)
    old_logp = torch.log_softmax(logits + 0.3 * torch.randn(n, a, generator=g, dtype=torch.float64), -1)[torch.arange(n), actions]
    old_values = values + 0.5 * torch.randn(n, generator=g, dtype=torch.float64)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    returns = torch.randn(n, generator=g, dtype=torch.float64)
    cfg = PPOConfig(clip_coef=0.1, ent_coef=0.01, vf_coef=0.5, clip_vloss=clip_vloss)
    logp_all = torch.log_softmax(logits, -1)
    new_logp = logp_all.gather(-1, actions[:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    terms = ppo_loss(new_logp, entropy, values, old_logp, old_values, adv, returns, cfg)
    total, pg, v, ent = reference_loss(logits, values, actions, old_logp, old_values, adv, returns, 0.1, 0.01, 0.5, clip_vloss)
    for got, want in [(terms.total, total), (terms.policy, pg), (terms.value, v), (terms.entropy, ent)]:
        assert got.item() == pytest.approx(want.item(), rel=1e-12, abs=1e-12)
    assert 0.0 < terms.clipfrac.item() < 1.0  # the perturbation puts some ratios outside the clip range


def test_minibatches_are_a_partition_and_independent_of_rank_layout():
    T, E_global, M = 16, 8, 4
    whole = minibatch_indices(7, 3, 1, 0, E_global, T, M)
    assert sorted(np.concatenate(whole).tolist()) == list(range(T * E_global))
    assert len({len(mb) for mb in whole}) == 1
    for shares_per_rank in ([4, 4], [2, 2, 2, 2], [3, 5], [1, 6, 1]):  # even and uneven layouts
        firsts = np.cumsum([0] + shares_per_rank[:-1])
        shares = [minibatch_indices(7, 3, 1, f, n, T, M) for f, n in zip(firsts, shares_per_rank)]
        for k in range(M):
            # Map each rank's local flat index (t * n + e) to the global one (t * E + first + e).
            union = sorted(int((i // n) * E_global + f + i % n)
                           for f, n, share in zip(firsts, shares_per_rank, shares) for i in share[k])
            assert union == sorted(whole[k].tolist())
            for n, share in zip(shares_per_rank, shares):
                assert len(share[k]) == n * T // M  # each env contributes T / M steps


def test_minibatch_order_changes_with_epoch_and_iteration():
    a = minibatch_indices(1, 1, 0, 0, 4, 16, 4)[0]
    assert not np.array_equal(a, minibatch_indices(1, 1, 1, 0, 4, 16, 4)[0])
    assert not np.array_equal(a, minibatch_indices(1, 2, 0, 0, 4, 16, 4)[0])


def _policy(action_space):
    torch.manual_seed(0)
    obs = gym.spaces.Box(-1, 1, (3,), np.float32)
    model = build_model(ModelConfig(kind="mlp"), obs, action_space)
    with torch.no_grad():
        if model.continuous:
            model.log_std.copy_(torch.tensor([-0.5, 0.3]))
    return model, model(torch.randn(16, 3))[0]


def test_gaussian_log_prob_and_entropy_match_torch_distributions():
    model, mean = _policy(gym.spaces.Box(-1, 1, (2,), np.float32))
    actions = torch.randn(16, 2)
    log_prob, entropy = model.log_prob_entropy(mean, actions)
    reference = torch.distributions.Normal(mean, model.log_std.exp())
    torch.testing.assert_close(log_prob, reference.log_prob(actions).sum(-1))
    torch.testing.assert_close(entropy, reference.entropy().sum(-1))
    sampled, sampled_log_prob = model.sample(mean)
    torch.testing.assert_close(sampled_log_prob, reference.log_prob(sampled).sum(-1))
    assert torch.equal(model.mode(mean), mean)


def test_categorical_log_prob_entropy_and_sampling_match_torch_distributions():
    model, logits = _policy(gym.spaces.Discrete(5))
    actions = torch.randint(0, 5, (16,))
    log_prob, entropy = model.log_prob_entropy(logits, actions)
    reference = torch.distributions.Categorical(logits=logits)
    torch.testing.assert_close(log_prob, reference.log_prob(actions))
    torch.testing.assert_close(entropy, reference.entropy())
    # Gumbel-max draws from the same distribution: frequencies over many draws
    torch.manual_seed(1)
    many = torch.stack([model.sample(logits[:1])[0] for _ in range(20000)]).reshape(-1)
    freq = torch.bincount(many, minlength=5).double() / len(many)
    torch.testing.assert_close(freq, reference.probs[0].double(), atol=0.015, rtol=0)


def test_logged_losses_weigh_ranks_by_their_samples():
    """Uneven layouts: a rank with 3 of 4 environments holds 3/4 of the samples, so the logged
    loss is the mean over all samples (2.5 here), not the plain mean of the ranks' means (2.0)."""
    from hvd_rl.algorithms.ppo import LOSS_METRICS, PPO

    ranks = [{"samples": 32.0, "loss": 1.0}, {"samples": 96.0, "loss": 3.0}]
    sums = {"returns": 0.0, "returns_sq": 128.0, "residual": 0.0, "residual_sq": 64.0,
            "samples": sum(r["samples"] for r in ranks)}
    sums.update({name: sum(r["loss"] * r["samples"] for r in ranks) for name in LOSS_METRICS})
    out = PPO.global_metrics(None, {"time_env": 0.1}, sums)
    assert all(out[name] == pytest.approx(2.5) for name in LOSS_METRICS)
    assert out["explained_variance"] == pytest.approx(0.5) and out["time_env"] == 0.1
