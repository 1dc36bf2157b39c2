"""SLURM templates, rendered and run on a real single-node SLURM cluster started by the tests."""
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from conftest import BIN, REPO, check, launch_env, missing_prerequisite, read_jsonl, run, wait_until
from hvd_rl.runtime.checkpoint import load_checkpoint

CLUSTER = REPO / "slurm" / "local_cluster.sh"
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL"}


def render(tmp_path: Path, name: str, *options: str) -> Path:
    out = tmp_path / f"{name}.sbatch"
    check(run([BIN / "hvd-rl", "slurm", "render", "--out", out, *options], timeout=60))
    return out


# ---- rendering (no cluster needed) ------------------------------------------------------------

@pytest.mark.parametrize("template", ["cpu", "gpu", "scaling"])
def test_rendered_templates_pass_bash_n_and_carry_the_options(tmp_path, template):
    script = render(tmp_path, template, "--template", template, "--nodes", "3", "--ntasks-per-node", "4",
                    "--cpus-per-task", "8", "--time", "1-02:00:00", "--partition", "batch", "--account", "proj42",
                    "--config", "configs/atari_ppo.toml", "--set", "env.id=ALE/Pong-v5", "--set", "ppo.total_timesteps=2e7",
                    "--signal-seconds", "300", *(["--gpus-per-node", "4"] if template == "gpu" else []),
                    *(["--ranks", "4 8 12", "--sweep-nodes", "1 2 3", "--mode", "strong"] if template == "scaling" else []))
    text = script.read_text()
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    for line in ("#SBATCH --nodes=3", "#SBATCH --ntasks-per-node=4", "#SBATCH --cpus-per-task=8",
                 "#SBATCH --time=1-02:00:00", "#SBATCH --partition=batch", "#SBATCH --account=proj42",
                 "#SBATCH --signal=B:USR1@300", "#SBATCH --requeue"):
        assert line in text, line
    # The GPU template keeps its own setting (device=cuda) ahead of the user's.
    device = "--set=distributed.device=cuda " if template == "gpu" else ""
    assert f"SET_ARGS=({device}--set=env.id=ALE/Pong-v5 --set=ppo.total_timesteps=2e7)" in text
    assert f"HVD_RL_HOME={REPO}" in text
    assert 'source "$HVD_RL_HOME/slurm/lib.sh"' in text and "hvd_rl_train_requeueable" in text
    if template == "gpu":
        assert "#SBATCH --gpus-per-node=4" in text
    if template == "scaling":
        assert "#SBATCH --array=0-2" in text and "RANKS=(4 8 12)" in text and "NODES=(1 2 3)" in text
        assert "MODE=strong" in text


def test_render_rejects_bad_options(tmp_path):
    result = run([BIN / "hvd-rl", "slurm", "render", "--out", tmp_path / "x.sbatch", "--time", "soon"], timeout=60)
    assert result.returncode == 2 and "--time 'soon' is not a SLURM time" in result.stdout
    assert not (tmp_path / "x.sbatch").exists()


@pytest.mark.parametrize("option, value", [
    ("--job-name", "x\nrm -rf ~"),  # an executable line, and the directives after it are dropped
    ("--partition", "p\n#SBATCH --foo"),
    ("--account", "proj 42"),
    ("--job-name", "a$(id)"),
    ("--job-name", "../x"),  # the run directory is $RUN_ROOT/$SLURM_JOB_NAME-$SLURM_JOB_ID
    ("--time", "01:00:00\n"),
    ("--config", "c.toml\nid"),
    ("--set", "env.id=x\ntouch /tmp/pwned"),
    ("--run-root", "runs\r"),
    ("--ranks", "1\n2"),
    ("--ranks", "\u00b2"),  # a digit to str.isdigit(), not to int()
])
def test_render_refuses_values_that_would_end_or_inject_a_directive(tmp_path, option, value):
    out = tmp_path / "x.sbatch"
    out.write_text("earlier\n")
    result = run([BIN / "hvd-rl", "slurm", "render", "--template", "scaling", "--out", out, option, value], timeout=60)
    assert result.returncode == 2, result.stdout
    assert result.stdout.startswith("hvd-rl: error: " + option) and result.stdout.count("\n") == 1, result.stdout
    assert out.read_text() == "earlier\n"  # nothing written over it


