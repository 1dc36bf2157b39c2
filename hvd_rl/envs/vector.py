"""Per-rank vector environments: backends, the Atari recipe, seeds and episode statistics.

Autoreset is SAME_STEP on every backend: when an episode ends, `step` already returns the first
observation of the next one (the last observation is kept in `final_obs`). So every stored
transition is a real one; NEXT_STEP's extra "reset step" (action ignored, reward 0) never
reaches the PPO loss.

Atari follows CleanRL's ppo_atari.py (NoopResetEnv(30) -> MaxAndSkipEnv(4) -> EpisodicLifeEnv ->
FireResetEnv -> ClipRewardEnv -> Resize 84 -> Grayscale -> FrameStack(4)) on every backend:
- reset: 1..noop_max no-op frames, then FIRE and action 2 (an agent step each, if action 1 is
  FIRE); the stack holds the first frame four times.
- a lost life (0 < lives < lives before the step; lives reaching 0 ahead of the game over do not
  count) is a terminal *for training* only (no bootstrap) and the game goes on: within the same
  agent step come EpisodicLifeEnv.reset's no-op step and FireResetEnv's FIRE and 2, and the next
  life starts from a stack of its first frame. One agent step is one transition; the forced
  steps' rewards count for the game's score, not for the agent (ForcedSteps has the fine print).
- episode statistics count whole games (raw score, agent steps); training rewards are clipped.
Both backends give single frames (ALE grayscale, max of the skip's last two frames, INTER_AREA
resize) and RankEnvs stacks them. sync/async: Gymnasium's AtariPreprocessing + AtariLifeCycle;
ale_vector: one C++ AtariVectorEnv per environment (see _AleVectorEnvs for why).

Measured (ale-py 0.12.1, Gymnasium 1.4, tests/test_atari_semantics.py):
- The backends against each other: without random no-ops (noop_max=0) bit-identical observations,
  rewards, terminals, truncations, final_obs and game statistics, step for step (Breakout,
  BankHeist, Pong; with and without episodic life and FIRE; time limits). What remains: the
  no-op counts come from different random streams (Gymnasium's np_random, the C++ env's
  mt19937; both uniform on 1..noop_max), so one seed gives different games on the two; and the
  time limit's clock: the ALE env (as in CleanRL) counts the reset's no-op frames, the C++ env
  starts after them, so an ale_vector game can last up to noop_max frames longer (at most 30 of
  108,000 by default; with max_episode_steps=50 on Pong, 48 agent steps against 41-48, mean 44.5).
- Against CleanRL's chain (restated in the tests, same actions, no random no-ops): the same
  training rewards, done flags, stack refills and game scores at every step (4,500 steps each of
  Breakout, 26 games, and BankHeist, 6 games; also games cut by a time limit inside the forced
  steps). The frames differ by the pixel pipeline alone (CleanRL max-pools and resizes RGB, then
  converts to gray): Breakout 0.09% of pixels, by 1 gray level; BankHeist 5% of pixels, mean
  0.054 gray levels, at most 18.
- Not copied from CleanRL: when a game ends in FireResetEnv's last step (action 2), CleanRL
  shows the ended game's last frame as the new game's first; here the new game's frame is shown.
  Episode lengths are agent steps (CleanRL's RecordEpisodeStatistics counts frames).
"""
from __future__ import annotations

import functools
import os
import signal
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode

from hvd_rl.config import EnvConfig
from hvd_rl.envs.ids import is_atari, register_ale

@dataclass(frozen=True)
class EnvLayout:
    """How many environments each rank owns. Global env indices are assigned in rank order:
    rank r owns [first(r), first(r) + counts[r])."""

    counts: tuple[int, ...]

    @classmethod
    def even(cls, world_size: int, per_rank: int) -> "EnvLayout":
        return cls((per_rank,) * world_size)

    @property
    def total(self) -> int:
        return sum(self.counts)

    @property
    def world_size(self) -> int:
        return len(self.counts)

    def first(self, rank: int) -> int:
        return sum(self.counts[:rank])

    @property
    def is_even(self) -> bool:
        return len(set(self.counts)) == 1


