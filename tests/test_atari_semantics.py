"""CleanRL's Atari semantics on real ROMs, for both Atari backends (ale_vector and Gymnasium sync).

CleanRL's ppo_atari.py: NoopResetEnv(30) -> MaxAndSkipEnv(4) -> EpisodicLifeEnv -> FireResetEnv
-> ClipRewardEnv -> Resize 84 -> Grayscale -> FrameStack(4). `CleanRLReference` below restates
that chain (on a frameskip-1 ALE env, RGB frames) to compare against step by step.
"""
import cv2
import gymnasium as gym
import numpy as np
import pytest

from hvd_rl.config import EnvConfig
from hvd_rl.envs.ids import register_ale
from hvd_rl.envs.vector import RankEnvs

BACKENDS = ["ale_vector", "sync"]
BREAKOUT_NO_FIRE = np.array([0, 2, 3])  # NOOP, RIGHT, LEFT: a policy that never presses FIRE


def make(backend: str, game: str = "Breakout", num_envs: int = 2, **kwargs) -> RankEnvs:
    return RankEnvs(EnvConfig(id=f"ALE/{game}-v5", backend=backend, num_envs=num_envs, **kwargs), threads=1)


def nonzero_per_frame(stack: np.ndarray) -> list[int]:
    return (stack > 0).reshape(stack.shape[0], -1).sum(axis=1).tolist()


def all_frames_equal(stack: np.ndarray) -> bool:
    return all(np.array_equal(stack[0], frame) for frame in stack[1:])


class CleanRLReference:
    """One env with CleanRL's wrapper chain (SB3's atari_wrappers + Resize/Grayscale/FrameStack)."""

    def __init__(self, game: str, seed: int, noops: int = 0, max_frames: int = 108_000):
        register_ale()
        self.env = gym.make(f"ALE/{game}-v5", frameskip=1, repeat_action_probability=0.0,
                            full_action_space=False, max_num_frames_per_episode=max_frames)
        self.ale = self.env.unwrapped.ale
        self.noops, self.seed = noops, seed
        self.buffer = np.zeros((2, 210, 160, 3), dtype=np.uint8)
        self.lives, self.was_real_done = 0, True
        self.game_return, self.returns = 0.0, []
        self.in_reset, self.reset_rewards = False, 0.0  # rewards taken inside the vector env's resets

    def _raw_step(self, action):  # inside RecordEpisodeStatistics: raw rewards count for the game
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.game_return += reward
        self.reset_rewards += reward if self.in_reset else 0.0
        if terminated or truncated:
            self.returns.append(self.game_return)
            self.game_return = 0.0
        return obs, reward, terminated, truncated

    def _noop_reset(self):  # NoopResetEnv
        self.env.reset(seed=self.seed)
        self.seed = None
        for _ in range(self.noops):
            obs, _, terminated, truncated = self._raw_step(0)
            if terminated or truncated:
                self.env.reset()

    def _skip_step(self, action):  # MaxAndSkipEnv(4)
        total, terminated, truncated = 0.0, False, False
        for i in range(4):
            obs, reward, terminated, truncated = self._raw_step(action)
            if i >= 2:
                self.buffer[i - 2] = obs
            total += reward
            if terminated or truncated:
                break
        return self.buffer.max(axis=0), total, terminated, truncated

    def _life_step(self, action):  # EpisodicLifeEnv.step
        obs, reward, terminated, truncated = self._skip_step(action)
        self.was_real_done = terminated or truncated
        lives = self.ale.lives()
        if 0 < lives < self.lives:
            terminated = True
        self.lives = lives
        return obs, reward, terminated, truncated

    def _life_reset(self):  # EpisodicLifeEnv.reset
        if self.was_real_done:
            self._noop_reset()
            obs = None
        else:
            obs, _, terminated, truncated = self._skip_step(0)
            if terminated or truncated:
                self._noop_reset()
        self.lives = self.ale.lives()
        return obs

    def _fire_reset(self):  # FireResetEnv.reset
        self.in_reset = True
        self._life_reset()
        obs, _, terminated, truncated = self._life_step(1)
        if terminated or truncated:
            self._life_reset()
        obs, _, terminated, truncated = self._life_step(2)
        if terminated or truncated:
            self._life_reset()
        self.in_reset = False
        return obs

    @staticmethod
    def _frame(rgb):  # ResizeObservation (84, 84) then GrayScaleObservation
        return cv2.cvtColor(cv2.resize(rgb, (84, 84), interpolation=cv2.INTER_AREA), cv2.COLOR_RGB2GRAY)

    def reset(self) -> np.ndarray:
        self.stack = np.repeat(self._frame(self._fire_reset())[None], 4, axis=0)
        return self.stack

    def step(self, action):
        """One agent step: (obs, clipped reward, done for training), with the vector env's reset."""
        obs, reward, terminated, truncated = self._life_step(action)
        if terminated or truncated:
            self.stack = np.repeat(self._frame(self._fire_reset())[None], 4, axis=0)
        else:
            self.stack = np.concatenate([self.stack[1:], self._frame(obs)[None]])
        return self.stack, float(np.sign(reward)), terminated or truncated


