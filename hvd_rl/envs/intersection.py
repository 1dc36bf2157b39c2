"""Cooperating vehicles: highway-env's multi-agent intersection as a PettingZoo Parallel env.

Each controlled vehicle is an agent with its own local perception (highway-env's Kinematics
observation of the 15 nearest vehicles, flattened, and the fraction of the episode's time left)
and its own speed decision (SLOWER, IDLE, FASTER). The time left is there because the episode has
a time limit (Pardo et al., 2018, "Time Limits in Reinforcement Learning"): without it a vehicle
that waits for the others to cross cannot tell how long it has waited, and training settled on
stopping (60k steps: 5% crashes, 20% arrivals, fewer than the idle policy's 36%). highway-env ends the whole episode at the first crash; here each vehicle is done on its
own (it crashed, or it arrived 25 m into its exit lane) and the episode ends when all are done or
the time limit passes, so the others go on driving around a wreck, as on a road. A vehicle that is
done keeps its last speed command (crashed ones stop by themselves) and no longer acts.

The team reward is what every agent receives (a cooperative task): arrivals minus collisions, i.e.
per step, the sum over vehicles of +1 on the step a vehicle arrives and -1 on the step it crashes,
divided by the number of vehicles. Not highway-env's weights (-5 per crash, +1 per arrival, a speed
bonus every step): under them, measured with scripted policies over 40 episodes, standing still
(0 crashes, 0 arrivals, return 0) beats every policy that arrives, and the speed bonus pays the
idle policy (all four vehicles reach the centre together: 64% crash) more than staggering the
vehicles' starts (1, 3, 5, 7 s: 15% crash, 48% arrive), so the task's goal and its reward disagreed.
Per episode: collision_rate and arrival_rate (fractions of the controlled vehicles).

Speed: highway-env simulates at 5 Hz here (its highway-fast-v0 setting; 15 Hz by default) and each
vehicle's observation is built with numpy instead of pandas (`NumpyKinematics`, the same numbers as
highway-env's KinematicObservation: tests/test_multiagent.py compares them), about 3x faster.
"""
from __future__ import annotations

import functools
from typing import Any

import gymnasium as gym
import numpy as np
from pettingzoo import ParallelEnv

IDLE = 1  # highway-env's DiscreteMetaAction index for "keep the target speed"
SIMULATION_HZ = 5
ARRIVAL_REWARD = 1.0
COLLISION_REWARD = -1.0


def _kinematics_class():
    from highway_env.envs.common.observation import KinematicObservation

    class NumpyKinematics(KinematicObservation):
        """highway-env's KinematicObservation for the intersection's settings (absolute
        coordinates, sorted by lane distance, normalised and clipped, no intentions), in numpy."""

        def observe(self) -> np.ndarray:
            ego = self.observer_vehicle
            others = self.env.road.close_objects_to(ego, self.env.PERCEPTION_DISTANCE, count=self.vehicles_count - 1,
                                                    see_behind=self.see_behind, sort=self.order == "sorted",
                                                    vehicles_only=not self.include_obstacles)
            seen = [ego, *others[-self.vehicles_count + 1:]] if others else [ego]
            values = {"presence": [1.0] * len(seen),
                      "x": [v.position[0] for v in seen], "y": [v.position[1] for v in seen],
                      "vx": [v.velocity[0] for v in seen], "vy": [v.velocity[1] for v in seen],
                      "cos_h": [v.direction[0] for v in seen], "sin_h": [v.direction[1] for v in seen]}
            obs = np.zeros((self.vehicles_count, len(self.features)), np.float64)
            for j, feature in enumerate(self.features):
                column = np.asarray(values[feature], np.float64)
                if feature in self.features_range:
                    low, high = self.features_range[feature]
                    column = np.clip(-1 + (column - low) * 2 / (high - low), -1, 1)  # utils.lmap to [-1, 1]
                obs[:len(seen), j] = column
            return obs.astype(np.float32)

    return NumpyKinematics


def _intersection_class():
    from highway_env.envs.intersection_env import MultiAgentIntersectionEnv

    fast = _kinematics_class()

    class FastIntersection(MultiAgentIntersectionEnv):
        def define_spaces(self) -> None:
            super().define_spaces()
            for observation in self.observation_type.agents_observation_types:
                observation.__class__ = fast

    return FastIntersection


