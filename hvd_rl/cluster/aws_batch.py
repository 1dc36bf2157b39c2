"""AWS Batch multi-node parallel jobs: N nodes running the same image become one MPI job.

AWS Batch starts the image's entry point on every node with AWS_BATCH_JOB_NODE_INDEX,
AWS_BATCH_JOB_MAIN_NODE_INDEX and AWS_BATCH_JOB_NUM_NODES set, and on the children
AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS. `hvd-rl aws-batch -- COMMAND...` (what
containers/entrypoint.sh runs when those are set) does the rest:

- the main node makes a fresh ssh key for this job (none is baked into the image) and listens on
  HVD_RL_RENDEZVOUS_PORT of its private address only, for peers in HVD_RL_RENDEZVOUS_ALLOW_CIDR
  (default: the /16 around its address, the largest VPC AWS allows);
- each child connects and proves that it holds the job's secret (HVD_RL_RENDEZVOUS_SECRET, an
  HMAC over fresh nonces from both sides, so the secret never travels), and the main node proves
  the same back; a node index that is already taken is refused. The child then receives the
  public key, starts sshd with that key alone on HVD_RL_SSH_PORT and reports sshd's host key;
- the main node writes the hostfile (itself first, then the children by index) and the children's
  host keys, and runs `mpirun` over ssh with COMMAND, then sends its exit code to every child,
  and each exits with it. Only authenticated nodes are in the hostfile, so the variables mpirun
  forwards (WANDB_API_KEY among them) reach no one else; the rendezvous secret is not forwarded.

SIGTERM (AWS Batch's stop, a Spot interruption) on the main node asks the ranks to checkpoint
(the run directory's stop.request file, as the SLURM templates do; SIGUSR1 through mpirun where
the run directory cannot be told), waits up to HVD_RL_STOP_TIMEOUT_S for mpirun, and exits 75,
which the job definition's retry strategy retries. Children that get SIGTERM keep hosting their
ranks until the main node tells them the job's exit code.

Nothing waits forever: a child that has not reported within HVD_RL_NODE_WAIT_S ends the job with
one line naming it (exit 2 on every node that can still be told); a child whose main node never
answers, or goes away without an exit code, says so and exits 2 or 1.
"""
from __future__ import annotations

import argparse
import hashlib
import hmac
import ipaddress
import json
import os
import secrets
import shlex
import shutil
import signal
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
EXIT_PREEMPTED = 75  # the trainer's "checkpointed, run me again" (EX_TEMPFAIL); the job definition retries it
DEFAULT_RENDEZVOUS_PORT = 29400
DEFAULT_SSH_PORT = 2022  # not 22: with host networking the instance's own sshd may hold it
DEFAULT_WAIT_S = 600.0
DEFAULT_STOP_TIMEOUT_S = 25.0  # AWS Batch (the ECS agent) sends SIGKILL 30 s after SIGTERM by default
SECRET_VAR = "HVD_RL_RENDEZVOUS_SECRET"
MIN_SECRET_CHARS = 32
HANDSHAKE_S = 10.0  # a peer gets this long for each message of the handshake before sshd starts
SSHD_START_S = 60.0  # ... and this long to start sshd and report ready
MAX_REFUSALS_LOGGED = 20
PROTOCOL = "hvd-rl-rendezvous/1"
STOP_FILE = "stop.request"  # hvd_rl/runtime/trainer.py: rank 0 checkpoints and every rank exits 75
PREEMPTED_MARKER = "preempted.json"
SSHD_CONFIG = CHECKOUT / "containers" / "sshd_config"
# Passed on to the ranks (ssh sessions start with a bare environment).
FORWARDED_PREFIXES = ("HVD_RL_", "HOROVOD_", "NCCL_", "OMPI_MCA_", "WANDB_", "CUDA_", "PYTHON")
FORWARDED_NAMES = ("PATH", "LD_LIBRARY_PATH", "HOME")
NOT_FOR_RANKS = (SECRET_VAR,)  # the ranks never need the rendezvous secret


class BatchSetupError(RuntimeError):
    """The job's nodes cannot form an MPI job; one line says why."""


