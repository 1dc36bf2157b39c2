"""PowerSGD and top-k gradient compression (hvd_rl/runtime/compression.py) on real ranks, in float64."""
import json

import torch

from conftest import PYTHON, REPO, check, mpirun_cmd, run

ROUNDING = 1e-12  # float64 sums of a few thousand terms of order 1


def _rows(np_: int, run_dir) -> list[dict]:
    out = check(run(mpirun_cmd(np_, PYTHON, REPO / "tests" / "workers" / "compression.py", run_dir), timeout=180))
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_compression_exactness_and_error_feedback_on_three_ranks(tmp_path):
    rows = _rows(3, tmp_path)
    assert sorted(r["rank"] for r in rows) == [0, 1, 2]
    for r in rows:
        assert max(r["powersgd_full"]) < ROUNDING  # full rank: the exact average
        assert max(r["topk_dense"]) < ROUNDING  # ratio 1: the exact average
        assert min(r["powersgd_low"]) > 0.1 and min(r["topk_sparse"]) > 0.1  # real compression drops a lot...
        assert r["powersgd_ledger"] < ROUNDING and r["topk_ledger"] < ROUNDING  # ...and carries all of it
        assert r["no_feedback_ledger"] > 0.1  # the control: without the residuals it is lost
        assert r["powersgd_resume_exact"] and r["topk_resume_exact"]  # state through a checkpoint: bitwise
        assert r["topk_deterministic"]  # K top-k SGD steps: the same parameter bytes on every rank
        for kind in ("powersgd_files", "topk_files"):  # through the runtime's per-rank files
            f = r[kind]
            assert f["files"] == [f"rank{i:05d}.{ext}" for i in range(3) for ext in ("json", "pt")]
            assert f["restored"] and f["held_after_restore"] > 0 and f["note"] == "compression residuals and state restored"
            assert f["same"] and f["identical_on_all_ranks"]  # parameters and residuals == uninterrupted
            assert not f["damaged_restored"] and f["damaged_residuals"] == 0  # rank 1's file damaged: all reset
            assert "rank00001.pt is truncated or damaged" in f["damaged_note"]
    shared = [{k: v for k, v in r.items() if k not in ("rank", "powersgd_files", "topk_files")} for r in rows]
    assert len({json.dumps(r) for r in shared}) == 1  # same on every rank


def test_compressor_state_follows_the_parameters_device_and_dtype():
    """A checkpoint is CPU tensors (map_location='cpu'); a compressor whose parameters live elsewhere
    (here the 'meta' device and float16 stand in for CUDA) holds what it loads on their device and
    dtype, and saves CPU tensors whatever it holds. Also: top-k builds its indices on that device."""
    from hvd_rl.runtime.compression import PowerSGD, TopK, _sum_sparse_by_rank

    cpu_params = [torch.nn.Parameter(torch.ones(8, 6)), torch.nn.Parameter(torch.ones(6))]
    saved = {"residuals": {0: torch.full((8, 6), 0.5, dtype=torch.float64)}, "q": {0: torch.eye(6, 2)}}
    for device, dtype in (("meta", torch.float32), ("cpu", torch.float16)):
        params = [torch.nn.Parameter(torch.empty(8, 6, device=device, dtype=dtype)),
                  torch.nn.Parameter(torch.empty(6, device=device, dtype=dtype))]
        compressor = PowerSGD(params, rank=2)
        compressor.load_state_dict(saved)
        assert compressor.residuals[0].device.type == device and compressor.residuals[0].dtype == dtype
        assert compressor.q[0].device.type == device and compressor.q[0].dtype == dtype
    on_cpu = PowerSGD(cpu_params, rank=2)
    on_cpu.load_state_dict(saved)
    state = on_cpu.state_dict()
    assert all(t.device.type == "cpu" for part in ("residuals", "q") for t in state[part].values())
    assert state["residuals"][0] is not on_cpu.residuals[0]  # a copy, not the live buffer
    meta = torch.empty(100, device="meta")
    dense = _sum_sparse_by_rank(meta, torch.arange(20, device="meta").view(2, 10), torch.empty(2, 10, device="meta"))
    assert dense.device.type == "meta"
    topk = TopK([torch.nn.Parameter(torch.empty(10, device="meta"))], ratio=1.0)
    assert topk.kept(10) == 10 and topk.kept(1000) == 1000


def test_topk_sums_ranks_in_a_fixed_order_without_atomics():
    """The dense sum of the ranks' sparse parts equals a reference summed rank after rank in float64,
    and repeats bit for bit (index_add_ on CUDA would add in arrival order)."""
    from hvd_rl.runtime.compression import _sum_sparse_by_rank

    g = torch.Generator().manual_seed(0)
    indices = torch.stack([torch.randperm(1000, generator=g)[:50].sort().values for _ in range(4)])
    values = torch.randn(4, 50, generator=g, dtype=torch.float64)
    reference = torch.zeros(1000, dtype=torch.float64)
    for r in range(4):
        for i, v in zip(indices[r].tolist(), values[r].tolist()):
            reference[i] += v
    once = _sum_sparse_by_rank(reference, indices, values)
    assert torch.equal(once, reference) and torch.equal(once, _sum_sparse_by_rank(reference, indices, values))


