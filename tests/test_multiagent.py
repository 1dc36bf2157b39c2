"""Multi-agent training (MAPPO, IPPO): environments as [envs, agents] arrays, dead agents masked,
exact N-rank math, and runs on real ranks with checkpoints, preemption and resume."""
import json
import os
import signal

import gymnasium as gym
import numpy as np
import pytest
import torch
from pettingzoo import ParallelEnv

from conftest import BIN, PYTHON, REPO, check, finish, mpirun_cmd, rank_pid, read_jsonl, run, start, train_cmd, \
    wait_for_iterations
from hvd_rl.algorithms.models import build_multiagent_model
from hvd_rl.algorithms.multiagent_rollout import InputRows, MultiAgentBuffer, MultiAgentCollector
from hvd_rl.algorithms.ppo import compute_gae
from hvd_rl.config import ModelConfig, load_config, validate, ConfigError
from hvd_rl.envs.multiagent import ParallelEnvVector

WORKERS = REPO / "tests" / "workers"
SPREAD = REPO / "configs" / "mpe_spread_mappo.toml"
VMAS = REPO / "configs" / "vmas_navigation_mappo.toml"
SMALL = ["logging.tensorboard=false", "env.num_envs=2", "ppo.num_steps=10", "ppo.num_minibatches=2",
         "ppo.update_epochs=2"]
PREEMPTED = 75


class DyingAgents(ParallelEnv):
    """A real PettingZoo Parallel env whose agents end at different steps: agent i terminates after
    LIFETIMES[i] steps (reward 1 a step while alive); the episode ends when the last one does."""

    metadata = {"name": "dying_agents_v0"}
    LIFETIMES = (5, 2, 3)

    def __init__(self):
        self.possible_agents = [f"agent_{i}" for i in range(3)]
        self._box = gym.spaces.Box(-np.inf, np.inf, (2,), np.float32)
        self.t = 0

    def observation_space(self, agent):
        return self._box

    def action_space(self, agent):
        return gym.spaces.Discrete(2)

    def _obs(self):
        return {a: np.array([self.t, self.possible_agents.index(a)], np.float32) for a in self.agents}

    def reset(self, seed=None, options=None):
        self.agents, self.t = list(self.possible_agents), 0
        return self._obs(), {a: {} for a in self.agents}

    def step(self, actions):
        assert set(actions) == set(self.agents), "actions must be for the live agents only"
        self.t += 1
        rewards = {a: 1.0 for a in self.agents}
        terms = {a: self.t >= self.LIFETIMES[self.possible_agents.index(a)] for a in self.agents}
        obs = self._obs()
        self.agents = [a for a in self.agents if not terms[a]]
        return obs, rewards, terms, {a: False for a in terms}, {a: {} for a in terms}


def test_agents_that_die_early_are_not_stepped_and_their_env_resets_when_all_are_done():
    envs = ParallelEnvVector(DyingAgents, 2)
    obs, state, alive = envs.reset([1, 2])
    assert obs.shape == (2, 3, 2) and state.shape == (2, 6) and alive.all()  # state: observations joined
    alive_seen, episodes = [], []
    for _ in range(6):
        result = envs.step(np.zeros((2, 3), np.int64))
        alive_seen.append(result.alive[0].tolist())
        episodes += result.episodes
    # agent_1 dies after 2 steps, agent_2 after 3, agent_0 after 5: then the env resets (all alive)
    assert alive_seen[:5] == [[True, True, True], [True, False, True], [True, False, False],
                              [True, False, False], [True, True, True]]
    assert len(episodes) == 2 and episodes[0].length == 5 and episodes[0].agent_returns == [5.0, 2.0, 3.0]
    assert episodes[0].team_return == pytest.approx(10 / 3)


