"""Observation/return statistics: the parallel-variance merge, and every rank agreeing with one process."""
import json

import numpy as np
import pytest

from conftest import PYTHON, REPO, check, mpirun_cmd, run
from hvd_rl.algorithms.normalize import Moments, RunningNormalizer


def test_pairwise_merge_equals_statistics_of_the_concatenation():
    rng = np.random.default_rng(0)
    data = rng.normal(1e3, 5.0, size=(1000, 4))  # a large mean: the naive sum-of-squares fails here
    total = Moments()
    for chunk in np.array_split(data, [1, 7, 300, 301, 999]):
        total = total.merge(Moments.of(chunk))
    assert total.count == 1000
    np.testing.assert_allclose(total.mean, data.mean(0), rtol=1e-12)
    np.testing.assert_allclose(total.var, data.var(0), rtol=1e-9)


def test_normalizer_is_frozen_until_sync_then_clips(monkeypatch):
    from hvd_rl.runtime import distributed

    monkeypatch.setattr(distributed, "allgather_rows", lambda rows, name: rows)  # a 1-rank world
    norm = RunningNormalizer((2,), clip=5.0)
    x = np.array([[3.0, -3.0]])
    before = norm.normalize(x)
    np.testing.assert_allclose(before, [[3.0, -3.0]], rtol=1e-3)  # neutral prior: mean 0, var 1
    norm.observe(np.array([[2.0, 2.0], [4.0, 4.0]]))
    np.testing.assert_array_equal(norm.normalize(x), before)  # frozen during a rollout
    norm.sync("test")
    np.testing.assert_allclose(norm.normalize(np.array([[3.0, 3.0]])), [[0.0, 0.0]], atol=1e-3)
    assert np.abs(norm.normalize(np.array([[1e6, -1e6]]))).max() == 5.0


def _stats(tmp_path, ranks):
    out = tmp_path / f"norm{ranks}.json"
    check(run(mpirun_cmd(ranks, PYTHON, REPO / "tests" / "workers" / "normalize.py", out), timeout=120))
    return json.loads(out.read_text())


def test_two_ranks_hold_identical_statistics_equal_to_one_process(tmp_path):
    one, two = _stats(tmp_path, 1), _stats(tmp_path, 2)
    a, b = two["states"]
    assert a == b  # bit-identical on every rank (the merge runs in rank order everywhere)
    reference = one["states"][0]
    for key in ("obs", "ret"):
        assert a[key]["count"] == pytest.approx(reference[key]["count"])
        np.testing.assert_allclose(a[key]["mean"], reference[key]["mean"], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(a[key]["m2"], reference[key]["m2"], rtol=1e-10)
    # and they are the statistics of all the data (plus the neutral prior of count 1e-4)
    stats = Moments.from_dict(a["obs"])
    np.testing.assert_allclose(stats.mean, one["expected_mean"], rtol=1e-6)
    np.testing.assert_allclose(stats.var, one["expected_var"], rtol=1e-5)