def env_seeds(base_seed: int, seed_offset: int, first_env: int, num_envs: int) -> list[int]:
    """Seeds for environments [first_env, first_env + num_envs) of a build.

    Each seed is drawn from a SeedSequence keyed by (base seed, seed_offset + global env index),
    so runs with different base seeds do not share environments (plain base + index would make
    seed=1 and seed=2 overlap in all but one env). `seed_offset` grows by the global env count
    at every rebuild (resume, elastic reset, rebalancing), so a rebuilt env never replays a seed.
    31-bit, as ALE takes a signed int; two distinct keys collide with probability 2^-31.
    """
    return [int(np.random.SeedSequence([base_seed, seed_offset + index]).generate_state(1)[0] & 0x7FFFFFFF)
            for index in range(first_env, first_env + num_envs)]


def _ignore_preemption_signals() -> None:
    """In env worker processes: SLURM and mpirun signal every process of a step, and a worker
    killed by SIGTERM/SIGUSR1 would take its rank down before it can checkpoint. The rank's main
    process alone decides (collectively) when to stop."""
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)


def _worker_env(factory: Callable[[], gym.Env]) -> gym.Env:
    import multiprocessing

    # AsyncVectorEnv also calls the first factory in the rank's own process to read the spaces:
    # there the rank's preemption handlers must stay.
    if multiprocessing.parent_process() is not None:
        _ignore_preemption_signals()
    return factory()


def _episode_frames(cfg: EnvConfig) -> int:
    """The Atari time limit in emulator frames (the ALE env counts the reset's no-op frames in
    them, as CleanRL's does; ale_vector's C++ env starts counting after them)."""
    return cfg.max_episode_steps * cfg.frame_skip if cfg.max_episode_steps else 108_000


# CleanRL's forced steps, as (action, checked) agent steps. FireResetEnv.reset takes FIRE (1) and
# action 2 through EpisodicLifeEnv.step, so with episodic life a life lost in one of them is
# followed by EpisodicLifeEnv.reset's no-op step ("checked"); a lost life's own no-op step is not
# checked. A game over in any of them resets the game (no-ops only) and the remaining steps go on.
ForcedSteps = list[tuple[int, bool]]


def _start_steps(fire_reset: bool, episodic_life: bool, action_meanings: list[str]) -> ForcedSteps:
    """After every reset: FIRE, then action 2, for games whose action 1 is FIRE (FireResetEnv)."""
    fire = fire_reset and len(action_meanings) >= 3 and action_meanings[1] == "FIRE"
    return [(1, episodic_life), (2, episodic_life)] if fire else []


def _life_lost(lives: Any, before: Any) -> Any:
    """CleanRL's EpisodicLifeEnv rule: a life is lost when 0 < lives < lives before the step
    (lives reaching 0 ahead of the game over, as in BankHeist or Atlantis, is not a loss)."""
    return (0 < lives) & (lives < before)