def test_dead_agents_are_masked_and_nothing_bootstraps_through_them():
    """The collector stores a dead agent's steps with mask 0, reward 0 and `terminated`, so that
    GAE restarts at its next episode; the agent's last live step is a terminal (no bootstrap)."""
    envs = ParallelEnvVector(DyingAgents, 1)
    rows = InputRows(envs.spec, agent_id=True, centralised=True)
    model = build_multiagent_model(ModelConfig(hidden_sizes=[8]), rows.actor_width, rows.critic_width,
                                   envs.spec.action_space, centralised=True)
    buffer = MultiAgentBuffer(6, 1, 3, rows.width, envs.spec.action_space, torch.device("cpu"))
    collector = MultiAgentCollector(envs, model, rows, buffer, torch.device("cpu"), [3], value_norm=None)
    last_value, _, episodes = collector.collect(6)
    mask = buffer.mask[:, 0].T  # [agent, step]
    assert mask.tolist() == [[1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 1], [1, 1, 1, 0, 0, 1]]
    rewards = buffer.rewards[:, 0].T
    assert (rewards == mask).all()  # 1 a live step, 0 a dead one
    # agent_1: its 2nd step is its last (terminated), steps 3-5 are dead (terminated, no reward)
    assert buffer.terminated[:, 0, 1].tolist() == [0, 1, 1, 1, 1, 0]
    gamma, lam = 0.9, 0.8
    advantages, _ = compute_gae(buffer.rewards.reshape(6, 3), buffer.values.reshape(6, 3),
                                buffer.terminated.reshape(6, 3), buffer.truncated.reshape(6, 3),
                                buffer.bootstrap_values.reshape(6, 3), last_value.reshape(3), gamma, lam)
    values = buffer.values.reshape(6, 3)
    # the death step: reward minus value, nothing from the steps after it
    assert advantages[1, 1].item() == pytest.approx(1.0 - values[1, 1].item(), abs=1e-6)
    step0 = 1.0 + gamma * values[1, 1] - values[0, 1] + gamma * lam * advantages[1, 1]
    assert advantages[0, 1].item() == pytest.approx(step0.item(), abs=1e-6)
    assert len(episodes.team_returns) == 1 and episodes.agent_returns[0] == [5.0, 2.0, 3.0]


def _update(tmp_path, np_, variant):
    out = tmp_path / f"{np_}-{variant}.pt"
    check(run(mpirun_cmd(np_, PYTHON, WORKERS / "multiagent_equivalence.py", out, variant), timeout=120))
    return torch.load(out, weights_only=True)


def _max_diff(a, b):
    return max((a["params"][k] - b["params"][k]).abs().max().item() for k in a["params"])


# As in tests/test_distributed.py: float64, where N ranks and one process differ by the order of
# sums alone (~1e-12 after Adam's amplification at most); a real error in the math is > 1e-4.
EXACT = 1e-8


def test_two_ranks_with_dead_agents_equal_one_process(tmp_path):
    """The ranks count different numbers of live agents (rank 0's envs have more dead ones): each
    rank's masked loss is its share of the mean over every rank's live samples, so 2 ranks make
    exactly the 1-process update; counting the dead agents' rows (the control) does not."""
    one = _update(tmp_path, 1, "masked")
    two = _update(tmp_path, 2, "masked")
    assert _max_diff(one, two) < EXACT and abs(one["kl"] - two["kl"]) < EXACT
    assert _max_diff(one, {"params": one["initial"]}) > 1e-3  # it did learn
    unmasked = _update(tmp_path, 2, "unmasked")
    assert _max_diff(two, unmasked) > 1e-4


@pytest.mark.parametrize("sets, fragment", [
    (["algorithm=ppo"], "is a multi-agent environment: algorithm must be 'mappo' or 'ippo'"),
    (["algorithm=dqn"], "is a multi-agent environment: algorithm must be 'mappo' or 'ippo'"),
    (["env.id=CartPole-v1"], "needs a multi-agent env.id"),
    (["env.id=mpe2/simple_nothing_v3"], "mpe2 has no task 'simple_nothing_v3'"),
    (["env.id=vmas/nothing"], "VMAS has no scenario 'nothing'"),
    (["env.id=mpe2/simple_adversary_v3", "multiagent.num_agents=0"], "different observation or action spaces"),
    (["ppo.normalize_observations=true"], "does not take ppo.normalize_observations"),
    (["distributed.env_counts=[1, 2]"], "needs algorithm 'ppo', not 'mappo'"),
    (["distributed.balance=static"], "which only algorithm 'ppo' supports, not 'mappo'"),
    (["env.backend=async"], "env.backend must be 'sync'"),
])
def test_combinations_multiagent_cannot_serve_are_refused(sets, fragment):
    with pytest.raises(ConfigError, match="invalid configuration") as err:
        validate(load_config(SPREAD, sets), world_size=2)
    assert fragment in str(err.value)


def test_refused_multiagent_config_exits_2_on_every_rank_and_writes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    result = run(mpirun_cmd(2, *train_cmd(run_dir, "env.id=mpe2/simple_adversary_v3", "multiagent.num_agents=0",
                                          config=SPREAD)), timeout=120)
    assert result.returncode == 2, result.stdout[-3000:]
    # the same message on every rank, printed once for all (as for any refused config)
    lines = [line for line in result.stdout.splitlines() if "different observation or action spaces" in line]
    assert len(lines) == 1 and lines[0].startswith("hvd-rl: error (all 2 ranks): invalid configuration: env.id")
    assert "Traceback" not in result.stdout
    assert not run_dir.exists()


