"""The AWS Batch rendezvous (hvd_rl/cluster/aws_batch.py) over real sockets on 127.0.0.1 only:
only peers with the job's secret, from an allowed network, under a node index nobody holds yet,
join the job; strangers are refused and logged and learn nothing; a main node without the
secret is not trusted; the secret never travels and is not handed to the ranks. And the main
node's SIGTERM (AWS Batch's stop): a real 2-rank job checkpoints, exits 75 and resumes.
Every socket is on 127.0.0.1, every wait is bounded."""
from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import threading

import pytest

from conftest import BIN, CARTPOLE, QUICK, REPO, launch_env, read_jsonl, start, wait_for_iterations
from hvd_rl.cluster import aws_batch
from hvd_rl.cluster.aws_batch import BatchSetupError, JobStopped, StopSignal

SECRET = secrets.token_hex(32)
LOOPBACK = "127.0.0.1"


def batch_env(index: int, num_nodes: int, port: int = 29400, secret: str = SECRET, allow: str = "127.0.0.1/32",
              wait_s: float = 20) -> dict[str, str]:
    env = {"AWS_BATCH_JOB_NUM_NODES": str(num_nodes), "AWS_BATCH_JOB_NODE_INDEX": str(index),
           "AWS_BATCH_JOB_MAIN_NODE_INDEX": "0", "HVD_RL_RANKS_PER_NODE": "1", "HVD_RL_NODE_WAIT_S": str(wait_s),
           "HVD_RL_RENDEZVOUS_SECRET": secret, "HVD_RL_RENDEZVOUS_BIND": LOOPBACK,
           "HVD_RL_RENDEZVOUS_ALLOW_CIDR": allow, "HVD_RL_RENDEZVOUS_PORT": str(port)}
    if index:
        env["AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS"] = LOOPBACK
    return env


class MainNode:
    """gather_children of a main node on 127.0.0.1 (an ephemeral port), in a thread."""

    def __init__(self, num_nodes: int, wait_s: float = 20, allow: str = "127.0.0.1/32",
                 stop: StopSignal | None = None) -> None:
        self.settings = aws_batch.settings_from_environment(batch_env(0, num_nodes, allow=allow, wait_s=wait_s))
        self.server = socket.create_server((LOOPBACK, 0))
        self.port = self.server.getsockname()[1]
        self.children: list = []
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._gather, args=(stop,), daemon=True)
        self.thread.start()

    def _gather(self, stop: StopSignal | None) -> None:
        try:
            self.children = aws_batch.gather_children(self.settings, "ssh-ed25519 AAAAjobkey", self.server, stop)
        except (BatchSetupError, JobStopped) as exc:
            self.error = exc

    def child(self, index: int, secret: str = SECRET) -> aws_batch.NodeSettings:
        return aws_batch.settings_from_environment(batch_env(index, self.settings.num_nodes, self.port, secret))

    def join(self, timeout: float = 30) -> None:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the main node is still gathering"


def register_ready(settings: aws_batch.NodeSettings) -> aws_batch.Registration:
    registration = aws_batch.register(settings)
    registration.ready(settings.secret, f"ssh-ed25519 AAAAhost{settings.index}")
    return registration


def test_only_nodes_with_the_secret_join_and_strangers_are_refused_and_logged(capsys):
    main = MainNode(num_nodes=3)
    # A stranger without the secret, registering as node 1 before the real node 1.
    with pytest.raises(BatchSetupError, match="refused this node: registration as node 1 without the job's secret"):
        aws_batch.register(main.child(1, secret="x" * 64))
    # Something that does not speak the protocol at all gets a challenge and nothing else.
    with socket.create_connection((LOOPBACK, main.port), timeout=5) as raw:
        raw.sendall(b"GET / HTTP/1.0\r\n\r\n")
        raw.settimeout(10)
        received = b""
        while chunk := raw.recv(4096):
            received += chunk
    assert list(json.loads(received)) == ["challenge", "protocol"]
    first, second = register_ready(main.child(1)), register_ready(main.child(2))
    main.join()
    assert main.error is None
    assert [(c.index, c.address, c.ranks) for c in main.children] == [(1, LOOPBACK, 1), (2, LOOPBACK, 1)]
    assert [c.host_key for c in main.children] == ["ssh-ed25519 AAAAhost1", "ssh-ed25519 AAAAhost2"]
    assert main.children[0].conn.getpeername() == first.conn.getsockname()
    log = capsys.readouterr().err
    refused = [line for line in log.splitlines() if "refused 127.0.0.1:" in line]
    assert len(refused) == 2, log
    assert "registration as node 1 without the job's secret" in refused[0] and "not a registration" in refused[1]
    assert "2 connection(s) refused in all" in log
    second.conn.close()
    first.conn.close()