class AtariLifeCycle(gym.Wrapper):
    """CleanRL's FireResetEnv and EpisodicLifeEnv resets, without resetting the game at a lost life.

    reset: after the inner reset (1..noop_max no-op frames, AtariPreprocessing), FIRE and action 2
    (if the game has FIRE). step: when the agent's step costs a life and episodic life is on,
    EpisodicLifeEnv.reset's no-op step and FireResetEnv's FIRE, 2 follow inside the same call, and
    the last frame is returned with info["life_lost"] = True (RankEnvs makes it a training
    terminal and refills the frame stack). Their rewards are not the agent's: info["forced_reward"]
    reports them for the game's raw score. If the game ends among them, the steps left are taken
    after the reset the vector env then calls, in place of FIRE, 2 (as in CleanRL).
    """

    def __init__(self, env: gym.Env, episodic_life: bool, fire_reset: bool):
        super().__init__(env)
        self.episodic_life = episodic_life
        self.start = _start_steps(fire_reset, episodic_life, env.unwrapped.get_action_meanings())
        self.after_loss: ForcedSteps = [(0, False)] + self.start
        self.ale = env.unwrapped.ale
        self.lives = 0
        self._resume: ForcedSteps | None = None  # forced steps a game over interrupted

    def _forced(self, steps: ForcedSteps):
        """Takes CleanRL's forced steps until done or a game ends; returns (obs, reward,
        terminated, truncated, info, the steps left after a game end, else None)."""
        pending, total = list(steps), 0.0
        obs = info = None
        while pending:
            action, checked = pending.pop(0)
            obs, reward, terminated, truncated, info = self.env.step(action)
            total += float(reward)
            if terminated or truncated:
                return obs, total, terminated, truncated, info, pending
            lives = self.ale.lives()
            if checked and _life_lost(lives, self.lives):
                pending.insert(0, (0, False))
            self.lives = lives
        return obs, total, False, False, info, None

    def reset(self, **kwargs: Any):
        steps = self.start if self._resume is None else self._resume
        self._resume = None
        obs, info = self.env.reset(**kwargs)
        self.lives = self.ale.lives()
        forced = 0.0
        while True:
            last_obs, reward, _, _, last_info, steps = self._forced(steps)
            forced += reward
            if last_obs is not None:
                obs, info = last_obs, last_info
            if steps is None:
                break
            obs, info = self.env.reset()  # a game over within the forced steps (FireResetEnv)
            self.lives = self.ale.lives()
        info["forced_reward"] = forced
        return obs, info

    def step(self, action: Any):
        obs, reward, terminated, truncated, info = self.env.step(action)
        lives = self.ale.lives()
        lost = bool(self.episodic_life and not (terminated or truncated)
                    and _life_lost(lives, self.lives))
        self.lives = lives
        forced = 0.0
        if lost:
            obs, forced, terminated, truncated, info, self._resume = self._forced(self.after_loss)
        info["life_lost"] = lost
        info["forced_reward"] = forced
        return obs, reward, terminated, truncated, info


def _make_gym_env(cfg: EnvConfig, atari: bool, render_mode: str | None = None) -> gym.Env:
    """`render_mode`: Gymnasium's, for recording videos (`rgb_array`); None in training."""
    extra = {"render_mode": render_mode} if render_mode else {}
    if not atari:
        kwargs = {"max_episode_steps": cfg.max_episode_steps} if cfg.max_episode_steps else {}
        return gym.make(cfg.id, **kwargs, **extra)
    register_ale()
    # NoFrameskip semantics at the ALE level; frame skipping and max-pooling happen in the wrapper.
    # The time limit counts emulator frames, as ale_vector's does; RankEnvs stacks the frames.
    env = gym.make(cfg.id, frameskip=1, repeat_action_probability=cfg.repeat_action_probability,
                   full_action_space=False, max_num_frames_per_episode=_episode_frames(cfg), **extra)
    env = gym.wrappers.AtariPreprocessing(
        env, noop_max=cfg.noop_max, frame_skip=cfg.frame_skip, screen_size=cfg.screen_size,
        terminal_on_life_loss=False, grayscale_obs=True, scale_obs=False)
    return AtariLifeCycle(env, cfg.episodic_life, cfg.fire_reset)


def _ale_game(env_id: str) -> str:
    spec = gym.spec(env_id)
    game = spec.kwargs.get("game")
    if not game:
        raise ValueError(f"cannot tell the ALE game of {env_id!r}")
    return game


class _AtariStep(NamedTuple):
    """One agent step of an Atari backend, before frame stacking and episode statistics."""

    frames: np.ndarray  # (N, H, W) newest frame; a new life's or game's first frame where one began
    reward: np.ndarray  # float64: raw reward of the agent's own frames
    terminated: np.ndarray  # game over in this step (in the agent's frames or the forced ones)
    truncated: np.ndarray  # the time limit ended the game in this step (no game over)
    life_lost: np.ndarray  # the agent's frames cost a life (episodic life only)
    end_extra: np.ndarray  # raw reward of forced frames, for the game that was in progress
    start_extra: np.ndarray  # raw reward of the start frames of a game begun in this step
    final_frames: np.ndarray | None  # (N, H, W): last frame of each game that ended (rows `ended`)


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


