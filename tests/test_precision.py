"""Mixed precision: the rollout and the learner see the same numbers; 'auto' picks sensibly."""
import gymnasium as gym
import numpy as np
import pytest
import torch

from hvd_rl.config import ModelConfig
from hvd_rl.algorithms.models import InferencePolicy, build_model
from hvd_rl.runtime.precision import Precision, PrecisionError, cpu_has_native_bf16, resolve_amp
from hvd_rl.algorithms.rollout import observation_storage, take_rows

FRAMES = gym.spaces.Box(0, 255, (4, 84, 84), np.uint8)


def _cnn(mode: str):
    torch.manual_seed(0)
    model = build_model(ModelConfig(kind="nature_cnn"), FRAMES, gym.spaces.Discrete(4))
    model.precision = Precision(mode, "cpu")
    return model


@pytest.mark.parametrize("mode", ["off", "bf16"])
def test_rollout_logprobs_equal_the_learners_so_the_first_ratio_is_one(mode):
    """Rollout: batches of 8 through the inference copy. Learner: a shuffled minibatch of 64
    through the training model under autocast. Same precision -> ratio 1 up to kernel rounding."""
    model = _cnn(mode)
    policy = InferencePolicy(model)
    obs = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (128, 4, 84, 84), dtype=np.uint8))
    actions = torch.arange(128) % 4
    with torch.no_grad():
        rollout = torch.cat([model.log_prob_entropy(policy(obs[i:i + 8])[0], actions[i:i + 8])[0]
                             for i in range(0, 128, 8)])
        order = torch.randperm(128, generator=torch.Generator().manual_seed(1))[:64]
        learner = model.log_prob_entropy(model(obs[order])[0], actions[order])[0]
    ratio = torch.exp(learner - rollout[order])
    assert (ratio - 1).abs().max().item() < (1e-5 if mode == "off" else 1e-2)
    if mode == "bf16":  # and the precision really changed the numbers
        with torch.no_grad():
            fp32 = _cnn("off")(obs[:8])[0]
        assert (policy(obs[:8])[0] - fp32).abs().max().item() > 0


def test_inference_copy_computes_exactly_what_autocast_computes():
    model = _cnn("bf16")
    policy = InferencePolicy(model)
    assert next(policy.model.parameters()).dtype == torch.bfloat16
    obs = torch.randint(0, 256, (8, 4, 84, 84), dtype=torch.uint8)
    with torch.no_grad():
        for a, b in zip(model(obs), policy(obs)):
            assert torch.equal(a, b)
        for p in model.parameters():  # a learner step happened: the copy follows after sync()
            p.add_(0.01)
        stale = policy(obs)[0]
        policy.sync()
        assert not torch.equal(stale, policy(obs)[0])
        assert torch.equal(model(obs)[0], policy(obs)[0])


def test_fp32_inference_uses_the_training_model_itself():
    model = _cnn("off")
    assert InferencePolicy(model).model is model


def test_auto_precision_choices():
    cpu = torch.device("cpu")
    assert resolve_amp("auto", cpu, convolutional=False) == "off"  # MLPs: autocast only costs
    assert resolve_amp("auto", cpu, convolutional=True) == ("bf16" if cpu_has_native_bf16() else "off")
    assert resolve_amp("bf16", cpu, convolutional=False) == "bf16"
    with pytest.raises(PrecisionError, match="needs a CUDA device"):
        resolve_amp("fp16", cpu, convolutional=True)


def test_channels_last_frame_storage_changes_no_number():
    """The rollout buffer keeps frames channels-last (one re-layout per frame, at the copy in);
    the inference copy and the training model compute bitwise what they compute on contiguous
    frames, in bf16 and fp32."""
    frames = torch.randint(0, 256, (2, 8, 4, 84, 84), dtype=torch.uint8)
    stored = observation_storage((2, 8), (4, 84, 84), torch.uint8, torch.device("cpu"))
    stored.copy_(frames)
    assert stored[1].is_contiguous(memory_format=torch.channels_last)
    assert stored.reshape(16, 4, 84, 84).data_ptr() == stored.data_ptr()  # the learner's batch is a view
    for mode in ("off", "bf16"):
        model = _cnn(mode)
        policy = InferencePolicy(model)
        with torch.no_grad():
            for a, b in zip(policy(frames[1]), policy(stored[1])):
                assert torch.equal(a, b)
            for a, b in zip(model(frames.reshape(16, 4, 84, 84)), model(stored.reshape(16, 4, 84, 84))):
                assert torch.equal(a, b)


