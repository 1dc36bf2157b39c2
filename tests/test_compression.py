"""PowerSGD and top-k gradient compression (hvd_rl/runtime/compression.py) on real ranks, in float64."""
import json

import torch

from conftest import PYTHON, REPO, check, mpirun_cmd, run

ROUNDING = 1e-12  # float64 sums of a few thousand terms of order 1


def _rows(np_: int) -> list[dict]:
    out = check(run(mpirun_cmd(np_, PYTHON, REPO / "tests" / "workers" / "compression.py"), timeout=120))
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_compression_exactness_and_error_feedback_on_three_ranks():
    rows = _rows(3)
    assert sorted(r["rank"] for r in rows) == [0, 1, 2]
    for r in rows:
        assert max(r["powersgd_full"]) < ROUNDING  # full rank: the exact average
        assert max(r["topk_dense"]) < ROUNDING  # ratio 1: the exact average
        assert min(r["powersgd_low"]) > 0.1 and min(r["topk_sparse"]) > 0.1  # real compression drops a lot...
        assert r["powersgd_ledger"] < ROUNDING and r["topk_ledger"] < ROUNDING  # ...and carries all of it
        assert r["no_feedback_ledger"] > 0.1  # the control: without the residuals it is lost
        assert r["powersgd_resume_exact"] and r["topk_resume_exact"]  # state through a checkpoint: bitwise
    assert len({json.dumps({k: v for k, v in r.items() if k != "rank"}) for r in rows}) == 1  # same on every rank


def test_compressed_training_counts_bytes_and_resumes_with_its_residuals(tmp_path):
    """2 ranks of CartPole PPO under each compression: identical parameters, the bytes each rank
    sent (comm_bytes) against the uncompressed gradient, and the error-feedback state through a
    checkpoint (same rank count: restored; another: residuals restart at zero, the log says so)."""
    from conftest import QUICK, read_jsonl, train_cmd
    from hvd_rl.runtime.checkpoint import load_checkpoint

    dense = {}
    for compression, min_ratio in (("none", 1.0), ("powersgd", 3.0), ("topk", 20.0)):
        run_dir = tmp_path / compression
        sets = [*QUICK, f"distributed.compression={compression}", "distributed.topk_ratio=0.01",
                "distributed.verify_every=1"]
        check(run(mpirun_cmd(2, *train_cmd(run_dir, *sets, "ppo.total_timesteps=256")), timeout=120))
        rows = read_jsonl(run_dir / "metrics.jsonl")
        assert all(r["parameters_identical"] for r in rows)
        assert all(r["compression_ratio"] >= min_ratio and r["comm_bytes"] > 0 for r in rows)
        dense[compression] = rows[-1]["comm_bytes"] * rows[-1]["compression_ratio"]
        communication = json.loads((run_dir / "summary.json").read_text())["communication"]
        assert communication["compression"] == compression and communication["compression_ratio"] >= min_ratio
        if compression == "none":
            continue
        saved = load_checkpoint(run_dir / "checkpoints" / "latest.pt")["compression"]
        assert saved["world_size"] == 2 and len(saved["by_rank"]) == 2
        mine, theirs = (saved["by_rank"][r][0]["residuals"] for r in (0, 1))
        assert mine and not all(torch.equal(mine[k], theirs[k]) for k in mine)  # each rank's own residuals
        out = check(run(mpirun_cmd(2, *train_cmd(run_dir, *sets, "ppo.total_timesteps=512",
                                                  extra=("--resume", "auto"))), timeout=120))
        assert "compression residuals and state restored" in out
        out = check(run(train_cmd(run_dir, *sets, "ppo.total_timesteps=640", extra=("--resume", "auto")),
                        timeout=120))
        assert "compression residuals restarted at zero (2 -> 1 ranks)" in out
        assert read_jsonl(run_dir / "metrics.jsonl")[-1]["global_step"] == 640
    assert len(set(dense.values())) == 1  # the same gradient bytes before compression
