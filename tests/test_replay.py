"""Replay shards: frames stored once, observations reconstructed exactly, wrap-around, sampling."""
import numpy as np
import pytest

from hvd_rl.config import EnvConfig
from hvd_rl.envs.vector import RankEnvs
from hvd_rl.algorithms.replay import ReplayShard


def _record(env_id, backend, num_envs, steps, capacity, seed=0, **env_kwargs):
    """Steps real environments with random actions into a shard and keeps every transition."""
    envs = RankEnvs(EnvConfig(id=env_id, backend=backend, num_envs=num_envs, **env_kwargs))
    space = envs.single_observation_space
    shard = ReplayShard(capacity, num_envs, tuple(space.shape), space.dtype, frame_stack=4)
    obs = envs.reset(list(range(seed, seed + num_envs))).copy()
    shard.start(obs)
    rng = np.random.default_rng(seed)
    history = [[] for _ in range(num_envs)]  # per env: (obs, action, reward, next_obs, done)
    for _ in range(steps):
        actions = rng.integers(0, envs.single_action_space.n, num_envs)
        result = envs.step(actions)
        final = {int(e): result.final_obs[i] for i, e in enumerate(np.flatnonzero(result.truncated))} \
            if result.final_obs is not None else {}
        shard.add(actions, result.reward, result.terminated, result.obs, final)
        for e in range(num_envs):
            history[e].append((obs[e].copy(), actions[e], result.reward[e],
                               final.get(e, result.obs[e]).copy(), result.terminated[e]))
        obs = result.obs.copy()
    envs.close()
    return shard, history


def _check_exact(shard, history):
    checked = 0
    for e, ring in enumerate(shard.envs):
        for slot in ring.valid():
            t = ring.count - 1 - ((ring.count - 1 - slot) % ring.capacity)  # transition in this slot
            obs, action, reward, next_obs, done = history[e][t]
            np.testing.assert_array_equal(ring.observations(ring.obs_end[[slot]])[0], obs)
            assert ring.actions[slot] == action and ring.rewards[slot] == reward and ring.dones[slot] == done
            if not done:  # a terminal's next observation is never used (and is the reset one)
                np.testing.assert_array_equal(ring.observations(ring.next_end[[slot]])[0], next_obs)
            checked += 1
    return checked


def test_atari_frames_are_stored_once_and_reconstructed_exactly_across_lives_and_wraparound():
    # 900 steps into 2 x 200 slots: the rings wrap several times; lives are lost and games reset.
    shard, history = _record("ALE/Breakout-v5", "ale_vector", 2, 900, capacity=400, max_episode_steps=300)
    assert sum(h[4] for hist in history for h in hist) >= 5  # terminals (lost lives) happened
    assert _check_exact(shard, history) >= 300
    frame = 84 * 84
    assert shard.nbytes < 400 * frame * 1.4  # vs 400 x 2 x 4 frames for (obs, next_obs) stacks


def test_time_limit_truncation_keeps_the_real_last_observation():
    shard, history = _record("CartPole-v1", "sync", 2, 60, capacity=200, max_episode_steps=7)
    assert shard.stack == 1
    assert _check_exact(shard, history) == 120


def test_sampling_draws_only_stored_transitions_roughly_uniformly():
    shard, history = _record("CartPole-v1", "sync", 2, 150, capacity=100)
    rng = np.random.default_rng(0)
    sample = shard.sample(4000, rng)
    assert sample.obs.shape == (4000, 4) and sample.next_obs.shape == (4000, 4)
    stored = {tuple(h[0]) for e, ring in enumerate(shard.envs) for h in history[e][-ring.capacity:]}
    assert {tuple(o) for o in sample.obs} <= stored
    counts = np.unique(sample.obs, axis=0, return_counts=True)[1]
    assert len(counts) == len(stored) and counts.max() < 4 * counts.mean()


def test_checkpointed_shard_round_trips():
    shard, history = _record("CartPole-v1", "sync", 2, 40, capacity=100)
    copy = ReplayShard(100, 2, (4,), np.float32, frame_stack=4)
    copy.load(shard.state())
    assert len(copy) == len(shard) == 80 and copy.capacity == 100
    assert _check_exact(copy, history) == 80  # every stored transition, compared with what was played
    with pytest.raises(ValueError):
        ReplayShard(50, 2, (4,), np.float32, frame_stack=4).load(shard.state())