class JobStopped(Exception):
    """SIGTERM arrived before mpirun started: there is nothing to checkpoint."""


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
    secret: bytes = field(default=b"", repr=False)
    bind_address: str | None = None  # the main node's private address (None on children)
    allowed_networks: list[ipaddress.IPv4Network] = field(default_factory=list)
    stop_timeout_s: float = DEFAULT_STOP_TIMEOUT_S
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


def _seconds(env: dict[str, str], name: str, default: float) -> float:
    text = env.get(name, "").strip()
    try:
        value = float(text) if text else default
    except ValueError:
        value = -1.0
    if not 0 < value < 1e6:
        raise BatchSetupError(f"{name}={text!r}: expected seconds, > 0")
    return value


def _default_ranks_per_node() -> int:
    """One rank per GPU where there are GPUs, else one rank per node."""
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
        gpus = sum(line.startswith("GPU ") for line in listed.stdout.splitlines())
    except (OSError, subprocess.TimeoutExpired):
        gpus = 0
    return max(1, gpus)


def _secret(env: dict[str, str]) -> bytes:
    """The job's rendezvous secret. There is no insecure mode: without it any host that can reach
    the port could join the job and receive what the ranks receive."""
    text = env.get(SECRET_VAR, "").strip()
    if not text:
        raise BatchSetupError(f"{SECRET_VAR} is not set: every node of the job needs the same secret to form the "
                              "job (the job definition takes it from Secrets Manager; docs/deploy/aws-batch.md)")
    if len(text) < MIN_SECRET_CHARS:
        raise BatchSetupError(f"{SECRET_VAR} has {len(text)} characters, expected at least {MIN_SECRET_CHARS} "
                              "(e.g. openssl rand -hex 32)")
    return text.encode()


