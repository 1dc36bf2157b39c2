"""Multi-agent environments: PettingZoo's Parallel API per rank, as [envs, agents] arrays.

One contract for every family: a rank owns E environments of A agents each, and a step takes an
[E, A] action array and gives [E, A] rewards, terminations and truncations, [E, A, D] local
observations, an [E, S] global state (the environment's `state()` where it has one, else every
agent's observation concatenated) and an [E, A] `alive` mask: which agents act at the next step.
An agent that is done while the others go on is dead until its environment resets (when every
agent is done): it takes no actions, gets no rewards, and the learner masks it out. Autoreset is
SAME_STEP as for single-agent environments (hvd_rl/envs/vector.py): the step that ends an episode
returns the next one's first observation, and the last one's is kept for truncation bootstraps.

Families (env.id = "<family>/<name>"):
- mpe2/<task>: PettingZoo MPE (mpe2), e.g. mpe2/simple_spread_v3, one Python env per slot;
- vmas/<scenario>: VMAS, torch-vectorised: all E environments of a rank in one simulator;
- highway/intersection: highway-env's intersection, each controlled vehicle an agent
  (hvd_rl/envs/intersection.py).
Every agent must have the same observation and action space (one shared actor); heterogeneous
spaces are refused when the id is checked (`check_multiagent_id`).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

import gymnasium as gym
import numpy as np

FAMILIES = ("mpe2", "vmas", "highway")
HIGHWAY_TASKS = ("intersection",)


def is_multiagent_id(env_id: str) -> bool:
    return env_id.split("/", 1)[0] in FAMILIES and "/" in env_id


@dataclass(frozen=True)
class MultiAgentSpec:
    """What the learner must know about an environment's agents (identical on every rank)."""

    agents: tuple[str, ...]
    observation_space: gym.spaces.Box  # one agent's local observation
    action_space: gym.Space  # one agent's action
    state_dim: int  # the global state's length
    has_state: bool  # the environment gives a global state (else: observations concatenated)

    @property
    def num_agents(self) -> int:
        return len(self.agents)


@dataclass
class Episode:
    """One finished episode of one environment."""

    team_return: float  # mean over agents of each agent's return
    length: int  # environment steps
    agent_returns: list[float]
    stats: dict[str, float] = field(default_factory=dict)  # per episode: collisions, arrivals, ...
    env: int = 0  # which of the rank's environments played it


@dataclass
class MultiAgentStep:
    obs: np.ndarray  # [E, A, D] float32, zeros for agents that are not alive
    state: np.ndarray  # [E, S] float32
    alive: np.ndarray  # [E, A] bool: acts at the next step
    rewards: np.ndarray  # [E, A] float32 (0 for agents that did not act)
    terminated: np.ndarray  # [E, A] bool
    truncated: np.ndarray  # [E, A] bool
    final_obs: np.ndarray | None  # [E, A, D] where truncated: the observation the agent's episode ended on
    final_state: np.ndarray | None  # [E, S] the state it ended in
    episodes: list[Episode]


class _Spaces:
    """One agent's spaces under RankEnvs' names (what policy/trained.py builds an algorithm from)."""

    spec: MultiAgentSpec

    @property
    def single_observation_space(self) -> gym.spaces.Box:
        return self.spec.observation_space

    @property
    def single_action_space(self) -> gym.Space:
        return self.spec.action_space


# ---- PettingZoo Parallel environments, one per slot -------------------------------------------

def _mpe2_factory(name: str, num_agents: int, max_cycles: int, render_mode: str | None) -> Callable[[], Any]:
    module = importlib.import_module(f"mpe2.{name}")
    kwargs: dict[str, Any] = {"continuous_actions": False, "render_mode": render_mode}
    if num_agents:
        kwargs["N"] = num_agents
    if max_cycles:
        kwargs["max_cycles"] = max_cycles
    return lambda: module.parallel_env(**kwargs)


def _highway_factory(name: str, num_agents: int, max_steps: int, render_mode: str | None) -> Callable[[], Any]:
    from hvd_rl.envs.intersection import IntersectionParallelEnv

    return lambda: IntersectionParallelEnv(num_agents or 4, max_steps, render_mode)


