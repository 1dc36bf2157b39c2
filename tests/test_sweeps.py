"""Sweeps (hvd_rl/cluster/sweeps): sweep files refused up front, trials as real multi-rank runs,
pruning through the runtime's collective stop, a SIGKILLed worker's trial retried from its run
directory, a preempted trial resumed as the same trial, and a study run by a SLURM job array."""
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import BIN, REPO, check, launch_env, missing_prerequisite, run, wait_until
from hvd_rl.runtime.metrics import read_jsonl  # [] while the file is not there yet

CLUSTER = REPO / "slurm" / "local_cluster.sh"


def sweep_file(tmp_path: Path, name: str = "s", **changes) -> Path:
    """A CartPole PPO sweep of short trials; `changes` replace top-level lines or add to the space."""
    top = {"name": f'"{name}"', "config": '"configs/cartpole_ppo.toml"', "ranks": "2", "trials": "3",
           "sampler": '"random"', "pruner": '"none"', "reports_per_run": "4", "startup_trials": "2",
           "warmup_reports": "1",
           "overrides": '["ppo.total_timesteps=4096", "ppo.num_steps=64", "logging.tensorboard=false", '
                        '"logging.console=false", "checkpoint.every=1"]'}
    space = {'"ppo.learning_rate"': "{ log_uniform = [1e-4, 1e-2] }", '"ppo.num_minibatches"': "{ choice = [2, 4] }"}
    space.update(changes.pop("space", {}))
    top.update(changes)
    text = "".join(f"{k} = {v}\n" for k, v in top.items() if v is not None)
    text += "[objective]\nlast_episodes = 10\n[space]\n" + "".join(f"{k} = {v}\n" for k, v in space.items()
                                                                    if v is not None)
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    return path


def sweep(*args, timeout=60, env=None) -> subprocess.CompletedProcess:
    return run([BIN / "hvd-rl", "sweep", *map(str, args)], timeout=timeout, env=env or launch_env())


def trials(study: Path) -> list[dict]:
    from hvd_rl.cluster.sweeps.storage import Study

    return [{"number": t.number, "state": t.state.name, "value": t.value, "params": t.params,
             "retry_of": t.system_attrs.get("failed_trial"), "attrs": t.user_attrs}
            for t in Study(study).trials()]


# ---- refused up front -----------------------------------------------------------------------

@pytest.mark.parametrize("changes, message", [
    ({"learning_rat": "3"}, "unknown key 'learning_rat'"),
    ({"space": {'"ppo.learning_rate"': "{ uniform = [0.01, 0.001] }"}}, "empty range"),
    ({"space": {'"ppo.no_such_key"': "{ choice = [1, 2] }"}}, "unknown key 'ppo.no_such_key'"),
    ({"space": {'"ppo.num_minibatches"': "{ choice = [4, 3] }"}}, "space 'ppo.num_minibatches' = 3 is refused"),
    ({"space": {'"ppo.update_epochs"': "{ uniform = [2, 8] }"}}, "ppo.update_epochs"),
    ({"space": {'"ppo.ent_coef"': "{ choice = [] }"}}, "needs a non-empty list"),
    ({"space": {'"seed"': "{ int = [1, 9] }"}}, "set by the sweep"),
    ({"sampler": '"grid"'}, "needs every dimension as grid or choice"),
    # Adasum with the base config's gradient clipping: validate() refuses the pair up front
    ({"space": {'"distributed.reduction"': '{ choice = ["average", "adasum"] }'}}, "adasum"),
])
def test_a_bad_sweep_file_is_one_line_exit_2_and_nothing_is_created(tmp_path, changes, message):
    study = tmp_path / "study"
    result = sweep("create", "--sweep", sweep_file(tmp_path, **changes), "--study-dir", study)
    assert result.returncode == 2, result.stdout
    assert result.stdout.startswith("hvd-rl: error: sweep: ") and result.stdout.count("\n") == 1, result.stdout
    assert message in result.stdout
    assert not study.exists()