def private_address() -> str:
    """The source address of this node's default route: its private address on AWS (the ENI's),
    without sending anything (a UDP connect only asks the kernel for a route)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1 (RFC 5737): any address the default route takes
            address = probe.getsockname()[0]
    except OSError:
        address = ""
    if not address or ipaddress.ip_address(address).is_loopback or address == "0.0.0.0":
        raise BatchSetupError("cannot tell this node's private IPv4 address (no default route): set "
                              "HVD_RL_RENDEZVOUS_BIND to the address the other nodes reach it at")
    return address


def _networks(text: str, name: str) -> list[ipaddress.IPv4Network]:
    try:
        networks = [ipaddress.IPv4Network(part.strip(), strict=False) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise BatchSetupError(f"{name}={text!r}: {exc}") from None
    if not networks:
        raise BatchSetupError(f"{name}={text!r}: expected IPv4 networks, e.g. 10.0.0.0/16,10.1.0.0/16")
    return networks


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
    settings = NodeSettings(index=index, main_index=main_index, num_nodes=num_nodes, main_address=main_address,
                            ranks_per_node=0, secret=_secret(env),
                            rendezvous_port=_int(env, "HVD_RL_RENDEZVOUS_PORT", DEFAULT_RENDEZVOUS_PORT, low=1),
                            ssh_port=_int(env, "HVD_RL_SSH_PORT", DEFAULT_SSH_PORT, low=1),
                            wait_s=_seconds(env, "HVD_RL_NODE_WAIT_S", DEFAULT_WAIT_S),
                            stop_timeout_s=_seconds(env, "HVD_RL_STOP_TIMEOUT_S", DEFAULT_STOP_TIMEOUT_S),
                            mpirun_args=shlex.split(env.get("HVD_RL_MPIRUN_ARGS", "")))
    if settings.is_main:
        bind = env.get("HVD_RL_RENDEZVOUS_BIND", "").strip()
        if bind:
            try:
                ipaddress.IPv4Address(bind)
            except ValueError:
                raise BatchSetupError(f"HVD_RL_RENDEZVOUS_BIND={bind!r}: expected this node's IPv4 address") from None
        settings.bind_address = bind or private_address()
        allowed = env.get("HVD_RL_RENDEZVOUS_ALLOW_CIDR", "").strip()
        settings.allowed_networks = (_networks(allowed, "HVD_RL_RENDEZVOUS_ALLOW_CIDR") if allowed else
                                     [ipaddress.IPv4Network(f"{settings.bind_address}/16", strict=False)])
    settings.ranks_per_node = ranks or _default_ranks_per_node()
    return settings


def log(settings: NodeSettings, text: str) -> None:
    print(f"[aws-batch node {settings.index}] {text}", file=sys.stderr, flush=True)


# ---- the wire: one JSON object per line, each step signed with the job's secret ---------------

def send(conn: socket.socket, message: dict) -> None:
    conn.sendall((json.dumps(message) + "\n").encode())


def receive(stream) -> dict | None:
    """The next message, or None when the peer closed the connection or sent something else."""
    line = stream.readline(65536)
    if not line:
        return None
    try:
        message = json.loads(line)
    except ValueError:
        return None
    return message if isinstance(message, dict) else None


def proof(secret: bytes, step: str, *parts: object) -> str:
    """HMAC-SHA256 of one handshake step: both nonces are in it, so it proves knowledge of the
    secret for this connection only (a recorded proof is worth nothing on another)."""
    text = "\n".join([PROTOCOL, step, *map(str, parts)])
    return hmac.new(secret, text.encode(), hashlib.sha256).hexdigest()


def proof_matches(secret: bytes, given: object, step: str, *parts: object) -> bool:
    return isinstance(given, str) and hmac.compare_digest(given.encode(), proof(secret, step, *parts).encode())


def _nonce(message: dict | None, name: str) -> str | None:
    value = (message or {}).get(name)
    return value if isinstance(value, str) and 16 <= len(value) <= 128 else None


# ---- stop requests (SIGTERM) -----------------------------------------------------------------

class StopSignal:
    """SIGTERM recorded by the handler; the loops act on it. Without a handler, SIGTERM to PID 1
    (this process, in the container) is ignored and SIGKILL follows the stop timeout."""

    def __init__(self, settings: NodeSettings) -> None:
        self.settings = settings
        self.event = threading.Event()
        self.at = 0.0  # time.monotonic() of the signal
        self.wall = 0.0  # time.time() of it: what files written since are compared with

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, _frame: object) -> None:
        if not self.event.is_set():
            self.at, self.wall = time.monotonic(), time.time()
            self.event.set()

    @property
    def raised(self) -> bool:
        return self.event.is_set()


# ---- main node ------------------------------------------------------------------------------

@dataclass
class Child:
    index: int
    address: str  # as the main node sees it: the address the peer filter checked
    ranks: int
    conn: socket.socket
    main_address: str  # the main node's address as this child reached it
    host_key: str = ""


class Rendezvous:
    """The children's registrations: who is in, which indexes are taken, what was refused."""

    def __init__(self, settings: NodeSettings, public_key: str) -> None:
        self.settings = settings
        self.public_key = public_key
        self.expected = set(range(settings.num_nodes)) - {settings.main_index}
        self.children: dict[int, Child] = {}
        self.claimed: set[int] = set()  # registered or in the middle of registering
        self.lock = threading.Lock()
        self.pending = threading.BoundedSemaphore(2 * settings.num_nodes + 8)
        self.refusals = 0

    def refuse(self, peer: str, reason: str, conn: socket.socket | None = None, tell: bool = False) -> None:
        with self.lock:
            self.refusals += 1
            count = self.refusals
        if count <= MAX_REFUSALS_LOGGED:
            log(self.settings, f"refused {peer}: {reason}")
        elif count == MAX_REFUSALS_LOGGED + 1:
            log(self.settings, "more refusals: counted, not logged")
        if conn is not None:
            if tell:
                try:
                    send(conn, {"refused": reason})
                except OSError:
                    pass
            conn.close()

    def admit(self, conn: socket.socket, peer: tuple[str, int]) -> None:
        """The peer filter, then the handshake in its own thread (bounded in number)."""
        where = f"{peer[0]}:{peer[1]}"
        address = ipaddress.ip_address(peer[0])
        if not any(address in network for network in self.settings.allowed_networks):
            allowed = ",".join(map(str, self.settings.allowed_networks))
            self.refuse(where, f"not in the allowed networks {allowed} (HVD_RL_RENDEZVOUS_ALLOW_CIDR)", conn)
            return
        if not self.pending.acquire(blocking=False):
            self.refuse(where, "too many registrations in progress", conn)
            return
        threading.Thread(target=self._serve, args=(conn, peer), daemon=True).start()

    def _serve(self, conn: socket.socket, peer: tuple[str, int]) -> None:
        where, claimed = f"{peer[0]}:{peer[1]}", None
        try:
            conn.settimeout(HANDSHAKE_S)
            stream = conn.makefile("r")
            main_nonce = secrets.token_hex(16)
            send(conn, {"challenge": main_nonce, "protocol": PROTOCOL})
            hello = receive(stream)
            child_nonce = _nonce(hello, "nonce")
            node, ranks = (hello or {}).get("node"), (hello or {}).get("ranks")
            if child_nonce is None or type(node) is not int or type(ranks) is not int:
                self.refuse(where, "not a registration", conn)
                return
            if not proof_matches(self.settings.secret, hello.get("proof"), "register", main_nonce, child_nonce,
                                 node, ranks):
                self.refuse(where, f"registration as node {node} without the job's secret", conn, tell=True)
                return
            with self.lock:
                taken = node in self.claimed
                if node in self.expected and not taken and 1 <= ranks <= 4096:
                    self.claimed.add(node)
                    claimed = node
            if claimed is None:
                reason = (f"node {node} is already registered" if taken else
                          f"node {node} with {ranks} rank(s) is not a child of this {self.settings.num_nodes}-node job")
                self.refuse(where, reason, conn, tell=True)
                return
            send(conn, {"authorized_key": self.public_key,
                        "proof": proof(self.settings.secret, "welcome", child_nonce, main_nonce, self.public_key)})
            conn.settimeout(SSHD_START_S)
            reply = receive(stream)
            host_key = (reply or {}).get("host_key")
            if not (reply and reply.get("ready") is True and isinstance(host_key, str) and
                    proof_matches(self.settings.secret, reply.get("proof"), "ready", main_nonce, child_nonce,
                                  host_key)):
                self.refuse(where, f"node {node} did not report ready", conn)
                return
            conn.settimeout(None)
            child = Child(index=node, address=peer[0], ranks=ranks, conn=conn, main_address=conn.getsockname()[0],
                          host_key=" ".join(host_key.split()[:2]))
            with self.lock:
                self.children[node] = child
                claimed = None  # kept
            log(self.settings, f"node {node} registered from {where} ({ranks} rank(s))")
        except (OSError, ValueError):
            conn.close()
        finally:
            if claimed is not None:
                with self.lock:
                    self.claimed.discard(claimed)
            self.pending.release()

    def complete(self) -> bool:
        with self.lock:
            return self.expected <= set(self.children)


