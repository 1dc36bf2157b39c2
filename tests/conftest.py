"""Shared helpers: launch real ranks (mpirun / horovodrun) with timeouts, read run outputs."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hvd_rl.cluster.launch import mpi_env

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent  # the venv's bin: hvd-rl, horovodrun, python
PYTHON = sys.executable
CARTPOLE = REPO / "configs" / "cartpole_ppo.toml"
ATARI = REPO / "configs" / "atari_ppo.toml"

# Small, fast CartPole settings for behaviour tests (not for learning).
QUICK = ["logging.tensorboard=false", "env.num_envs=2", "ppo.num_steps=32",
         "ppo.num_minibatches=2", "ppo.update_epochs=2"]


IN_CI = os.environ.get("CI", "").lower() not in ("", "0", "false", "no")

# The long suite (`make test-long`, `pytest -m long`): end-to-end scenarios that repeat, at more
# cost, a property a default test already holds, or that exercise tooling outside the training
# path (the GPU machine's dry run, a whole new venv, the OCI image). `make test` (CI) leaves them
# out to stay within its 45 minutes on 2 cores; run them when you change what they cover.
# Node-id prefixes, with their measured seconds (2-core AMD EPYC, 2026-12-07; the image build is
# ~380 s more on a fresh machine).
LONG_TESTS = {
    "tests/test_containers.py": 215,  # + the image build; the AWS Batch rendezvous itself: test_aws_batch_rendezvous.py
    "tests/test_gpu_bundle.py::test_device_script_dry_run_runs_every_step_on_cpu": 273,
    "tests/test_setup.py::test_new_venv_uses_cached_horovod_wheel_and_rerun_is_fast": 181,  # .ci/run runs setup itself
    "tests/test_learning_report.py::test_study_skips_completed_runs_and_resumes_an_interrupted_one": 90,
    "tests/test_learning_report.py::test_learning_array_renders_from_the_plan_and_runs_an_element": 28,
    "tests/test_slurm.py::test_sbatch_preemption_checkpoints_requeues_and_finishes[mpirun-TERM-sync]": 90,
    "tests/test_slurm.py::test_sbatch_preemption_checkpoints_requeues_and_finishes[mpirun-USR1-sync]": 37,
    "tests/test_slurm.py::test_sbatch_preemption_checkpoints_requeues_and_finishes[srun-USR1-sync]": 35,
    "tests/test_node_faults.py::test_sbatch_job_requeued_after_node_crash_resumes_to_total": 60,
    "tests/test_trainer.py::test_cartpole_two_ranks_learns": 53,  # learning: benchmarks/learning.py
    "tests/test_trainer.py::test_steady_state_iterations_touch_no_new_memory": 27,
    "tests/test_trainer.py::test_atari_breakout_two_ranks_two_iterations[async-4]": 18,
    "tests/test_benchmarks.py::test_throughput_benchmark_machine_limit_and_ratios_are_consistent": 56,
    "tests/test_report.py::test_small_real_sweep_end_to_end_matches_raw_jsonl": 38,
    "tests/test_tracking.py::test_preempted_twice_offline_run_syncs_as_one_run_on_one_step_axis": 36,
    "tests/test_fault_tolerance.py::test_elastic_training_grows_when_a_host_appears": 38,
    "tests/test_fault_tolerance.py::test_resume_auto_follows_the_newest_branch_after_a_rollback[5]": 24,
    "tests/test_fault_tolerance.py::test_bad_checkpoint_is_refused_by_every_rank_and_run_dir_untouched[truncated]": 15,
    "tests/test_fault_tolerance.py::test_bad_checkpoint_is_refused_by_every_rank_and_run_dir_untouched[other_model]": 16,
    "tests/test_policy.py::test_onnx_and_torchscript_match_pytorch_on_real_observations[pendulum-mean]": 29,
    "tests/test_policy.py::test_onnx_and_torchscript_match_pytorch_on_real_observations[dqn-q_values]": 22,
    "tests/test_policy.py::test_video_and_gif_of_greedy_games[hopper-size2]": 20,
    "tests/test_distributed.py::test_uneven_shares_three_plus_five_envs_equal_eight_in_one_process[mlp]": 14,
    "tests/test_distributed.py::test_two_ranks_on_half_batches_equal_one_process_on_whole_batch[mlp]": 15,
    "tests/test_dqn.py::test_resume_with_and_without_the_replay_shards[False]": 20,
    "tests/test_multinode.py::test_training_across_two_nodes[1-": 15,
    "tests/test_multinode.py::test_sbatch_template_across_two_nodes[mpirun]": 10,
    "tests/test_multinode.py::test_sbatch_template_across_two_nodes[horovodrun]": 10,
    "tests/test_node_faults.py::test_elastic_job_survives_a_node_crash_and_regrows_when_it_boots": 34,
    "tests/test_fault_tolerance.py::test_resume_of_a_finished_run_without_its_summary_writes_it": 17,
    "tests/test_distributed.py::test_fp16_compression_stays_close_but_not_exact": 15,
    "tests/test_policy.py::test_video_and_gif_of_greedy_games[cartpole-size1]": 15,
    "tests/test_dqn.py::test_three_ranks_learn_with_learning_starts_equal_to_buffer_size": 13,
    # making room for the overlapped-sampling tests (tests/test_pipeline.py, the option matrix's overlap rows)
    "tests/test_slurm.py::test_sbatch_preemption_checkpoints_requeues_and_finishes[horovodrun-USR1-sync]": 46,
    "tests/test_compression.py::test_elastic_removal_of_a_host_restarts_compression_residuals": 27,
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if any(item.nodeid.startswith(prefix) for prefix in LONG_TESTS):
            item.add_marker(pytest.mark.long)


def missing_prerequisite(what: str) -> None:
    """A prerequisite is missing. Under CI (`CI=1`, set by CI's `.ci/run`) `make test` should have
    installed it, so the test fails naming it; on a developer machine it skips with the reason."""
    if IN_CI:
        pytest.fail(f"prerequisite missing under CI (make test installs it): {what}", pytrace=False)
    pytest.skip(what)


def wait_until(predicate, timeout: float, what: str, poll: float = 1.0):
    """predicate()'s first truthy value, or a test failure naming `what` after `timeout` seconds."""
    import time

    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    pytest.fail(f"timed out after {timeout}s waiting for {what}")


def launch_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = mpi_env()  # root allowance for Open MPI, this venv's bin first on PATH
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("HOROVOD_RANK", None)
    env.update(extra or {})
    return env


def run(cmd: list, timeout: float, env: dict[str, str] | None = None,
        cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Runs a command in its own process group; on timeout kills the whole group and fails."""
    proc = start(cmd, env=env, cwd=cwd)
    code, out = finish(proc, timeout)
    return subprocess.CompletedProcess(proc.args, code, out, "")


def mpirun_cmd(np: int, *args) -> list[str]:
    return ["mpirun", "-np", str(np), "--oversubscribe", "--bind-to", "none", *map(str, args)]


def horovodrun_cmd(np: int, *args, gloo: bool = True) -> list[str]:
    return [str(BIN / "horovodrun"), "--gloo" if gloo else "--mpi", "-np", str(np),
            "-H", f"localhost:{np}", *map(str, args)]


def train_cmd(run_dir: Path, *sets: str, config: Path = CARTPOLE, extra: tuple[str, ...] = ()) -> list[str]:
    cmd = [str(BIN / "hvd-rl"), "train", "--config", str(config), "--run-dir", str(run_dir)]
    for s in sets:
        cmd += ["--set", s]
    return cmd + list(extra)


def host_discovery(tmp_path: Path, *hosts: str) -> tuple[Path, Path]:
    """A hosts file and a horovodrun --host-discovery-script that prints it: rewrite the file to
    make hosts disappear or appear during an elastic run."""
    hosts_file = tmp_path / "hosts.txt"
    hosts_file.write_text("".join(f"{host}\n" for host in hosts))
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/bash\ncat {hosts_file}\n")
    discover.chmod(0o755)
    return hosts_file, discover


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def check(result: subprocess.CompletedProcess, code: int = 0) -> str:
    assert result.returncode == code, f"exit {result.returncode} (expected {code}):\n{result.stdout[-6000:]}"
    return result.stdout


def start(cmd: list, env: dict[str, str] | None = None, cwd: Path | None = None,
          log: Path | None = None) -> subprocess.Popen:
    """Starts a command in its own process group (so a timeout can kill every rank); its output goes
    to a pipe, or to `log` where a test reads it while the command still runs."""
    sink = open(log, "w") if log else subprocess.PIPE
    try:
        return subprocess.Popen([str(c) for c in cmd], stdout=sink, stderr=subprocess.STDOUT,
                                text=True, env=env or launch_env(), cwd=cwd or REPO, start_new_session=True)
    finally:
        if log:
            sink.close()


def finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"timed out after {timeout}s: {' '.join(map(str, proc.args))}\n{out[-4000:]}")
    return proc.returncode, out


def wait_for_iterations(run_dir: Path, count: int, proc: subprocess.Popen, timeout: float) -> None:
    import time

    deadline = time.time() + timeout
    path = Path(run_dir) / "metrics.jsonl"
    while time.time() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= count:
            return
        if proc.poll() is not None:
            pytest.fail(f"job ended early ({proc.returncode}):\n{proc.stdout.read()[-4000:]}")
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    pytest.fail(f"{count} iterations not reached in {timeout}s")


def rank_pid(marker: str, rank: int) -> int:
    """PID of the trainer process of a given global rank whose command line contains marker."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if marker not in cmdline or "hvd-rl" not in cmdline or "horovodrun" in cmdline:
            continue
        for var in (b"OMPI_COMM_WORLD_RANK=", b"HOROVOD_RANK="):
            if var + str(rank).encode() in environ:
                return int(entry.name)
    raise AssertionError(f"no rank {rank} process for {marker}")
