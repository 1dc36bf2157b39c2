"""Environments: SAME_STEP autoreset (no bogus transitions), truncation, episodic life, seeds."""
import numpy as np
import pytest
import torch

from hvd_rl.config import EnvConfig, ModelConfig
from hvd_rl.envs.vector import EnvLayout, RankEnvs, env_seeds
from hvd_rl.algorithms.models import build_model
from hvd_rl.algorithms.rollout import RolloutBuffer, RolloutCollector


def test_cartpole_rollout_has_no_reset_transitions():
    """NEXT_STEP autoreset would store a step with reward 0 after every episode end."""
    envs = RankEnvs(EnvConfig(id="CartPole-v1", num_envs=3))
    torch.manual_seed(0)
    model = build_model(ModelConfig(kind="mlp"), envs.single_observation_space, envs.single_action_space)
    buffer = RolloutBuffer(200, 3, envs.single_observation_space, envs.single_action_space, torch.device("cpu"))
    collector = RolloutCollector(envs, model, buffer, torch.device("cpu"), seeds=[0, 1, 2])
    _, _, episodes = collector.collect()
    collector.close()
    assert len(episodes.returns) >= 10  # many episode boundaries inside the rollout
    assert buffer.terminated.sum() == len(episodes.returns)
    assert torch.all(buffer.rewards == 1.0)  # every stored transition is a real CartPole step
    # The observation after each termination is a fresh reset state (all |x| <= 0.05).
    t, e = torch.nonzero(buffer.terminated[:-1], as_tuple=True)
    assert torch.all(buffer.obs[t + 1, e].abs() <= 0.05)


def test_time_limit_truncation_gives_final_obs_and_no_termination():
    envs = RankEnvs(EnvConfig(id="CartPole-v1", num_envs=2, max_episode_steps=5))
    envs.reset([0, 1])
    results = [envs.step(np.zeros(2, dtype=np.int64)) for _ in range(5)]
    last = results[-1]
    assert not any(r.terminated.any() for r in results)
    assert last.truncated.all() and last.final_obs.shape == (2, 4)
    assert not np.allclose(last.final_obs, last.obs)  # final obs is the old episode's, obs the new one
    assert last.episode_lengths == [5, 5]
    envs.close()


@pytest.mark.parametrize("backend", ["ale_vector", "sync"])
def test_atari_episodic_life_terminals_but_whole_game_statistics(backend):
    envs = RankEnvs(EnvConfig(id="ALE/Breakout-v5", backend=backend, num_envs=2))
    assert envs.single_observation_space.shape == (4, 84, 84)
    obs = envs.reset([3, 4])
    assert obs.shape == (2, 4, 84, 84) and obs.dtype == np.uint8
    rng = np.random.default_rng(0)
    terminals, games, rewards = 0, 0, set()
    for _ in range(3000):
        result = envs.step(rng.integers(0, 4, size=2))
        terminals += int(result.terminated[0])
        rewards.update(result.reward.tolist())
        games += len(result.episode_returns)
        if games >= 2:
            break
    envs.close()
    assert games >= 2
    assert terminals >= 4  # lives lost inside games are training terminals
    assert rewards <= {0.0, 1.0}  # clipped training rewards


def test_env_seeds_never_overlap_across_ranks_rebuilds_and_base_seeds():
    seen = set()
    for base in (1, 2, 3):  # runs with neighbouring base seeds share no environment
        offset = 0
        for counts in ((8, 8, 8, 8), (8, 8, 8), (3, 5), (8,) * 8):  # resizes, uneven layouts
            layout = EnvLayout(counts)
            for rank in range(layout.world_size):
                seeds = env_seeds(base, offset, layout.first(rank), counts[rank])
                assert len(seeds) == counts[rank] and not seen & set(seeds)
                assert all(0 <= s < 2 ** 31 for s in seeds)
                seen |= set(seeds)
            offset += layout.total
    # a rank's seeds do not depend on how the other environments are spread over ranks
    assert env_seeds(1, 0, 3, 5) == env_seeds(1, 0, 0, 8)[3:]
