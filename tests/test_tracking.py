"""Experiment tracking with W&B in offline mode (no network): rank 0 alone writes one W&B run whose
offline files hold the scalars TensorBoard gets at the same global steps, the resolved config and
the topology; every later start in the run directory (a preemption's requeue, a crash's rerun)
continues that W&B run on one step axis, and a rerun with nothing left to do leaves no W&B run."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from wandb.proto import wandb_internal_pb2

from conftest import QUICK, check, finish, mpirun_cmd, read_jsonl, run, start, train_cmd, wait_for_iterations

BLOCK = 32768  # the .wandb file is a LevelDB-style log: 7-byte header, then 32 KiB blocks of records
PREEMPTED = 75
# One iteration of QUICK on 2 ranks: 2 ranks x env.num_envs=2 x ppo.num_steps=32 environment steps.
STEPS_PER_ITERATION = 2 * 2 * 32

# What a PPO iteration row of metrics.jsonl is charted as (TensorBoard and W&B), written out here
# rather than computed with the writer's own function: a metric that goes missing, is renamed or
# lands in another group fails the test.
PPO_TAGS = {
    "charts/world_size": "world_size", "charts/sps": "sps", "charts/episodic_return_mean": "episodic_return_mean",
    "charts/episodic_length_mean": "episodic_length_mean", "charts/episodes": "episodes",
    "charts/learning_rate": "learning_rate",
    "losses/sps_per_rank": "sps_per_rank", "losses/policy_loss": "policy_loss", "losses/value_loss": "value_loss",
    "losses/entropy": "entropy", "losses/old_approx_kl": "old_approx_kl", "losses/clipfrac": "clipfrac",
    "losses/explained_variance": "explained_variance", "losses/approx_kl": "approx_kl",
    "losses/epochs_run": "epochs_run", "losses/grad_norm": "grad_norm", "losses/collectives": "collectives",
    "losses/comm_bytes": "comm_bytes", "losses/compression_ratio": "compression_ratio",
    "time/time_env": "time_env", "time/time_inference": "time_inference", "time/time_update": "time_update",
    "time/time_allreduce": "time_allreduce", "time/time_wait": "time_wait", "time/time_compress": "time_compress",
    "time/time_iteration": "time_iteration",
    **{f"ranks/{name}/rank{rank}": (f"{name}_by_rank", rank) for rank in (0, 1)
       for name in ("time_wait", "time_busy", "env_steps_per_busy_s", "cpu_util", "page_faults")},
}
W_AND_B_OWN = {"global_step", "_step", "_runtime", "_timestamp"}  # keys W&B adds to every history row


def wandb_records(path: Path) -> list[wandb_internal_pb2.Record]:
    """Every record of an offline run's .wandb file (what `wandb sync` uploads). wandb 0.31 ships
    no Python reader for it (the sync is wandb-core's Go code); the protobuf messages are public."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", "not a W&B run file"
    records, pending, pos = [], b"", 7
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a record header is padding
            pos += BLOCK - pos % BLOCK
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:  # a whole record
            records.append(chunk)
        elif kind == 2:  # first, middle and last pieces of a record spanning blocks
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            records.append(pending + chunk)
    parsed = []
    for raw in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        parsed.append(record)
    return parsed


def offline_runs(run_dir: Path) -> list[Path]:
    """One .wandb file per process start, oldest first (the folder name starts with its start time)."""
    return sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))


def run_record(records) -> wandb_internal_pb2.RunRecord:
    return next(r.run for r in records if r.WhichOneof("record_type") == "run")


def history(records) -> list[dict]:
    rows = []
    for r in records:
        if r.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item})
    return rows


def tensorboard_scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def expected_value(metric: dict, source) -> float:
    return metric[source[0]][source[1]] if isinstance(source, tuple) else metric[source]