class ParallelEnvVector(_Spaces):
    """E PettingZoo ParallelEnvs stepped in this process, as [E, A] arrays. An environment with
    `stat_names` and `episode_stats()` reports those per finished episode (Episode.stats)."""

    def __init__(self, factory: Callable[[], Any], num_envs: int):
        self.envs = [factory() for _ in range(num_envs)]
        first = self.envs[0]
        self.stat_names: tuple[str, ...] = tuple(getattr(first, "stat_names", ()))
        self.agents = tuple(first.possible_agents)
        self.spec = _spec_of(first, self.agents)
        self._returns = np.zeros((num_envs, len(self.agents)), np.float64)
        self._lengths = np.zeros(num_envs, np.int64)

    @property
    def num_envs(self) -> int:
        return len(self.envs)

    def _state(self, env: Any, obs: dict[str, np.ndarray]) -> np.ndarray:
        if self.spec.has_state:
            return np.asarray(env.state(), np.float32).reshape(-1)
        return np.concatenate([np.asarray(obs.get(a, np.zeros(self.spec.observation_space.shape)), np.float32)
                               .reshape(-1) for a in self.agents])

    def _fill(self, out: np.ndarray, obs: dict[str, np.ndarray]) -> None:
        out[:] = 0.0
        for i, agent in enumerate(self.agents):
            if agent in obs:
                out[i] = obs[agent]

    def reset(self, seeds: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Seeds each environment once; later resets continue its own random stream."""
        E, A = self.num_envs, len(self.agents)
        obs = np.zeros((E, A) + self.spec.observation_space.shape, np.float32)
        state = np.zeros((E, self.spec.state_dim), np.float32)
        for e, (env, seed) in enumerate(zip(self.envs, seeds)):
            got, _ = env.reset(seed=int(seed))
            self._fill(obs[e], got)
            state[e] = self._state(env, got)
        self._returns[:] = 0.0
        self._lengths[:] = 0
        return obs, state, self.alive()

    def alive(self) -> np.ndarray:
        return np.array([[a in env.agents for a in self.agents] for env in self.envs], bool)

    def render(self) -> np.ndarray:
        """The first environment's whole scene, every agent in it (made with render_mode="rgb_array")."""
        return self.envs[0].render()

    @property
    def render_fps(self) -> float:
        return float(self.envs[0].metadata.get("render_fps") or 10)

    def step(self, actions: np.ndarray) -> MultiAgentStep:
        E, A = self.num_envs, len(self.agents)
        obs = np.zeros((E, A) + self.spec.observation_space.shape, np.float32)
        state = np.zeros((E, self.spec.state_dim), np.float32)
        rewards = np.zeros((E, A), np.float32)
        terminated = np.zeros((E, A), bool)
        truncated = np.zeros((E, A), bool)
        final_obs = final_state = None
        episodes: list[Episode] = []
        for e, env in enumerate(self.envs):
            acting = list(env.agents)
            got, rew, term, trunc, _ = env.step({a: actions[e, self.agents.index(a)] for a in acting})
            for i, agent in enumerate(self.agents):
                rewards[e, i] = rew.get(agent, 0.0)
                terminated[e, i] = bool(term.get(agent, False))
                truncated[e, i] = bool(trunc.get(agent, False)) and not terminated[e, i]
            self._returns[e] += rewards[e]
            self._lengths[e] += 1
            if truncated[e].any():
                if final_obs is None:
                    final_obs = np.zeros_like(obs)
                    final_state = np.zeros_like(state)
                self._fill(final_obs[e], got)
                final_state[e] = self._state(env, got)
            if env.agents:
                live = {a: got[a] for a in env.agents}
                self._fill(obs[e], live)
                state[e] = self._state(env, live)
                continue
            stats = env.episode_stats() if self.stat_names else {}
            episodes.append(Episode(float(self._returns[e].mean()), int(self._lengths[e]),
                                    self._returns[e].tolist(), stats, env=e))
            self._returns[e] = 0.0
            self._lengths[e] = 0
            got, _ = env.reset()
            self._fill(obs[e], got)
            state[e] = self._state(env, got)
        return MultiAgentStep(obs, state, self.alive(), rewards, terminated, truncated, final_obs,
                              final_state, episodes)

    def close(self) -> None:
        for env in self.envs:
            env.close()


def _spec_of(env: Any, agents: tuple[str, ...]) -> MultiAgentSpec:
    obs_spaces = [env.observation_space(a) for a in agents]
    act_spaces = [env.action_space(a) for a in agents]
    _check_homogeneous(obs_spaces, act_spaces, agents)
    has_state = _has_state(env)
    state_dim = int(np.prod(env.state_space.shape)) if has_state else \
        len(agents) * int(np.prod(obs_spaces[0].shape))
    return MultiAgentSpec(agents, obs_spaces[0], act_spaces[0], state_dim, has_state)


def _has_state(env: Any) -> bool:
    try:
        return getattr(env, "state_space", None) is not None and env.state_space.shape is not None
    except (AttributeError, NotImplementedError):
        return False


class HeterogeneousAgents(ValueError):
    """Agents with different observation or action spaces (one shared actor cannot serve them)."""


def _check_homogeneous(obs_spaces: list[gym.Space], act_spaces: list[gym.Space], agents: tuple[str, ...]) -> None:
    for i, agent in enumerate(agents[1:], 1):
        if obs_spaces[i] != obs_spaces[0] or act_spaces[i] != act_spaces[0]:
            raise HeterogeneousAgents(
                f"agents {agents[0]!r} and {agent!r} have different observation or action spaces "
                f"({obs_spaces[0]}, {act_spaces[0]} vs {obs_spaces[i]}, {act_spaces[i]}); the shared "
                "actor needs agents alike")
    if not isinstance(obs_spaces[0], gym.spaces.Box) or len(obs_spaces[0].shape) != 1:
        raise HeterogeneousAgents(f"agents' observations must be flat vectors (Box), got {obs_spaces[0]}")


# ---- VMAS: all of a rank's environments in one vectorised simulator ---------------------------

class VmasVector(_Spaces):
    """A VMAS scenario with E environments in one torch simulator. Every agent of an environment
    ends together in VMAS (no dead agents); environments reset one by one (`reset_at`)."""

    stat_names = ("collisions",)  # agent-agent collisions per episode (VMAS's agent_collisions)

    render_fps = 10.0  # VMAS's dt is 0.1 s

    def __init__(self, scenario: str, num_envs: int, num_agents: int, max_steps: int):
        import torch
        import vmas

        self.torch = torch
        kwargs: dict[str, Any] = {"n_agents": num_agents} if num_agents else {}
        self.env = vmas.make_env(scenario, num_envs=num_envs, device="cpu", continuous_actions=True,
                                 max_steps=max_steps or 100, terminated_truncated=True, seed=None, **kwargs)
        self.agents = tuple(a.name for a in self.env.agents)
        # VMAS builds its spaces with the old `gym` package: the same boxes, as Gymnasium's.
        obs_spaces = [_gymnasium_box(s) for s in self.env.observation_space.spaces]
        act_spaces = [_gymnasium_box(s) for s in self.env.action_space.spaces]
        _check_homogeneous(obs_spaces, act_spaces, self.agents)
        dim = int(np.prod(obs_spaces[0].shape))
        self.spec = MultiAgentSpec(self.agents, obs_spaces[0], act_spaces[0], len(self.agents) * dim, False)
        self._returns = np.zeros((num_envs, len(self.agents)), np.float64)
        self._lengths = np.zeros(num_envs, np.int64)
        self._collisions = np.zeros(num_envs, np.float64)
        self._num_envs = num_envs

    @property
    def num_envs(self) -> int:
        return self._num_envs

    def _arrays(self, obs: list[Any]) -> tuple[np.ndarray, np.ndarray]:
        stacked = self.torch.stack(list(obs), dim=1).numpy().astype(np.float32)  # [E, A, D]
        return stacked, stacked.reshape(stacked.shape[0], -1)

    def reset(self, seeds: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        # VMAS seeds torch's global generator: seeded from this rank's first environment seed,
        # and the policy's sampling generator is re-seeded by the runtime afterwards.
        self.env.seed(int(seeds[0]) % (2 ** 31))
        obs, state = self._arrays(self.env.reset())
        self._returns[:] = 0.0
        self._lengths[:] = 0
        self._collisions[:] = 0.0
        return obs, state, np.ones((self.num_envs, len(self.agents)), bool)

    def step(self, actions: np.ndarray) -> MultiAgentStep:
        torch = self.torch
        acts = torch.from_numpy(np.asarray(actions, np.float32))
        obs, rews, term, trunc, info = self.env.step([acts[:, i] for i in range(len(self.agents))])
        rewards = torch.stack(list(rews), dim=1).numpy().astype(np.float32)
        term_np, trunc_np = term.numpy().astype(bool), trunc.numpy().astype(bool)
        trunc_np &= ~term_np
        E, A = self.num_envs, len(self.agents)
        terminated = np.repeat(term_np[:, None], A, axis=1)
        truncated = np.repeat(trunc_np[:, None], A, axis=1)
        obs_np, state = self._arrays(obs)
        final_obs = final_state = None
        if trunc_np.any():
            final_obs, final_state = obs_np.copy(), state.copy()
        self._returns += rewards
        self._lengths += 1
        if info and "agent_collisions" in info[0]:
            self._collisions += sum(np.asarray(i["agent_collisions"], np.float64).reshape(E) for i in info)
        episodes = []
        ended = np.flatnonzero(term_np | trunc_np)
        for k, e in enumerate(ended):
            episodes.append(Episode(float(self._returns[e].mean()), int(self._lengths[e]),
                                    self._returns[e].tolist(), {"collisions": float(self._collisions[e])}, int(e)))
            self._returns[e], self._lengths[e], self._collisions[e] = 0.0, 0, 0.0
            fresh = self.env.reset_at(int(e), return_observations=k == len(ended) - 1)
            if k == len(ended) - 1:  # every environment's observations, the reset ones' new
                obs_np, state = self._arrays(fresh)
        return MultiAgentStep(obs_np, state, np.ones((E, A), bool), rewards, terminated, truncated,
                              final_obs, final_state, episodes)

    def render(self) -> np.ndarray:
        """Environment 0's scene (VMAS draws with pyglet, which needs OpenGL)."""
        return np.asarray(self.env.render(mode="rgb_array", env_index=0))

    def close(self) -> None:
        pass


def _gymnasium_box(space: Any) -> gym.spaces.Box:
    return gym.spaces.Box(np.asarray(space.low, np.float32), np.asarray(space.high, np.float32),
                          tuple(space.shape), np.float32)


# ---- the front door -----------------------------------------------------------------------------

def make_multiagent_envs(env_id: str, num_envs: int, num_agents: int, max_steps: int,
                         render_mode: str | None = None):
    """This rank's multi-agent environments for an id of one of FAMILIES."""
    family, name = env_id.split("/", 1)
    if family == "mpe2":
        return ParallelEnvVector(_mpe2_factory(name, num_agents, max_steps, render_mode), num_envs)
    if family == "vmas":
        return VmasVector(name, num_envs, num_agents, max_steps)
    if family == "highway":
        return ParallelEnvVector(_highway_factory(name, num_agents, max_steps, render_mode), num_envs)
    raise ValueError(f"unknown multi-agent family {family!r}")


def describe(env_id: str, num_agents: int, max_steps: int) -> MultiAgentSpec:
    """The agents and spaces of one environment (builds one; no collective)."""
    envs = make_multiagent_envs(env_id, 1, num_agents, max_steps)
    try:
        return envs.spec
    finally:
        envs.close()


def check_multiagent_id(env_id: str, num_agents: int, max_steps: int) -> str | None:
    """One-line problem with a multi-agent id (unknown task, heterogeneous agents), else None."""
    family, name = env_id.split("/", 1)
    try:
        if family == "mpe2":
            importlib.import_module(f"mpe2.{name}")
        elif family == "vmas":
            import vmas

            if name not in vmas.scenarios:
                return f"env.id {env_id!r}: VMAS has no scenario {name!r} (it has e.g. navigation, balance, transport)"
        elif family == "highway":
            import highway_env  # noqa: F401  (the package must be there)

            if name not in HIGHWAY_TASKS:
                return f"env.id {env_id!r}: the highway family has {', '.join(HIGHWAY_TASKS)}, not {name!r}"
        describe(env_id, num_agents, max_steps)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] == family and exc.name != family:
            return f"env.id {env_id!r}: {family} has no task {name!r}"
        return f"env.id {env_id!r} needs the {exc.name} package (scripts/setup.sh installs it)"
    except HeterogeneousAgents as exc:
        return f"env.id {env_id!r}: {exc}"
    except (TypeError, ValueError, AssertionError) as exc:
        return f"env.id {env_id!r} cannot be built with these settings ({type(exc).__name__}: {exc})"
    return None
