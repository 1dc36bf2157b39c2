"""Environment ids: which Gymnasium ids exist and which are Atari games. Imports no hvd_rl
module, so that config.py checks an id while validating without importing the environment code
(envs/vector.py), which itself reads the config."""
from __future__ import annotations

import gymnasium as gym

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


def check_env_id(env_id: str, backend: str, algorithm: str = "ppo", num_agents: int = 0,
                 max_steps: int = 0) -> str | None:
    """One-line problem description for an env id that cannot be used, else None. Multi-agent
    ids ("mpe2/...", "vmas/...") are for the multi-agent algorithms only, and the others not."""
    from hvd_rl.envs.multiagent import check_multiagent_id, is_multiagent_id

    multiagent_algorithm = algorithm in ("mappo", "ippo")
    if is_multiagent_id(env_id):
        if not multiagent_algorithm:
            return (f"env.id {env_id!r} is a multi-agent environment: algorithm must be 'mappo' or 'ippo', "
                    f"got {algorithm!r}")
        return check_multiagent_id(env_id, num_agents, max_steps)
    if multiagent_algorithm:
        return (f"algorithm {algorithm!r} needs a multi-agent env.id (mpe2/<task> or vmas/<scenario>, "
                f"e.g. mpe2/simple_spread_v3), got {env_id!r}")
    register_ale()
    try:
        gym.spec(env_id)
    except (gym.error.Error, ValueError) as exc:  # ValueError: a version number too long for int()
        return f"env.id {env_id!r} is not a registered Gymnasium environment ({exc})"
    if backend == "ale_vector" and not is_atari(env_id):
        return f"env.backend 'ale_vector' needs an ALE environment, but {env_id!r} is not one"
    return None