def open_rendezvous(settings: NodeSettings) -> socket.socket:
    """The listening socket, on the main node's private address only."""
    try:
        return socket.create_server((settings.bind_address or "", settings.rendezvous_port))
    except OSError as exc:
        raise BatchSetupError(f"cannot listen on {settings.bind_address}:{settings.rendezvous_port}: "
                              f"{exc.strerror or exc}") from None


def gather_children(settings: NodeSettings, public_key: str, server: socket.socket | None = None,
                    stop: StopSignal | None = None) -> list[Child]:
    """Every child, authenticated and ready to take ssh connections, ordered by node index;
    BatchSetupError when some have not reported within the wait, JobStopped on SIGTERM."""
    rendezvous = Rendezvous(settings, public_key)
    server = server or open_rendezvous(settings)
    server.settimeout(0.5)
    deadline = time.monotonic() + settings.wait_s
    try:
        while time.monotonic() < deadline and not rendezvous.complete() and not (stop and stop.raised):
            try:
                conn, peer = server.accept()
            except TimeoutError:  # socket.timeout
                continue
            rendezvous.admit(conn, peer)
    finally:
        server.close()  # the listener lives only while the job forms
    with rendezvous.lock:
        missing = sorted(rendezvous.expected - set(rendezvous.children))
        ready = [rendezvous.children[i] for i in sorted(rendezvous.children)]
    if rendezvous.refusals:
        log(settings, f"{rendezvous.refusals} connection(s) refused in all")
    if stop and stop.raised:
        for child in ready:
            tell_exit(child, EXIT_PREEMPTED)
        raise JobStopped()
    if missing:
        for child in ready:
            tell_exit(child, EXIT_BAD_SETUP)
        names = ", ".join(map(str, missing))
        raise BatchSetupError(
            f"node{'s' if len(missing) > 1 else ''} {names} of {settings.num_nodes} did not report to the main node "
            f"(node {settings.main_index}, {settings.bind_address}:{settings.rendezvous_port}) within "
            f"{settings.wait_s:g} s: check that every node runs this image with the job's {SECRET_VAR}, that their "
            f"addresses are in HVD_RL_RENDEZVOUS_ALLOW_CIDR, and that TCP ports {settings.rendezvous_port} and "
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


def write_known_hosts(path: Path, settings: NodeSettings, children: list[Child]) -> None:
    """The children's sshd host keys, as they reported them over the authenticated rendezvous:
    mpirun's ssh checks them (no trust on first use)."""
    path.write_text("".join(f"[{c.address}]:{settings.ssh_port} {c.host_key}\n" for c in children))


def mpirun_command(settings: NodeSettings, hostfile: Path, key: Path, total_ranks: int, command: list[str],
                   env: dict[str, str], known_hosts: Path | None = None) -> list[str]:
    checks = (f"-o StrictHostKeyChecking=yes -o UserKnownHostsFile={known_hosts} -o GlobalKnownHostsFile=/dev/null"
              if known_hosts else "-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null")
    ssh = f"-p {settings.ssh_port} -i {key} {checks} -o LogLevel=ERROR -o BatchMode=yes"
    forwarded = sorted(name for name in env if (name in FORWARDED_NAMES or name.startswith(FORWARDED_PREFIXES))
                       and name not in NOT_FOR_RANKS)
    cmd = ["mpirun", "--hostfile", str(hostfile), "-np", str(total_ranks), "--bind-to", "none",
           "--map-by", "slot", "--mca", "plm_rsh_agent", "ssh", "--mca", "plm_rsh_args", ssh]
    for name in forwarded:
        cmd += ["-x", name]
    return cmd + settings.mpirun_args + command


def rank_environment(env: dict[str, str]) -> dict[str, str]:
    return {name: value for name, value in env.items() if name not in NOT_FOR_RANKS}


def run_directory(command: list[str]) -> Path | None:
    """The run directory of a `train` command, read as `hvd-rl train` reads it (its --config,
    --set and --run-dir); None for other commands or where it cannot be told."""
    words = command[1:] if command[:1] == ["hvd-rl"] else command
    if words[:1] != ["train"]:
        return None
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--config", "-c")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--run-dir")
    try:
        args, _ = parser.parse_known_args(words[1:])
        if args.run_dir:
            return Path(args.run_dir).absolute()
        from hvd_rl.config import load_config

        return Path(load_config(args.config, list(args.overrides)).run_dir).absolute()
    except (Exception, SystemExit):  # the ranks will say what is wrong with it
        return None