def test_offline_run_holds_tensorboards_scalars_config_and_topology_and_a_rerun_continues_it(tmp_path):
    run_dir = tmp_path / "cartpole"
    sets = [s for s in QUICK if not s.startswith("logging.tensorboard")] + ["checkpoint.every=2"]
    tracking = ["logging.wandb=true", "logging.wandb_group=study-1", "logging.wandb_tags=[\"smoke\", \"cpu\"]"]
    check(run(mpirun_cmd(2, *train_cmd(run_dir, *sets, "ppo.total_timesteps=384", *tracking)), timeout=300))
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    files = offline_runs(run_dir)
    assert len(files) == 1 and files[0].name == f"run-{run_id}.wandb"  # rank 0 alone
    records = wandb_records(files[0])
    first = run_record(records)
    assert first.run_id == run_id and first.run_group == "study-1" and list(first.tags) == ["smoke", "cpu"]
    config = {item.key: json.loads(item.value_json) for item in first.config.update}
    assert config["ppo"]["total_timesteps"] == 384 and config["env"]["id"] == "CartPole-v1"
    assert config["topology"]["ranks"] == 2 and config["topology"]["nodes"] == 1

    # W&B and TensorBoard: exactly the tags PPO_TAGS names, with metrics.jsonl's values, at its steps
    rows = history(records)
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    steps = [m["global_step"] for m in metrics]
    assert steps == [row["global_step"] for row in rows] == [row["_step"] for row in rows] == [128, 256, 384]
    board = tensorboard_scalars(run_dir)
    assert set(board) == set(PPO_TAGS)
    for row, metric in zip(rows, metrics):
        assert set(row) - W_AND_B_OWN == set(PPO_TAGS)
        for tag, source in PPO_TAGS.items():
            value = expected_value(metric, source)
            assert row[tag] == pytest.approx(value), tag
            assert board[tag][metric["global_step"]] == pytest.approx(value, rel=1e-6), tag  # float32 events
    summary_items = {item.key: json.loads(item.value_json) for r in records
                     if r.WhichOneof("record_type") == "summary" for item in r.summary.update}
    assert summary_items["status"] == "completed" and summary_items["parameters_identical"] is True

    # A rerun after a crash (here: as if it died before iteration 3's checkpoint) resumes from
    # iteration 2 and runs iteration 3 again. W&B cannot replace a logged row: the rerun leaves
    # step 384 as first logged, so the run's steps still rise strictly.
    for name in ("ckpt_00000003.pt", "ckpt_00000003.json", "latest.pt"):
        (run_dir / "checkpoints" / name).unlink()
    out = check(run(mpirun_cmd(2, *train_cmd(run_dir, *sets, "ppo.total_timesteps=640", *tracking,
                                             extra=("--resume", "auto"))), timeout=300))
    assert "at iteration 2, global step 256" in out
    assert "W&B already holds global steps up to 384" in out
    assert [m["global_step"] for m in read_jsonl(run_dir / "metrics.jsonl")] == [128, 256, 384, 512, 640]
    assert (run_dir / "wandb_run_id").read_text().strip() == run_id
    files = offline_runs(run_dir)
    assert len(files) == 2 and all(f.name == f"run-{run_id}.wandb" for f in files)
    resumed = history(wandb_records(files[1]))
    assert [row["_step"] for row in resumed] == [row["global_step"] for row in resumed] == [512, 640]
    assert sorted(board["charts/sps"]) == [128, 256, 384]  # TensorBoard purges and rewrites instead
    assert sorted(tensorboard_scalars(run_dir)["charts/sps"]) == [128, 256, 384, 512, 640]


def test_preempted_twice_offline_run_syncs_as_one_run_on_one_step_axis(tmp_path):
    """Run, preempt, resume, preempt, resume, complete: every start writes its own offline folder
    (W&B makes one per process); `wandb sync` uploads them in start-time order into one run when
    they share the id and say resume, and keeps each row's logged `_step` (wandb-core's sender
    takes an explicit `_step` as is). Offline, W&B's own step counter restarts at 0 in every
    process, so the rows must carry global_step as their `_step`."""
    run_dir = tmp_path / "cartpole"
    sets = [*QUICK, "ppo.total_timesteps=2560", "ppo.update_epochs=40", "checkpoint.every=1000",
            "logging.wandb=true"]
    for start_number in range(3):
        proc = start(mpirun_cmd(2, *train_cmd(run_dir, *sets, extra=("--resume", "auto") if start_number else ())))
        if start_number < 2:
            rows_before = len(read_jsonl(run_dir / "metrics.jsonl")) if start_number else 0
            wait_for_iterations(run_dir, rows_before + 2, proc, timeout=240)
            (run_dir / "stop.request").touch()
        code, out = finish(proc, timeout=300)
        assert code == (PREEMPTED if start_number < 2 else 0), out[-3000:]
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    files = offline_runs(run_dir)
    assert [f.name for f in files] == [f"run-{run_id}.wandb"] * 3
    runs = [run_record(wandb_records(f)) for f in files]
    assert all(r.run_id == run_id and r.resume for r in runs)  # so the server appends to one run
    assert [r.start_time.ToNanoseconds() for r in runs] == sorted(r.start_time.ToNanoseconds() for r in runs)

    per_start = [history(wandb_records(f)) for f in files]
    assert all(per_start)  # each start logged some of the run
    union = [row for rows in per_start for row in rows]
    steps = [m["global_step"] for m in read_jsonl(run_dir / "metrics.jsonl")]
    assert steps == [STEPS_PER_ITERATION * i for i in range(1, 2560 // STEPS_PER_ITERATION + 1)]
    # W&B's step axis = the run's global steps: no reset, duplicate or gap across the three starts
    assert [row["_step"] for row in union] == [row["global_step"] for row in union] == steps

    # A rerun of the finished run has nothing to do: it must not leave an empty W&B run behind.
    out = check(run(mpirun_cmd(2, *train_cmd(run_dir, *sets, extra=("--resume", "auto"))), timeout=300))
    assert "nothing to do" in out
    assert offline_runs(run_dir) == files and len(list((run_dir / "wandb").glob("offline-run-*"))) == 3


def test_tracking_settings_are_checked_before_any_rank_starts(tmp_path):
    for setting, expect in (("logging.wandb_mode=\"cloud\"", "logging.wandb_mode must be one of"),
                            ("logging.wandb_project=\"my project!\"", "logging.wandb_project must be")):
        result = run(train_cmd(tmp_path / "x", *QUICK, "logging.wandb=true", setting), timeout=120)
        assert result.returncode == 2 and expect in result.stdout, result.stdout
        assert not (tmp_path / "x" / "wandb").exists()
