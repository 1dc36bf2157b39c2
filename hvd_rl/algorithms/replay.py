"""A rank's replay shard: transitions of this rank's environments, frames stored once.

Atari observations are stacks of the last 4 frames, so consecutive observations share 3 of them.
Storing each observation (and the next one) whole costs 8x the frames; here each environment has
a ring of single frames, and a transition records where its observation and next observation end
in that ring. A step whose observation continues the previous one (its first frames equal the
previous observation's last ones) appends one frame; anything else (a reset, the refilled stack
after a lost life) starts a new chain with the whole stack. Reconstruction therefore returns
exactly the observations the environment produced, whatever its stacking rules. Vector
observations (CartPole, MuJoCo) are stored whole, one per step (a "stack" of 1).

Memory: (capacity + chain overhead) x one frame, e.g. 1M transitions of 84x84 frames ~= 7.1 GB
instead of 56 GB for (obs, next_obs) pairs of 4x84x84 stacks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class Sample:
    obs: np.ndarray
    actions: np.ndarray
    rewards: np.ndarray
    next_obs: np.ndarray
    dones: np.ndarray  # 1.0 where the transition ended the episode (no bootstrap)


class _EnvRing:
    """One environment's frames and transitions."""

    def __init__(self, capacity: int, frame_shape: tuple[int, ...], dtype: np.dtype, stack: int):
        self.stack = stack
        # Each chain start costs stack - 1 extra frames; episodes are far longer than that.
        self.frame_capacity = capacity + capacity // 4 + 4 * stack
        self.frames = np.zeros((self.frame_capacity,) + frame_shape, dtype=dtype)
        self.frame_count = 0  # frames ever written (positions are absolute, modulo capacity)
        self.capacity = capacity
        self.obs_end = np.zeros(capacity, dtype=np.int64)  # absolute frame position
        self.next_end = np.zeros(capacity, dtype=np.int64)
        self.actions: np.ndarray | None = None
        self.rewards = np.zeros(capacity, dtype=np.float32)
        self.dones = np.zeros(capacity, dtype=np.float32)
        self.count = 0  # transitions ever written
        self.current_end = -1  # frame position where the current observation ends
        self.last_obs: np.ndarray | None = None

    def _push_frame(self, frame: np.ndarray) -> int:
        self.frames[self.frame_count % self.frame_capacity] = frame
        self.frame_count += 1
        return self.frame_count - 1

    def push_observation(self, obs: np.ndarray) -> int:
        """Appends an observation; returns the position where it ends."""
        if self.stack > 1 and self.last_obs is not None and np.array_equal(obs[:-1], self.last_obs[1:]):
            end = self._push_frame(obs[-1])
        else:  # a new chain: the whole stack
            for frame in (obs if self.stack > 1 else obs[None]):
                end = self._push_frame(frame)
        self.last_obs = np.array(obs)  # a copy: vector envs reuse their output arrays
        self.current_end = end
        return end

    def add(self, action: Any, reward: float, done: bool, next_obs: np.ndarray, episode_start: np.ndarray | None) -> None:
        """Records the transition from the current observation to `next_obs`; `episode_start`
        (the first observation of the next episode, SAME_STEP autoreset) becomes current."""
        slot = self.count % self.capacity
        if self.actions is None:
            action = np.asarray(action)
            self.actions = np.zeros((self.capacity,) + action.shape, dtype=action.dtype)
        self.obs_end[slot] = self.current_end
        self.next_end[slot] = self.push_observation(next_obs)
        self.actions[slot] = action
        self.rewards[slot] = reward
        self.dones[slot] = float(done)
        self.count += 1
        if episode_start is not None:
            self.push_observation(episode_start)

    def valid(self) -> np.ndarray:
        """Slots whose frames have not been overwritten yet."""
        n = min(self.count, self.capacity)
        slots = np.arange(n)
        oldest_frame = self.frame_count - self.frame_capacity
        return slots[self.obs_end[:n] - (self.stack - 1) >= oldest_frame]

    def observations(self, ends: np.ndarray) -> np.ndarray:
        offsets = np.arange(-(self.stack - 1), 1)
        positions = (ends[:, None] + offsets[None, :]) % self.frame_capacity
        obs = self.frames[positions]  # [n, stack, *frame]
        return obs if self.stack > 1 else obs[:, 0]