def _written_since(path: Path, wall: float) -> bool:
    try:
        return path.stat().st_mtime >= wall - 1.0  # file systems (EFS) keep coarser times
    except OSError:
        return False


def run_mpirun(settings: NodeSettings, cmd: list[str], env: dict[str, str], run_dir: Path | None,
               stop: StopSignal) -> int:
    """mpirun's exit code. On SIGTERM: ask the ranks to checkpoint (the stop file, renewed every
    second so that a trainer still starting takes it as a request of its own run; SIGUSR1 through
    mpirun, which forwards it to every rank, where the run directory is unknown), wait up to
    the stop timeout, then end mpirun; 75 unless the job finished anyway."""
    proc = subprocess.Popen(cmd, env=env)
    asked = terminated = False
    stop_file = run_dir / STOP_FILE if run_dir else None
    while True:
        try:
            code = proc.wait(timeout=0.5)
            break
        except subprocess.TimeoutExpired:
            pass
        if not stop.raised:
            continue
        if not asked:
            asked = True
            how = f"writing {stop_file}" if stop_file else "SIGUSR1 to the ranks (the run directory is unknown)"
            log(settings, f"SIGTERM: asking the ranks to checkpoint ({how}); waiting up to "
                          f"{settings.stop_timeout_s:g} s (HVD_RL_STOP_TIMEOUT_S)")
            if stop_file is None:
                proc.send_signal(signal.SIGUSR1)
        if stop_file is not None and stop_file.parent.is_dir() and not _written_since(run_dir / PREEMPTED_MARKER,
                                                                                       stop.wall):
            stop_file.touch()  # a marker of an earlier attempt does not count: the trainer removes it at start
        waited = time.monotonic() - stop.at
        if waited > settings.stop_timeout_s and not terminated:
            log(settings, f"the ranks did not finish within {settings.stop_timeout_s:g} s: ending mpirun")
            proc.terminate()
            terminated = True
        elif waited > settings.stop_timeout_s + 5:
            proc.kill()
    if not stop.raised:
        return code
    if stop_file is not None:
        stop_file.unlink(missing_ok=True)  # acted on, or too late: the next attempt must not see it
    checkpointed = run_dir is not None and _written_since(run_dir / PREEMPTED_MARKER, stop.wall)
    final = 0 if code == 0 else EXIT_PREEMPTED
    log(settings, f"stopped by SIGTERM: mpirun exited {code}"
                  f"{', checkpoint and ' + PREEMPTED_MARKER + ' written' if checkpointed else ''}; exiting {final}"
                  f"{' (the retry strategy resumes from the newest checkpoint)' if final else ''}")
    return final