@pytest.mark.parametrize("backend", BACKENDS)
def test_ball_is_relaunched_after_every_lost_life(backend):
    """A policy that never presses FIRE still plays whole games: FIRE follows every lost life."""
    envs = make(backend)
    envs.reset([0, 1])
    rng = np.random.default_rng(0)
    terminals, games = np.zeros(2, dtype=int), []
    for _ in range(1500):
        result = envs.step(rng.choice(BREAKOUT_NO_FIRE, size=2))
        terminals += result.terminated
        games += result.episode_returns
        if len(games) >= 4:
            break
    envs.close()
    # Without FIRE after a lost life the ball stays put after the first one until the time limit.
    assert len(games) >= 4
    assert sum(games) > 0
    assert terminals.sum() >= 5 * len(games)  # 5 lives per Breakout game, each one a terminal


@pytest.mark.parametrize("backend", BACKENDS)
def test_frame_stack_is_refilled_at_reset_and_at_every_lost_life(backend):
    envs = make(backend)
    obs = envs.reset([0, 1])
    for env_obs in obs:  # no zero padding: the first frame four times
        assert all_frames_equal(env_obs) and min(nonzero_per_frame(env_obs)) > 2000
    rng = np.random.default_rng(1)
    refills = 0
    for _ in range(400):
        result = envs.step(rng.integers(0, 4, size=2))
        for e in range(2):
            if result.terminated[e]:  # lost life or game over: the next life starts from one frame
                assert all_frames_equal(result.obs[e])
                refills += 1
            else:  # otherwise the stack shifts by one frame
                assert np.array_equal(result.obs[e, :3], obs[e, 1:])
        obs = result.obs
    envs.close()
    assert refills >= 6


@pytest.mark.parametrize("game", ["Breakout", "BankHeist"])
def test_backends_are_identical_step_for_step(game):
    """Without random no-ops both backends are deterministic: same observations (reset and after
    lost lives included), rewards, training terminals and whole-game statistics."""
    backends = [make(backend, game, noop_max=0) for backend in BACKENDS]
    first = [envs.reset([5, 6]) for envs in backends]
    np.testing.assert_array_equal(first[0], first[1])
    rng = np.random.default_rng(2)
    n, terminals, games = backends[0].single_action_space.n, 0, 0
    for _ in range(700):
        actions = rng.integers(0, n, size=2)
        a, b = (envs.step(actions) for envs in backends)
        np.testing.assert_array_equal(a.obs, b.obs)
        np.testing.assert_array_equal(a.reward, b.reward)
        np.testing.assert_array_equal(a.terminated, b.terminated)
        np.testing.assert_array_equal(a.truncated, b.truncated)
        assert a.episode_returns == b.episode_returns and a.episode_lengths == b.episode_lengths
        terminals += int(a.terminated.sum())
        games += len(a.episode_returns)
    for envs in backends:
        envs.close()
    assert terminals >= 8 and games >= 1


def test_same_observation_statistics_after_reset_and_after_a_lost_life():
    """With CleanRL's random no-ops (different random streams per backend), the observations at a
    reset and after a lost life look alike: four equal frames, the same non-zero pixel counts."""
    stats = {}
    for backend in BACKENDS:
        envs = make(backend, num_envs=6)
        at_reset = [nonzero_per_frame(o) for o in envs.reset(list(range(6)))]
        after_loss = []
        rng = np.random.default_rng(3)
        for _ in range(150):
            result = envs.step(rng.integers(0, 4, size=6))
            after_loss += [nonzero_per_frame(result.obs[e]) for e in np.flatnonzero(result.terminated)]
        envs.close()
        stats[backend] = (np.array(at_reset), np.array(after_loss))
    for at_reset, after_loss in stats.values():
        assert len(after_loss) >= 8
        for counts in (at_reset, after_loss):  # every frame of every stack has the same count
            assert (counts == counts[:, :1]).all()
    (reset_a, loss_a), (reset_b, loss_b) = stats.values()
    assert abs(reset_a.mean() - reset_b.mean()) < 10  # ~2580 non-zero pixels per frame
    assert abs(loss_a.mean() - loss_b.mean()) < 10
    assert reset_a.min() > 2000 and reset_b.min() > 2000  # no zero-padded frames