def test_points_refused_only_in_combination_fail_with_the_reason_and_the_study_goes_on(tmp_path):
    # ppo.num_steps must be a multiple of ppo.num_minibatches: 60 steps pass with the base's 4
    # minibatches, 8 minibatches pass with the base's 64 steps, 60 with 8 do not.
    spec = sweep_file(tmp_path, trials="2", sampler='"grid"',
                      overrides='["ppo.total_timesteps=2048", "logging.tensorboard=false", "logging.console=false"]',
                      space={'"ppo.learning_rate"': None, '"ppo.num_minibatches"': "{ grid = [8] }",
                             '"ppo.num_steps"': "{ grid = [60, 64] }"})
    study = tmp_path / "study"
    check(sweep("create", "--sweep", spec, "--study-dir", study))
    result = sweep("worker", "--study-dir", study, "--max-trials", "2", timeout=240)
    states = {t["params"]["ppo.num_steps"]: t for t in trials(study)}
    why = states[60]["attrs"]["failed_because"]
    assert states[60]["state"] == "FAIL" and "refused by validate()" in why and "divisible" in why, result.stdout
    assert states[64]["state"] == "COMPLETE", result.stdout
    assert not (study / "trials" / f"{states[60]['number']:04d}" / "CartPole-v1-seed1").exists()


@pytest.mark.parametrize("base, space", [
    # DQN: the objective is read from the same episodes.jsonl; one trial
    ("configs/cartpole_dqn.toml", {'"ppo.learning_rate"': None, '"ppo.num_minibatches"': None,
                                   '"dqn.learning_rate"': "{ grid = [5e-4] }"}),
    # PPO with gradient compression and the load balancer searched over: two trials
    ("configs/cartpole_ppo.toml", {'"ppo.learning_rate"': None, '"ppo.num_minibatches"': None,
                                   '"distributed.compression"': '{ grid = ["powersgd", "topk"] }',
                                   '"distributed.balance"': '{ grid = ["dynamic"] }'}),
])
def test_sweeps_combine_with_dqn_compression_and_balance(tmp_path, base, space):
    dqn = "dqn" in base
    overrides = ('["dqn.total_timesteps=2000", "dqn.learning_starts=500", "logging.tensorboard=false", '
                 '"logging.console=false"]' if dqn else
                 '["ppo.total_timesteps=2048", "ppo.num_steps=64", "logging.tensorboard=false", '
                 '"logging.console=false", "distributed.balance_every=2"]')
    spec = sweep_file(tmp_path, config=f'"{base}"', trials="1" if dqn else "2", sampler='"grid"',
                      overrides=overrides, space=space)
    study = tmp_path / "study"
    check(sweep("create", "--sweep", spec, "--study-dir", study))
    result = sweep("worker", "--study-dir", study, timeout=300)
    final = trials(study)
    assert result.returncode == 0 and [t["state"] for t in final] == ["COMPLETE"] * len(final), result.stdout
    for t in final:
        run_dir = study / t["attrs"]["trial_dir"] / "CartPole-v1-seed1"
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["parameters_identical"] and summary["topology"]["ranks"] == 2
        config = (run_dir / "config.toml").read_text()
        for key, value in t["params"].items():
            assert f"{key.split('.')[-1]} = {json.dumps(value) if isinstance(value, str) else value}" in config


@pytest.mark.parametrize("options, message", [
    (["--template", "sweep", "--study-dir", "s"], "needs --sweep-file and --study-dir"),
    (["--template", "cpu", "--study-dir", "s"], "--study-dir belongs to --template sweep"),
    (["--template", "sweep", "--study-dir", "s", "--sweep-file", "missing.toml"], "sweep file not found"),
])
def test_the_sweep_template_refuses_what_it_cannot_render(tmp_path, options, message):
    result = run([BIN / "hvd-rl", "slurm", "render", "--out", tmp_path / "x.sbatch", *options], timeout=60)
    assert result.returncode == 2 and message in result.stdout and result.stdout.count("\n") == 1, result.stdout
    assert not (tmp_path / "x.sbatch").exists()


# ---- a worker's life: pruning, SIGKILL, SIGTERM ------------------------------------------------

def start_worker(study: Path, log: Path) -> subprocess.Popen:
    return subprocess.Popen([str(BIN / "hvd-rl"), "sweep", "worker", "--study-dir", str(study)],
                            env=launch_env(), stdout=open(log, "w"), stderr=subprocess.STDOUT)


def iterations(run_dir: Path) -> list[int]:
    return [r["iteration"] for r in read_jsonl(run_dir / "metrics.jsonl")]