def test_mappo_preempted_and_resumed_continues_to_exactly_total_timesteps(tmp_path):
    """MPE simple_spread on 2 ranks: SIGTERM on rank 1 mid-run checkpoints every rank and exits 75;
    `--resume auto` continues to exactly total_timesteps with identical parameters, one metrics
    row per iteration, per-agent returns logged."""
    run_dir = tmp_path / "run"
    per_iteration = 2 * 2 * 10  # ranks x envs x steps
    total = per_iteration * 30
    sets = [*SMALL, f"ppo.total_timesteps={total}", "checkpoint.every=100", "debug.iteration_sleep=0.2"]
    proc = start(mpirun_cmd(2, *train_cmd(run_dir, *sets, config=SPREAD)))
    wait_for_iterations(run_dir, 3, proc, timeout=120)
    os.kill(rank_pid(str(run_dir), 1), signal.SIGTERM)
    code, out = finish(proc, timeout=60)
    assert code == PREEMPTED, out[-3000:]
    stopped = json.loads((run_dir / "preempted.json").read_text())["iteration"]
    assert stopped < 30
    out = check(run(mpirun_cmd(2, *train_cmd(run_dir, *sets[:-1], config=SPREAD, extra=("--resume", "auto"))),
                    timeout=180))
    assert f"ckpt_{stopped:08d}.pt" in out
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["iteration"] for r in rows] == list(range(1, 31))
    assert rows[-1]["global_step"] == total
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["parameters_identical"] and summary["algorithm"] == "mappo"
    episodes = [r for r in rows if r["episodes"]]
    assert episodes and all(r["return_agent_0"] is not None and r["episodic_length_mean"] == 25 for r in episodes)
    # the shared actor alone plays fresh episodes, 2 per environment
    result = json.loads(check(run([BIN / "hvd-rl", "evaluate", "--checkpoint", run_dir / "checkpoints" / "latest.pt",
                                   "--episodes", "4", "--num-envs", "2"], timeout=120)).splitlines()[-1])
    assert result["episodes"] == 4 and [len(r) for r in result["returns_by_env"]] == [2, 2]
    assert result["agents"] == ["agent_0", "agent_1", "agent_2"] and len(result["mean_return_by_agent"]) == 3


def test_ippo_on_vmas_trains_on_two_ranks(tmp_path):
    """VMAS navigation (continuous actions, one torch simulator per rank), IPPO's own-observation
    critic: the run reaches total_timesteps with identical parameters and per-episode collisions."""
    run_dir = tmp_path / "run"
    total = 2 * 8 * 20 * 3
    check(run(mpirun_cmd(2, *train_cmd(run_dir, "algorithm=ippo", "logging.tensorboard=false", "env.num_envs=8",
                                       "ppo.num_steps=20", "ppo.num_minibatches=2", "ppo.update_epochs=2",
                                       "env.max_episode_steps=20", f"ppo.total_timesteps={total}", config=VMAS)),
              timeout=180))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["parameters_identical"] and summary["global_step"] == total and summary["algorithm"] == "ippo"
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert all(r["episodes"] == 16 and r["collisions_per_episode"] is not None for r in rows)


# ---- cooperating vehicles: highway-env's intersection ---------------------------------------------

INTERSECTION = REPO / "configs" / "intersection_mappo.toml"


def test_numpy_kinematics_is_highway_envs_own_observation():
    """The numpy observation gives exactly what highway-env's pandas KinematicObservation gives,
    for every vehicle, over steps with crashes and new traffic."""
    from highway_env.envs.common.observation import KinematicObservation

    from hvd_rl.envs.intersection import IntersectionParallelEnv

    env = IntersectionParallelEnv(4, 13)
    env.reset(seed=3)
    rng = np.random.default_rng(0)
    compared = 0
    for _ in range(40):
        if not env.agents:
            env.reset()
        env.step({a: int(rng.integers(0, 3)) for a in env.agents})
        for observation in env.env.observation_type.agents_observation_types:
            ours, theirs = observation.observe(), KinematicObservation.observe(observation)
            assert ours.dtype == theirs.dtype and np.array_equal(ours, theirs)
            compared += int(theirs[:, 0].sum())  # vehicles seen
    assert compared > 40 * 4 * 3  # a busy intersection, not empty observations


