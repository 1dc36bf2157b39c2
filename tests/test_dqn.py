"""Distributed DQN with real ranks: learning, target sync at the same global step, replay ratio,
replay shards through checkpoints, and a clear error for continuous actions."""
import json

import pytest
import torch

from conftest import (REPO, check, mpirun_cmd, read_jsonl, run, train_cmd)
from hvd_rl.algorithms.dqn import crossings, linear_schedule
from hvd_rl.checkpoint import load_checkpoint

DQN = REPO / "configs" / "cartpole_dqn.toml"
QUICK = ["logging.tensorboard=false", "dqn.steps_per_iteration=500", "dqn.learning_starts=200",
         "dqn.buffer_size=2000", "dqn.batch_size=32"]


def test_schedules_are_functions_of_the_global_step():
    assert crossings(0, 4, 4) == 1 and crossings(3, 5, 4) == 1 and crossings(4, 7, 4) == 0
    assert crossings(0, 12, 4) == 3  # more envs than train_frequency: several updates per step
    assert linear_schedule(1.0, 0.05, 100, 0) == 1.0
    assert linear_schedule(1.0, 0.05, 100, 50) == pytest.approx(0.525)
    assert linear_schedule(1.0, 0.05, 100, 1000) == 0.05


def test_two_ranks_target_sync_replay_ratio_and_identical_parameters(tmp_path):
    run_dir = tmp_path / "run"
    # 2 ranks x 1 env, 250 vector steps per iteration; target updated every 1000 global steps.
    check(run(mpirun_cmd(2, *train_cmd(run_dir, *QUICK, "dqn.total_timesteps=2000",
                                        "dqn.target_network_frequency=1000", "distributed.verify_every=1",
                                        "checkpoint.every=1", "checkpoint.keep=4", config=DQN)), timeout=240))
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["global_step"] for r in rows] == [500, 1000, 1500, 2000]
    assert all(r["parameters_identical"] for r in rows)
    # learning from global step 200 on (200, 210, ..., 500): one update per 10 global env steps,
    # batch 32 over both ranks
    assert [r["updates"] for r in rows] == [31, 50, 50, 50]
    assert rows[-1]["updates_per_env_step"] == pytest.approx(0.1)
    assert rows[-1]["samples_per_env_step"] == pytest.approx(3.2)
    ckpts = {r["iteration"]: load_checkpoint(run_dir / "checkpoints" / f"ckpt_{r['iteration']:08d}.pt")
             for r in rows}
    for iteration, ckpt in ckpts.items():
        q, target = ckpt["state"]["q_network"], ckpt["state"]["target_network"]
        same = all(torch.equal(q[k], target[k]) for k in q)
        # the target is a copy of the online network right after global steps 1000 and 2000
        assert same == (iteration in (2, 4)), iteration
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["parameters_identical"] and summary["algorithm"] == "dqn"


@pytest.mark.parametrize("keep_replay", [True, False])
def test_resume_with_and_without_the_replay_shards(tmp_path, keep_replay):
    run_dir = tmp_path / "run"
    sets = [*QUICK, f"dqn.checkpoint_replay={str(keep_replay).lower()}", "checkpoint.every=2"]
    check(run(mpirun_cmd(2, *train_cmd(run_dir, *sets, "dqn.total_timesteps=2000", config=DQN)), timeout=240))
    assert (run_dir / "replay" / "rank00001.npz").exists() == keep_replay
    out = check(run(mpirun_cmd(2, *train_cmd(run_dir, *sets, "dqn.total_timesteps=3500", config=DQN,
                                              extra=("--resume", "auto"))), timeout=240))
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["global_step"] for r in rows] == [500 * i for i in range(1, 8)]
    resumed = rows[4:]
    if keep_replay:
        assert "replay shards restored" in out
        assert all(r["updates"] == 50 for r in resumed)  # learning goes on at once
    else:
        assert "replay shards not restored: refilling before learning" in out
        assert resumed[0]["updates"] < 50  # the shards refill (200 steps) before learning resumes
        assert resumed[-1]["updates"] == 50


def test_dqn_refuses_continuous_actions_on_every_rank(tmp_path):
    result = run(mpirun_cmd(2, *train_cmd(tmp_path / "run", *QUICK, "env.id=Pendulum-v1", config=DQN)),
                 timeout=120)
    assert result.returncode == 2, result.stdout[-2000:]
    assert result.stdout.count("algorithm 'dqn' needs discrete actions") == 2
    assert "Traceback" not in result.stdout


def test_cartpole_two_ranks_learns_within_500k_steps(tmp_path):
    """CleanRL's dqn.py recipe on 2 ranks: a 10-game mean return of 475+ within 500k global steps."""
    run_dir = tmp_path / "run"
    check(run(mpirun_cmd(2, *train_cmd(run_dir, "logging.tensorboard=false", "logging.console=false",
                                        config=DQN)), timeout=1200))
    games = read_jsonl(run_dir / "episodes.jsonl")
    assert games[-1]["global_step"] <= 500_000
    returns = [g["return"] for g in games]
    best = max(sum(returns[i - 10:i]) / 10 for i in range(10, len(returns) + 1))
    assert best >= 475, f"best 10-game mean return {best}"