def test_killed_worker_is_retried_and_a_preempted_trial_resumes_as_the_same_trial(tmp_path):
    spec = sweep_file(tmp_path, trials="2", overrides='["ppo.total_timesteps=8192", "ppo.num_steps=64", '
                      '"logging.tensorboard=false", "logging.console=false", "checkpoint.every=1", '
                      '"debug.iteration_sleep=1.0"]')  # slow enough to be preempted mid-retry
    study = tmp_path / "study"
    check(sweep("create", "--sweep", spec, "--study-dir", study, "--heartbeat", "1", "--grace", "5"))
    first = study / "trials" / "0000" / "CartPole-v1-seed1"

    # 1. SIGKILL mid-trial: no word to anyone; the launcher dies with it (PDEATHSIG).
    worker = start_worker(study, tmp_path / "w1.log")
    wait_until(lambda: len(iterations(first)) >= 3, 120, "trial 0 to train 3 iterations")
    worker.send_signal(signal.SIGKILL)
    worker.wait(timeout=10)
    killed_at = max(iterations(first))
    wait_until(lambda: subprocess.run(["pgrep", "-f", "--", f"--run-dir {first}"]).returncode != 0, 30,
             "trial 0's ranks to die with their worker")
    time.sleep(6)  # past the 5 s grace: the next worker finds trial 0 stale before it asks for a trial

    # 2. the next worker finds trial 0's heartbeat stale, retries it in trial 0's directory;
    #    SIGTERM it mid-way through the retry: checkpoint, back in the queue, exit 75.
    worker = start_worker(study, tmp_path / "w2.log")
    wait_until(lambda: len(trials(study)) >= 2 and len(iterations(first)) >= killed_at + 2, 120,
               "the retry to resume trial 0's run and train on", poll=0.2)
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(timeout=60) == 75, (tmp_path / "w2.log").read_text()
    log2 = (tmp_path / "w2.log").read_text()
    by_number = {t["number"]: t for t in trials(study)}
    retry = by_number[1]
    assert by_number[0]["state"] == "FAIL" and retry["retry_of"] == 0, log2
    assert retry["state"] == "WAITING" and "back in the queue" in log2
    assert (first / "preempted.json").exists()
    preempted_at = max(iterations(first))

    # 3. a third worker takes the same trial (1) back, resumes, and finishes the study.
    worker = start_worker(study, tmp_path / "w3.log")
    assert worker.wait(timeout=240) == 0, (tmp_path / "w3.log").read_text()
    log3 = (tmp_path / "w3.log").read_text()
    final = trials(study)
    complete = [t for t in final if t["state"] in ("COMPLETE", "PRUNED")]
    assert len(complete) == 2 and "study complete" in log3
    assert [t["number"] for t in final] == sorted({t["number"] for t in final})  # no number twice
    assert by_number[1]["params"] == by_number[0]["params"] == next(t for t in final if t["number"] == 1)["params"]
    # the run continued across both interruptions, never restarted from iteration 1
    its = iterations(first)
    assert its == list(range(1, len(its) + 1)) and its[-1] == 8192 // (2 * 4 * 64), its
    assert killed_at < preempted_at < its[-1]
    logs = (first.parent / "CartPole-v1-seed1.log").read_text()
    assert logs.count("starting a new run") == 1 and logs.count("preempted at iteration") == 2, logs