@pytest.mark.parametrize("backend", BACKENDS)
def test_lives_reaching_zero_before_game_over_is_not_a_terminal(backend):
    """BankHeist shows 0 lives while the last car still drives; CleanRL's rule (0 < lives <
    before) makes only the 3 lives lost before it and the game over terminals (4 per game)."""
    envs = make(backend, "BankHeist", num_envs=1)
    envs.reset([0])
    rng = np.random.default_rng(0)
    terminals, per_game = 0, []
    while len(per_game) < 2:
        result = envs.step(rng.integers(0, 18, size=1))
        terminals += int(result.terminated[0])
        if result.episode_returns:
            per_game.append(terminals)
            terminals = 0
    envs.close()
    assert per_game == [4, 4]


@pytest.mark.parametrize("backend", BACKENDS)
def test_noop_resets_take_1_to_noop_max_frames(backend):
    """CleanRL's NoopResetEnv: randint(1, noop_max + 1) no-op frames, then FIRE and action 2."""
    noops = []
    envs = make(backend, num_envs=8, noop_max=30)
    for round_ in range(3):
        envs.reset(list(range(100 * round_, 100 * round_ + 8)))
        noops += [_episode_frames(envs, e) - 8 for e in range(8)]  # FIRE and 2: 2 x 4 frames
    envs.close()
    assert min(noops) >= 1 and max(noops) <= 30
    assert len(set(noops)) >= 12  # spread over the range, not a constant


def _episode_frames(envs: RankEnvs, e: int) -> int:
    """Emulator frames since the game's reset, read from the environment itself."""
    if envs.cfg.backend == "ale_vector":  # a no-op step on env e alone, then subtract its 4 frames
        env = envs.vec.envs[e]
        env.ale.send([0], [1.0])
        return int(env.ale.recv()[4]["episode_frame_number"][0]) - 4
    return envs.vec.envs[e].unwrapped.ale.getEpisodeFrameNumber()


def compare_with_cleanrl(backend: str, seed: int, steps: int, max_episode_steps: int = 0,
                         game: str = "Breakout"):
    """Same actions into this backend and into CleanRL's chain, no random no-ops on either; every
    step must give the same training reward, done flag and refill, and every finished game the
    same raw score. Returns (mean |pixel difference| per step, games, dones, reference)."""
    envs = make(backend, game, num_envs=1, noop_max=0, max_episode_steps=max_episode_steps)
    ref = CleanRLReference(game, seed=seed, max_frames=4 * max_episode_steps or 108_000)
    ours, theirs = envs.reset([seed]), ref.reset()
    diffs = [np.abs(ours[0].astype(int) - theirs).mean()]
    rng = np.random.default_rng(seed)
    returns, dones = [], 0
    for _ in range(steps):
        action = int(rng.integers(0, envs.single_action_space.n))
        result = envs.step(np.array([action]))
        obs, reward, done = ref.step(action)
        assert result.reward[0] == reward
        assert bool(result.terminated[0] or result.truncated[0]) == done
        assert all_frames_equal(result.obs[0]) == all_frames_equal(obs)
        diffs.append(np.abs(result.obs[0].astype(int) - obs).mean())
        returns += result.episode_returns
        dones += int(done)
    envs.close()
    assert returns == ref.returns[:len(returns)]
    return float(np.mean(diffs)), len(returns), dones, ref


@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_cleanrl_reference_step_for_step(backend):
    """The frames differ only by CleanRL's other pixel pipeline (RGB max-pool, RGB resize, then
    grayscale): in Breakout 0.09% of the pixels, by one gray level."""
    pixel_diff, games, dones, _ = compare_with_cleanrl(backend, seed=7, steps=600)
    assert games >= 2 and dones >= 10
    assert pixel_diff < 0.05  # gray levels per pixel (0-255)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("max_episode_steps", [51, 78])
def test_a_game_ending_inside_the_forced_steps_goes_on_like_cleanrl(backend, max_episode_steps):
    """These time limits end a game during the no-op, FIRE, 2 after a lost life (51: in the FIRE
    step, 78: in the no-op step); CleanRL resets the game without FIRE and takes the steps left."""
    pixel_diff, games, _, _ = compare_with_cleanrl(backend, max_episode_steps, 300, max_episode_steps)
    assert games >= 2 and pixel_diff < 0.05


@pytest.mark.parametrize("backend", BACKENDS)
def test_rewards_of_forced_steps_count_for_the_game_not_the_agent(backend):
    """Riverraid scores in some FIRE steps after a reset or a lost life: CleanRL's vector env takes
    them inside its reset, so the agent never gets them, while the game's score includes them."""
    _, games, _, ref = compare_with_cleanrl(backend, seed=1, steps=1000, game="Riverraid")
    assert ref.reset_rewards > 0 and games >= 1
