"""Multi-node behaviour on the simulated cluster of slurm/sim_cluster.sh: two "nodes" (network
namespaces with their own address and hostname on a bridge, a real slurmd each), ranks spread over
them by srun --mpi=pmix, mpirun (through the cluster's ssh) and horovodrun --gloo, talking TCP
across the bridge. One cluster for the whole module, stopped at the end even when a test fails."""
import json
import os
import re
import socket
import subprocess
import time
from pathlib import Path

import pytest

from conftest import BIN, QUICK, REPO, check, launch_env, missing_prerequisite, read_jsonl, run, train_cmd

CLUSTER = REPO / "slurm" / "sim_cluster.sh"
NODES = ["node1", "node2"]
ITERATIONS = 4


def _cluster(env, *args, timeout=180) -> subprocess.CompletedProcess:
    return subprocess.run([str(CLUSTER), *args], env=env, capture_output=True, text=True, timeout=timeout)


def _cluster_env(base: dict[str, str]) -> dict[str, str]:
    """`sim_cluster.sh env` applied to an environment (SLURM_CONF, ssh on PATH, Open MPI over TCP)."""
    env = dict(base)
    out = _cluster(env, "env").stdout
    for key, value in re.findall(r"^export (\w+)=(.*)$", out, flags=re.M):
        env[key] = value.replace("${PATH}", env.get("PATH", ""))
    return env


def running_cluster(tmp_path_factory, name: str, *start_args: str):
    """A simulated cluster for one test module (also tests/test_node_faults.py), stopped at the
    end even when a test fails. Where namespaces cannot be used or SLURM cannot be installed it
    skips with the reason, and fails under CI (conftest.missing_prerequisite)."""
    probe = subprocess.run([str(CLUSTER), "check"], capture_output=True, text=True, timeout=60)
    if probe.returncode == 3:
        missing_prerequisite(f"no simulated cluster here: {probe.stdout.strip()}")
    assert probe.returncode == 0, probe.stdout + probe.stderr
    state = tmp_path_factory.mktemp(name)
    owner = Path("/sys/class/net/hvdrl0/ifalias")
    if owner.exists() and Path(owner.read_text().strip()).is_relative_to(tmp_path_factory.getbasetemp().parent):
        # An earlier test session that was killed before its teardown left its cluster running.
        _cluster({**os.environ, "HVD_RL_SIMCLUSTER_DIR": owner.read_text().strip()}, "stop")
    env = _cluster_env(launch_env({"HVD_RL_SIMCLUSTER_DIR": str(state)}))
    start = _cluster(env, "start", str(len(NODES)), *start_args, timeout=600)
    if start.returncode != 0:
        _cluster(env, "stop")
        if "apt-get" in start.stderr or "Unable to locate package" in start.stderr:
            missing_prerequisite(f"SLURM cannot be installed here: {start.stderr.strip()[-300:]}")
        pytest.fail(f"could not start the simulated cluster:\n{start.stdout}\n{start.stderr}")
    try:
        yield env
    finally:
        stop = _cluster(env, "stop")
        assert stop.returncode == 0, stop.stderr


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from running_cluster(tmp_path_factory, "simcluster")


# ---- the cluster itself --------------------------------------------------------------------------

def test_nodes_have_their_own_hostname_address_slurmd_and_ssh(cluster):
    again = _cluster(cluster, "start", "2")  # idempotent
    assert again.returncode == 0 and "already running" in again.stdout
    status = _cluster(cluster, "status")
    assert status.returncode == 0, status.stdout + status.stderr
    assert re.search(r"^node1 .* idle", status.stdout, re.M) and re.search(r"^node2 .* idle", status.stdout, re.M)
    out = check(run(["srun", "-N2", "--ntasks-per-node=1", "-l", "bash", "-c",
                     "echo $(hostname) $(hostname -I) $SLURMD_NODENAME"], timeout=60, env=cluster))
    assert sorted(out.split("\n")[:2]) == ["0: node1 10.77.0.1 node1", "1: node2 10.77.0.2 node2"]
    assert socket.gethostname() not in NODES
    for node, ip in (("node1", "10.77.0.1"), ("node2", "10.77.0.2")):
        out = check(run(["ssh", "-o", "BatchMode=yes", node, "hostname; hostname -I"], timeout=30, env=cluster))
        assert out.split() == [node, ip]
        assert check(run([CLUSTER, "exec", node, "hostname"], timeout=30, env=cluster)).strip() == node


