"""Node faults on the simulated cluster of slurm/sim_cluster.sh (real namespaces, a real slurmd per
node, MPI and Gloo over TCP between them): a node whose every process dies (`crash`), a node that
goes silent (`link down`), SLURM requeueing a job that lost a node, and an elastic job that loses a
node and gets it back (`boot`). One cluster for the module (SlurmdTimeout=10, so that SLURM declares
a dead node down within seconds), stopped at the end even when a test fails."""
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import BIN, QUICK, finish, host_discovery, read_jsonl, start, train_cmd
from test_multinode import NODES, _cluster, running_cluster

PEER_LOST = 4  # hvd_rl.runtime.watchdog.EXIT_PEER_LOST


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from running_cluster(tmp_path_factory, "simcluster-faults", "--slurm", "SlurmdTimeout=10")


@pytest.fixture
def healthy(cluster):
    """Every test starts and ends with both nodes up, linked and idle in SLURM."""
    yield cluster
    _cluster(cluster, "link", "node2", "up")
    _cluster(cluster, "crash", "node2")  # whatever a test left on node2 (a rank cut off by link down)
    assert _cluster(cluster, "boot", "node2").returncode == 0
    _wait(lambda: re.search(r"^\s*2\s+idle", _sinfo(cluster), re.M), 60, "both nodes idle again", cluster)


def _sinfo(env) -> str:
    return subprocess.run(["sinfo", "-h", "-o", "%D %T %N"], env=env, capture_output=True, text=True).stdout


def _wait(condition, timeout: float, what: str, env=None) -> float:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if condition():
            return time.time()
        time.sleep(0.5)
    pytest.fail(f"timed out after {timeout} s waiting for {what}" + (f"\n{_sinfo(env)}" if env else ""))


def _processes_on(env, node: str, marker: str) -> list[int]:
    """PIDs of the processes on a node whose command line contains marker."""
    pids = []
    for pid in _cluster(env, "pids", node).stdout.split():
        try:
            if marker in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode():
                pids.append(int(pid))
        except OSError:
            continue
    return pids


def _trainers_on(env, node: str, marker: str) -> list[int]:
    """PIDs of `hvd-rl train` processes of this run (marker in the command line) on a node."""
    pids = []
    for pid in _cluster(env, "pids", node).stdout.split():
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if marker in cmdline and "hvd-rl" in cmdline and " train " in cmdline and "horovodrun" not in cmdline:
            pids.append(int(pid))
    return pids


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its parent has exited)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _exports() -> list[str]:
    """mpirun -x for what the ranks need from this environment (the cluster's ssh gives them a
    login environment): PYTHONPATH too where the tests run from a checkout other than the venv's."""
    return [a for var in ("PYTHONUNBUFFERED", "PYTHONPATH") if var in os.environ for a in ("-x", var)]


def _wait_iterations(run_dir: Path, count: int, proc: subprocess.Popen, timeout: float) -> None:
    def ready():
        if proc is not None and proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            pytest.fail(f"job ended early ({proc.returncode}):\n{out[-4000:]}")
        path = run_dir / "metrics.jsonl"
        return path.exists() and len(path.read_text().splitlines()) >= count
    _wait(ready, timeout, f"{count} iterations in {run_dir}")


# ---- (a) a non-elastic job: every surviving rank exits non-zero within 60 s ------------------------

def test_crashed_node_ends_a_nonelastic_mpirun_job(healthy, tmp_path):
    """Every process of node2 is SIGKILLed mid-training (`crash`): the ranks on node1 and mpirun
    end non-zero within 60 s."""
    run_dir = tmp_path / "run"
    trainer = train_cmd(run_dir, *QUICK, "ppo.total_timesteps=1000000", "debug.iteration_sleep=0.1",
                        "distributed.peer_timeout=10")
    proc = start(["mpirun", "-np", "4", "-H", "node1:2,node2:2", "--oversubscribe", "--bind-to", "none",
                  "--tag-output", *_exports(), *trainer], env=healthy, cwd=tmp_path)
    _wait_iterations(run_dir, 2, proc, 180)
    survivors = _trainers_on(healthy, "node1", str(run_dir))
    assert len(survivors) == 2 and len(_trainers_on(healthy, "node2", str(run_dir))) == 2
    crashed_at = time.time()
    assert _cluster(healthy, "crash", "node2").returncode == 0
    code, out = finish(proc, timeout=60)
    ended = time.time() - crashed_at
    assert code != 0 and ended < 60, (code, ended, out[-3000:])
    gone = _wait(lambda: not any(map(_alive, survivors)), max(1.0, 60 - ended), "the ranks on node1 to exit")
    assert gone - crashed_at < 60
    assert read_jsonl(run_dir / "metrics.jsonl")[-1]["world_size"] == 4
    assert not (run_dir / "summary.json").exists()  # the run did not pretend to finish
    print(f"mpirun ended {ended:.1f} s after the crash with {code}")


