"""Per-rank vector environments: backends, the Atari recipe, seeds and episode statistics.

Autoreset is SAME_STEP on every backend: when an episode ends, `step` already returns the first
observation of the next one (the last observation is kept in `final_obs`). So every stored
transition is a real one; NEXT_STEP's extra "reset step" (action ignored, reward 0) never
reaches the PPO loss.

Episodic life (CleanRL's EpisodicLifeEnv) is applied here, not by resetting the game: a lost
life is a terminal *for training* (no value bootstrapped across it) while the game goes on, which
is also what ale-py's C++ vector env does. Episode statistics always count whole games.
"""
from __future__ import annotations

import functools
import signal
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode

from hvd_rl.config import EnvConfig

_ALE_REGISTERED = False


def register_ale() -> None:
    """Makes the ALE/* ids known to Gymnasium (ale-py >= 0.9 ships the ROMs in its wheel)."""
    global _ALE_REGISTERED
    if not _ALE_REGISTERED:
        import ale_py

        gym.register_envs(ale_py)
        _ALE_REGISTERED = True


def is_atari(env_id: str) -> bool:
    register_ale()
    spec = gym.spec(env_id)
    entry = spec.entry_point if isinstance(spec.entry_point, str) else ""
    return entry.startswith("ale_py")


def check_env_id(env_id: str, backend: str) -> str | None:
    """One-line problem description for an env id that cannot be used, else None."""
    register_ale()
    try:
        gym.spec(env_id)
    except gym.error.Error as exc:
        return f"env.id {env_id!r} is not a registered Gymnasium environment ({exc})"
    if backend == "ale_vector" and not is_atari(env_id):
        return f"env.backend 'ale_vector' needs an ALE environment, but {env_id!r} is not one"
    return None


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


class FireResetEnv(gym.Wrapper):
    """Presses FIRE after a reset, for games that wait for it (CleanRL/Baselines FireResetEnv)."""

    def reset(self, **kwargs: Any):
        self.env.reset(**kwargs)
        for action in (1, 2):
            obs, _, terminated, truncated, info = self.env.step(action)
            if terminated or truncated:
                obs, info = self.env.reset(**kwargs)
        return obs, info


def _make_gym_env(cfg: EnvConfig, atari: bool) -> gym.Env:
    if not atari:
        kwargs = {"max_episode_steps": cfg.max_episode_steps} if cfg.max_episode_steps else {}
        return gym.make(cfg.id, **kwargs)
    register_ale()
    # NoFrameskip semantics at the ALE level; frame skipping and max-pooling happen in the wrapper.
    env = gym.make(cfg.id, frameskip=1, repeat_action_probability=cfg.repeat_action_probability,
                   full_action_space=False)
    env = gym.wrappers.AtariPreprocessing(
        env, noop_max=cfg.noop_max, frame_skip=cfg.frame_skip, screen_size=cfg.screen_size,
        terminal_on_life_loss=False, grayscale_obs=True, scale_obs=False)
    if cfg.fire_reset and "FIRE" in env.unwrapped.get_action_meanings()[1:2]:
        env = FireResetEnv(env)
    if cfg.max_episode_steps:
        env = gym.wrappers.TimeLimit(env, cfg.max_episode_steps)
    return gym.wrappers.FrameStackObservation(env, cfg.frame_stack)


def _ale_game(env_id: str) -> str:
    spec = gym.spec(env_id)
    game = spec.kwargs.get("game")
    if not game:
        raise ValueError(f"cannot tell the ALE game of {env_id!r}")
    return game


@dataclass
class StepResult:
    obs: np.ndarray
    reward: np.ndarray  # float32, clipped to its sign for Atari when env.clip_rewards
    terminated: np.ndarray  # bool: no bootstrap (real termination, or a lost life)
    truncated: np.ndarray  # bool: episode cut by a time limit; bootstrap from final_obs
    final_obs: np.ndarray | None  # observations at truncation, rows for np.flatnonzero(truncated)
    episode_returns: list[float] = field(default_factory=list)  # whole games finished this step
    episode_lengths: list[int] = field(default_factory=list)


class RankEnvs:
    """This rank's vector of environments behind one interface, whatever the backend."""

    def __init__(self, cfg: EnvConfig, threads: int = 1):
        register_ale()
        self.cfg = cfg
        self.atari = is_atari(cfg.id)
        self.num_envs = cfg.num_envs
        self.clip_rewards = self.atari and cfg.clip_rewards
        self.track_lives = self.atari and cfg.episodic_life
        if cfg.backend == "ale_vector":
            from ale_py.vector_env import AtariVectorEnv

            frames = cfg.max_episode_steps * cfg.frame_skip if cfg.max_episode_steps else 108_000
            self.vec: gym.vector.VectorEnv = AtariVectorEnv(
                _ale_game(cfg.id), cfg.num_envs, num_threads=cfg.env_threads or threads,
                autoreset_mode=AutoresetMode.SAME_STEP, frameskip=cfg.frame_skip,
                stack_num=cfg.frame_stack, img_height=cfg.screen_size, img_width=cfg.screen_size,
                noop_max=cfg.noop_max, episodic_life=False, life_loss_info=False,
                reward_clipping=False, use_fire_reset=cfg.fire_reset,
                repeat_action_probability=cfg.repeat_action_probability,
                max_num_frames_per_episode=frames)
        else:
            factory: Callable[[], gym.Env] = functools.partial(_make_gym_env, cfg, self.atari)
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
        self._returns = np.zeros(self.num_envs, dtype=np.float64)
        self._lengths = np.zeros(self.num_envs, dtype=np.int64)
        self._lives = np.zeros(self.num_envs, dtype=np.int64)

    def reset(self, seeds: list[int]) -> np.ndarray:
        if self.cfg.backend == "ale_vector":
            obs, info = self.vec.reset(seed=np.asarray(seeds, dtype=np.int64))
        else:
            obs, info = self.vec.reset(seed=list(seeds))
        self._returns[:] = 0
        self._lengths[:] = 0
        if self.track_lives:
            self._lives[:] = info["lives"]
        return obs

    def step(self, actions: np.ndarray) -> StepResult:
        obs, reward, terminated, truncated, info = self.vec.step(actions)
        reward = np.asarray(reward, dtype=np.float64)
        terminated = np.asarray(terminated, dtype=bool)
        truncated = np.asarray(truncated, dtype=bool)
        ended = terminated | truncated

        self._returns += reward
        self._lengths += 1
        result_returns: list[float] = []
        result_lengths: list[int] = []
        if ended.any():
            done_idx = np.flatnonzero(ended)
            result_returns = self._returns[done_idx].tolist()
            result_lengths = self._lengths[done_idx].tolist()
            self._returns[done_idx] = 0
            self._lengths[done_idx] = 0

        train_terminated = terminated
        if self.track_lives:
            lives = info["lives"]
            # After a finished game `lives` already belongs to the new game; `ended` covers it.
            train_terminated = terminated | ((lives < self._lives) & ~ended)
            self._lives[:] = lives
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
        )

    def close(self) -> None:
        """Never raises: after a crash, a dead worker's BrokenPipeError must not replace the
        error that brought the rank down."""
        try:
            self.vec.close()
        except Exception as exc:  # noqa: BLE001
            print(f"[hvd_rl] warning: closing environments: {type(exc).__name__}: {exc}",
                  file=sys.stderr, flush=True)
