"""Experiment tracking with W&B in offline mode (no network): rank 0 alone writes one W&B run whose
offline files hold the same scalars as TensorBoard at the same global steps, the resolved config and
the topology; `--resume auto` continues the same W&B run id."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from wandb.proto import wandb_internal_pb2

from conftest import QUICK, check, mpirun_cmd, read_jsonl, run, train_cmd
from hvd_rl.runtime.metrics import chart_scalars

BLOCK = 32768  # the .wandb file is a LevelDB-style log: 7-byte header, then 32 KiB blocks of records


def wandb_records(path: Path) -> list[wandb_internal_pb2.Record]:
    """Every record of an offline run's .wandb file (what `wandb sync` uploads)."""
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
    return sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))


def history(records) -> list[dict]:
    rows = []
    for r in records:
        if r.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item})
    return rows


def test_offline_run_holds_tensorboards_scalars_config_and_topology_and_resume_continues_it(tmp_path):
    run_dir = tmp_path / "cartpole"
    tracking = ["logging.wandb=true", "logging.wandb_group=study-1", "logging.wandb_tags=[\"smoke\", \"cpu\"]"]
    check(run(mpirun_cmd(2, *train_cmd(run_dir, *QUICK, "ppo.total_timesteps=384", *tracking)), timeout=300))
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    files = offline_runs(run_dir)
    assert len(files) == 1 and files[0].name == f"run-{run_id}.wandb"  # rank 0 alone
    records = wandb_records(files[0])
    run_record = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run_record.run_id == run_id and run_record.run_group == "study-1" and list(run_record.tags) == ["smoke", "cpu"]
    config = {item.key: json.loads(item.value_json) for item in run_record.config.update}
    assert config["ppo"]["total_timesteps"] == 384 and config["env"]["id"] == "CartPole-v1"
    assert config["topology"]["ranks"] == 2 and config["topology"]["nodes"] == 1

    # the same scalars as TensorBoard, at the same global steps
    rows = [row for row in history(records) if "global_step" in row]
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [row["global_step"] for row in rows] == [m["global_step"] for m in metrics] == [128, 256, 384]
    for row, metric in zip(rows, metrics):
        expected = chart_scalars({k: v for k, v in metric.items() if v is not None})
        assert set(expected) <= set(row)
        assert all(row[key] == pytest.approx(value) for key, value in expected.items())
    summary_items = {item.key: json.loads(item.value_json) for r in records
                     if r.WhichOneof("record_type") == "summary" for item in r.summary.update}
    assert summary_items["status"] == "completed" and summary_items["parameters_identical"] is True

    # a resume (as a SLURM requeue runs it) continues the same W&B run from the checkpoint
    check(run(mpirun_cmd(2, *train_cmd(run_dir, *QUICK, "ppo.total_timesteps=640", *tracking,
                                       extra=("--resume", "auto"))), timeout=300))
    assert (run_dir / "wandb_run_id").read_text().strip() == run_id
    files = offline_runs(run_dir)
    assert len(files) == 2 and all(f.name == f"run-{run_id}.wandb" for f in files)
    resumed = [row["global_step"] for row in history(wandb_records(files[1])) if "global_step" in row]
    assert resumed == [512, 640]


def test_tracking_settings_are_checked_before_any_rank_starts(tmp_path):
    for setting, expect in (("logging.wandb_mode=\"cloud\"", "logging.wandb_mode must be one of"),
                            ("logging.wandb_project=\"my project!\"", "logging.wandb_project must be")):
        result = run(train_cmd(tmp_path / "x", *QUICK, "logging.wandb=true", setting), timeout=120)
        assert result.returncode == 2 and expect in result.stdout, result.stdout
        assert not (tmp_path / "x" / "wandb").exists()
