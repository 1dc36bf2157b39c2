"""The OCI image (containers/Containerfile, built by `make image`'s script) run for real with podman:
the image checks itself, 2 ranks train in one container, two containers on a podman network act
as two nodes (Open MPI over ssh between them) and the run directory on a bind mount outlives
them (a new container resumes it), and AWS Batch multi-node parallel jobs: N containers given
the AWS_BATCH_JOB_* variables form one MPI job, and a child that never shows up ends the job
with one line, on every node, within the wait.

On AWS Batch the job's secret keeps a stranger out (a container without it is refused, by
the main node, in one line), and SIGTERM, as AWS Batch stops a job, checkpoints the ranks: both
containers exit 75 and a new job resumes the run. containers/podman.sh keeps the host's own
containers.conf settings under its own.

Where podman, mmdebstrap (the local base image) or namespaces are missing: skipped with the
reason, failed under CI (`make test` installs them on Debian; conftest.missing_prerequisite).
HVD_RL_TEST_IMAGE names an image to test instead of building one."""
from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from conftest import QUICK, REPO, missing_prerequisite, read_jsonl

pytestmark = pytest.mark.container

PODMAN = REPO / "containers" / "podman.sh"
IMAGE = os.environ.get("HVD_RL_TEST_IMAGE", "localhost/hvd-rl:test")
CARTPOLE = "configs/cartpole_ppo.toml"  # as the image sees it (its working directory holds configs/)
SUBNET = "10.89.71"  # the test network's /24; the containers get fixed addresses in it


def podman(*args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(PODMAN), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "HVD_RL_PODMAN_QUIET": "1"})
    if check and proc.returncode != 0:
        pytest.fail(f"podman {' '.join(args[:3])} ...: exit {proc.returncode}\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return proc


@pytest.fixture(scope="module")
def image() -> str:
    if shutil.which("podman") is None:
        missing_prerequisite("podman is not installed (Debian: apt-get install podman runc mmdebstrap; make test does)")
    if "HVD_RL_TEST_IMAGE" in os.environ:
        podman("image", "exists", IMAGE)
        return IMAGE
    if shutil.which("mmdebstrap") is None:
        missing_prerequisite("mmdebstrap is not installed: the local base image cannot be made")
    build = subprocess.run([str(REPO / "containers" / "build_image.sh")], capture_output=True, text=True,
                           timeout=3600, env={**os.environ, "IMAGE": IMAGE, "HVD_RL_PODMAN_QUIET": "1"})
    assert build.returncode == 0, f"image build failed:\n{build.stdout[-4000:]}\n{build.stderr[-4000:]}"
    return IMAGE


@pytest.fixture(scope="module")
def network(image):
    name = f"hvdrl-test-{uuid.uuid4().hex[:8]}"
    made = podman("network", "create", "--subnet", f"{SUBNET}.0/24", name, check=False)
    if made.returncode != 0:
        missing_prerequisite(f"podman cannot make a network here: {made.stderr.strip()[-300:]}")
    try:
        yield name
    finally:
        podman("network", "rm", "-f", name, check=False)


@pytest.fixture
def containers():
    """Names of the containers a test starts; all removed at its end, whatever happened."""
    names: list[str] = []
    yield names
    if names:
        podman("rm", "-f", "-t", "0", *names, check=False, timeout=120)


def quick(*extra: str) -> list[str]:
    sets = []
    for setting in (*QUICK, *extra):
        sets += ["--set", setting]
    return sets


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def test_podman_wrapper_keeps_the_host_configuration_under_its_own_settings(tmp_path):
    """The host's containers.conf (here CONTAINERS_CONF's) still counts when containers/podman.sh
    adds its settings (on hosts that need none, it runs podman as it is)."""
    if shutil.which("podman") is None:
        missing_prerequisite("podman is not installed (Debian: apt-get install podman runc mmdebstrap; make test does)")
    host = tmp_path / "host.conf"
    host.write_text('[containers]\ntz = "UTC"\n[engine]\nevents_logger = "none"\n')
    info = subprocess.run([str(PODMAN), "info", "--format", "{{.Host.EventLogger}}"], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "CONTAINERS_CONF": str(host), "HVD_RL_PODMAN_QUIET": "1"})
    assert info.returncode == 0, info.stderr[-2000:]
    assert info.stdout.strip() == "none"


