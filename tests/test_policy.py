"""Using a trained policy: `hvd-rl evaluate --video/--gif` records greedy games from the env's own
screen (Atari, classic control, MuJoCo), and `hvd-rl export` writes the policy network as ONNX or
TorchScript that gives the same outputs as PyTorch (< 1e-4 on 100 real observations of each kind:
Nature CNN logits, MLP logits, Gaussian mean with observation normalisation, Q-values), also run
without hvd_rl importable. Checkpoints come from short real training runs (one process)."""
from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import imageio.v3 as iio
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from PIL import Image

from conftest import BIN, PYTHON, REPO, check, run, train_cmd

CARTPOLE_PPO = REPO / "configs" / "cartpole_ppo.toml"
KINDS = {
    # name: (config, overrides): a few iterations each, fp32 so that PyTorch is the exact reference
    "atari": (REPO / "configs" / "atari_ppo.toml",
              ["env.id=ALE/Breakout-v5", "env.num_envs=2", "ppo.num_steps=32", "ppo.total_timesteps=128",
               "env.backend=ale_vector", "distributed.amp=off", "env.max_episode_steps=400"]),
    "cartpole": (CARTPOLE_PPO, ["env.num_envs=2", "ppo.num_steps=64", "ppo.total_timesteps=512"]),
    "pendulum": (REPO / "configs" / "mujoco_ppo.toml",
                 ["env.id=Pendulum-v1", "env.num_envs=2", "ppo.num_steps=64", "ppo.total_timesteps=512",
                  "ppo.normalize_observations=true", "ppo.normalize_rewards=true"]),
    "hopper": (REPO / "configs" / "mujoco_ppo.toml", ["env.num_envs=1", "ppo.num_steps=128", "ppo.total_timesteps=256",
                                                      "env.max_episode_steps=60"]),
    "dqn": (REPO / "configs" / "cartpole_dqn.toml",
            ["dqn.total_timesteps=600", "dqn.learning_starts=200", "dqn.steps_per_iteration=200",
             "dqn.train_frequency=4", "dqn.batch_size=32"]),
}


class _Checkpoints(dict):
    """Each kind's checkpoint, trained the first time a test asks for it (a test run with -k
    trains only the kinds it needs)."""

    def __init__(self, root: Path):
        super().__init__()
        self.root = root

    def __missing__(self, name: str) -> Path:
        config, sets = KINDS[name]
        run_dir = self.root / name
        check(run(train_cmd(run_dir, "logging.tensorboard=false", *sets, config=config), timeout=300))
        self[name] = run_dir / "checkpoints" / "latest.pt"
        return self[name]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    return _Checkpoints(tmp_path_factory.mktemp("trained"))


def _cli(*args, env: dict | None = None) -> dict:
    out = check(run([BIN / "hvd-rl", *map(str, args)], timeout=300, env=env))
    return json.loads(out.strip().splitlines()[-1])


# ---- evaluating ------------------------------------------------------------------------------

def _games_in_finishing_order(checkpoint: Path, quotas: list[int], seed: int) -> list[tuple[int, float, int]]:
    """(environment, return, length) of every game evaluate's run plays, in the order they end:
    the same environments, seeds, random stream and stopping point, replayed here."""
    from hvd_rl.envs.vector import RankEnvs
    from hvd_rl.policy.trained import checkpoint_config, load_trained, single_process_env

    cfg, state = checkpoint_config(checkpoint)
    envs = RankEnvs(single_process_env(cfg.env, len(quotas)), threads=max(1, torch.get_num_threads()))
    games: list[tuple[int, float, int]] = []
    try:
        trained = load_trained(checkpoint, envs, cfg, state)
        torch.manual_seed(seed)
        obs = envs.reset(list(range(seed, seed + len(quotas))))
        while any(sum(g[0] == env for g in games) < quota for env, quota in enumerate(quotas)):
            result = envs.step(trained.algorithm.act(obs, False))
            games += zip(result.episode_envs, result.episode_returns, result.episode_lengths)
            obs = result.obs
    finally:
        envs.close()
    return games


def test_evaluate_counts_each_envs_first_games_not_the_first_to_finish(checkpoints):
    """Each environment's first games up to its quota (the quotas sum to --episodes), whatever the
    others do. The first --episodes games to finish across the environments, which evaluate kept
    before, over-represent short games: here they differ, and are shorter on average."""
    from hvd_rl.policy.evaluate import episode_quotas, evaluate_checkpoint

    episodes, num_envs, seed = 14, 4, 10_000
    quotas = episode_quotas(episodes, num_envs)
    assert quotas == [4, 4, 3, 3]
    summary = evaluate_checkpoint(checkpoints["cartpole"], episodes=episodes, num_envs=num_envs, seed=seed)
    games = _games_in_finishing_order(checkpoints["cartpole"], quotas, seed)
    per_env = [[g for g in games if g[0] == env][:quota] for env, quota in enumerate(quotas)]
    assert summary["returns_by_env"] == [[r for _, r, _ in kept] for kept in per_env]
    assert summary["lengths_by_env"] == [[n for _, _, n in kept] for kept in per_env]
    first_finished = games[:episodes]
    lengths = [n for kept in per_env for _, _, n in kept]
    assert max(lengths) > 2 * min(lengths)  # games of widely different lengths: where the bias shows
    assert sorted(first_finished) != sorted(g for kept in per_env for g in kept)
    assert np.mean([n for _, _, n in first_finished]) < np.mean(lengths)
    returns = [r for kept in summary["returns_by_env"] for r in kept]
    assert summary["episodes"] == episodes == len(returns)
    assert summary["mean_return"] == pytest.approx(np.mean(returns))
    assert summary["stderr_return"] == pytest.approx(np.std(returns, ddof=1) / np.sqrt(episodes))