def test_render_accepts_ordinary_names_and_quotes_shell_values(tmp_path):
    script = render(tmp_path, "ok", "--job-name", "pong_v5.run-2", "--partition", "cpu,gpu-a100",
                    "--account", "proj.42+x", "--config", "my configs/a'b.toml", "--run-root", "/scratch/$USER/runs")
    text = script.read_text()
    for line in ("#SBATCH --job-name=pong_v5.run-2", "#SBATCH --partition=cpu,gpu-a100",
                 "#SBATCH --account=proj.42+x"):
        assert line in text, line
    assert "CONFIG='my configs/a'\"'\"'b.toml'" in text and "RUN_ROOT='/scratch/$USER/runs'" in text



# ---- the cluster scripts' state directories (nothing started) ----------------------------------

CLUSTER_SCRIPTS = {"local_cluster.sh": ("HVD_RL_SLURM_DIR", ["start"]),
                   "sim_cluster.sh": ("HVD_RL_SIMCLUSTER_DIR", ["start", "2"])}


def _unsafe_state_dir(tmp_path: Path, kind: str) -> Path:
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    state = tmp_path / "state"
    if kind == "symlink":  # e.g. planted in /tmp by another user, pointing where root should not write
        state.symlink_to(target)
    elif kind == "not_a_directory":
        state.write_text("x\n")
    else:
        state.mkdir(mode=0o700)
        if kind == "other_owner":
            os.chown(state, 65534, 65534)
        else:
            state.chmod(0o777 if kind == "world_writable" else 0o770)
    return state


@pytest.mark.parametrize("kind", ["symlink", "not_a_directory", "other_owner", "world_writable", "group_writable"])
@pytest.mark.parametrize("script", sorted(CLUSTER_SCRIPTS))
def test_cluster_scripts_refuse_an_unsafe_state_directory(tmp_path, script, kind):
    """The root-run scripts keep state (slurm.conf, pid files, the daemons' spool) under a fixed
    default path in the shared temp directory: one planted there must not be used."""
    if os.geteuid() != 0:  # CI runs as root: the SLURM daemons and the simulated cluster need it
        missing_prerequisite("root: the cluster scripts start daemons as root, and chown needs root")
    if script == "sim_cluster.sh":
        probe = subprocess.run([str(REPO / "slurm" / script), "check"], capture_output=True, text=True)
        if probe.returncode != 0:
            missing_prerequisite(f"no simulated cluster here (sim_cluster.sh refuses before it looks at its "
                                 f"state): {probe.stdout.strip()}")
    var, args = CLUSTER_SCRIPTS[script]
    state = _unsafe_state_dir(tmp_path, kind)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    result = subprocess.run([str(REPO / "slurm" / script), *args], env={**os.environ, var: str(state)},
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert result.stdout == "" and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"{script.split('.')[0]}: refusing state directory {state}: "), result.stderr
    assert var in result.stderr
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # nothing written, through the link or not


def test_state_directory_is_created_private_and_an_existing_own_one_is_used(tmp_path):
    def ensure(path: Path) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-c", 'source "$0"; ensure_state_dir "$1" HVD_RL_X; echo ok',
                               str(REPO / "slurm" / "cluster_common.sh"), str(path)],
                              capture_output=True, text=True, timeout=30)

    fresh = tmp_path / "a" / "b"
    result = ensure(fresh)
    assert result.returncode == 0 and result.stdout == "ok\n", result.stderr
    assert fresh.is_dir() and (fresh.stat().st_mode & 0o777) == 0o700 and fresh.stat().st_uid == os.geteuid()
    (fresh / "slurm.conf").write_text("kept\n")
    fresh.chmod(0o755)  # readable by others is fine; writable is not
    result = ensure(fresh)
    assert result.returncode == 0 and result.stdout == "ok\n", result.stderr
    assert (fresh / "slurm.conf").read_text() == "kept\n"