def test_image_checks_itself_and_its_entry_point(image):
    doctor = podman("run", "--rm", image, "doctor", timeout=300)
    assert "all checks passed" in doctor.stdout
    assert "[X] MPI" in podman("run", "--rm", image, "horovodrun", "--check-build").stdout
    version = podman("run", "--rm", image, "--version").stdout
    assert version.startswith("hvd-rl ")
    # a bad config: one line, exit 2, from inside the container as outside
    bad = podman("run", "--rm", image, "train", "--config", CARTPOLE, "--set", "ppo.num_steps=-1", check=False)
    assert bad.returncode == 2 and "num_steps" in bad.stderr and bad.stderr.count("\n") == 1, bad.stderr


def test_two_ranks_in_one_container(image, tmp_path):
    podman("run", "--rm", "-v", f"{tmp_path}:/runs", image, "mpirun", "-np", "2", "hvd-rl", "train",
           "--config", CARTPOLE, "--run-dir", "/runs/one", *quick("ppo.total_timesteps=512"), timeout=300)
    result = summary(tmp_path / "one")
    assert result["status"] == "completed" and result["global_step"] == 512 and result["world_size"] == 2
    assert result["parameters_identical"] and len(set(result["parameter_digests"])) == 1


def _ssh_keys(directory: Path) -> None:
    directory.mkdir()
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(directory / "id")], check=True)
    shutil.copy(directory / "id.pub", directory / "authorized_keys")


def test_two_containers_as_two_nodes_then_a_new_container_resumes(image, network, containers, tmp_path):
    """Open MPI across two containers (ssh on port 2022, a per-test key), the run directory on a bind
    mount both see; then the containers are gone and a new one resumes the run to a longer goal."""
    keys = tmp_path / "keys"
    _ssh_keys(keys)
    runs = tmp_path / "runs"
    runs.mkdir()
    worker, launcher = f"w-{uuid.uuid4().hex[:6]}", f"l-{uuid.uuid4().hex[:6]}"
    mounts = ["-v", f"{runs}:/runs", "-v", f"{keys}:/keys:ro"]
    containers.append(worker)
    podman("run", "-d", "--name", worker, "--hostname", "node2", "--network", network, "--ip", f"{SUBNET}.12",
           *mounts, image, "hvd-rl-sshd", "-p", "2022", "-o", "AuthorizedKeysFile=/keys/authorized_keys")
    deadline = time.monotonic() + 60  # mpirun's ssh must find the worker's sshd listening
    while "Server listening" not in podman("logs", worker).stderr:
        assert time.monotonic() < deadline, podman("logs", worker).stderr
        time.sleep(0.3)
    containers.append(launcher)
    ssh = "-p 2022 -i /keys/id"
    run = podman("run", "--name", launcher, "--hostname", "node1", "--network", network, "--ip", f"{SUBNET}.11",
                 *mounts, image, "mpirun", "-np", "2", "-H", f"{SUBNET}.11:1,{SUBNET}.12:1",
                 "--mca", "plm_rsh_args", ssh, "--mca", "btl_tcp_if_include", f"{SUBNET}.0/24",
                 "-x", "PATH", "-x", "PYTHONUNBUFFERED", "hvd-rl", "train", "--config", CARTPOLE,
                 "--run-dir", "/runs/two", "--resume", "auto", *quick("ppo.total_timesteps=512"),
                 timeout=400, check=False)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    first = summary(runs / "two")
    assert first["status"] == "completed" and first["global_step"] == 512 and first["world_size"] == 2
    assert first["parameters_identical"] and len(set(first["parameter_digests"])) == 1
    assert first["topology"]["nodes"] == 2 and sorted(first["topology"]["hostnames"]) == ["node1", "node2"]
    podman("rm", "-f", "-t", "0", worker, launcher)
    containers.clear()

    # The containers are gone; the run directory is not. A new container continues it.
    again = podman("run", "--rm", "-v", f"{runs}:/runs", image, "mpirun", "-np", "2", "hvd-rl", "train",
                   "--config", CARTPOLE, "--run-dir", "/runs/two", "--resume", "auto",
                   *quick("ppo.total_timesteps=1024"), timeout=300)
    assert "resum" in (again.stdout + again.stderr).lower()
    second = summary(runs / "two")
    assert second["status"] == "completed" and second["global_step"] == 1024 and second["parameters_identical"]
    steps = [r["global_step"] for r in read_jsonl(runs / "two" / "metrics.jsonl")]
    assert steps == sorted(steps) and steps[-1] == 1024 and len(set(steps)) == len(steps)