def _transfer_seconds(env, megabytes: int) -> float:
    """Seconds to send `megabytes` over TCP from node1 to node2 (a Python server on node2)."""
    server = subprocess.Popen(
        [str(CLUSTER), "exec", "node2", "python3", "-c",
         "import socket\ns = socket.create_server(('10.77.0.2', 5201))\nprint('ready', flush=True)\n"
         "c, _ = s.accept()\nn = 0\nwhile (b := c.recv(1 << 20)):\n    n += len(b)\n"
         "c.sendall(b'k')\nprint(n, flush=True)"],
        env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "ready"
        # Timed until node2 confirms it has every byte (sendall alone returns once they are buffered).
        client = check(run([CLUSTER, "exec", "node1", "python3", "-c",
                            "import socket, time\nc = socket.create_connection(('10.77.0.2', 5201))\n"
                            f"t = time.perf_counter()\nc.sendall(bytes({megabytes << 20}))\n"
                            "c.shutdown(socket.SHUT_WR)\nassert c.recv(1) == b'k'\n"
                            "print(time.perf_counter() - t)"], timeout=60, env=env))
        assert int(server.stdout.readline()) == megabytes << 20
        return float(client)
    finally:
        server.kill()
        server.wait()


def test_link_rate_limit_applies_and_lifts(cluster):
    try:
        check(run([CLUSTER, "rate", "100mbit"], timeout=60, env=cluster))
        assert "rate 100Mbit" in _cluster(cluster, "status").stdout
        limited = _transfer_seconds(cluster, 8)  # 8 MiB at 100 Mbit/s: >= 0.67 s
    finally:
        check(run([CLUSTER, "rate", "off"], timeout=60, env=cluster))
    assert "rate unlimited" in _cluster(cluster, "status").stdout
    unlimited = _transfer_seconds(cluster, 8)
    assert limited > 0.55 and unlimited < limited / 3, (limited, unlimited)


def test_refuses_clearly_without_root(tmp_path):
    if os.geteuid() == 0:
        nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", str(CLUSTER)]
    else:
        nobody = [str(CLUSTER)]
    probe = subprocess.run([*nobody, "check"], capture_output=True, text=True, timeout=60)
    assert probe.returncode == 3 and probe.stdout.startswith("needs root"), probe
    start = subprocess.run([*nobody, "start", "2"], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "HVD_RL_SIMCLUSTER_DIR": str(tmp_path / "x")})
    assert start.returncode == 1 and start.stdout == ""
    assert start.stderr.count("\n") == 1 and start.stderr.startswith("sim_cluster: needs root"), start.stderr


# ---- training across nodes ------------------------------------------------------------------------

def _launch(launcher: str, per_node: int, run_dir: Path, *sets: str, forward: tuple[str, ...] = ()) -> list[str]:
    ranks = len(NODES) * per_node
    total = ranks * 2 * 32 * ITERATIONS  # QUICK: 2 envs x 32 steps per rank and iteration
    trainer = train_cmd(run_dir, *QUICK, f"ppo.total_timesteps={total}", "checkpoint.every=2", *sets)
    if launcher == "srun":
        return ["srun", f"-N{len(NODES)}", f"--ntasks-per-node={per_node}", "--cpus-per-task=1", "--mpi=pmix",
                "--kill-on-bad-exit=1", "--label", *trainer]
    if launcher == "mpirun":
        # The ranks start from the cluster's ssh with a login environment: pass on what they need.
        # PYTHONPATH too where the tests run from a checkout other than the venv's own.
        passed = ("PYTHONUNBUFFERED", *(("PYTHONPATH",) if "PYTHONPATH" in os.environ else ()), *forward)
        exports = [arg for var in passed for arg in ("-x", var)]
        return ["mpirun", "-np", str(ranks), "-H", ",".join(f"{n}:{per_node}" for n in NODES), "--oversubscribe",
                "--bind-to", "none", "--tag-output", *exports, *trainer]
    assert launcher == "horovodrun"
    return [str(BIN / "horovodrun"), "--gloo", "-np", str(ranks), "-H", ",".join(f"{n}:{per_node}" for n in NODES),
            *trainer]


