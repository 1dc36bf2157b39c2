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
