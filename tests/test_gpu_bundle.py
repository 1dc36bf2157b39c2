"""benchmarks/gpu (issue 26): the bundle script and the device script's CPU dry run, so the one
command prepared for a lent GPU machine cannot rot: every step runs for real (wheels installed
into a prefix, Horovod from the one build recipe, doctor, the Atari preset on 1 and 2 ranks under
horovodrun --gloo, a --resume auto continuation, the env sweep, the learner alone)."""
import json
import sys

from conftest import REPO, launch_env, run

PYV = f"{sys.version_info.major}.{sys.version_info.minor}"


def test_bundle_refuses_over_its_size_limit(tmp_path):
    out = run([REPO / "benchmarks" / "gpu" / "make_bundle.sh", "--out", tmp_path / "b", "--python-version", PYV,
               "--limit-mib", "1"], timeout=600, env=launch_env())
    assert out.returncode == 1 and "over the 1 MiB limit" in out.stdout, out.stdout[-2000:]


def test_device_script_dry_run_runs_every_step_on_cpu(tmp_path):
    bundle = tmp_path / "bundle"
    made = run([REPO / "benchmarks" / "gpu" / "make_bundle.sh", "--out", bundle, "--python-version", PYV],
               timeout=600, env=launch_env())
    assert made.returncode == 0, made.stdout[-2000:]
    assert any(p.name.startswith("ale_py-") for p in bundle.iterdir()) and (bundle / "horovod-0.28.1.tar.gz").exists()
    out_dir = tmp_path / "out"
    dry = run([REPO / "benchmarks" / "gpu" / "run_on_device.sh", "--cpu-dry-run", "--bundle", bundle],
              timeout=1500, env=launch_env({"OUT": str(out_dir), "HVD_RL_GPU_LAUNCHER": "gloo"}))
    assert dry.returncode == 0, dry.stdout[-3000:]
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["failed_steps"] == [], (summary["failed_steps"], (out_dir / "log.txt").read_text()[-3000:])
    names = {s["step"] for s in summary["steps"]}
    assert {"info", "horovod", "install", "doctor", "learner"} <= names
    runs = {r["run"]: r for r in summary["runs"]}
    assert set(runs) == {"r1_off", "r2_off", "r1_bf16", "r2_bf16", "r2_bf16_resumed", "sweep_2x2", "sweep_2x4",
                         "c_powersgd", "c_powersgd_resumed", "c_topk", "c_topk_resumed"}
    for r in runs.values():
        assert r["status"] == "completed" and r["parameters_identical"] is True and r["sps"] > 0, r
    assert runs["r2_off"]["world_size"] == 2 and runs["r1_bf16"]["precision"] == "bf16"
    assert runs["sweep_2x4"]["env_counts"] == [4, 4]
    resume = summary["resume"]
    assert resume["ok"] and resume["continued_at_iteration"] == 4 and resume["to_step"] > resume["from_step"]
    # compression: stopped after 2 iterations, resumed from each rank's residual file at the 3rd
    assert {k: (v["ok"], v["continued_at_iteration"]) for k, v in summary["compression_resume"].items()} == {
        "c_powersgd": (True, 3), "c_topk": (True, 3)}
    check = summary["compression_check"]
    assert check["ok"] and [s["run"] for s in check["state"]] == ["c_powersgd_resumed", "c_topk_resumed"]
    assert check["topk_sum"]["fixed_order_bitwise_repeatable"]
    assert len(summary["learner"]) == 4 and all(row["learner_samples_per_s"] > 0 for row in summary["learner"])
    back = {p.name for p in out_dir.iterdir()}
    assert {"log.txt", "steps.jsonl", "summary.json", "table.txt", "runs.tar.gz"} <= back and len(back) <= 8