def _rank_of_line(launcher: str, line: str) -> int | None:
    """The global rank a launcher's output line came from (srun --label, mpirun --tag-output,
    horovodrun's '[rank]<stdout>:' prefix)."""
    match = {"srun": r"^\s*(\d+): ", "mpirun": r"^\[\d+,(\d+)\]<std(?:out|err)>:",
             "horovodrun": r"^\[(\d+)\]<std(?:out|err)>:"}[launcher]
    found = re.match(match, line)
    return int(found.group(1)) if found else None


def _check_multinode_run(launcher: str, per_node: int, run_dir: Path, out: str) -> dict:
    ranks = len(NODES) * per_node
    summary = json.loads((run_dir / "summary.json").read_text())
    topo = summary["topology"]
    # Horovod's view: cross_size = nodes, local_size = ranks per node, local ranks 0..per_node-1.
    assert topo["ranks"] == summary["world_size"] == ranks
    assert topo["nodes"] == len(NODES) and topo["ranks_per_node"] == per_node
    assert topo["hostnames"] == NODES
    # Block placement by every launcher: ranks 0..per_node-1 on node1, the next on node2.
    assert topo["per_rank"] == [{"rank": r, "hostname": NODES[r // per_node], "local_rank": r % per_node,
                                 "local_size": per_node} for r in range(ranks)]
    assert summary["parameters_identical"] and len(set(summary["parameter_digests"])) == 1
    assert summary["global_step"] == summary["total_timesteps"] and summary["iteration"] == ITERATIONS

    (seeds,) = read_jsonl(run_dir / "env_seeds.jsonl")
    assert seeds["world_size"] == ranks and len(seeds["seeds_by_rank"]) == ranks
    flat = [s for rank in seeds["seeds_by_rank"] for s in rank]
    assert len(flat) == len(set(flat)) == ranks * 2

    # Only global rank 0 (on node1) writes the checkpoint: its checkpoint notes are the only ones,
    # the manifests name node1 as the writer, and the run directory holds nothing else any other rank
    # could have made. Each rank writes only its own per-rank file (RNG state), on its own node.
    notes = [line for line in out.splitlines() if "[hvd_rl] checkpoint " in line]
    assert len(notes) == ITERATIONS // 2 and {_rank_of_line(launcher, n) for n in notes} == {0}, notes
    ckpts = run_dir / "checkpoints"
    manifests = sorted(ckpts.glob("ckpt_*.json"))
    assert [json.loads(m.read_text())["iteration"] for m in manifests] == [2, 4]
    assert {json.loads(m.read_text())["hostname"] for m in manifests} == {"node1"}
    assert sorted(p.name for p in ckpts.iterdir()) == sorted(
        ["latest.pt", "ranks"] + [f"ckpt_{i:08d}{ext}" for i in (2, 4) for ext in (".pt", ".json")])
    assert sorted(p.name for p in (ckpts / "ranks").iterdir()) == sorted(
        f"rank{r:05d}{ext}" for r in range(ranks) for ext in (".pt", ".json"))
    rank_manifests = [json.loads((ckpts / "ranks" / f"rank{r:05d}.json").read_text()) for r in range(ranks)]
    assert [(m["hostname"], m["iteration"]) for m in rank_manifests] == [
        (NODES[r // per_node], ITERATIONS) for r in range(ranks)]
    assert sorted(p.name for p in run_dir.iterdir()) == sorted(
        ["checkpoints", "config.toml", "env_seeds.jsonl", "episodes.jsonl", "metrics.jsonl", "summary.json"])
    assert {r["world_size"] for r in read_jsonl(run_dir / "metrics.jsonl")} == {ranks}
    return summary


@pytest.mark.parametrize("launcher", ["srun", "mpirun"])
@pytest.mark.parametrize("per_node", [1, 2])
def test_training_across_two_nodes(cluster, tmp_path, launcher, per_node):
    run_dir = tmp_path / "run"
    started = time.time()
    out = check(run(_launch(launcher, per_node, run_dir), timeout=300, env=cluster, cwd=tmp_path))
    _check_multinode_run(launcher, per_node, run_dir, out)
    if launcher == "mpirun":  # really over TCP between the namespaces, not shared memory
        assert "10.77.0.0/24" in cluster["OMPI_MCA_btl_tcp_if_include"] and "tcp" in cluster["OMPI_MCA_btl"]
    if launcher == "srun" and per_node == 2:
        # The scaling report names the nodes of the run.
        report = tmp_path / "report"
        check(run([BIN / "hvd-rl", "report", run_dir, "--out", report], timeout=120))
        text = (report / "report.md").read_text()
        assert "hosts used: node1, node2" in text
        assert re.search(r"\| run \| 4 \| 2 \| 2 \|", text), text
    print(f"{launcher} {len(NODES)}x{per_node}: {time.time() - started:.1f} s")


def test_horovodrun_gloo_across_two_nodes(cluster, tmp_path):
    """horovodrun reaches node2 through the cluster's ssh (first on PATH) and finds the common
    interface (hvdrl0 on the nodes and on this host's bridge) for Gloo's rendezvous."""
    run_dir = tmp_path / "run"
    out = check(run(_launch("horovodrun", 1, run_dir), timeout=300, env=cluster, cwd=tmp_path))
    _check_multinode_run("horovodrun", 1, run_dir, out)


@pytest.mark.parametrize("launcher", ["srun", "mpirun", "horovodrun"])
def test_sbatch_template_across_two_nodes(cluster, tmp_path, launcher):
    """The CPU template on 2 nodes: the batch script runs on node1 and starts one rank per node
    with srun, with mpirun (which reads the allocation) or with horovodrun (over the ssh)."""
    runs = tmp_path / "runs"
    script = tmp_path / "job.sbatch"
    check(run([BIN / "hvd-rl", "slurm", "render", "--out", script, "--template", "cpu", "--job-name", launcher,
               "--nodes", "2", "--ntasks-per-node", "1", "--cpus-per-task", "1", "--time", "00:10:00",
               "--launcher", launcher, "--config", "configs/cartpole_ppo.toml", "--run-root", runs,
               *[arg for s in QUICK for arg in ("--set", s)], "--set", "ppo.total_timesteps=512"], timeout=60))
    submit = subprocess.run(["sbatch", "--parsable", str(script)], env=cluster, cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert submit.returncode == 0, submit.stderr
    job = submit.stdout.strip()
    deadline = time.time() + 240
    while time.time() < deadline:
        state = subprocess.run(["scontrol", "show", "job", "-o", job], env=cluster, capture_output=True,
                               text=True).stdout
        if re.search(r"JobState=(COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL)", state):
            break
        time.sleep(1)
    log = (tmp_path / f"slurm-{launcher}-{job}.out").read_text()
    assert "JobState=COMPLETED" in state and "ExitCode=0:0" in state, log
    assert "NodeList=node[1-2]" in state and f"launcher {launcher}" in log
    summary = json.loads((runs / f"{launcher}-{job}" / "summary.json").read_text())
    assert summary["parameters_identical"] and summary["global_step"] == 512
    assert summary["topology"]["per_rank"] == [
        {"rank": 0, "hostname": "node1", "local_rank": 0, "local_size": 1},
        {"rank": 1, "hostname": "node2", "local_rank": 0, "local_size": 1}]


def test_hierarchical_allreduce_option_across_two_nodes(cluster, tmp_path):
    """distributed.hierarchical_allreduce puts HOROVOD_HIERARCHICAL_ALLREDUCE=1 into every rank before
    hvd.init. Whether Horovod then reduces hierarchically is read from Horovod itself: its autotuner
    logs the value its allreduce consults; the summary's `active` must agree with it. (Horovod
    0.28.1 honours the flag only for NCCL GPU allreduces: on a CPU build both say 0.)"""
    import horovod.torch as hvd

    run_dir, autotune_log = tmp_path / "run", tmp_path / "autotune.csv"
    horovod_env = {"HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_LOG": str(autotune_log),
                   "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "0", "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "1",
                   "HOROVOD_LOG_LEVEL": "info"}
    out = check(run(_launch("mpirun", 2, run_dir, "distributed.hierarchical_allreduce=true",
                            forward=tuple(horovod_env)), timeout=300, env={**cluster, **horovod_env}, cwd=tmp_path))
    summary = _check_multinode_run("mpirun", 2, run_dir, out)
    status = summary["topology"]["hierarchical_allreduce"]
    assert status["requested"] is True
    rows = [line.split(",") for line in autotune_log.read_text().splitlines()]
    assert rows[0][0] == "hierarchical_allreduce" and len(rows) > 1, rows
    horovod_says = {int(row[0]) for row in rows[1:]}
    assert horovod_says == {int(status["active"])}, (horovod_says, status)
    # Horovod's own log line on rank 0 carries the same value (the first of the tunables).
    assert re.search(r"\[1,0\]<std(?:out|err)>:.*Autotuner: \[%d, " % int(status["active"]), out)
    if not (hvd.nccl_built() or hvd.ddl_built()):
        assert status["active"] is False and "no NCCL/DDL" in status["why_not"]
        assert "hierarchical allreduce requested but inactive" in out


def test_hierarchical_allreduce_setting_and_status(monkeypatch):
    """No cluster needed: the option's environment variable and the status rule."""
    import torch

    import horovod.torch as hvd
    from hvd_rl.runtime import distributed as dist

    monkeypatch.delenv(dist.HIERARCHICAL_VAR, raising=False)
    monkeypatch.delenv(dist.YIELD_VAR, raising=False)
    settings = dist.apply_runtime_settings(True, 0.0, hierarchical_allreduce=False)
    assert dist.HIERARCHICAL_VAR not in os.environ and [s.name for s in settings] == [dist.YIELD_VAR]
    settings = dist.apply_runtime_settings(True, 0.0, hierarchical_allreduce=True)
    assert os.environ[dist.HIERARCHICAL_VAR] == "1"
    assert dist.RuntimeSetting(dist.HIERARCHICAL_VAR, "1", "config") in settings
    monkeypatch.setenv(dist.HIERARCHICAL_VAR, "0")  # the user's value wins, and means off
    assert dist.RuntimeSetting(dist.HIERARCHICAL_VAR, "0", "environment") in dist.apply_runtime_settings(
        True, 0.0, hierarchical_allreduce=True)
    two_nodes = dist.Topology(rank=0, size=4, local_rank=0, local_size=2, cross_size=2)
    assert dist.hierarchical_allreduce_status(two_nodes, torch.device("cpu")) == {
        "requested": False, "active": False, "why_not": None}
    monkeypatch.setenv(dist.HIERARCHICAL_VAR, "1")
    one_node = dist.Topology(rank=0, size=2, local_rank=0, local_size=2, cross_size=1)
    status = dist.hierarchical_allreduce_status(one_node, torch.device("cpu"))
    assert status["requested"] and not status["active"] and "all ranks on one node" in status["why_not"]
    status = dist.hierarchical_allreduce_status(two_nodes, torch.device("cpu"))
    if hvd.nccl_built() or hvd.ddl_built():
        assert not status["active"] and status["why_not"] == "tensors are on the CPU"
    else:
        assert not status["active"] and "no NCCL/DDL" in status["why_not"]


def test_stop_leaves_nothing_behind(cluster):
    state = Path(cluster["HVD_RL_SIMCLUSTER_DIR"])
    holders = [int((state / "run" / f"{name}.holder").read_text()) for name in ["head", *NODES]]
    daemons = [int(p.read_text()) for p in (state / "run").glob("slurm*.pid")]
    assert len(daemons) == 1 + len(NODES)
    stop = _cluster(cluster, "stop")
    assert stop.returncode == 0, stop.stderr
    for pid in holders + daemons:  # gone (a zombie until its reaper collects it is gone too)
        stat = Path(f"/proc/{pid}/stat")
        assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z", pid
    assert "hvdrl" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "hvdrl0" not in subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    assert "hvdrl0" not in subprocess.run(["tc", "qdisc", "show"], capture_output=True, text=True).stdout
    assert sorted(p.name for p in state.iterdir()) == ["logs"]
    again = _cluster(cluster, "stop")  # idempotent
    assert again.returncode == 0 and again.stderr == ""