class _AleVectorEnvs:
    """The `ale_vector` backend: ale-py's C++ AtariVectorEnv, one per environment, stepped together.

    A C++ vector env steps all of its environments at every call, while CleanRL's life cycle needs
    steps that only some environments take, inside the agent step in which they happen: FIRE and
    action 2 after a reset, a no-op, FIRE and 2 after a lost life. So every environment is its own
    one-env C++ vector (emulation and preprocessing in C++ on its own worker thread): `send` to
    each and then `recv` from each runs them concurrently, at most `window` at a time (env_threads,
    else this rank's threads), and the forced steps go only to the environments that need them.
    The C++ env presses no FIRE, stacks no frames, clips nothing and knows no episodic life; at a
    reset it draws 0..noop_max no-op frames (it is built with noop_max + 1), and a draw of 0 is
    reset again, which leaves CleanRL's 1..noop_max.
    """

    def __init__(self, cfg: EnvConfig, threads: int):
        from ale_py.vector_env import AtariVectorEnv

        self.num_envs = cfg.num_envs
        self.envs = [AtariVectorEnv(
            _ale_game(cfg.id), 1, num_threads=1, autoreset_mode=AutoresetMode.SAME_STEP,
            frameskip=cfg.frame_skip, stack_num=1, img_height=cfg.screen_size,
            img_width=cfg.screen_size, noop_max=cfg.noop_max + 1, episodic_life=False,
            life_loss_info=False, reward_clipping=False, use_fire_reset=False,
            repeat_action_probability=cfg.repeat_action_probability,
            max_num_frames_per_episode=_episode_frames(cfg)) for _ in range(cfg.num_envs)]
        # At most `threads` envs step at once, unless this process cannot use more CPUs than that
        # anyway (e.g. a rank bound to one core): then all of them, which saves thread hand-offs.
        threads = cfg.env_threads or threads
        self.window = cfg.num_envs if _usable_cpus() <= threads else max(1, min(cfg.num_envs, threads))
        meanings = [a.name for a in self.envs[0].ale.get_action_set()]
        self.start = _start_steps(cfg.fire_reset, cfg.episodic_life, meanings)
        self.after_loss: ForcedSteps | None = [(0, False)] + self.start if cfg.episodic_life else None
        self.min_noops = 1 if cfg.noop_max > 0 else 0
        self.single_action_space = self.envs[0].single_action_space
        self.single_observation_space = gym.spaces.Box(0, 255, (cfg.screen_size, cfg.screen_size), np.uint8)
        self.lives = np.zeros(cfg.num_envs, dtype=np.int64)
        self._strength = [1.0]

    def _run(self, rows: Any, actions: Any) -> list[tuple]:
        """Steps envs `rows` with `actions` (one each), at most `window` at a time, in order."""
        envs, window, count = self.envs, self.window, len(rows)
        for j in range(min(window, count)):
            envs[rows[j]].ale.send([int(actions[j])], self._strength)
        results = []
        for j in range(count):
            results.append(envs[rows[j]].ale.recv())
            if j + window < count:
                envs[rows[j + window]].ale.send([int(actions[j + window])], self._strength)
        return results

    def _begin(self, i: int, obs: np.ndarray, info: dict) -> tuple[np.ndarray, int]:
        """A game was just reset (by us or by SAME_STEP autoreset): redraw zero no-ops."""
        while info["episode_frame_number"][0] < self.min_noops:
            obs, info = self.envs[i].reset()
        return obs[0, -1], int(info["lives"][0])

    def _forced(self, pending: dict[int, ForcedSteps], in_game: set[int], frames: np.ndarray,
                terminated: np.ndarray, truncated: np.ndarray, end_extra: np.ndarray,
                start_extra: np.ndarray) -> None:
        """Takes CleanRL's forced steps (see ForcedSteps) on the envs in `pending` only, all of
        them at once. `in_game`: envs whose steps follow a lost life and belong to the game in
        progress until it ends; the others' belong to the game that starts."""
        while pending:
            rows = list(pending)
            results = self._run(rows, [pending[i][0][0] for i in rows])
            for i, (obs, reward, term, trunc, info) in zip(rows, results):
                _, checked = pending[i].pop(0)
                (end_extra if i in in_game else start_extra)[i] += reward[0]
                lives = int(info["lives"][0])
                if term[0] or trunc[0]:  # the C++ env reset the game (no-ops only); steps go on
                    if i in in_game:
                        terminated[i] |= term[0]
                        truncated[i] |= trunc[0] and not term[0]
                        in_game.discard(i)
                    frames[i], lives = self._begin(i, obs, info)
                else:
                    frames[i] = obs[0, -1]
                    if checked and _life_lost(lives, self.lives[i]):
                        pending[i].insert(0, (0, False))
                self.lives[i] = lives
                if not pending[i]:
                    del pending[i]

    def reset(self, seeds: list[int]) -> tuple[np.ndarray, np.ndarray]:
        n = self.num_envs
        frames = np.empty((n,) + self.single_observation_space.shape, dtype=np.uint8)
        for i, env in enumerate(self.envs):
            obs, info = env.reset(seed=np.asarray(seeds[i:i + 1], dtype=np.int64))
            frames[i], self.lives[i] = self._begin(i, obs, info)
        start_extra = np.zeros(n)
        if self.start:
            none = np.zeros(n, dtype=bool)
            self._forced({i: list(self.start) for i in range(n)}, set(), frames, none, none.copy(),
                         np.zeros(n), start_extra)
        return frames, start_extra

    def step(self, actions: np.ndarray) -> _AtariStep:
        n = self.num_envs
        results = self._run(range(n), actions)
        frames = np.concatenate([r[0] for r in results]).reshape((n,) + self.single_observation_space.shape)
        reward = np.concatenate([r[1] for r in results]).astype(np.float64)
        terminated = np.concatenate([r[2] for r in results])
        truncated = np.concatenate([r[3] for r in results])
        lives = np.concatenate([r[4]["lives"] for r in results])
        ended = terminated | truncated
        if self.after_loss is None:
            life_lost = np.zeros(n, dtype=bool)
        else:
            life_lost = _life_lost(lives, self.lives) & ~ended
        self.lives[:] = lives
        end_extra, start_extra, final_frames = np.zeros(n), np.zeros(n), None
        pending: dict[int, ForcedSteps] = {}
        if ended.any():
            final_frames = np.zeros_like(frames)
            for i in np.flatnonzero(ended).tolist():
                obs, _, _, _, info = results[i]
                final_frames[i] = info["final_obs"][0, -1]
                frames[i], self.lives[i] = self._begin(i, obs, info)
                if self.start:
                    pending[i] = list(self.start)
        lost = np.flatnonzero(life_lost).tolist()
        for i in lost:
            pending[i] = list(self.after_loss)
        if pending:
            self._forced(pending, set(lost), frames, terminated, truncated, end_extra, start_extra)
        return _AtariStep(frames, reward, terminated, truncated, life_lost, end_extra, start_extra,
                          final_frames)

    def close(self) -> None:
        for env in self.envs:
            env.close()
        self.envs = []