def test_a_duplicate_node_index_is_refused_and_the_first_registration_stays(capsys):
    main = MainNode(num_nodes=3)
    first = register_ready(main.child(1))
    with pytest.raises(BatchSetupError, match="refused this node: node 1 is already registered"):
        aws_batch.register(main.child(1))  # the secret, even: one node index, one node
    register_ready(main.child(2))
    main.join()
    assert main.error is None and [c.index for c in main.children] == [1, 2]
    assert main.children[0].conn.getpeername() == first.conn.getsockname()  # the first one, not the last
    log = capsys.readouterr().err
    assert sum("refused 127.0.0.1:" in line and "node 1 is already registered" in line
               for line in log.splitlines()) == 1, log


def test_a_peer_outside_the_allowed_networks_gets_not_one_byte(capsys):
    main = MainNode(num_nodes=2, wait_s=3, allow="10.0.0.0/8")
    with socket.create_connection((LOOPBACK, main.port), timeout=5) as raw:
        raw.settimeout(10)
        assert raw.recv(4096) == b""  # closed before the challenge
    main.join()
    assert isinstance(main.error, BatchSetupError) and "node 1 of 2 did not report" in str(main.error)
    log = capsys.readouterr().err
    assert "not in the allowed networks 10.0.0.0/8 (HVD_RL_RENDEZVOUS_ALLOW_CIDR)" in log, log


def _fake_main(welcome_proof: str) -> tuple[socket.socket, list[bytes], threading.Thread]:
    """A main node that does not hold the secret: it challenges, records what it gets, and answers
    with a key of its own."""
    server = socket.create_server((LOOPBACK, 0))
    received: list[bytes] = []

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            conn.settimeout(10)
            conn.sendall(json.dumps({"challenge": secrets.token_hex(16)}).encode() + b"\n")
            received.append(conn.makefile("rb").readline())
            conn.sendall(json.dumps({"authorized_key": "ssh-ed25519 AAAAattacker", "proof": welcome_proof}).encode()
                         + b"\n")
        server.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return server, received, thread


def test_a_main_node_without_the_secret_is_not_trusted_and_learns_no_secret():
    server, received, thread = _fake_main("0" * 64)
    port = server.getsockname()[1]
    child = aws_batch.settings_from_environment(batch_env(1, 2, port))
    with pytest.raises(BatchSetupError, match="does not hold the job's HVD_RL_RENDEZVOUS_SECRET: not trusting it"):
        aws_batch.register(child)
    thread.join(10)
    hello = json.loads(received[0])
    assert set(hello) == {"node", "ranks", "nonce", "proof"} and SECRET not in received[0].decode()


def test_the_secret_is_not_handed_to_the_ranks_but_the_rest_is(tmp_path):
    settings = aws_batch.settings_from_environment(batch_env(0, 2))
    env = aws_batch.rank_environment({"HVD_RL_RENDEZVOUS_SECRET": SECRET, "WANDB_API_KEY": "k", "PATH": "/bin",
                                      "HVD_RL_RANKS_PER_NODE": "1"})
    cmd = aws_batch.mpirun_command(settings, tmp_path / "hosts", tmp_path / "key", 2, ["hvd-rl", "train"], env,
                                   tmp_path / "known_hosts")
    forwarded = {cmd[i + 1] for i, word in enumerate(cmd) if word == "-x"}
    assert forwarded == {"WANDB_API_KEY", "PATH", "HVD_RL_RANKS_PER_NODE"}
    assert "HVD_RL_RENDEZVOUS_SECRET" not in env
    assert "StrictHostKeyChecking=yes" in " ".join(cmd)  # the children's host keys came over the rendezvous


