"""ppo.pipeline = "overlap" (hvd_rl/algorithms/sampler.py): the sampler thread's one-update policy
lag, identical ranks, runs independent of thread timing, preemption. Real ranks, real threads."""
import json
import os
import signal

from conftest import (PYTHON, QUICK, REPO, check, finish, mpirun_cmd, rank_pid, read_jsonl, run, start,
                      train_cmd, wait_for_iterations)
from hvd_rl.runtime.checkpoint import load_checkpoint

WORKER = REPO / "tests" / "workers" / "overlap.py"
PREEMPTED = 75
# The stored log-probabilities were computed step by step on 2 environments, the recomputation on
# the whole 64-sample batch: the same fp32 network on other batch shapes differs by rounding,
# ~1e-7 for CartPole's two-action log-softmax. One update at learning rate 0.01 moves them by
# ~1e-2 or more (the worker prints every gap).
SAME = 1e-5
MOVED = 1e-3


def _gaps(pipeline: str, iterations: int) -> list[list[float]]:
    out = check(run([PYTHON, str(WORKER), pipeline, str(iterations)], timeout=120))
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [r["iteration"] for r in rows] == list(range(1, iterations + 1))
    return [r["gaps"] for r in rows]


def test_overlap_learns_from_the_behaviour_policys_log_probabilities():
    """With overlap, rollout k (k >= 2) was sampled with the weights from before update k - 1 and
    the learner's batch carries exactly those log-probabilities, not the current policy's (a
    pipeline that re-evaluated them with the weights the update starts from fails the second
    assertion). Sync, the control: each rollout comes from the weights its update starts from."""
    overlap = _gaps("overlap", 4)
    assert overlap[0][0] < SAME  # the first rollout is collected synchronously
    for k in range(2, 5):
        behaviour, current = overlap[k - 1][k - 2], overlap[k - 1][k - 1]
        assert behaviour < SAME and current > MOVED, (k, overlap[k - 1])
    sync = _gaps("sync", 3)
    assert all(sync[k][k] < SAME for k in range(3))
    assert sync[1][0] > MOVED


def test_overlap_keeps_ranks_identical_and_runs_do_not_depend_on_thread_timing(tmp_path):
    """Two ranks with overlap: parameters identical on both after every update, and a second run
    ends bit-identical to the first (the sampler's and the learner's timing differ every run)."""
    digests = []
    for name in ("first", "second"):
        run_dir = tmp_path / name
        sets = (*QUICK, "ppo.pipeline=overlap", "ppo.total_timesteps=1024", "distributed.verify_every=1")
        out = check(run(mpirun_cmd(2, *train_cmd(run_dir, *sets)), timeout=180))
        assert "overlapped sampling" in out
        rows = read_jsonl(run_dir / "metrics.jsonl")
        assert rows[-1]["global_step"] == 1024 and all(r["parameters_identical"] for r in rows)
        assert rows[0]["time_sampler_wait"] == 0.0  # the first rollout: collected, not waited for
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["parameters_identical"]
        digests.append(summary["parameter_digests"])
    assert digests[0] == digests[1]


def test_overlap_preempted_checkpoints_and_resumes_to_the_target(tmp_path):
    """SIGTERM on rank 1 while the sampler thread runs: every rank checkpoints the same iteration
    and exits 75; the resume (the rollout that was in flight is discarded: fresh environments,
    a synchronous first rollout) runs every remaining iteration once."""
    run_dir = tmp_path / "run"
    total = 64 * 2 * 30
    sets = (*QUICK, "ppo.pipeline=overlap", f"ppo.total_timesteps={total}", "checkpoint.every=100")
    proc = start(mpirun_cmd(2, *train_cmd(run_dir, *sets, "debug.iteration_sleep=0.2")))
    wait_for_iterations(run_dir, 3, proc, timeout=120)
    os.kill(rank_pid(str(run_dir), 1), signal.SIGTERM)
    code, out = finish(proc, timeout=60)
    assert code == PREEMPTED, out[-3000:]
    marker = json.loads((run_dir / "preempted.json").read_text())
    ckpt = load_checkpoint(run_dir / "checkpoints" / "latest.pt")
    assert ckpt["iteration"] == marker["iteration"] < 30
    assert ckpt["config"]["ppo"]["pipeline"] == "overlap"

    check(run(mpirun_cmd(2, *train_cmd(run_dir, *sets, extra=("--resume", "auto"))), timeout=180))
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["iteration"] for r in rows] == list(range(1, 31))
    assert [r["global_step"] for r in rows] == [128 * i for i in range(1, 31)]
    resumed = rows[marker["iteration"]]  # the first iteration after the resume
    assert resumed["time_sampler_wait"] == 0.0
    assert json.loads((run_dir / "summary.json").read_text())["parameters_identical"]


def test_overlap_refuses_elastic_runs_with_one_line():
    from hvd_rl.config import config_problems, load_config

    cfg = load_config(REPO / "configs" / "cartpole_ppo.toml", ["ppo.pipeline=overlap"])
    assert config_problems(cfg) == []
    (problem,) = config_problems(cfg, elastic=True)
    assert "ppo.pipeline = 'overlap' cannot run elastic" in problem and "\n" not in problem
