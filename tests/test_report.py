"""Scaling report: efficiency math, missing points, multi-node, and a small real sweep end to end."""
import json
from pathlib import Path

import pytest

from conftest import BIN, CARTPOLE, PYTHON, REPO, check, read_jsonl, run
from hvd_rl.analysis.report import write_report


def fake_run(directory: Path, mode: str, ranks: int, sps_per_iteration: list[float], batch: int,
             nodes: int = 1, warmup: int = 1, status: str = "ok", oversubscribed: bool = False):
    """A run directory as the trainer writes it, with exactly known throughput per iteration."""
    directory.mkdir(parents=True)
    rows, step = [], 0
    for i, sps in enumerate(sps_per_iteration, start=1):
        step += batch
        t = batch / sps
        rows.append({"iteration": i, "global_step": step, "world_size": ranks, "sps": sps,
                     "time_env": 0.1 * t, "time_inference": 0.2 * t, "time_update": 0.3 * t,
                     "time_allreduce": 0.25 * t, "time_iteration": t})
    (directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (directory / "summary.json").write_text(json.dumps({"topology": {
        "ranks": ranks, "nodes": nodes, "ranks_per_node": ranks // nodes, "threads_per_rank": 1,
        "device": "cpu", "hostnames": [f"node{i}" for i in range(nodes)]}}))
    (directory / "point.json").write_text(json.dumps({"mode": mode, "ranks": ranks, "nodes": nodes,
                                                      "status": status, "warmup_iterations": warmup,
                                                      "oversubscribed": oversubscribed}))


def sweep_dir(tmp_path: Path, points) -> Path:
    root = tmp_path / "sweep"
    root.mkdir()
    plan = []
    for mode, ranks, nodes, sps, present in points:
        name = f"{mode}-r{ranks}" + (f"-n{nodes}" if nodes > 1 else "")
        plan.append({"mode": mode, "ranks": ranks, "nodes": nodes, "name": name})
        if present:
            batch = 1000 * (ranks if mode == "weak" else 4)
            fake_run(root / name, mode, ranks, sps, batch, nodes=nodes, oversubscribed=ranks > 2)
    (root / "sweep.json").write_text(json.dumps({"kind": "hvd_rl.scaling_sweep", "points": plan,
                                                 "machine": {"hostname": "test", "cpus": 2}}))
    return root


def test_efficiency_math_missing_point_and_multi_node(tmp_path):
    root = sweep_dir(tmp_path, [
        ("weak", 1, 1, [999.0, 1000.0, 1000.0], True),   # warm-up iteration excluded
        ("weak", 2, 1, [5.0, 1800.0, 1800.0], True),
        ("weak", 4, 2, [5.0, 3000.0, 3000.0], True),     # two nodes
        ("weak", 8, 2, None, False),                      # planned, never ran
        ("strong", 1, 1, [1.0, 800.0, 800.0], True),
        ("strong", 2, 1, [1.0, 1200.0, 1200.0], True),
    ])
    out = tmp_path / "report"
    write_report([str(root)], str(out))
    data = json.loads((out / "report.json").read_text())
    by_name = {p["name"]: p for p in data["points"]}
    assert by_name["weak-r1"]["global_sps"] == pytest.approx(1000.0)
    assert by_name["weak-r2"]["efficiency"] == pytest.approx(1800 / (2 * 1000))
    assert by_name["weak-r4-n2"]["efficiency"] == pytest.approx(3000 / (4 * 1000))
    assert by_name["weak-r4-n2"]["nodes"] == 2 and by_name["weak-r4-n2"]["per_rank_sps"] == pytest.approx(750)
    assert by_name["strong-r2"]["efficiency"] == pytest.approx(1200 / (2 * 800))
    assert by_name["weak-r8-n2"]["status"] == "missing (never ran)" and by_name["weak-r8-n2"]["efficiency"] is None
    text = (out / "report.md").read_text()
    assert "| weak | 8 | 2 |" in text and "missing (never ran)" in text  # marked, not dropped
    assert "| weak | 4 | 2 | 2 | 1 | cpu |" in text and "node0, node1" in text
    assert "(oversubscribed)" in text
    for png in ("scaling.png", "phases.png"):
        assert (out / png).stat().st_size > 10_000


def test_single_rank_and_baseline_without_one_rank(tmp_path):
    run_dir = tmp_path / "only"
    fake_run(run_dir, "weak", 1, [10.0, 500.0], 512)
    out = tmp_path / "r1"
    write_report([str(run_dir)], str(out))
    (point,) = json.loads((out / "report.json").read_text())["points"]
    assert point["efficiency"] == pytest.approx(1.0) and point["global_sps"] == pytest.approx(500.0)

    root = sweep_dir(tmp_path, [("strong", 2, 1, [1.0, 1000.0], True), ("strong", 4, 1, [1.0, 1500.0], True)])
    out = tmp_path / "r2"
    write_report([str(root)], str(out))
    data = json.loads((out / "report.json").read_text())
    assert "no 1-rank point" in data["efficiency_baselines"]["strong"]
    assert {p["ranks"]: p["efficiency"] for p in data["points"]}[4] == pytest.approx(1500 * 2 / (4 * 1000))


def test_report_rejects_unknown_input(tmp_path):
    (tmp_path / "x.json").write_text("{}")
    result = run([BIN / "hvd-rl", "report", tmp_path / "x.json", "--out", tmp_path / "o"], timeout=60)
    assert result.returncode == 2 and "not an allreduce or env-throughput result" in result.stdout


def test_small_real_sweep_end_to_end_matches_raw_jsonl(tmp_path):
    sweep = tmp_path / "sweep"
    check(run([PYTHON, REPO / "benchmarks" / "scaling.py", "sweep", "--out", sweep, "--config", CARTPOLE,
               "--ranks", "1", "2", "--modes", "weak", "strong", "--warmup", "1", "--iterations", "2",
               "--strict"], timeout=600))
    check(run([PYTHON, REPO / "benchmarks" / "allreduce.py", "--np", "2", "--max-size", str(1 << 20),
               "--reps", "3", "--out", sweep / "allreduce.json"], timeout=300))
    out = tmp_path / "report"
    check(run([BIN / "hvd-rl", "report", sweep, "--out", out], timeout=120))
    data = json.loads((out / "report.json").read_text())
    assert {(p["mode"], p["ranks"]) for p in data["points"]} == {("weak", 1), ("weak", 2), ("strong", 1), ("strong", 2)}
    text = (out / "report.md").read_text()
    for p in data["points"]:
        rows = read_jsonl(Path(p["run_dir"]) / "metrics.jsonl")
        assert len(rows) == 3 and p["measured_iterations"] == 2
        measured = rows[1:]
        batch = rows[1]["global_step"] - rows[0]["global_step"]
        expected = batch * len(measured) / sum(r["time_iteration"] for r in measured)
        assert p["global_sps"] == pytest.approx(expected, rel=1e-12)
        assert p["phases_s"]["time_update"] == pytest.approx(sum(r["time_update"] for r in measured) / 2)
        assert f"{expected:,.1f}" in text  # the table shows the same number
    strong = {p["ranks"]: p for p in data["points"] if p["mode"] == "strong"}
    assert strong[2]["global_batch"] == strong[1]["global_batch"]  # strong: the global batch is fixed
    assert strong[2]["efficiency"] == pytest.approx(strong[2]["global_sps"] / (2 * strong[1]["global_sps"]))
    assert data["allreduce"][0]["rows"][0]["bytes"] == 4096
    assert (out / "allreduce.png").exists() and (out / "scaling.png").exists()