def run_main(settings: NodeSettings, command: list[str]) -> int:
    if not command:
        raise BatchSetupError("no command to run (e.g. hvd-rl aws-batch -- hvd-rl train --config ...)")
    if shutil.which("mpirun") is None or shutil.which("ssh-keygen") is None:
        raise BatchSetupError("the main node needs mpirun and ssh-keygen (Open MPI and openssh-client)")
    stop = StopSignal(settings)
    stop.install()
    with tempfile.TemporaryDirectory(prefix="hvd-rl-batch-") as tmp:
        key = Path(tmp) / "id_ed25519"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "hvd-rl-aws-batch", "-f", str(key)],
                       check=True)
        server = open_rendezvous(settings)
        log(settings, f"main node: waiting up to {settings.wait_s:g} s for {settings.num_nodes - 1} child node(s) "
                      f"on {settings.bind_address}:{settings.rendezvous_port} (peers from "
                      f"{','.join(map(str, settings.allowed_networks))} with the job's secret)")
        try:
            children = gather_children(settings, key.with_suffix(".pub").read_text().strip(), server, stop)
        except JobStopped:
            log(settings, f"SIGTERM before the job started: nothing to checkpoint; exiting {EXIT_PREEMPTED}")
            return EXIT_PREEMPTED
        hostfile, known_hosts = Path(tmp) / "hostfile", Path(tmp) / "known_hosts"
        lines = write_hostfile(hostfile, settings, children)
        write_known_hosts(known_hosts, settings, children)
        total = settings.ranks_per_node + sum(c.ranks for c in children)
        env = rank_environment(dict(os.environ))
        cmd = mpirun_command(settings, hostfile, key, total, command, env, known_hosts)
        log(settings, f"hostfile: {'; '.join(lines)}; running {total} rank(s): {shlex.join(cmd)}")
        code = run_mpirun(settings, cmd, env, run_directory(command), stop)
        log(settings, f"mpirun exited {code}; telling {len(children)} child node(s)")
        for child in children:
            tell_exit(child, code)
        return code


# ---- child node -----------------------------------------------------------------------------

