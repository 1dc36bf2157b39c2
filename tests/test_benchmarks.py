"""Benchmarks compute what they claim (speed itself is measured by the benchmarks, not asserted)."""
import json

import pytest

from conftest import CARTPOLE, PYTHON, REPO, check, run


def test_throughput_benchmark_machine_limit_and_ratios_are_consistent(tmp_path):
    out = tmp_path / "throughput.json"
    text = check(run([PYTHON, REPO / "benchmarks" / "throughput.py", "--np", "2", "--config", CARTPOLE,
                      "--rounds", "1", "--iterations", "3", "--steps", "64", "--out", out], timeout=400))
    r = json.loads(out.read_text())
    assert r["ranks"] == 2 and r["cores_used"] == 2 and r["update_epochs"] == 4 and len(r["rounds"]) == 1
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
    assert "2 rounds from" in combined
    assert f"2 ranks / (2 x 1 rank)     {r['summary']['weak_scaling']:.2f}" in combined
    assert f"2 ranks / machine limit   {r['summary']['fraction_of_machine_limit']:.2f}" in combined


def test_interleave_benchmark_times_every_layer_of_every_full_forward_pass(tmp_path):
    out = tmp_path / "interleave.json"
    text = check(run([PYTHON, REPO / "benchmarks" / "interleave.py", "--config", CARTPOLE, "--rounds", "2",
                      "--skip", "8", "--out", out], timeout=300))
    r = json.loads(out.read_text())
    conditions = r["conditions"]
    assert list(conditions) == ["back to back", "after spin", "after read", "after sleep", "in rollout"]
    # CartPole's MLP agent: actor torso, critic torso, both heads (Flatten + Linear/Tanh layers)
    layers = list(conditions["back to back"]["layers_ms"])
    assert layers[0].startswith("input + torso.0") and layers[-1] == "outputs to fp32"
    assert "critic (Linear)" in layers and "actor (Linear)" in layers
    assert any(layer.startswith("critic_torso.") for layer in layers)
    for condition in conditions.values():
        # every full forward pass of 2 rounds x 128 steps, minus 8 warm-up passes per round; the
        # rollout's value-only passes (the last observation's value) are not counted
        assert condition["passes"] == 2 * (128 - 8)
        assert list(condition["layers_ms"]) == layers
        assert all(ms > 0 for ms in condition["layers_ms"].values()) and condition["forward_ms"] > 0
    assert r["config"] == "configs/cartpole_ppo.toml" and str(REPO) not in out.read_text()
    assert "vs back to back" in text and "in rollout" in text


def test_allreduce_benchmark_reduces_the_gradient_with_each_compression(tmp_path):
    """benchmarks/allreduce.py --compressions (what compression_allreduce.py runs on 2-8 simulated
    nodes): each compression's row reports the bytes that compression really hands to the
    collectives, and only PowerSGD and top-k spend compute outside them."""
    out = tmp_path / "allreduce.json"
    check(run([PYTHON, REPO / "benchmarks" / "allreduce.py", "--np", "2", "--no-sweep", "--reps", "2",
               "--compressions", "none,fp16,topk,powersgd", "--out", out], timeout=300))
    r = json.loads(out.read_text())
    assert r["rows"] == [] and r["ranks"] == 2
    rows = {row["compression"]: row for row in r["compressed"]}
    assert list(rows) == ["none", "fp16", "topk", "powersgd"]
    dense = r["gradient"]["bytes"]
    assert rows["none"]["bytes_per_rank"] == rows["none"]["dense_bytes"] == dense
    assert rows["fp16"]["bytes_per_rank"] == dense // 2
    # top-k 0.01: a value (4 bytes) and an index (8 bytes) per kept entry, about 3% of the dense bytes
    assert 0.02 * dense < rows["topk"]["bytes_per_rank"] < 0.04 * dense
    # PowerSGD rank 4: the P and Q factors of the weight matrices plus the biases as they are
    assert rows["powersgd"]["bytes_per_rank"] < 0.03 * dense
    for name, row in rows.items():
        assert row["latency_s"] > 0 and row["reps"] == 2 and 0 < row["cpu_busy"] <= 1.5
        assert (row["time_compress_s"] > 0) == (name in ("topk", "powersgd"))