def test_evaluate_cli_reports_mean_and_standard_error(checkpoints):
    summary = _cli("evaluate", "--checkpoint", checkpoints["cartpole"], "--episodes", 3, "--greedy")
    assert summary["episodes"] == 3 and summary["num_envs"] == 3 and summary["std_return"] is not None
    assert summary["stderr_return"] == pytest.approx(summary["std_return"] / np.sqrt(3))
    assert [len(kept) for kept in summary["returns_by_env"]] == [1, 1, 1]


def test_video_frames_go_to_the_encoder_as_they_are_drawn(checkpoints, tmp_path):
    """A recording 10 times longer needs no more memory: each frame goes to ffmpeg when drawn.
    Holding them (as before) took 720 KB per CartPole frame, 2.7 GB for 30 minutes of Atari."""
    import tracemalloc

    from hvd_rl.policy.video import record_checkpoint

    def peak_bytes(frames: int) -> int:
        tracemalloc.start()
        try:
            summary = record_checkpoint(checkpoints["cartpole"], video=tmp_path / f"{frames}.mp4", episodes=10_000,
                                        max_frames=frames)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert summary["frames"] == frames and summary["height"] * summary["width"] * 3 == 720_000
        return peak

    short, long = peak_bytes(30), peak_bytes(300)
    assert long < short + 30 * 720_000, (short, long)  # holding 270 more frames would add 194 MB


# ---- watching the agent -----------------------------------------------------------------------

@pytest.mark.parametrize("kind, size", [("atari", (210, 160)), ("cartpole", (400, 600)), ("hopper", (480, 480))])
def test_video_and_gif_of_greedy_games(checkpoints, tmp_path, kind, size):
    video, gif = tmp_path / "agent.mp4", tmp_path / "agent.gif"
    env = {**os.environ, "MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl")}
    result = _cli("evaluate", "--checkpoint", checkpoints[kind], "--video", video, "--gif", gif, "--episodes", 1,
                  "--max-frames", 400, env=env)
    # one frame after the reset and one per agent step, until the game ended or the cap
    assert result["frames"] == (1 + sum(result["lengths"]) if result["complete"] else 400)
    assert (result["height"], result["width"]) == size
    assert result["fps"] == {"atari": 15.0, "cartpole": 50.0, "hopper": 125.0}[kind]  # real time
    frames = np.stack(list(iio.imiter(video, plugin="FFMPEG")))
    assert frames.shape == (result["frames"], *size, 3)
    assert frames.std() > 1.0  # pictures, not a blank screen
    # GIF writers merge identical consecutive frames into longer ones, and above 50 frames/s every
    # k-th frame is kept: the animation lasts as long as the frames do (to GIF's hundredths of a second)
    animation = iio.imread(gif, index=None)
    assert animation.shape[1:3] == size and 1 < len(animation) <= result["frames"]
    with Image.open(gif) as image:
        durations = [image.seek(i) or image.info["duration"] for i in range(image.n_frames)]
    assert sum(durations) / 1000 == pytest.approx(result["frames"] / result["fps"], rel=0.2)


def test_ale_vector_checkpoint_is_recorded_with_a_backend_that_renders(checkpoints, tmp_path):
    out = check(run([BIN / "hvd-rl", "evaluate", "--checkpoint", checkpoints["atari"], "--gif", tmp_path / "a.gif",
                     "--max-frames", "20"], timeout=300))
    assert "env.backend 'ale_vector' cannot render; recording with 'sync'" in out
    assert json.loads(out.strip().splitlines()[-1])["frames"] == 20


def test_recording_needs_a_file_and_refuses_bad_input_in_one_line(checkpoints, tmp_path):
    bad = run([BIN / "hvd-rl", "evaluate", "--checkpoint", checkpoints["cartpole"], "--gif", tmp_path / "a.gif",
               "--max-frames", "1"], timeout=120)
    assert bad.returncode == 2 and "--max-frames > 1" in bad.stdout and len(bad.stdout.strip().splitlines()) == 1
    missing = run([BIN / "hvd-rl", "evaluate", "--checkpoint", tmp_path / "none.pt", "--video", tmp_path / "a.mp4"],
                  timeout=120)
    assert missing.returncode == 2 and not (tmp_path / "a.mp4").exists()