# ---- a real cluster ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def slurm_env(tmp_path_factory):
    if os.geteuid() != 0 and subprocess.run(["sudo", "-n", "true"], capture_output=True).returncode != 0:
        missing_prerequisite("SLURM daemons need root or passwordless sudo on this machine")
    state = tmp_path_factory.mktemp("slurm_state")
    env = launch_env({"HVD_RL_SLURM_DIR": str(state), "SLURM_CONF": str(state / "slurm.conf")})
    start = subprocess.run([str(CLUSTER), "start"], env=env, capture_output=True, text=True, timeout=600)
    if start.returncode != 0:
        if "apt-get" in start.stderr or "Unable to locate package" in start.stderr:
            missing_prerequisite(f"SLURM cannot be installed here: {start.stderr.strip()[-300:]}")
        pytest.fail(f"could not start SLURM:\n{start.stdout}\n{start.stderr}")
    yield env
    subprocess.run([str(CLUSTER), "stop"], env=env, capture_output=True, timeout=120)


def jobs(env, job_id: str) -> list[dict[str, str]]:
    """One dict per job (or array element) from `scontrol show job -o`."""
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=env, capture_output=True, text=True).stdout
    return [dict(re.findall(r"(\w+)=(\S*)", line)) for line in out.splitlines() if line.strip()]


def submit(env, script: Path, cwd: Path) -> str:
    out = subprocess.run(["sbatch", "--parsable", str(script)], env=env, cwd=cwd, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().split(";")[0]


def wait_terminal(env, job_id: str, timeout: float) -> list[dict[str, str]]:
    def done():
        records = jobs(env, job_id)
        return records if records and all(r["JobState"] in TERMINAL for r in records) else None

    return wait_until(done, timeout, f"job {job_id} to finish")


def test_sbatch_cpu_cartpole_on_two_tasks(slurm_env, tmp_path):
    runs = tmp_path / "runs"
    script = render(tmp_path, "cart", "--template", "cpu", "--job-name", "cart", "--ntasks-per-node", "2",
                    "--cpus-per-task", "1", "--time", "00:10:00", "--config", "configs/cartpole_ppo.toml",
                    "--set", "ppo.total_timesteps=8192", "--set", "logging.tensorboard=false", "--run-root", str(runs))
    job = submit(slurm_env, script, tmp_path)
    (record,) = wait_terminal(slurm_env, job, 300)
    log = (tmp_path / f"slurm-cart-{job}.out").read_text()
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", log
    run_dir = runs / f"cart-{job}"
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert {r["world_size"] for r in rows} == {2} and rows[-1]["global_step"] == 8192
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["topology"]["ranks"] == 2 and summary["topology"]["threads_per_rank"] == 1
    assert summary["parameters_identical"]
    assert load_checkpoint(run_dir / "checkpoints" / "latest.pt")["global_step"] == 8192
    assert "launcher srun" in log


@pytest.mark.parametrize("launcher, signal, backend", [
    ("srun", "USR1", "sync"),  # --signal=B:USR1@N ahead of the time limit
    ("mpirun", "USR1", "sync"),
    ("horovodrun", "USR1", "sync"),  # horovodrun itself would die of USR1
    ("mpirun", "TERM", "sync"),  # preemption: SIGTERM to every process; mpirun kills the job on it
    ("srun", "USR1", "async"),  # Gymnasium worker processes (their SIGTERM: test_fault_tolerance)
])
def test_sbatch_preemption_checkpoints_requeues_and_finishes(slurm_env, tmp_path, launcher, signal, backend):
    runs = tmp_path / "runs"
    total = 24 * 1024
    script = render(tmp_path, "long", "--template", "cpu", "--job-name", "long", "--ntasks-per-node", "2",
                    "--cpus-per-task", "1", "--time", "00:20:00", "--config", "configs/cartpole_ppo.toml",
                    "--set", f"ppo.total_timesteps={total}", "--set", "logging.tensorboard=false",
                    "--set", f"env.backend={backend}", "--set", "debug.iteration_sleep=0.4",
                    "--launcher", launcher, "--run-root", str(runs))
    job = submit(slurm_env, script, tmp_path)
    run_dir = runs / f"long-{job}"
    wait_until(lambda: (run_dir / "metrics.jsonl").exists() and len(read_jsonl(run_dir / "metrics.jsonl")) >= 3,
               180, "the job to train a few iterations")
    if signal == "USR1":
        subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=slurm_env, check=True)
    else:  # what SLURM's preemption does: SIGTERM to the batch shell and every process of every step
        subprocess.run(["scancel", "--signal=TERM", "--full", job], env=slurm_env, check=True)
    # SLURM holds a requeued job for 120 s (BeginTime). To keep the test short we release it
    # as soon as the first run's step daemons are gone (what the 120 s are there to ensure).
    wait_until(lambda: jobs(slurm_env, job)[0].get("Restarts") == "1" and
               jobs(slurm_env, job)[0]["JobState"] == "PENDING", 120, "the job to requeue itself")
    wait_until(lambda: subprocess.run(["pgrep", "-x", "slurmstepd"]).returncode != 0, 60,
               "the first run's slurmstepd to exit")
    subprocess.run(["scontrol", "update", f"jobid={job}", "StartTime=now"], env=slurm_env, check=True)
    (record,) = wait_terminal(slurm_env, job, 300)
    log = (tmp_path / f"slurm-long-{job}.out").read_text()
    assert record["JobState"] == "COMPLETED" and record["Restarts"] == "1", log
    assert f"{signal}: asking the ranks to checkpoint" in log and "requeueing job" in log and "restart 1" in log
    assert f"launcher {launcher}" in log
    match = re.search(r"resuming from \S+ckpt_(\d+)\.pt at iteration (\d+)", log)
    assert match and 3 <= int(match.group(2)) < 24, log
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["iteration"] for r in rows] == list(range(1, 25))
    assert rows[-1]["global_step"] == total
    assert json.loads((run_dir / "summary.json").read_text())["global_step"] == total


