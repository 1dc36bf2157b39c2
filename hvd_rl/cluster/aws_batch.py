"""AWS Batch multi-node parallel jobs: N nodes running the same image become one MPI job.

AWS Batch starts the image's entry point on every node with AWS_BATCH_JOB_NODE_INDEX,
AWS_BATCH_JOB_MAIN_NODE_INDEX and AWS_BATCH_JOB_NUM_NODES set, and on the children
AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS. `hvd-rl aws-batch -- COMMAND...` (what
containers/entrypoint.sh runs when those are set) does the rest:

- the main node makes a fresh ssh key for this job (none is baked into the image) and listens on
  HVD_RL_RENDEZVOUS_PORT;
- each child connects to it, says its node index, address and rank count, receives the public
  key, starts sshd with that key alone on HVD_RL_SSH_PORT and says it is ready;
- the main node writes the hostfile (itself first, then the children by index) and runs
  `mpirun` over ssh with COMMAND, then sends its exit code to every child, and each exits with it.

Nothing waits forever: a child that has not reported within HVD_RL_NODE_WAIT_S ends the job with
one line naming it (exit 2 on every node that can still be told); a child whose main node never
answers, or goes away without an exit code, says so and exits 2 or 1.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from hvd_rl import CHECKOUT

EXIT_BAD_SETUP = 2  # as `hvd-rl train`'s bad input: nothing ran
EXIT_MAIN_LOST = 1
DEFAULT_RENDEZVOUS_PORT = 29400
DEFAULT_SSH_PORT = 2022  # not 22: with host networking the instance's own sshd may hold it
DEFAULT_WAIT_S = 600.0
SSHD_CONFIG = CHECKOUT / "containers" / "sshd_config"
# Passed on to the ranks (ssh sessions start with a bare environment).
FORWARDED_PREFIXES = ("HVD_RL_", "HOROVOD_", "NCCL_", "OMPI_MCA_", "WANDB_", "CUDA_", "PYTHON")
FORWARDED_NAMES = ("PATH", "LD_LIBRARY_PATH", "HOME")


class BatchSetupError(RuntimeError):
    """The job's nodes cannot form an MPI job; one line says why."""


@dataclass
class NodeSettings:
    index: int
    main_index: int
    num_nodes: int
    main_address: str | None
    ranks_per_node: int
    rendezvous_port: int
    ssh_port: int
    wait_s: float
    mpirun_args: list[str] = field(default_factory=list)

    @property
    def is_main(self) -> bool:
        return self.index == self.main_index


def _int(env: dict[str, str], name: str, default: int | None = None, low: int = 0) -> int:
    text = env.get(name, "").strip()
    if not text:
        if default is None:
            raise BatchSetupError(f"{name} is not set (is this an AWS Batch multi-node parallel job?)")
        return default
    if not text.isdigit() or int(text) < low:
        raise BatchSetupError(f"{name}={text!r}: expected a whole number >= {low}")
    return int(text)


def _default_ranks_per_node() -> int:
    """One rank per GPU where there are GPUs, else one rank per node."""
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
        gpus = sum(line.startswith("GPU ") for line in listed.stdout.splitlines())
    except (OSError, subprocess.TimeoutExpired):
        gpus = 0
    return max(1, gpus)


def settings_from_environment(env: dict[str, str] | None = None) -> NodeSettings:
    env = dict(os.environ if env is None else env)
    num_nodes = _int(env, "AWS_BATCH_JOB_NUM_NODES", low=1)
    index = _int(env, "AWS_BATCH_JOB_NODE_INDEX")
    main_index = _int(env, "AWS_BATCH_JOB_MAIN_NODE_INDEX")
    for name, value in (("AWS_BATCH_JOB_NODE_INDEX", index), ("AWS_BATCH_JOB_MAIN_NODE_INDEX", main_index)):
        if value >= num_nodes:
            raise BatchSetupError(f"{name}={value} is not below AWS_BATCH_JOB_NUM_NODES={num_nodes}")
    main_address = env.get("AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS", "").strip() or None
    if index != main_index and main_address is None:
        raise BatchSetupError(f"node {index}: AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS is not set, so this "
                              "child cannot find the main node")
    ranks = _int(env, "HVD_RL_RANKS_PER_NODE", default=0, low=1)  # unset: 0, the node's GPUs or 1
    wait_text = env.get("HVD_RL_NODE_WAIT_S", "").strip()
    try:
        wait_s = float(wait_text) if wait_text else DEFAULT_WAIT_S
    except ValueError:
        wait_s = -1.0
    if not 0 < wait_s < 1e6:
        raise BatchSetupError(f"HVD_RL_NODE_WAIT_S={wait_text!r}: expected seconds, > 0")
    return NodeSettings(index=index, main_index=main_index, num_nodes=num_nodes, main_address=main_address,
                        ranks_per_node=ranks or _default_ranks_per_node(),
                        rendezvous_port=_int(env, "HVD_RL_RENDEZVOUS_PORT", DEFAULT_RENDEZVOUS_PORT, low=1),
                        ssh_port=_int(env, "HVD_RL_SSH_PORT", DEFAULT_SSH_PORT, low=1), wait_s=wait_s,
                        mpirun_args=shlex.split(env.get("HVD_RL_MPIRUN_ARGS", "")))