def test_silent_node_makes_the_surviving_ranks_exit_4(healthy, tmp_path):
    """node2's link goes down mid-training (a node that goes silent: nothing resets the TCP
    connections, the ranks would wait in their next collective for ~15 min). The peer watchdog
    ends every rank on node1 with exit code 4 within distributed.peer_timeout (10 s) + a heartbeat;
    srun reports each, as it does every rank's exit code."""
    run_dir = tmp_path / "run"
    trainer = train_cmd(run_dir, *QUICK, "ppo.total_timesteps=1000000", "debug.iteration_sleep=0.1",
                        "distributed.peer_timeout=10")
    log = tmp_path / "srun.log"
    proc = start(["srun", "-N2", "--ntasks-per-node=2", "--cpus-per-task=1", "--mpi=pmix", "--kill-on-bad-exit=1",
                  "--label", *trainer], env=healthy, cwd=tmp_path, log=log)
    _wait_iterations(run_dir, 2, proc, 180)
    survivors = _trainers_on(healthy, "node1", str(run_dir))
    assert len(survivors) == 2, survivors
    down_at = time.time()
    assert _cluster(healthy, "link", "node2", "down").returncode == 0
    gone = _wait(lambda: not any(map(_alive, survivors)), 60, "the ranks on node1 to exit")
    assert gone - down_at < 60
    # srun reports node1's exit codes once slurmstepd has told it (seconds after the ranks exit on a
    # loaded machine), but keeps waiting for the step on the unreachable node, even after SLURM
    # declared the node down: wait for the report, then end the job and srun.
    srun_report = re.compile(r"srun: error: node1: tasks? 0(-1)?: Exited with exit code 4")
    deadline = time.time() + 60
    while time.time() < deadline and not srun_report.search(log.read_text()):
        time.sleep(0.5)
    subprocess.run(["scancel", "--full", "--signal=KILL", "-u", "root"], env=healthy, timeout=30)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    out = log.read_text()
    assert srun_report.search(out), out[-3000:]
    for rank in (0, 1):
        assert re.search(rf"^{rank}: \[rank {rank}\] hvd-rl: error: the other ranks have not answered", out, re.M), out[-3000:]
    print(f"ranks on node1 gone {gone - down_at:.1f} s after the link went down")


# ---- (b) SLURM: the job that lost a node is requeued and resumes --------------------------------

