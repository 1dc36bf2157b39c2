"""Distributed DQN with real ranks: learning, target sync at the same global step, replay ratio,
replay shards through checkpoints, and a clear error for continuous actions."""
import contextlib
import json
import math
import os
import stat
import time

import gymnasium as gym
import numpy as np
import pytest
import torch

from conftest import (REPO, check, mpirun_cmd, read_jsonl, run, train_cmd)
from hvd_rl.runtime import distributed as dist
from hvd_rl.algorithms.base import IterationContext
from hvd_rl.algorithms.dqn import DQN as DQNAlgorithm, crossings, linear_schedule
from hvd_rl.runtime.checkpoint import load_checkpoint
from hvd_rl.config import ConfigError, ModelConfig, load_config, validate
from hvd_rl.envs.vector import EnvLayout
from hvd_rl.algorithms.models import build_model, build_q_network

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
    assert result.stdout.count("algorithm 'dqn' needs discrete actions") == 1  # one copy for both ranks
    assert "hvd-rl: error (all 2 ranks): algorithm 'dqn' needs discrete actions" in result.stdout
    assert "Traceback" not in result.stdout


# ---- issue 22: findings 2, 3, 4, 10 and 12 (DQN parts) -------------------------------------------

class _SlowSyncOptimizer:
    """Stands in for Horovod's DistributedOptimizer in one process: synchronize() waits `delay`
    seconds, as a rank does for slower ranks' gradients."""

    def __init__(self, base, delay):
        self.base, self.delay = base, delay
        self.state, self.param_groups = base.state, base.param_groups

    def zero_grad(self):
        self.base.zero_grad()

    def synchronize(self):
        time.sleep(self.delay)

    def skip_synchronize(self):
        return contextlib.nullcontext()

    def step(self):
        self.base.step()


def _one_process_dqn(monkeypatch, world, *sets, delay=0.0):
    """Rank 0 of a `world`-rank even layout (one env per rank), collectives faked in-process."""
    monkeypatch.setattr(dist, "distributed_optimizer", lambda base, model, **kw: _SlowSyncOptimizer(base, delay))
    monkeypatch.setattr(dist, "allreduce_sum_async", lambda values, name: np.asarray(values, dtype=np.float64))
    monkeypatch.setattr(dist, "wait_sum", lambda handle: handle)
    cfg = load_config(DQN, ["logging.tensorboard=false", "distributed.amp=off", *sets])
    probe = gym.make(cfg.env.id)
    algo = DQNAlgorithm(cfg, torch.device("cpu"), 1, probe.observation_space, probe.action_space)
    probe.close()
    layout = EnvLayout.even(world, 1)
    algo.build_envs(layout, 0, [cfg.seed])
    return cfg, algo, layout


def _iterate(algo, layout, iteration, global_step):
    env_steps = algo.rollout_length(10 ** 9, layout)
    context = IterationContext(iteration=iteration, global_step=global_step, env_steps=env_steps,
                               layout=layout, rank=0, world_size=layout.world_size,
                               stop_requested=lambda: False)
    return algo.iterate(context), global_step + env_steps * layout.total


def test_learning_starts_when_shards_cap_below_learning_starts_and_metrics_count_what_was_drawn(monkeypatch):
    """3 ranks share buffer 500 as 3 x 166 = 498 < learning_starts 500: learning must still start
    (finding 2). Until then td_loss is NaN (null in metrics.jsonl) and not checked for finiteness;
    samples_per_env_step counts the 3 x (32 // 3) = 30 samples drawn, not 32 (finding 10);
    time_update leaves out the wait in synchronize(), which dist.CLOCK counts (finding 10)."""
    delay = 0.2
    cfg, algo, layout = _one_process_dqn(monkeypatch, 3, "dqn.buffer_size=500", "dqn.learning_starts=500",
                                         "dqn.batch_size=32", "dqn.steps_per_iteration=300", delay=delay)
    try:
        first, step = _iterate(algo, layout, 1, 0)  # global steps 0 -> 300: filling
        assert first.extra["updates"] == 0
        assert math.isnan(first.metrics["td_loss"]) and math.isnan(first.metrics["q_values"])
        assert first.finite == ()
        clock_before = dist.CLOCK.seconds
        second, step = _iterate(algo, layout, 2, step)  # 300 -> 600: learning from 500 on
        updates = second.extra["updates"]
        assert updates == crossings(498, 600, cfg.dqn.train_frequency) == 11
        assert math.isfinite(second.metrics["td_loss"]) and second.finite == ("td_loss",)
        assert second.extra["samples_per_env_step"] == pytest.approx(updates * 30 / 300)
        waited = dist.CLOCK.seconds - clock_before
        assert waited >= updates * delay
        # before the fix: compute + waited
        assert second.metrics["time_update"] < waited, (second.metrics["time_update"], waited)
        algo.optimizer.delay = 0.0
        third, step = _iterate(algo, layout, 3, step)
        assert third.extra["updates"] == 30 and len(algo.replay) == algo.replay.capacity == 166
    finally:
        algo.close()