# ---- export -----------------------------------------------------------------------------------

def _real_observations(checkpoint: Path, count: int = 100) -> tuple[np.ndarray, object]:
    """`count` observations the environment really produced (random actions), and the trained
    algorithm rebuilt in this process."""
    from hvd_rl.envs.vector import RankEnvs
    from hvd_rl.policy.trained import checkpoint_config, load_trained, single_process_env

    cfg, state = checkpoint_config(checkpoint)
    envs = RankEnvs(single_process_env(cfg.env, 4), threads=1)
    try:
        trained = load_trained(checkpoint, envs, cfg, state)
        rng = np.random.default_rng(0)
        obs, seen = envs.reset([7, 8, 9, 10]), []
        while sum(len(o) for o in seen) < count:
            seen.append(np.array(obs))
            space = envs.single_action_space
            actions = (rng.integers(0, space.n, 4) if hasattr(space, "n")
                       else rng.uniform(space.low, space.high, (4, *space.shape)).astype(np.float32))
            obs = envs.step(actions).obs
    finally:
        envs.close()
    return np.concatenate(seen)[:count], trained


def _pytorch_outputs(trained, obs: np.ndarray) -> np.ndarray:
    """What the trained algorithm computes in PyTorch (fp32) before it picks an action."""
    algorithm = trained.algorithm
    with torch.no_grad():
        if trained.cfg.algorithm == "dqn":
            return algorithm.q_network(torch.from_numpy(obs)).numpy()
        if algorithm.obs_normalizer is not None:
            obs = algorithm.obs_normalizer.normalize(obs)
        return algorithm.model(torch.from_numpy(np.asarray(obs)))[0].numpy()


@pytest.mark.parametrize("kind, output", [("atari", "logits"), ("cartpole", "logits"), ("pendulum", "mean"),
                                          ("dqn", "q_values")])
def test_onnx_and_torchscript_match_pytorch_on_real_observations(checkpoints, tmp_path, kind, output):
    obs, trained = _real_observations(checkpoints[kind])
    expected = _pytorch_outputs(trained, obs)
    assert expected.shape[0] == 100 and np.isfinite(expected).all()

    summary = _cli("export", "--checkpoint", checkpoints[kind], "--format", "onnx", "--out", tmp_path / "p.onnx")
    assert summary["output"] == output and summary["input_dtype"] == str(obs.dtype)
    model = onnx.load(tmp_path / "p.onnx")
    onnx.checker.check_model(model)
    meta = {p.key: p.value for p in model.metadata_props}
    assert meta["hvd_rl.output"] == output and json.loads(meta["hvd_rl.observation_shape"]) == list(obs.shape[1:])
    session = ort.InferenceSession(str(tmp_path / "p.onnx"))
    got = session.run([output], {"obs": obs})[0]
    assert np.abs(got - expected).max() < 1e-4
    # the batch size is free
    assert session.run([output], {"obs": obs[:3]})[0].shape == (3, *expected.shape[1:])

    _cli("export", "--checkpoint", checkpoints[kind], "--format", "torchscript", "--out", tmp_path / "p.pt")
    scripted = torch.jit.load(str(tmp_path / "p.pt"))
    assert np.abs(scripted(torch.from_numpy(obs)).detach().numpy() - expected).max() < 1e-4


def test_normalisation_is_inside_the_exported_graph(checkpoints, tmp_path):
    """The pendulum run normalised observations: feeding raw observations to the network without
    the normaliser would give other outputs, so the match above proves the export includes it."""
    obs, trained = _real_observations(checkpoints["pendulum"])
    raw = trained.algorithm.model(torch.from_numpy(obs))[0].detach().numpy()
    assert np.abs(raw - _pytorch_outputs(trained, obs)).max() > 1e-3


def test_docs_example_runs_the_exported_policy_without_hvd_rl(checkpoints, tmp_path):
    text = (REPO / "docs" / "policy.md").read_text()
    example = re.search(r"<!-- export-example -->\s*```python\n(.*?)```", text, re.S).group(1)
    assert len(example.strip().splitlines()) <= 10
    _cli("export", "--checkpoint", checkpoints["atari"], "--out", tmp_path / "policy.onnx")
    blocker = "import sys; sys.modules.update({m: None for m in ('hvd_rl', 'horovod', 'gymnasium', 'torch')})\n"
    done = subprocess.run([PYTHON, "-c", blocker + example], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    action = int(done.stdout.strip().splitlines()[-1])
    assert 0 <= action < 4  # Breakout's actions


def test_export_refuses_bad_input_in_one_line(checkpoints, tmp_path):
    bad = run([BIN / "hvd-rl", "export", "--checkpoint", tmp_path / "missing.pt", "--out", tmp_path / "x.onnx"],
              timeout=120)
    assert bad.returncode == 2 and len(bad.stdout.strip().splitlines()) == 1 and not (tmp_path / "x.onnx").exists()