def test_minibatch_rows_are_taken_as_whole_rows_with_the_same_numbers():
    """take_rows (the learner's minibatch gather) gives exactly what advanced indexing gives, in
    the storage's layout, for channels-last frames and for plain vectors."""
    frames = torch.randint(0, 256, (16, 4, 84, 84), dtype=torch.uint8)
    stored = observation_storage((16,), (4, 84, 84), torch.uint8, torch.device("cpu"))
    stored.copy_(frames)
    index = torch.tensor([9, 3, 3, 15, 0])
    rows = take_rows(stored, index)
    assert torch.equal(rows, frames[index])
    assert rows.is_contiguous(memory_format=torch.channels_last)
    model = _cnn("bf16")
    with torch.no_grad():
        for a, b in zip(model(rows), model(stored[index])):
            assert torch.equal(a, b)
    vectors = torch.randn(16, 3)
    assert torch.equal(take_rows(vectors, index), vectors[index])
    assert torch.equal(take_rows(vectors[:, 0], index), vectors[index, 0])


def _atari_pong_two_ranks(run_dir, bf16_by_rank):
    """mpirun MPMD: each rank its own environment, as on a partition mixing CPU types."""
    from conftest import ATARI, train_cmd

    cmd = train_cmd(run_dir, "logging.tensorboard=false", "env.num_envs=2", "ppo.num_steps=16",
                    "ppo.total_timesteps=64", "distributed.amp=auto", config=ATARI)
    launch = ["mpirun", "--oversubscribe", "--bind-to", "none"]
    for rank, flag in enumerate(bf16_by_rank):
        launch += (([":"] if rank else []) + ["-np", "1", "-x", f"HVD_RL_CPU_BF16={flag}", *cmd])
    return launch


def test_auto_precision_that_differs_between_ranks_is_refused_on_every_rank(tmp_path):
    """amp = 'auto' is each rank's own decision (its CPU's bf16 support): ranks that decided
    differently would run bf16 + fused Adam beside fp32 + for-loop Adam and drift apart."""
    from conftest import run

    result = run(_atari_pong_two_ranks(tmp_path / "run", ["1", "0"]), timeout=180)
    assert result.returncode == 2, result.stdout[-3000:]
    assert "precision bf16 on rank 0, off on rank 1" in result.stdout and "Traceback" not in result.stdout
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_resume_in_another_precision_keeps_this_runs_adam_kernel(tmp_path):
    """The checkpoint's optimizer state carries its run's kernel choice (fused for bf16); a
    resume in fp32 must step with the for-loop kernel, and the log says what changed."""
    from conftest import QUICK, check, run, train_cmd
    from hvd_rl.runtime.checkpoint import load_checkpoint

    run_dir = tmp_path / "run"
    check(run(train_cmd(run_dir, *QUICK, "ppo.total_timesteps=128", "distributed.amp=bf16"), timeout=120))
    groups = load_checkpoint(run_dir / "checkpoints" / "latest.pt")["state"]["optimizer"]["param_groups"]
    assert all(g["fused"] for g in groups)
    out = check(run(train_cmd(run_dir, *QUICK, "ppo.total_timesteps=256", "distributed.amp=off",
                              extra=("--resume", "auto")), timeout=120))
    assert "since the checkpoint: precision bf16 -> off" in out
    ckpt = load_checkpoint(run_dir / "checkpoints" / "latest.pt")
    assert ckpt["global_step"] == 256 and ckpt["numerics"]["precision"] == "off"
    assert all(not g["fused"] for g in ckpt["state"]["optimizer"]["param_groups"])