def test_learning_starts_must_not_exceed_buffer_size():
    with pytest.raises(ConfigError) as err:
        validate(load_config(DQN, ["dqn.buffer_size=5000", "dqn.learning_starts=10000"]))
    lines = [line for line in str(err.value).splitlines() if "dqn.learning_starts" in line]
    assert len(lines) == 1 and "dqn.buffer_size" in lines[0], str(err.value)
    validate(load_config(DQN, ["dqn.buffer_size=10000", "dqn.learning_starts=10000"]))  # equal is fine


def test_three_ranks_learn_with_learning_starts_equal_to_buffer_size(tmp_path):
    """Finding 2 with real ranks: on 3 ranks the shards hold 3 x 166 = 498 < 500 transitions."""
    run_dir = tmp_path / "run"
    check(run(mpirun_cmd(3, *train_cmd(run_dir, "logging.tensorboard=false", "dqn.buffer_size=500",
                                        "dqn.learning_starts=500", "dqn.batch_size=32",
                                        "dqn.steps_per_iteration=300", "dqn.total_timesteps=1500",
                                        config=DQN)), timeout=240))
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["global_step"] for r in rows] == [300, 600, 900, 1200, 1500]
    assert [r["updates"] for r in rows] == [0, 11, 30, 30, 30]  # before the fix: all 0
    assert rows[0]["td_loss"] is None and rows[0]["q_values"] is None  # no update yet: null, not 0.0
    assert all(math.isfinite(r["td_loss"]) and math.isfinite(r["q_values"]) for r in rows[1:])
    assert rows[-1]["samples_per_env_step"] == pytest.approx(30 * 30 / 300)  # 3 ranks x 10 drawn
    assert json.loads((run_dir / "summary.json").read_text())["parameters_identical"]


def test_a_damaged_replay_shard_is_refilled_on_every_rank_and_stale_temporaries_go(tmp_path):
    """Finding 3: a truncated shard must not fail the resume (BadZipFile on one rank); every rank
    discards and refills. Finding 12: a temporary shard left by a crash mid-save is removed."""
    run_dir = tmp_path / "run"
    sets = [*QUICK, "dqn.checkpoint_replay=true", "checkpoint.every=2"]
    check(run(mpirun_cmd(2, *train_cmd(run_dir, *sets, "dqn.total_timesteps=1000", config=DQN)), timeout=240))
    shard = run_dir / "replay" / "rank00001.npz"
    os.truncate(shard, shard.stat().st_size // 2)
    stale = run_dir / "replay" / ".rank00003.tmp.npz"
    stale.write_bytes(b"half a shard")
    out = check(run(mpirun_cmd(2, *train_cmd(run_dir, *sets, "dqn.total_timesteps=2000", config=DQN,
                                              extra=("--resume", "auto"))), timeout=240))
    assert "Traceback" not in out
    assert "replay shards not restored: refilling before learning" in out
    assert f"replay shard {shard} is unreadable" in out
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["global_step"] for r in rows] == [500, 1000, 1500, 2000]
    assert rows[2]["updates"] == 31 and rows[3]["updates"] == 50  # refilled (200 steps), then learning
    assert not stale.exists()
    assert shard.exists() and np.load(shard)["iteration"] == 4  # rewritten whole at the final checkpoint