JOB_SECRET = secrets.token_hex(32)  # what the job definition's Secrets Manager entry gives every node


def _batch_node(image: str, network: str, name: str, index: int, num_nodes: int, runs: Path,
                wait_s: int, *command: str, base: int = 20, address: int | None = None,
                secret: str = JOB_SECRET) -> list[str]:
    """`podman run` arguments of node `index` of a job whose nodes have addresses SUBNET.base + index
    (`address`: another last byte for this one)."""
    env = {"AWS_BATCH_JOB_NODE_INDEX": index, "AWS_BATCH_JOB_MAIN_NODE_INDEX": 0,
           "AWS_BATCH_JOB_NUM_NODES": num_nodes, "HVD_RL_NODE_WAIT_S": wait_s, "HVD_RL_RANKS_PER_NODE": 1,
           "HVD_RL_RENDEZVOUS_SECRET": secret}
    if index != 0:
        env["AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS"] = f"{SUBNET}.{base}"
    last_byte = base + index if address is None else address
    args = ["run", "-d", "--name", name, "--network", network, "--ip", f"{SUBNET}.{last_byte}", "-v", f"{runs}:/runs"]
    for key, value in env.items():
        args += ["-e", f"{key}={value}"]
    return args + [image, *command]


def _wait_exit(name: str, timeout: float) -> int:
    """The container's exit code once it has exited (polled: podman 4.3's `wait` may notice an
    exit only a minute late)."""
    deadline = time.monotonic() + timeout
    while True:
        state = podman("inspect", "--format", "{{.State.Status}} {{.State.ExitCode}}", name).stdout.split()
        if state[0] in ("exited", "stopped"):
            return int(state[1])
        assert time.monotonic() < deadline, f"{name} still {state[0]} after {timeout} s"
        time.sleep(0.5)


