"""Benchmarks compute what they claim (speed itself is measured by the benchmarks, not asserted)."""
import json

import pytest

from conftest import CARTPOLE, PYTHON, REPO, check, run


def test_throughput_benchmark_machine_limit_and_ratios_are_consistent(tmp_path):
    out = tmp_path / "throughput.json"
    text = check(run([PYTHON, REPO / "benchmarks" / "throughput.py", "--np", "2", "--config", CARTPOLE,
                      "--rounds", "2", "--iterations", "3", "--steps", "64", "--out", out], timeout=400))
    r = json.loads(out.read_text())
    assert r["ranks"] == 2 and r["cores_used"] == 2 and r["update_epochs"] == 4 and len(r["rounds"]) == 2
    for rnd in r["rounds"]:
        p = rnd["probes"]
        core = 1 / (1 / p["env_sps"] + 4 / p["learner_samples_per_s"] + 1 / p["inference_sps"])
        assert rnd["core_ceiling_sps"] == pytest.approx(core)
        assert rnd["machine_limit_sps"] == pytest.approx(2 * core)
        assert rnd["fraction_of_machine_limit"] == pytest.approx(rnd["n_ranks"]["sps"] / (2 * core))
        # the 1-rank runs right before and after the 2-rank run, averaged (drift cancels)
        one_rank = (rnd["one_rank"]["sps"] + rnd["one_rank_after"]["sps"]) / 2
        assert rnd["one_rank_sps"] == pytest.approx(one_rank)
        assert rnd["weak_scaling"] == pytest.approx(rnd["n_ranks"]["sps"] / (2 * one_rank))
        assert rnd["n_ranks"]["iterations"] == rnd["one_rank"]["iterations"] == rnd["one_rank_after"]["iterations"] == 3
        # the hardware's own 2-core efficiency: 2 probe copies and 2 one-rank trainers side by side
        together = [1 / (1 / q["env_sps"] + 4 / q["learner_samples_per_s"] + 1 / q["inference_sps"])
                    for q in rnd["probes_together"]]
        assert len(together) == 2 and rnd["hardware_limit_sps"] == pytest.approx(sum(together))
        assert rnd["fraction_of_hardware_limit"] == pytest.approx(rnd["n_ranks"]["sps"] / sum(together))
        independent = [t["sps"] for t in rnd["trainers_together"]]
        assert len(independent) == 2 and all(t["iterations"] == 3 for t in rnd["trainers_together"])
        assert rnd["independent_scaling"] == pytest.approx(sum(independent) / (2 * one_rank))
        assert rnd["n_ranks"]["runtime_settings"] == {"OMPI_MCA_mpi_yield_when_idle": "1", "HOROVOD_CYCLE_TIME": "1"}
        # per iteration: advantage statistics, 4 epochs x 4 minibatch gradients (epoch controls
        # ride along), the metrics allgather
        assert rnd["n_ranks"]["collectives_per_iteration"] == 1 + 16 + 4 + 1
    assert set(r["summary"]) >= {"machine_limit_sps", "fraction_of_machine_limit", "weak_scaling",
                                 "hardware_efficiency", "independent_scaling", "vs_independent_trainers"}
    assert "/" not in r["config"][:1] and str(REPO) not in out.read_text()  # repository-relative paths
    assert "2 ranks / machine limit" in text and "2 ranks / (2 x 1 rank)" in text
    # --combine: medians over the rounds of several result files (here the same one twice)
    combined = check(run([PYTHON, REPO / "benchmarks" / "throughput.py", "--combine", out, out], timeout=60))
    assert "4 rounds from" in combined
    assert f"2 ranks / (2 x 1 rank)     {r['summary']['weak_scaling']:.2f}" in combined
    assert f"2 ranks / machine limit   {r['summary']['fraction_of_machine_limit']:.2f}" in combined