def log(settings: NodeSettings, text: str) -> None:
    print(f"[aws-batch node {settings.index}] {text}", file=sys.stderr, flush=True)


# ---- the wire: one JSON object per line ------------------------------------------------------

def send(conn: socket.socket, message: dict) -> None:
    conn.sendall((json.dumps(message) + "\n").encode())


def receive(stream) -> dict | None:
    """The next message, or None when the peer closed the connection."""
    line = stream.readline()
    if not line:
        return None
    return json.loads(line)


# ---- main node ------------------------------------------------------------------------------

@dataclass
class Child:
    index: int
    address: str
    ranks: int
    conn: socket.socket
    main_address: str  # the main node's address as this child reached it
    ready: bool = False


def _serve_child(conn: socket.socket, public_key: str, children: dict[int, Child], lock: threading.Lock,
                 step_timeout: float) -> None:
    """hello -> key -> ready, for one connection; a connection that does not follow it is dropped."""
    try:
        conn.settimeout(step_timeout)
        stream = conn.makefile("r")
        hello = receive(stream)
        if not hello or not isinstance(hello.get("node"), int):
            conn.close()
            return
        child = Child(index=hello["node"], address=str(hello.get("address") or conn.getpeername()[0]),
                      ranks=int(hello.get("ranks", 1)), conn=conn, main_address=conn.getsockname()[0])
        send(conn, {"authorized_key": public_key})
        reply = receive(stream)
        child.ready = bool(reply and reply.get("ready"))
        if not child.ready:
            conn.close()
            return
        conn.settimeout(None)
        with lock:
            children[child.index] = child
    except (OSError, ValueError):
        conn.close()


def gather_children(settings: NodeSettings, public_key: str) -> list[Child]:
    """Every child, ready to take ssh connections, ordered by node index; BatchSetupError when some
    have not reported within the wait."""
    expected = set(range(settings.num_nodes)) - {settings.main_index}
    children: dict[int, Child] = {}
    lock = threading.Lock()
    server = socket.create_server(("", settings.rendezvous_port), reuse_port=False)
    server.settimeout(0.5)
    deadline = time.monotonic() + settings.wait_s
    try:
        while time.monotonic() < deadline:
            with lock:
                if expected <= set(children):
                    break
            try:
                conn, _ = server.accept()
            except socket.timeout:
                continue
            threading.Thread(target=_serve_child, args=(conn, public_key, children, lock, min(60.0, settings.wait_s)),
                             daemon=True).start()
    finally:
        server.close()
    with lock:
        missing = sorted(expected - set(children))
        ready = [children[i] for i in sorted(children) if i in expected]
    if missing:
        for child in ready:
            tell_exit(child, EXIT_BAD_SETUP)
        names = ", ".join(map(str, missing))
        raise BatchSetupError(
            f"node{'s' if len(missing) > 1 else ''} {names} of {settings.num_nodes} did not report to the main node "
            f"(node {settings.main_index}, TCP port {settings.rendezvous_port}) within {settings.wait_s:g} s: "
            f"check that every node runs this image and that TCP ports {settings.rendezvous_port} and "
            f"{settings.ssh_port} are open between the nodes")
    return ready


def tell_exit(child: Child, code: int) -> None:
    try:
        send(child.conn, {"exit": code})
        child.conn.close()
    except OSError:
        pass


def write_hostfile(path: Path, settings: NodeSettings, children: list[Child]) -> list[str]:
    main = children[0].main_address if children else "localhost"
    lines = [f"{main} slots={settings.ranks_per_node}"] + [f"{c.address} slots={c.ranks}" for c in children]
    path.write_text("\n".join(lines) + "\n")
    return lines


def mpirun_command(settings: NodeSettings, hostfile: Path, key: Path, total_ranks: int, command: list[str],
                   env: dict[str, str]) -> list[str]:
    ssh = (f"-p {settings.ssh_port} -i {key} -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null "
           "-o LogLevel=ERROR -o BatchMode=yes")
    forwarded = sorted(name for name in env if name in FORWARDED_NAMES or name.startswith(FORWARDED_PREFIXES))
    cmd = ["mpirun", "--hostfile", str(hostfile), "-np", str(total_ranks), "--bind-to", "none",
           "--map-by", "slot", "--mca", "plm_rsh_agent", "ssh", "--mca", "plm_rsh_args", ssh]
    for name in forwarded:
        cmd += ["-x", name]
    return cmd + settings.mpirun_args + command