def test_aws_batch_nodes_form_one_mpi_job_and_share_its_exit_code(image, network, containers, tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    command = ["train", "--config", CARTPOLE, "--run-dir", "/runs/batch", "--resume", "auto",
               *quick("ppo.total_timesteps=768")]
    names = [f"b{i}-{uuid.uuid4().hex[:6]}" for i in range(3)]
    stranger = f"s-{uuid.uuid4().hex[:6]}"
    containers.extend([*names, stranger])
    # A child first (it waits for the main node), and a stranger on the same network that claims to
    # be node 1 without the job's secret; then the main node; the real node 1 once the stranger
    # has been refused.
    podman(*_batch_node(image, network, names[2], 2, 3, runs, 120, *command))
    podman(*_batch_node(image, network, stranger, 1, 3, runs, 120, *command, address=29, secret="x" * 64))
    podman(*_batch_node(image, network, names[0], 0, 3, runs, 120, *command))
    deadline = time.monotonic() + 120
    while f"refused {SUBNET}.29:" not in podman("logs", names[0]).stderr:
        assert time.monotonic() < deadline, podman("logs", names[0]).stderr + podman("logs", stranger).stderr
        time.sleep(0.5)
    podman(*_batch_node(image, network, names[1], 1, 3, runs, 120, *command))
    codes = [_wait_exit(name, 400) for name in names]
    logs = [podman("logs", name).stderr for name in names]
    assert codes == [0, 0, 0], "\n".join(logs)
    assert _wait_exit(stranger, 60) == 2
    stranger_log = podman("logs", stranger).stderr
    stranger_errors = [line for line in stranger_log.splitlines() if line.startswith("hvd-rl: error")]
    assert len(stranger_errors) == 1 and "refused this node: registration as node 1 without the job's secret" \
        in stranger_errors[0], stranger_errors
    assert f"{SUBNET}.20 slots=1" in logs[0]  # the main node's own (bound) address leads the hostfile
    result = summary(runs / "batch")
    assert result["status"] == "completed" and result["world_size"] == 3 and result["global_step"] == 768
    assert result["parameters_identical"] and result["topology"]["nodes"] == 3
    assert f"{SUBNET}.21 slots=1" in logs[0] and f"{SUBNET}.22 slots=1" in logs[0]

    # A failing job: every node exits with the main node's code (2: a refused config).
    bad = [f"x{i}-{uuid.uuid4().hex[:6]}" for i in range(2)]
    containers.extend(bad)
    for index in (1, 0):
        podman(*_batch_node(image, network, bad[index], index, 2, runs, 120, "train", "--config", CARTPOLE,
                            "--set", "ppo.num_steps=0", base=30))
    assert [_wait_exit(name, 300) for name in bad] == [2, 2]


def test_aws_batch_child_that_never_shows_up_ends_the_job_clearly(image, network, containers, tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    names = [f"m{i}-{uuid.uuid4().hex[:6]}" for i in range(2)]
    containers.extend(names)
    started = time.monotonic()
    # 3 nodes are announced, node 2 never starts
    podman(*_batch_node(image, network, names[1], 1, 3, runs, 20, "train", "--config", CARTPOLE, base=40))
    podman(*_batch_node(image, network, names[0], 0, 3, runs, 20, "train", "--config", CARTPOLE, base=40))
    codes = [_wait_exit(name, 120) for name in names]
    assert time.monotonic() - started < 90  # bounded by the 20 s wait, not by a hang
    assert codes == [2, 2]
    main_log = podman("logs", names[0]).stderr
    errors = [line for line in main_log.splitlines() if line.startswith("hvd-rl: error")]
    assert len(errors) == 1 and "node 2 of 3 did not report" in errors[0], main_log
    assert not (runs / "batch").exists()


def test_aws_batch_sigterm_checkpoints_every_node_exits_75_and_a_new_job_resumes(image, network, containers,
                                                                                    tmp_path):
    """As AWS Batch stops a job (or a Spot instance goes): SIGTERM to each container's PID 1 (the
    entry point), the child's first, and SIGKILL 30 s later (podman stop -t 30, the ECS agent's
    default). The ranks checkpoint within that, both nodes exit 75 (the job definition retries
    it), and the retry, new containers on the same run directory, resumes."""
    runs = tmp_path / "runs"
    runs.mkdir()
    command = ["train", "--config", CARTPOLE, "--run-dir", "/runs/stop", "--resume", "auto"]
    main, child = f"p0-{uuid.uuid4().hex[:6]}", f"p1-{uuid.uuid4().hex[:6]}"
    containers.extend([main, child])
    podman(*_batch_node(image, network, child, 1, 2, runs, 120, *command, *quick("ppo.total_timesteps=1000000"),
                        base=50))
    podman(*_batch_node(image, network, main, 0, 2, runs, 120, *command, *quick("ppo.total_timesteps=1000000"),
                        base=50))
    metrics, deadline = runs / "stop" / "metrics.jsonl", time.monotonic() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert time.monotonic() < deadline, podman("logs", main).stderr[-4000:]
        time.sleep(0.5)
    podman("kill", "--signal", "TERM", child)  # a child that gets SIGTERM must not end the job early
    podman("stop", "-t", "30", main, timeout=120)
    codes = [_wait_exit(main, 120), _wait_exit(child, 120)]
    main_log, child_log = podman("logs", main).stderr, podman("logs", child).stderr
    assert codes == [75, 75], main_log[-4000:] + child_log[-2000:]
    assert "SIGTERM: asking the ranks to checkpoint (writing /runs/stop/stop.request)" in main_log
    assert "preempted.json written; exiting 75" in main_log
    assert "had SIGTERM: stayed up for the main node" in child_log
    marker = json.loads((runs / "stop" / "preempted.json").read_text())
    assert not (runs / "stop" / "stop.request").exists()

    # The retry strategy's next attempt: new containers, the same run directory.
    goal = marker["global_step"] + 256
    again = [f"r{i}-{uuid.uuid4().hex[:6]}" for i in range(2)]
    containers.extend(again)
    for index in (1, 0):
        podman(*_batch_node(image, network, again[index], index, 2, runs, 120, *command,
                            *quick(f"ppo.total_timesteps={goal}"), base=60))
    assert [_wait_exit(name, 400) for name in again] == [0, 0], podman("logs", again[0]).stderr[-4000:]
    resumed = podman("logs", again[0])
    assert "resum" in (resumed.stdout + resumed.stderr).lower()
    result = summary(runs / "stop")
    assert result["status"] == "completed" and result["global_step"] == goal and result["world_size"] == 2
    assert result["parameters_identical"]
    steps = [r["global_step"] for r in read_jsonl(runs / "stop" / "metrics.jsonl")]
    assert steps == sorted(steps) and len(set(steps)) == len(steps) and steps[-1] == goal