@dataclass
class Registration:
    """A child's authenticated connection to the main node, before sshd starts."""
    conn: socket.socket
    stream: object
    authorized_key: str
    main_nonce: str
    nonce: str

    def ready(self, secret: bytes, host_key: str) -> None:
        send(self.conn, {"ready": True, "host_key": host_key,
                         "proof": proof(secret, "ready", self.main_nonce, self.nonce, host_key)})


def register(settings: NodeSettings, stop: StopSignal | None = None) -> Registration:
    """Connects to the main node and proves this node holds the job's secret, and checks that the
    main node does too. Retried while the main node is not up or closes before its challenge
    (it refuses connections while too many registrations are in progress); refused for good when
    either side's proof is wrong."""
    deadline = time.monotonic() + settings.wait_s
    where = f"{settings.main_address}:{settings.rendezvous_port}"
    while True:
        if stop is not None and stop.raised:
            raise JobStopped()
        try:
            conn = socket.create_connection((settings.main_address, settings.rendezvous_port), timeout=5)
            conn.settimeout(min(60.0, settings.wait_s))
            stream = conn.makefile("r")
            challenge = receive(stream)
            main_nonce = _nonce(challenge, "challenge")
            if main_nonce is not None:
                break
            conn.close()
        except OSError:
            pass
        if time.monotonic() >= deadline:
            raise BatchSetupError(f"node {settings.index}: the main node {where} did not answer within "
                                  f"{settings.wait_s:g} s (or closed every connection: is this node's address in "
                                  "its HVD_RL_RENDEZVOUS_ALLOW_CIDR?)")
        time.sleep(1.0)
    nonce = secrets.token_hex(16)
    signed = proof(settings.secret, "register", main_nonce, nonce, settings.index, settings.ranks_per_node)
    send(conn, {"node": settings.index, "ranks": settings.ranks_per_node, "nonce": nonce, "proof": signed})
    welcome = receive(stream)
    if welcome and isinstance(welcome.get("refused"), str):
        raise BatchSetupError(f"node {settings.index}: the main node {where} refused this node: {welcome['refused']}")
    key = (welcome or {}).get("authorized_key")
    if not isinstance(key, str):
        raise BatchSetupError(f"node {settings.index}: the main node {where} closed the connection before sending "
                              "its key")
    if not proof_matches(settings.secret, welcome.get("proof"), "welcome", nonce, main_nonce, key):
        raise BatchSetupError(f"node {settings.index}: {where} does not hold the job's {SECRET_VAR}: not trusting it")
    return Registration(conn=conn, stream=stream, authorized_key=key, main_nonce=main_nonce, nonce=nonce)


def start_sshd(settings: NodeSettings, directory: Path, public_key: str) -> tuple[subprocess.Popen, str]:
    """sshd on the job's port that accepts the main node's key alone, and its host public key."""
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
            return proc, host_key.with_suffix(".pub").read_text().strip()
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise BatchSetupError(f"node {settings.index}: sshd did not listen on port {settings.ssh_port} within 30 s")


def run_child(settings: NodeSettings) -> int:
    stop = StopSignal(settings)
    stop.install()  # SIGTERM: the ranks this node hosts go on until the main node's mpirun ends them
    try:
        registration = register(settings, stop)
    except JobStopped:
        log(settings, f"SIGTERM before this node joined the job; exiting {EXIT_PREEMPTED}")
        return EXIT_PREEMPTED
    with tempfile.TemporaryDirectory(prefix="hvd-rl-batch-") as tmp:
        sshd, host_key = start_sshd(settings, Path(tmp), registration.authorized_key)
        try:
            registration.ready(settings.secret, host_key)
            registration.conn.settimeout(None)
            log(settings, f"child node: sshd on port {settings.ssh_port}, hosting {settings.ranks_per_node} "
                          f"rank(s) for the main node {settings.main_address}")
            try:
                verdict = receive(registration.stream)
            except (OSError, ValueError):
                verdict = None
        finally:
            sshd.terminate()
            try:
                sshd.wait(timeout=10)
            except subprocess.TimeoutExpired:
                sshd.kill()
    if stop.raised:
        log(settings, "had SIGTERM: stayed up for the main node, which asks the ranks to checkpoint")
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