def run_main(settings: NodeSettings, command: list[str]) -> int:
    if not command:
        raise BatchSetupError("no command to run (e.g. hvd-rl aws-batch -- hvd-rl train --config ...)")
    if shutil.which("mpirun") is None or shutil.which("ssh-keygen") is None:
        raise BatchSetupError("the main node needs mpirun and ssh-keygen (Open MPI and openssh-client)")
    with tempfile.TemporaryDirectory(prefix="hvd-rl-batch-") as tmp:
        key = Path(tmp) / "id_ed25519"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "hvd-rl-aws-batch", "-f", str(key)],
                       check=True)
        log(settings, f"main node: waiting up to {settings.wait_s:g} s for {settings.num_nodes - 1} child node(s) "
                      f"on TCP port {settings.rendezvous_port}")
        children = gather_children(settings, key.with_suffix(".pub").read_text().strip())
        hostfile = Path(tmp) / "hostfile"
        lines = write_hostfile(hostfile, settings, children)
        total = settings.ranks_per_node + sum(c.ranks for c in children)
        cmd = mpirun_command(settings, hostfile, key, total, command, dict(os.environ))
        log(settings, f"hostfile: {'; '.join(lines)}; running {total} rank(s): {shlex.join(cmd)}")
        code = subprocess.run(cmd).returncode
        log(settings, f"mpirun exited {code}; telling {len(children)} child node(s)")
        for child in children:
            tell_exit(child, code)
        return code


# ---- child node -----------------------------------------------------------------------------

def connect_to_main(settings: NodeSettings) -> socket.socket:
    deadline = time.monotonic() + settings.wait_s
    while True:
        try:
            return socket.create_connection((settings.main_address, settings.rendezvous_port), timeout=5)
        except OSError:
            if time.monotonic() >= deadline:
                raise BatchSetupError(f"node {settings.index}: the main node {settings.main_address}:"
                                      f"{settings.rendezvous_port} did not answer within {settings.wait_s:g} s") from None
            time.sleep(1.0)


def start_sshd(settings: NodeSettings, directory: Path, public_key: str) -> subprocess.Popen:
    """sshd on the job's port that accepts the main node's key alone."""
    sshd = shutil.which("sshd") or "/usr/sbin/sshd"
    if not os.path.exists(sshd) or shutil.which("ssh-keygen") is None:
        raise BatchSetupError(f"node {settings.index}: needs sshd and ssh-keygen (openssh-server) to host ranks")
    (directory / "authorized_keys").write_text(public_key + "\n")
    host_key = directory / "host_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(host_key)], check=True)
    Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # sshd's privilege-separation directory
    cmd = [sshd, "-D", "-e", "-p", str(settings.ssh_port), "-h", str(host_key),
           "-o", f"AuthorizedKeysFile={directory / 'authorized_keys'}", "-o", f"PidFile={directory / 'sshd.pid'}"]
    if SSHD_CONFIG.exists():
        cmd += ["-f", str(SSHD_CONFIG)]
    proc = subprocess.Popen(cmd)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # ready when it accepts connections
        if proc.poll() is not None:
            raise BatchSetupError(f"node {settings.index}: sshd exited {proc.returncode} (port {settings.ssh_port})")
        try:
            socket.create_connection(("127.0.0.1", settings.ssh_port), timeout=1).close()
            return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise BatchSetupError(f"node {settings.index}: sshd did not listen on port {settings.ssh_port} within 30 s")


def run_child(settings: NodeSettings) -> int:
    conn = connect_to_main(settings)
    conn.settimeout(min(60.0, settings.wait_s))  # the key exchange; then the job's length, unbounded
    stream = conn.makefile("r")
    send(conn, {"node": settings.index, "address": conn.getsockname()[0], "ranks": settings.ranks_per_node})
    welcome = receive(stream)
    if not welcome or "authorized_key" not in welcome:
        raise BatchSetupError(f"node {settings.index}: the main node closed the connection before sending its key")
    with tempfile.TemporaryDirectory(prefix="hvd-rl-batch-") as tmp:
        sshd = start_sshd(settings, Path(tmp), welcome["authorized_key"])
        try:
            send(conn, {"ready": True})
            conn.settimeout(None)
            log(settings, f"child node: sshd on port {settings.ssh_port}, hosting {settings.ranks_per_node} "
                          f"rank(s) for the main node {settings.main_address}")
            try:
                verdict = receive(stream)
            except (OSError, ValueError):
                verdict = None
        finally:
            sshd.terminate()
            try:
                sshd.wait(timeout=10)
            except subprocess.TimeoutExpired:
                sshd.kill()
    if not verdict or not isinstance(verdict.get("exit"), int):
        print(f"hvd-rl: error: aws-batch: node {settings.index}: the main node closed the connection without an "
              "exit code (it failed or was stopped)", file=sys.stderr, flush=True)
        return EXIT_MAIN_LOST
    log(settings, f"the main node's job exited {verdict['exit']}")
    return int(verdict["exit"])


def run(command: list[str], env: dict[str, str] | None = None) -> int:
    """This node's part of the job; its exit code is the main node's mpirun's."""
    settings = settings_from_environment(env)
    if settings.is_main:
        return run_main(settings, command)
    return run_child(settings)
