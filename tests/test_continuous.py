"""Continuous-action PPO with real ranks: identical networks and normalisation statistics on every
rank, statistics in checkpoints and restored on resume, MuJoCo installed and running."""
import json

import numpy as np

from conftest import REPO, check, mpirun_cmd, read_jsonl, run, train_cmd
from hvd_rl.runtime.checkpoint import load_checkpoint

MUJOCO = REPO / "configs" / "mujoco_ppo.toml"
QUICK = ["logging.tensorboard=false", "ppo.num_steps=64", "ppo.num_minibatches=4", "ppo.update_epochs=2"]


def test_pendulum_two_ranks_identical_networks_and_statistics_then_resume(tmp_path):
    run_dir = tmp_path / "run"
    sets = [*QUICK, "env.id=Pendulum-v1", "env.num_envs=2", "distributed.verify_every=1"]
    check(run(mpirun_cmd(2, *train_cmd(run_dir, *sets, "ppo.total_timesteps=1024", config=MUJOCO)), timeout=240))
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert len(rows) == 4 and all(r["parameters_identical"] for r in rows)  # digests include the statistics
    state = load_checkpoint(run_dir / "checkpoints" / "latest.pt")["state"]
    obs_stats = state["obs_normalizer"]
    # every observation of both ranks (the 4 resets and 1024 steps' next observations) was counted once
    assert round(obs_stats["count"]) == 1024 + 4 and len(obs_stats["mean"]) == 3
    assert state["reward_scaler"]["count"] > 1000 and "log_std" in "".join(state["model"])
    check(run(mpirun_cmd(2, *train_cmd(run_dir, *sets, "ppo.total_timesteps=2048", config=MUJOCO,
                                        extra=("--resume", "auto"))), timeout=240))
    resumed = load_checkpoint(run_dir / "checkpoints" / "latest.pt")["state"]["obs_normalizer"]
    assert round(resumed["count"]) == 2048 + 8  # continued from the checkpoint (+4 new resets)
    assert json.loads((run_dir / "summary.json").read_text())["parameters_identical"]


def test_hopper_mujoco_runs_with_clipped_actions(tmp_path):
    run_dir = tmp_path / "run"
    check(run(train_cmd(run_dir, *QUICK, "ppo.total_timesteps=256", config=MUJOCO), timeout=240))
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert rows[-1]["global_step"] == 256 and all(np.isfinite(r["policy_loss"]) for r in rows)
    from hvd_rl.policy.evaluate import evaluate_checkpoint

    summary = evaluate_checkpoint(run_dir / "checkpoints" / "latest.pt", episodes=2, greedy=True)
    assert summary["episodes"] == 2 and np.isfinite(summary["mean_return"])
