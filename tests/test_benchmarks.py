"""Benchmarks compute what they claim (speed itself is measured by the benchmarks, not asserted)."""
import json

import pytest

from conftest import CARTPOLE, PYTHON, REPO, check, run


def test_throughput_benchmark_ceiling_and_fraction_are_consistent(tmp_path):
    out = tmp_path / "throughput.json"
    text = check(run([PYTHON, REPO / "benchmarks" / "throughput.py", "--np", "2", "--config", CARTPOLE,
                      "--set", "logging.tensorboard=false", "--rounds", "2", "--steps", "64",
                      "--out", out], timeout=300))
    r = json.loads(out.read_text())
    assert r["ranks"] == 2 and r["update_epochs"] == 4
    implied = 1 / (1 / r["env_sps"] + r["update_epochs"] / r["learner_samples_per_s"] + 1 / r["inference_sps"])
    assert r["ceiling_sps"] == pytest.approx(implied)
    assert r["ceiling_sps"] < min(r["env_sps"], r["inference_sps"], r["learner_samples_per_s"] / 4)
    assert r["fraction_of_ceiling"] == pytest.approx(r["trainer_sps"] / r["ceiling_sps"])
    assert set(r["trainer_phases_s"]) == {"time_env", "time_inference", "time_update", "time_allreduce",
                                          "time_iteration"}
    assert "trainer / ceiling" in text