def test_replay_shard_is_fsynced_before_the_rename_and_a_corrupt_one_is_not_restored(monkeypatch, tmp_path, capsys):
    cfg, algo, layout = _one_process_dqn(monkeypatch, 1, "dqn.checkpoint_replay=true", "dqn.buffer_size=100",
                                         "dqn.steps_per_iteration=50")
    try:
        _iterate(algo, layout, 1, 0)
        events = []
        real_fsync, real_replace = os.fsync, os.replace
        monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.fstat(fd).st_mode)), real_fsync(fd)))
        monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", None)), real_replace(a, b)))
        algo.save_local(tmp_path, 1, 0)
        monkeypatch.setattr(os, "fsync", real_fsync)
        monkeypatch.setattr(os, "replace", real_replace)
        kinds = [(kind, None if mode is None else ("dir" if stat.S_ISDIR(mode) else "file"))
                 for kind, mode in events]
        # The shard, then its manifest (sha256, iteration), are down before the shard's rename.
        assert kinds == [("fsync", "file"), ("fsync", "file"), ("replace", None), ("replace", None), ("fsync", "dir")]
        path = tmp_path / "replay" / "rank00000.npz"
        assert algo.load_local(tmp_path, 1, 0)
        data = bytearray(path.read_bytes())
        middle = len(data) // 3
        data[middle:middle + 64] = bytes(b ^ 0xFF for b in data[middle:middle + 64])  # inside a member
        path.write_bytes(bytes(data))
        assert not algo.load_local(tmp_path, 1, 0)
        os.truncate(path, 100)
        assert not algo.load_local(tmp_path, 1, 0)
        assert f"replay shard {path} is unreadable" in capsys.readouterr().err
        assert len(algo.replay) == 0
    finally:
        algo.close()


def test_adasum_dqn_updates_and_keeps_parameters_identical(tmp_path):
    """Finding 4: Horovod's Adasum optimizer has no skip_synchronize; DQN steps through it."""
    run_dir = tmp_path / "run"
    check(run(mpirun_cmd(2, *train_cmd(run_dir, *QUICK, "distributed.reduction=adasum", "dqn.total_timesteps=1000",
                                        "distributed.verify_every=1", config=DQN)), timeout=240))
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["updates"] for r in rows] == [31, 50]
    assert all(math.isfinite(r["td_loss"]) for r in rows) and all(r["parameters_identical"] for r in rows)
    assert json.loads((run_dir / "summary.json").read_text())["parameters_identical"]


def test_adasum_with_dqn_clipping_is_refused_naming_the_dqn_field():
    validate(load_config(DQN, ["distributed.reduction=adasum"]))  # ppo.max_grad_norm is not DQN's
    with pytest.raises(ConfigError) as err:
        validate(load_config(DQN, ["distributed.reduction=adasum", "dqn.max_grad_norm=10"]))
    text = str(err.value)
    assert text.count("max_grad_norm") == 1 and "set dqn.max_grad_norm = 0" in text and "ppo." not in text, text


def _orthogonal(weight):
    w = weight.detach().flatten(1)
    gram = w @ w.T if w.shape[0] <= w.shape[1] else w.T @ w
    return torch.allclose(gram / gram.diagonal().mean(), torch.eye(len(gram)), atol=1e-4)


def test_q_network_cnn_keeps_pytorch_default_init_and_ppo_keeps_orthogonal():
    """Finding 12: CleanRL's dqn_atari uses PyTorch's default init; its PPO the orthogonal one."""
    space = gym.spaces.Box(0, 255, (4, 84, 84), np.uint8)
    torch.manual_seed(0)
    q = build_q_network(ModelConfig(kind="nature_cnn"), space, gym.spaces.Discrete(4))
    torch.manual_seed(0)
    reference = torch.nn.Conv2d(4, 32, 8, stride=4)
    conv = q.torso[0]
    assert torch.equal(conv.weight, reference.weight) and torch.equal(conv.bias, reference.bias)
    assert not _orthogonal(conv.weight) and conv.bias.abs().sum() > 0
    ppo = build_model(ModelConfig(kind="nature_cnn"), space, gym.spaces.Discrete(4))
    assert _orthogonal(ppo.torso[0].weight) and ppo.torso[0].bias.abs().sum() == 0