class IntersectionParallelEnv(ParallelEnv):
    # one frame per one-second decision, played at 2 frames/s (twice real time)
    metadata = {"name": "highway_intersection", "render_modes": ["rgb_array"], "is_parallelizable": True,
                "render_fps": 2}
    stat_names = ("collision_rate", "arrival_rate")

    def __init__(self, num_vehicles: int = 4, max_steps: int = 0, render_mode: str | None = None):
        config: dict[str, Any] = {"controlled_vehicles": num_vehicles, "destination": None,
                                  "simulation_frequency": SIMULATION_HZ}
        if max_steps:
            config["duration"] = max_steps  # seconds; one decision per second (policy_frequency 1)
        self.env = _intersection_class()(config=config, render_mode=render_mode)
        self.render_mode = render_mode
        self.possible_agents = [f"vehicle_{i}" for i in range(num_vehicles)]
        self.agents: list[str] = []
        self.env.reset(seed=0)  # builds the spaces
        one = self.env.observation_space.spaces[0]
        size = int(np.prod(one.shape))
        self._observation_space = gym.spaces.Box(-np.inf, np.inf, (size + 1,), np.float32)  # + time left
        self._action_space = gym.spaces.Discrete(int(self.env.action_space.spaces[0].n))
        self._done = np.zeros(num_vehicles, bool)
        self._crashed = np.zeros(num_vehicles, bool)
        self._arrived = np.zeros(num_vehicles, bool)

    @functools.lru_cache(maxsize=None)
    def observation_space(self, agent: str) -> gym.spaces.Box:
        return self._observation_space

    @functools.lru_cache(maxsize=None)
    def action_space(self, agent: str) -> gym.spaces.Discrete:
        return self._action_space

    def _observation(self, obs: tuple, agent: str) -> np.ndarray:
        """One vehicle's kinematics, flattened, then the fraction of the episode's time left."""
        left = max(0.0, 1.0 - self.env.time / self.env.config["duration"])
        return np.append(np.asarray(obs[self.possible_agents.index(agent)], np.float32).reshape(-1),
                         np.float32(left))

    def _observations(self, obs: tuple) -> dict[str, np.ndarray]:
        return {a: self._observation(obs, a) for i, a in enumerate(self.possible_agents) if not self._done[i]}

    def reset(self, seed: int | None = None, options: dict | None = None):
        obs, _ = self.env.reset(seed=seed)
        self._done[:] = self._crashed[:] = self._arrived[:] = False
        self.agents = list(self.possible_agents)
        observations = self._observations(obs)
        return observations, {a: {} for a in observations}

    def step(self, actions: dict[str, int]):
        command = tuple(int(actions.get(a, IDLE)) for a in self.possible_agents)
        obs, _, _, time_up, _ = self.env.step(command)
        team = 0.0
        newly_done = np.zeros_like(self._done)
        for i, vehicle in enumerate(self.env.controlled_vehicles):
            if self._done[i]:
                continue
            if vehicle.crashed:
                self._crashed[i] = newly_done[i] = True
                team += COLLISION_REWARD
            elif self.env.has_arrived(vehicle):
                self._arrived[i] = newly_done[i] = True
                team += ARRIVAL_REWARD
        team /= len(self.possible_agents)
        acting = list(self.agents)
        rewards = {a: team for a in acting}
        terminations = {a: bool(newly_done[self.possible_agents.index(a)]) for a in acting}
        truncations = {a: bool(time_up) and not terminations[a] for a in acting}
        self._done |= newly_done
        self.agents = [] if time_up else [a for a in acting if not terminations[a]]
        observations = {a: self._observation(obs, a) for a in acting}
        return observations, rewards, terminations, truncations, {a: {} for a in acting}

    def episode_stats(self) -> dict[str, float]:
        """The finished episode's collision and arrival rates (fractions of the vehicles)."""
        return {"collision_rate": float(self._crashed.mean()), "arrival_rate": float(self._arrived.mean())}

    def render(self) -> np.ndarray | None:
        """The whole intersection from above, every vehicle in one frame."""
        if self.env.viewer is None and self.render_mode == "rgb_array":
            from highway_env.envs.common.graphics import EnvViewer

            self.env.viewer = EnvViewer(self.env)
            # highway-env stops drawing under SDL's dummy video driver (no screen), though its
            # off-screen surfaces need none: drawn anyway
            self.env.viewer.enabled = True
        return self.env.render()

    def close(self) -> None:
        self.env.close()