def test_intersection_vehicles_end_one_by_one_and_share_the_team_reward():
    """A crashed vehicle is done while the others drive on (highway-env alone would end the
    episode); every agent gets the same reward, and over the episode it sums to arrivals minus
    collisions over the number of vehicles; the rates count each vehicle once."""
    from hvd_rl.envs.intersection import IntersectionParallelEnv

    env = IntersectionParallelEnv(4, 13)
    partial_ends = 0
    for seed in range(12):
        first, _ = env.reset(seed=seed)
        assert all(o[-1] == 1.0 for o in first.values())  # the whole episode's time left
        crashed, arrived = set(), set()
        team_return = 0.0
        while env.agents:
            acting = list(env.agents)
            obs, rewards, terms, truncs, _ = env.step({a: 2 for a in acting})  # everyone: faster
            assert set(rewards) == set(acting) and len(set(rewards.values())) == 1
            team_return += rewards[acting[0]]
            assert all(0.0 <= o[-1] < 1.0 for o in obs.values())
            for a in acting:
                vehicle = env.env.controlled_vehicles[env.possible_agents.index(a)]
                if terms[a]:
                    (crashed if vehicle.crashed else arrived).add(a)
            if any(terms.values()) and env.agents:
                partial_ends += 1
                assert not set(env.agents) & (crashed | arrived)
        stats = env.episode_stats()
        assert stats == {"collision_rate": len(crashed) / 4, "arrival_rate": len(arrived) / 4}
        assert team_return == pytest.approx((len(arrived) - len(crashed)) / 4)
    assert partial_ends > 0


def test_intersection_mappo_trains_on_two_ranks_records_every_vehicle_and_exports_the_shared_actor(tmp_path):
    """Two ranks train a few iterations (collision and arrival rates logged); the video shows the
    whole scene, moving; the ONNX actor takes [N, vehicles, D] observations and gives the trained
    actor's logits for every vehicle."""
    onnxruntime = pytest.importorskip("onnxruntime") if not os.environ.get("CI") else __import__("onnxruntime")
    run_dir = tmp_path / "run"
    total = 2 * 2 * 16 * 2
    check(run(mpirun_cmd(2, *train_cmd(run_dir, "logging.tensorboard=true", "env.num_envs=2", "ppo.num_steps=16",
                                       "ppo.update_epochs=2", f"ppo.total_timesteps={total}",
                                       config=INTERSECTION)), timeout=180))
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert rows[-1]["global_step"] == total
    assert all(0 <= r["collision_rate"] <= 1 and 0 <= r["arrival_rate"] <= 1 for r in rows if r["episodes"])
    # TensorBoard: every vehicle's return under agents/, the task's rates beside the team return
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0})
    board.Reload()
    tags = set(board.Tags()["scalars"])
    assert {f"agents/return_vehicle_{i}" for i in range(4)} | {"charts/collision_rate", "charts/arrival_rate",
                                                                "charts/episodic_return_mean"} <= tags
    last = [r for r in rows if r["episodes"]][-1]
    logged = board.Scalars("charts/collision_rate")[-1]
    assert logged.step == last["global_step"] and logged.value == pytest.approx(last["collision_rate"], rel=1e-6)
    checkpoint = run_dir / "checkpoints" / "latest.pt"
    video = tmp_path / "intersection.mp4"
    out = json.loads(check(run([BIN / "hvd-rl", "evaluate", "--checkpoint", checkpoint, "--video", video],
                               timeout=120)).splitlines()[-1])
    assert out["episodes"] == 1 and set(out["stats"][0]) == {"collision_rate", "arrival_rate"}
    import imageio.v2 as imageio

    frames = [frame for frame in imageio.get_reader(video)]
    assert len(frames) == out["frames"] == out["lengths"][0] + 1 and frames[0].shape == (600, 600, 3)
    assert frames[0].std() > 10 and np.abs(frames[-1].astype(int) - frames[0]).mean() > 1  # drawn, and moving
    onnx_file = tmp_path / "actor.onnx"
    exported = json.loads(check(run([BIN / "hvd-rl", "export", "--checkpoint", checkpoint, "--out", onnx_file],
                                    timeout=180)).splitlines()[-1])
    assert exported["input_shape"] == ["batch", 4, 106] and exported["output"] == "logits"

    from hvd_rl.policy.trained import checkpoint_config, load_trained
    from hvd_rl.envs.multiagent import make_multiagent_envs

    cfg, state = checkpoint_config(checkpoint)
    envs = make_multiagent_envs(cfg.env.id, 3, 4, 13)
    obs, env_state, _ = envs.reset([1, 2, 3])
    trained = load_trained(checkpoint, envs, cfg, state)
    envs.close()
    rows_in = torch.from_numpy(trained.algorithm.inputs(obs, env_state)).reshape(12, -1)
    with torch.no_grad():
        expected = trained.algorithm.model(rows_in)[0].reshape(3, 4, -1).numpy()
    session = onnxruntime.InferenceSession(str(onnx_file))
    got = session.run(None, {"obs": obs})[0]
    assert got.shape == (3, 4, 3) and np.allclose(got, expected, rtol=1e-5, atol=1e-5)