def _info_array(info: dict, key: str, n: int, dtype: Any) -> np.ndarray:
    value = info.get(key)
    return np.zeros(n, dtype=dtype) if value is None else np.asarray(value, dtype=dtype)


@dataclass
class StepResult:
    obs: np.ndarray
    reward: np.ndarray  # float32, clipped to its sign for Atari when env.clip_rewards
    terminated: np.ndarray  # bool: no bootstrap (real termination, or a lost life)
    truncated: np.ndarray  # bool: episode cut by a time limit; bootstrap from final_obs
    final_obs: np.ndarray | None  # observations at truncation, rows for np.flatnonzero(truncated)
    episode_returns: list[float] = field(default_factory=list)  # whole games finished this step
    episode_lengths: list[int] = field(default_factory=list)
    episode_envs: list[int] = field(default_factory=list)  # the environment each of those games ran in


class RankEnvs:
    """This rank's vector of environments behind one interface, whatever the backend."""

    def __init__(self, cfg: EnvConfig, threads: int = 1, render_mode: str | None = None):
        """`render_mode` (`rgb_array`: `render()` gives frames for videos) needs the sync backend."""
        register_ale()
        if render_mode and cfg.backend != "sync":
            raise ValueError(f"env.backend {cfg.backend!r} cannot render; use 'sync'")
        self.cfg = cfg
        self.atari = is_atari(cfg.id)
        self.num_envs = cfg.num_envs
        self.clip_rewards = self.atari and cfg.clip_rewards
        self.vec: Any
        if cfg.backend == "ale_vector":
            self.vec = _AleVectorEnvs(cfg, threads)
        else:
            factory: Callable[[], gym.Env] = functools.partial(_make_gym_env, cfg, self.atari, render_mode)
            fns = [factory] * cfg.num_envs
            if cfg.backend == "async":
                # forkserver: children never inherit MPI/Horovod threads and sockets.
                fns = [functools.partial(_worker_env, fn) for fn in fns]
                self.vec = gym.vector.AsyncVectorEnv(
                    fns, shared_memory=True, copy=False, context="forkserver",
                    autoreset_mode=AutoresetMode.SAME_STEP)
            else:
                self.vec = gym.vector.SyncVectorEnv(
                    fns, copy=False, autoreset_mode=AutoresetMode.SAME_STEP)
        self.single_observation_space = self.vec.single_observation_space
        self.single_action_space = self.vec.single_action_space
        if self.atari:  # the backends give single frames; the stack is kept here, for both alike
            frame = self.single_observation_space.shape
            self.single_observation_space = gym.spaces.Box(
                0, 255, (cfg.frame_stack,) + tuple(frame), dtype=np.uint8)
            self._stack = np.zeros((self.num_envs, cfg.frame_stack) + tuple(frame), dtype=np.uint8)
        self._returns = np.zeros(self.num_envs, dtype=np.float64)
        self._lengths = np.zeros(self.num_envs, dtype=np.int64)

    def render(self, index: int = 0) -> np.ndarray:
        """Environment `index`'s current screen (RGB, H x W x 3); needs render_mode='rgb_array'."""
        return np.asarray(self.vec.envs[index].render())

    def reset(self, seeds: list[int]) -> np.ndarray:
        start_extra: Any = 0  # raw reward of the forced steps that started each game
        if self.cfg.backend == "ale_vector":
            obs, start_extra = self.vec.reset(seeds)
        else:
            obs, info = self.vec.reset(seed=list(seeds))
            if self.atari:
                start_extra = _info_array(info, "forced_reward", self.num_envs, np.float64)
        self._returns[:] = start_extra
        self._lengths[:] = 0
        if self.atari:
            # A new game's first frame fills the whole stack (CleanRL's FrameStack.reset).
            self._stack = np.repeat(np.asarray(obs)[:, None], self.cfg.frame_stack, axis=1)
            return self._stack
        return obs

    def _gym_atari_step(self, actions: np.ndarray) -> _AtariStep:
        frames, reward, terminated, truncated, info = self.vec.step(actions)
        n = self.num_envs
        terminated = np.asarray(terminated, dtype=bool)
        truncated = np.asarray(truncated, dtype=bool) & ~terminated
        forced = _info_array(info, "forced_reward", n, np.float64)
        life_lost = _info_array(info, "life_lost", n, bool)
        ended = terminated | truncated
        end_extra, start_extra, final_frames = forced, np.zeros(n), None
        if ended.any():  # this step's info of an ended game is in final_info; info is the reset's
            final = info["final_info"]
            end_extra = np.where(ended, _info_array(final, "forced_reward", n, np.float64), forced)
            start_extra = np.where(ended, forced, 0.0)
            life_lost = np.where(ended, _info_array(final, "life_lost", n, bool), life_lost)
            final_frames = np.zeros_like(frames)
            for i in np.flatnonzero(ended):
                final_frames[i] = info["final_obs"][i]
        return _AtariStep(np.asarray(frames), np.asarray(reward, dtype=np.float64), terminated,
                          truncated, life_lost, end_extra, start_extra, final_frames)

    def _finish_games(self, ended: np.ndarray) -> tuple[list[float], list[int], list[int]]:
        """Statistics of the whole games that ended in this step, and their environments; their
        counters restart."""
        if not ended.any():
            return [], [], []
        done_idx = np.flatnonzero(ended)
        returns, lengths = self._returns[done_idx].tolist(), self._lengths[done_idx].tolist()
        self._returns[done_idx] = 0
        self._lengths[done_idx] = 0
        return returns, lengths, done_idx.tolist()

    def _atari_step(self, actions: np.ndarray) -> StepResult:
        s = self.vec.step(actions) if self.cfg.backend == "ale_vector" else self._gym_atari_step(actions)
        ended = s.terminated | s.truncated
        self._returns += s.reward + s.end_extra  # raw game score, forced steps included
        self._lengths += 1  # agent steps
        result_returns, result_lengths, result_envs = self._finish_games(ended)
        self._returns += s.start_extra

        # A lost life is a terminal for training only; the game goes on (and was relaunched).
        train_terminated = s.terminated | s.life_lost
        bootstrap = s.truncated & ~train_terminated
        stack = self._stack
        obs = np.empty_like(stack)
        obs[:, :-1] = stack[:, 1:]
        obs[:, -1] = s.frames
        fresh = ended | s.life_lost
        if fresh.any():  # a new game or life starts from a full stack of its first frame
            obs[fresh] = s.frames[fresh][:, None]
        final_obs = None
        if bootstrap.any():
            rows = np.flatnonzero(bootstrap)
            final_obs = np.concatenate([stack[rows, 1:], s.final_frames[rows][:, None]], axis=1)
        self._stack = obs
        return StepResult(
            obs=obs,
            reward=(np.sign(s.reward) if self.clip_rewards else s.reward).astype(np.float32),
            terminated=train_terminated,
            truncated=bootstrap,
            final_obs=final_obs,
            episode_returns=result_returns,
            episode_lengths=result_lengths,
            episode_envs=result_envs,
        )

    def step(self, actions: np.ndarray) -> StepResult:
        if self.atari:
            return self._atari_step(actions)
        obs, reward, terminated, truncated, info = self.vec.step(actions)
        reward = np.asarray(reward, dtype=np.float64)
        terminated = np.asarray(terminated, dtype=bool)
        truncated = np.asarray(truncated, dtype=bool)
        ended = terminated | truncated

        self._returns += reward
        self._lengths += 1
        result_returns, result_lengths, result_envs = self._finish_games(ended)

        train_terminated = terminated
        bootstrap = truncated & ~train_terminated
        final_obs = None
        if bootstrap.any():
            rows = np.flatnonzero(bootstrap)
            stored = info["final_obs"]
            final_obs = np.stack([np.asarray(stored[i]) for i in rows])
        return StepResult(
            obs=obs,
            reward=(np.sign(reward) if self.clip_rewards else reward).astype(np.float32),
            terminated=train_terminated,
            truncated=bootstrap,
            final_obs=final_obs,
            episode_returns=result_returns,
            episode_lengths=result_lengths,
            episode_envs=result_envs,
        )

    def close(self) -> None:
        """Never raises: after a crash, a dead worker's BrokenPipeError must not replace the
        error that brought the rank down."""
        try:
            self.vec.close()
        except Exception as exc:  # noqa: BLE001
            print(f"[hvd_rl] warning: closing environments: {type(exc).__name__}: {exc}",
                  file=sys.stderr, flush=True)