def test_sweep_job_array_one_and_two_ranks(slurm_env, tmp_path):
    runs = tmp_path / "runs"
    script = render(tmp_path, "sweep", "--template", "scaling", "--ranks", "1 2", "--ntasks-per-node", "2",
                    "--cpus-per-task", "1", "--time", "00:15:00", "--mode", "weak", "--iterations", "2",
                    "--config", "configs/cartpole_ppo.toml", "--run-root", str(runs))
    job = submit(slurm_env, script, tmp_path)
    records = wait_terminal(slurm_env, job, 400)
    assert len(records) == 2 and all(r["JobState"] == "COMPLETED" for r in records), records
    sweep = runs / f"sweep-{job}"
    for ranks in (1, 2):
        point = sweep / f"weak-r{ranks}"
        meta = json.loads((point / "point.json").read_text())
        assert meta["status"] == "ok" and meta["ranks"] == ranks
        rows = read_jsonl(point / "metrics.jsonl")
        assert len(rows) == 4 and {r["world_size"] for r in rows} == {ranks}  # 2 warm-up + 2 measured
    out = tmp_path / "report"
    check(run([BIN / "hvd-rl", "report", sweep, "--out", out], timeout=120))
    report = (out / "report.md").read_text()
    assert "| weak | 1 |" in report and "| weak | 2 |" in report and (out / "scaling.png").exists()


def test_srun_without_mpi_plugin_is_refused_on_every_task(slurm_env, tmp_path):
    """Without --mpi=pmix each task would be a lone rank 0 writing the same run directory."""
    run_dir = tmp_path / "run"
    result = run(["srun", "--mpi=none", "-n", "2", BIN / "hvd-rl", "train", "--config", REPO / "configs" / "cartpole_ppo.toml",
                  "--run-dir", run_dir], timeout=180, env=slurm_env)
    assert result.returncode == 2, result.stdout
    assert result.stdout.count("srun started 2 tasks without an MPI plugin") == 2
    assert "launch with srun --mpi=pmix" in result.stdout
    assert not run_dir.exists()