def test_compressed_training_counts_bytes_and_resumes_with_its_residuals(tmp_path):
    """2 ranks of CartPole PPO under each compression: identical parameters, the bytes each rank
    sent (comm_bytes) against the uncompressed gradient, and the error-feedback state through a
    checkpoint: in each rank's own file (not rank 0's), restored at the same rank count, residuals
    restarting at zero on another. (Parameters and residuals against an uninterrupted run, bit for
    bit, through the same files: test_compression_exactness_and_error_feedback_on_three_ranks.)"""
    import math

    from conftest import QUICK, read_jsonl, train_cmd
    from hvd_rl.runtime.checkpoint import load_checkpoint

    updates_per_iteration = 2 * 2  # QUICK: update_epochs x num_minibatches
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
        summary = json.loads((run_dir / "summary.json").read_text())
        communication = summary["communication"]
        assert communication["compression"] == compression and communication["compression_ratio"] >= min_ratio
        gradient_bytes = summary["gradient_bytes"]
        if compression == "none":
            assert all(r["comm_bytes"] == updates_per_iteration * gradient_bytes for r in rows)
            continue
        if compression == "topk":  # on the wire: float32 values and int32 indices, k = ceil(ratio x size)
            kept = math.ceil(0.01 * (gradient_bytes // 4))
            assert [r["comm_bytes"] for r in rows] == [updates_per_iteration * kept * (4 + 4)] * len(rows)
        checkpoint = load_checkpoint(run_dir / "checkpoints" / "latest.pt")
        assert "compression" not in checkpoint and "rng" not in checkpoint  # per rank, not in rank 0's file
        files = [torch.load(run_dir / "checkpoints" / "ranks" / f"rank{r:05d}.pt", weights_only=True) for r in (0, 1)]
        assert [f["rank"] for f in files] == [0, 1] and all(f["iteration"] == checkpoint["iteration"] for f in files)
        mine, theirs = (f["compression"][0]["residuals"] for f in files)
        assert mine and not all(torch.equal(mine[k], theirs[k]) for k in mine)  # each rank's own residuals
        assert not torch.equal(files[0]["torch_rng"], files[1]["torch_rng"])  # and its own RNG stream
        out = check(run(mpirun_cmd(2, *train_cmd(run_dir, *sets, "ppo.total_timesteps=512",
                                                  extra=("--resume", "auto"))), timeout=120))
        assert "compression residuals and state restored" in out
        out = check(run(train_cmd(run_dir, *sets, "ppo.total_timesteps=640", extra=("--resume", "auto")),
                        timeout=120))
        assert "compression residuals restarted at zero (2 -> 1 ranks)" in out
        assert read_jsonl(run_dir / "metrics.jsonl")[-1]["global_step"] == 640
    assert len(set(dense.values())) == 1  # the same gradient bytes before compression


def test_elastic_removal_of_a_host_restarts_compression_residuals(tmp_path):
    """Finding 4: Horovod skips state.sync() when hosts were only removed, so the reset must not
    live there: a 3-rank elastic PowerSGD run that loses a host from discovery says its residuals
    restarted at zero, and finishes exactly, with identical parameters on the 2 left."""
    import os

    from conftest import BIN, QUICK, host_discovery, launch_env, read_jsonl, start, finish, train_cmd, wait_for_iterations

    hosts_file, discover = host_discovery(tmp_path, "localhost:1", "127.0.0.1:1", f"{os.uname().nodename}:1")
    run_dir = tmp_path / "run"
    total = 64 * 3 * 2 * 6  # whole iterations of 3 ranks (192 steps) and of 2 (128)
    cmd = [BIN / "horovodrun", "-np", "3", "--min-np", "2", "--max-np", "3", "--host-discovery-script", discover,
           *train_cmd(run_dir, *QUICK, f"ppo.total_timesteps={total}", "distributed.threads_per_rank=1",
                      "distributed.compression=powersgd", "distributed.verify_every=1",
                      "debug.iteration_sleep=0.3", "checkpoint.every=0", extra=("--elastic",))]
    proc = start(cmd, env=launch_env({"HOROVOD_GLOO_TIMEOUT_SECONDS": "20"}))
    wait_for_iterations(run_dir, 2, proc, timeout=180)
    hosts_file.write_text("localhost:1\n127.0.0.1:1\n")
    code, out = finish(proc, timeout=400)
    assert code == 0, out[-4000:]
    assert "elastic reset: now 2 rank(s); compression residuals restarted at zero" in out
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert rows[0]["world_size"] == 3 and rows[-1]["world_size"] == 2 and rows[-1]["global_step"] == total
    assert all(r["parameters_identical"] for r in rows)