def test_sigterm_before_the_job_forms_tells_the_registered_children_75():
    stop = StopSignal(aws_batch.settings_from_environment(batch_env(0, 3)))
    main = MainNode(num_nodes=3, stop=stop)
    first = register_ready(main.child(1))
    stop._handle(signal.SIGTERM, None)  # what the handler does on the main thread's SIGTERM
    main.join()
    assert isinstance(main.error, JobStopped)
    first.conn.settimeout(10)
    assert aws_batch.receive(first.stream) == {"exit": 75}


def _cli(env: dict[str, str], *command: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "hvd-rl"), "aws-batch", "--", *command], capture_output=True, text=True,
                          timeout=120, env={**launch_env(), **env})


@pytest.mark.parametrize("secret, says", [("", "HVD_RL_RENDEZVOUS_SECRET is not set"),
                                          ("short", "HVD_RL_RENDEZVOUS_SECRET has 5 characters, expected at least 32")])
def test_no_usable_secret_is_one_line_and_exit_2_on_every_node(secret, says):
    for index in (0, 1):
        result = _cli(batch_env(index, 2, secret=secret), "true")
        assert result.returncode == 2 and result.stderr.count("\n") == 1 and says in result.stderr, result.stderr


def test_sigterm_to_the_main_node_checkpoints_the_ranks_exits_75_and_the_job_resumes(tmp_path):
    """A one-node job (the main node alone: mpirun's 2 ranks on this machine, no ssh), stopped as
    AWS Batch stops it: SIGTERM to the `hvd-rl aws-batch` process only, not to mpirun or the ranks."""
    run_dir = tmp_path / "run"
    sets = [word for setting in QUICK for word in ("--set", setting)]
    env = {**launch_env(), **batch_env(0, 1), "HVD_RL_RANKS_PER_NODE": "2", "HVD_RL_STOP_TIMEOUT_S": "120",
           "HVD_RL_MPIRUN_ARGS": "--oversubscribe"}
    command = [str(BIN / "hvd-rl"), "aws-batch", "--", "hvd-rl", "train", "--config", str(CARTPOLE),
               "--run-dir", str(run_dir), "--resume", "auto", *sets]
    log = tmp_path / "first.log"
    proc = start([*command, "--set", "ppo.total_timesteps=1000000"], env=env, log=log)
    try:
        wait_for_iterations(run_dir, 2, proc, timeout=240)
        os.kill(proc.pid, signal.SIGTERM)
        code = proc.wait(timeout=180)
    finally:  # whatever is left of the job (mpirun and the ranks outlive a main node killed by SIGTERM)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    text = log.read_text()
    assert code == 75, text[-4000:]
    assert f"SIGTERM: asking the ranks to checkpoint (writing {run_dir / 'stop.request'})" in text
    assert "preempted.json written; exiting 75" in text
    marker = json.loads((run_dir / "preempted.json").read_text())
    assert (run_dir / "checkpoints" / "latest.pt").exists() and not (run_dir / "stop.request").exists()

    # The retry: the same job again continues from that checkpoint to a goal a little further on.
    goal = marker["global_step"] + 128
    again = subprocess.run([*command, "--set", f"ppo.total_timesteps={goal}"], capture_output=True, text=True,
                           timeout=300, env=env, cwd=REPO)
    assert again.returncode == 0, again.stderr[-4000:]
    assert "resum" in (again.stdout + again.stderr).lower()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["global_step"] == goal and summary["world_size"] == 2
    steps = [row["global_step"] for row in read_jsonl(run_dir / "metrics.jsonl")]
    assert steps == sorted(steps) and len(set(steps)) == len(steps) and steps[-1] == goal