def _job(env, job: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job], env=env, capture_output=True, text=True).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def test_sbatch_job_requeued_after_node_crash_resumes_to_total(healthy, tmp_path):
    """The CPU template (--requeue) on 2 nodes under srun. node2 crashes after a checkpoint: SLURM
    declares it down (SlurmdTimeout), ends the job with NODE_FAIL and requeues it; when node2 is
    booted again the job runs again with the same id and run directory, resumes from the newest
    checkpoint and ends at exactly total_timesteps."""
    runs = tmp_path / "runs"
    script = tmp_path / "job.sbatch"
    per_iteration = 2 * 64  # 2 ranks x 2 envs x 32 steps
    total = per_iteration * 12
    subprocess.run([BIN / "hvd-rl", "slurm", "render", "--out", script, "--template", "cpu", "--job-name", "faults",
                    "--nodes", "2", "--ntasks-per-node", "1", "--cpus-per-task", "1", "--time", "00:10:00",
                    "--launcher", "srun", "--config", "configs/cartpole_ppo.toml", "--run-root", runs,
                    *[arg for s in QUICK for arg in ("--set", s)], "--set", f"ppo.total_timesteps={total}",
                    "--set", "checkpoint.every=1", "--set", "debug.iteration_sleep=0.5",
                    "--set", "distributed.peer_timeout=10"], check=True, timeout=60, capture_output=True)
    submit = subprocess.run(["sbatch", "--parsable", str(script)], env=healthy, cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert submit.returncode == 0, submit.stderr
    job = submit.stdout.strip()
    run_dir = runs / f"faults-{job}"
    _wait_iterations(run_dir, 3, None, 180)
    _wait(lambda: len(list((run_dir / "checkpoints").glob("ckpt_*.json"))) >= 2, 60, "two checkpoints")
    _cluster(healthy, "crash", "node2")
    _wait(lambda: _job(healthy, job).get("JobState") == "PENDING", 90, "the job to be requeued", healthy)
    info = _job(healthy, job)
    assert int(info["Restarts"]) == 1, info
    crashed_at = [r["global_step"] for r in read_jsonl(run_dir / "metrics.jsonl")][-1]
    # The newest complete checkpoint on disk once the first run has ended (its note may be lost
    # with the crashed step's output: rank 0 can finish writing it as node2 goes down).
    on_disk = max(json.loads(m.read_text())["iteration"] for m in (run_dir / "checkpoints").glob("ckpt_*.json"))
    assert crashed_at < total
    assert _cluster(healthy, "boot", "node2").returncode == 0
    # SLURM holds a requeued job for 120 s (BeginTime), so that what is left of the first run (its
    # step on node1 waits KillWait for the lost node) is gone before the same job id starts again.
    # and slurmctld has cleaned up the first run on node2 once it registers again. Release it when
    # node2 is back in service, no step daemon is left on node1, and a few seconds later (started at
    # once, the new run lost node2 to the old run's clean-up: "allocated node count 2 != 1").
    _wait(lambda: re.search(r"^\s*2\s+idle", _sinfo(healthy), re.M), 60, "node2 back in service", healthy)
    _wait(lambda: not _processes_on(healthy, "node1", "slurmstepd"), 90, "the first run's step to end on node1")
    time.sleep(10)
    assert re.search(r"^\s*2\s+idle", _sinfo(healthy), re.M), _sinfo(healthy)
    subprocess.run(["scontrol", "update", f"jobid={job}", "StartTime=now"], env=healthy, check=True, timeout=30)
    _wait(lambda: _job(healthy, job).get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"),
          180, "the requeued job to finish", healthy)
    log = (tmp_path / f"slurm-faults-{job}.out").read_text()
    info = _job(healthy, job)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log[-4000:]
    assert "restart 0 on node[1-2]" in log and "restart 1 on node[1-2]" in log, log[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["global_step"] == total and summary["parameters_identical"]
    assert summary["world_size"] == 2 and summary["topology"]["hostnames"] == NODES
    # The second run resumed from the newest checkpoint the first one wrote before the crash (not
    # from 0), and the metrics (rolled back to that checkpoint on resume) count every iteration once.
    first, second = log.split("restart 1 on node[1-2]")
    resumed = re.search(r"resuming from \S+/ckpt_(\d+)\.pt at iteration (\d+), global step (\d+)", second)
    assert resumed, second[-3000:]
    iteration, step = int(resumed.group(2)), int(resumed.group(3))
    written = [int(i) for i in re.findall(r"checkpoint \S+/ckpt_(\d+)\.pt", first)]
    assert iteration == int(resumed.group(1)) == on_disk >= max(written) >= 2, (iteration, on_disk, written)
    assert step == iteration * per_iteration <= crashed_at
    assert "no checkpoint" not in second
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["global_step"] for r in rows] == [per_iteration * i for i in range(1, total // per_iteration + 1)]
    manifests = sorted((run_dir / "checkpoints").glob("ckpt_*.json"))
    assert json.loads(manifests[-1].read_text())["global_step"] == total


# ---- (c) elastic: continues on the remaining node, the booted node joins again ------------------

def test_elastic_job_survives_a_node_crash_and_regrows_when_it_boots(healthy, tmp_path):
    """horovodrun --gloo elastic on node1 + node2 (one worker each, discovery from a file).
    node2 crashes: the worker on node1 resets and trains alone; node2 boots and discovery lists it
    again: a worker starts there and joins (after the blacklist cool-down), and the job ends at
    exactly total_timesteps on 2 ranks, parameters identical."""
    hosts, discover = host_discovery(tmp_path, "node1:1", "node2:1")
    run_dir = tmp_path / "run"
    # The global batch is 64 on 1 rank (2 envs) and on 2 ranks (1 + 1): total is exact either way.
    total = 64 * 40
    cmd = [BIN / "horovodrun", "--gloo", "-np", "2", "--min-np", "1", "--max-np", "2",
           "--host-discovery-script", discover, "--blacklist-cooldown-range", "1", "2",
           *train_cmd(run_dir, *QUICK, f"ppo.total_timesteps={total}", "distributed.threads_per_rank=1",
                      "debug.iteration_sleep=0.3", "checkpoint.every=0", "distributed.verify_every=1",
                      "distributed.env_counts=[1, 1]", extra=("--elastic",))]
    proc = start(cmd, env={**healthy, "HOROVOD_GLOO_TIMEOUT_SECONDS": "10"}, cwd=tmp_path)
    _wait_iterations(run_dir, 2, proc, 180)
    assert _trainers_on(healthy, "node2", str(run_dir))
    _cluster(healthy, "crash", "node2")
    hosts.write_text("node1:1\n")  # what a cluster's discovery says about a dead node
    _wait(lambda: any(r["world_size"] == 1 for r in read_jsonl(run_dir / "metrics.jsonl")), 120,
          "an iteration on node1 alone")
    assert _cluster(healthy, "boot", "node2").returncode == 0
    hosts.write_text("node1:1\nnode2:1\n")
    code, out = finish(proc, timeout=240)
    assert code == 0, out[-4000:]
    assert "elastic reset: now 1 rank(s)" in out and "elastic reset: now 2 rank(s)" in out
    rows = read_jsonl(run_dir / "metrics.jsonl")
    sizes = [r["world_size"] for r in rows]
    first_alone = sizes.index(1)
    assert sizes[0] == 2 and 2 in sizes[first_alone:] and sizes[-1] == 2, sizes
    assert rows[-1]["global_step"] == total
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["global_step"] == total and summary["world_size"] == 2
    assert summary["parameters_identical"] and summary["topology"]["hostnames"] == NODES
    builds = read_jsonl(run_dir / "env_seeds.jsonl")
    seeds = [s for b in builds for rank in b["seeds_by_rank"] for s in rank]
    assert len(builds) >= 3 and len(seeds) == len(set(seeds))