class ReplayShard:
    """This rank's transitions; `capacity` counts transitions over all of its environments."""

    def __init__(self, capacity: int, num_envs: int, obs_shape: tuple[int, ...], obs_dtype: np.dtype,
                 frame_stack: int):
        image_stack = len(obs_shape) == 3 and obs_shape[0] == frame_stack and frame_stack > 1
        self.stack = frame_stack if image_stack else 1
        frame_shape = tuple(obs_shape[1:]) if image_stack else tuple(obs_shape)
        per_env = max(1, capacity // num_envs)
        self.envs = [_EnvRing(per_env, frame_shape, obs_dtype, self.stack) for _ in range(num_envs)]

    def __len__(self) -> int:
        return sum(min(ring.count, ring.capacity) for ring in self.envs)

    @property
    def capacity(self) -> int:
        """Transitions this shard holds when full (whole slots per environment)."""
        return sum(ring.capacity for ring in self.envs)

    @property
    def nbytes(self) -> int:
        return sum(ring.frames.nbytes + ring.obs_end.nbytes * 2 + ring.rewards.nbytes * 2
                   + (ring.actions.nbytes if ring.actions is not None else 0) for ring in self.envs)

    def start(self, obs: np.ndarray) -> None:
        """The environments' first observations (after a reset of all of them)."""
        for ring, o in zip(self.envs, obs):
            ring.push_observation(o)

    def add(self, actions: np.ndarray, rewards: np.ndarray, dones: np.ndarray, next_obs: np.ndarray,
            final_obs: dict[int, np.ndarray]) -> None:
        """One vector step. `next_obs` is what the envs returned: after an episode end (SAME_STEP
        autoreset) already the next episode's first observation, which is fine for terminated
        transitions (done = 1: next_obs is never used). `final_obs[e]` is the real last
        observation of env e's episode when a time limit cut it (its value is bootstrapped)."""
        for e, ring in enumerate(self.envs):
            if e in final_obs:
                ring.add(actions[e], rewards[e], dones[e], final_obs[e], episode_start=next_obs[e])
            else:
                ring.add(actions[e], rewards[e], dones[e], next_obs[e], episode_start=None)

    def sample(self, batch_size: int, rng: np.random.Generator) -> Sample:
        """Uniform over this shard's valid transitions."""
        valid = [ring.valid() for ring in self.envs]
        sizes = np.array([len(v) for v in valid])
        picks = rng.integers(0, sizes.sum(), size=batch_size)
        bounds = np.cumsum(sizes)
        env_of = np.searchsorted(bounds, picks, side="right")
        parts = []
        for e in np.unique(env_of):
            ring = self.envs[e]
            slots = valid[e][picks[env_of == e] - (bounds[e] - sizes[e])]
            parts.append((ring.observations(ring.obs_end[slots]), ring.actions[slots], ring.rewards[slots],
                          ring.observations(ring.next_end[slots]), ring.dones[slots]))
        return Sample(*(np.concatenate(x) for x in zip(*parts)))

    # ---- optional checkpointing of the shard ----

    def state(self) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {"stack": np.array(self.stack), "num_envs": np.array(len(self.envs))}
        for e, ring in enumerate(self.envs):
            for key in ("frames", "obs_end", "next_end", "rewards", "dones"):
                out[f"{e}.{key}"] = getattr(ring, key)
            out[f"{e}.actions"] = ring.actions if ring.actions is not None else np.zeros(0)
            out[f"{e}.counters"] = np.array([ring.frame_count, ring.count, ring.current_end])
            out[f"{e}.last_obs"] = ring.last_obs if ring.last_obs is not None else np.zeros(0)
        return out

    def load(self, state: dict[str, np.ndarray]) -> None:
        if int(state["num_envs"]) != len(self.envs) or int(state["stack"]) != self.stack:
            raise ValueError("replay shard layout differs from this run's")
        for e, ring in enumerate(self.envs):
            if state[f"{e}.frames"].shape != ring.frames.shape:
                raise ValueError("replay shard capacity differs from this run's")
            for key in ("frames", "obs_end", "next_end", "rewards", "dones"):
                setattr(ring, key, state[f"{e}.{key}"].copy())
            actions = state[f"{e}.actions"]
            ring.actions = actions.copy() if actions.size else None
            ring.frame_count, ring.count, ring.current_end = (int(x) for x in state[f"{e}.counters"])
            last = state[f"{e}.last_obs"]
            ring.last_obs = last.copy() if last.size else None