def test_pruned_trial_stops_all_ranks_together_with_exit_0(tmp_path):
    from hvd_rl.runtime.preemption import PRUNE_FILE

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = launch_env()
    proc = subprocess.Popen(["mpirun", "-np", "2", "--oversubscribe", "--bind-to", "none", str(BIN / "hvd-rl"),
                             "train", "--config", str(REPO / "configs" / "cartpole_ppo.toml"), "--run-dir",
                             str(run_dir), "--set", "ppo.total_timesteps=16384", "--set", "ppo.num_steps=64",
                             "--set", "logging.tensorboard=false", "--set", "debug.iteration_sleep=0.3"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_until(lambda: len(iterations(run_dir)) >= 2, 120, "two iterations")
    (run_dir / PRUNE_FILE).touch()
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    marker = json.loads((run_dir / "pruned.json").read_text())
    assert not (run_dir / "preempted.json").exists() and not (run_dir / "summary.json").exists()
    assert marker["iteration"] == max(iterations(run_dir)) < 16384 // (2 * 4 * 64)
    assert out.count("pruned at iteration") == 1, out  # said once, by rank 0


# ---- the SLURM array ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def slurm_4cpu(tmp_path_factory):
    if os.geteuid() != 0 and subprocess.run(["sudo", "-n", "true"], capture_output=True).returncode != 0:
        missing_prerequisite("SLURM daemons need root or passwordless sudo on this machine")
    state = tmp_path_factory.mktemp("slurm_state")
    # 4 declared CPUs on 2 cores: the two array tasks (2 ranks each) run at the same time
    env = launch_env({"HVD_RL_SLURM_DIR": str(state), "SLURM_CONF": str(state / "slurm.conf"),
                      "HVD_RL_SLURM_CPUS": "4"})
    start = subprocess.run([str(CLUSTER), "start"], env=env, capture_output=True, text=True, timeout=600)
    if start.returncode != 0:
        pytest.fail(f"could not start SLURM:\n{start.stdout}\n{start.stderr}")
    yield env
    subprocess.run([str(CLUSTER), "stop"], env=env, capture_output=True, timeout=120)


def test_slurm_array_of_two_workers_runs_a_pruned_study_to_its_budget(slurm_4cpu, tmp_path):
    spec = sweep_file(tmp_path, "arr", trials="6", pruner='"median"', startup_trials="2",
                      overrides='["ppo.total_timesteps=4096", "ppo.num_steps=64", "logging.tensorboard=false", '
                                '"logging.console=false"]',
                      space={'"ppo.learning_rate"': "{ log_uniform = [1e-5, 3e-2] }"})
    study = tmp_path / "study"
    script = tmp_path / "sweep.sbatch"
    check(run([BIN / "hvd-rl", "slurm", "render", "--template", "sweep", "--sweep-file", spec, "--study-dir", study,
               "--workers", "2", "--concurrency", "2", "--cpus-per-task", "1", "--time", "00:20:00", "--out", script],
              timeout=60))
    out = subprocess.run(["sbatch", "--parsable", str(script)], env=slurm_4cpu, cwd=tmp_path, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr
    job = out.stdout.strip().split(";")[0]

    def finished():
        text = subprocess.run(["squeue", "-h", "-j", job], env=slurm_4cpu, capture_output=True, text=True).stdout
        return not text.strip()

    started = time.time()
    overlap = False
    while not finished():
        running = subprocess.run(["squeue", "-h", "-j", job, "-t", "R"], env=slurm_4cpu, capture_output=True,
                                 text=True).stdout.strip().splitlines()
        overlap = overlap or len(running) == 2
        assert time.time() - started < 600, "the sweep array did not finish in 600 s"
        time.sleep(1)
    logs = "\n".join(p.read_text() for p in sorted(tmp_path.glob("slurm-*.out")))
    final = trials(study)
    states = [t["state"] for t in final]
    assert overlap, "the two array tasks never ran at the same time"
    assert sum(s in ("COMPLETE", "PRUNED") for s in states) == 6, (states, logs)
    assert "PRUNED" in states and "COMPLETE" in states, (states, logs)
    assert len({t["number"] for t in final}) == len(final)
    dirs = sorted(p.name for p in (study / "trials").iterdir())
    assert len(dirs) == len(final) - states.count("FAIL")  # one directory per trial that ran
    assert logs.count("study complete") == 2, logs
    for name in ("report.md", "best.toml", "trials.csv", "history.png", "curves.png"):
        assert (study / "report" / name).exists(), name
    best = (study / "report" / "best.toml").read_text()
    assert "learning_rate" in best and "Best trial" in best


def test_seed_study_runs_the_best_trial_and_the_defaults_on_fresh_seeds(tmp_path):
    spec = sweep_file(tmp_path, "seeds", trials="1", ranks="1",
                      overrides='["ppo.total_timesteps=2048", "ppo.num_steps=64", "logging.tensorboard=false", '
                                '"logging.console=false"]')
    study = tmp_path / "study"
    check(sweep("create", "--sweep", spec, "--study-dir", study))
    check(sweep("worker", "--study-dir", study, timeout=240))
    best = next(t for t in trials(study) if t["state"] == "COMPLETE")
    check(sweep("seeds", "--study-dir", study, "--seeds", "2", "--first-seed", "1000", timeout=300))
    report = json.loads((study / "report" / "seeds.json").read_text())
    assert report["seeds"] == [1000, 1001] and report["best_trial"] == best["number"]
    assert report["results"]["best"]["params"] == best["params"] and report["results"]["defaults"]["params"] == {}
    for label in ("best", "defaults"):
        assert sorted(report["results"][label]["per_seed"]) == ["1000", "1001"]
        for seed in (1000, 1001):
            run_dir = study / "seeds" / label / f"CartPole-v1-seed{seed}"
            summary = json.loads((run_dir / "summary.json").read_text())
            assert summary["global_step"] == 2048, summary
            assert f"seed = {seed}" in (run_dir / "config.toml").read_text()
    lr = (study / "seeds" / "best" / "CartPole-v1-seed1000" / "config.toml").read_text()
    assert repr(best["params"]["ppo.learning_rate"])[:8] in lr  # the best trial's point, not the default
    assert (study / "report" / "seeds.md").exists() and (study / "report" / "seeds.png").exists()
