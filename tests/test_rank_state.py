"""Each rank's own state through a checkpoint (hvd_rl/runtime/checkpointing.py), on real ranks:
per-rank files, a missing one, and checkpoints of format 2 (RNG gathered into rank 0's file)."""
import shutil

import torch

from conftest import QUICK, check, mpirun_cmd, read_jsonl, run, train_cmd
from hvd_rl.runtime.checkpoint import load_checkpoint, save_checkpoint


def _two_rank_run(run_dir, total):
    return check(run(mpirun_cmd(2, *train_cmd(run_dir, *QUICK, f"ppo.total_timesteps={total}",
                                               extra=("--resume", "auto"))), timeout=180))


def test_a_missing_rank_file_reseeds_every_rank_with_one_warning(tmp_path):
    run_dir = tmp_path / "run"
    _two_rank_run(run_dir, 256)
    (run_dir / "checkpoints" / "ranks" / "rank00001.pt").unlink()
    out = _two_rank_run(run_dir, 512)
    assert out.count("warning: per-rank state not restored (rank00001.pt is missing): RNG reseeded") == 1
    assert read_jsonl(run_dir / "metrics.jsonl")[-1]["global_step"] == 512


def test_a_format_2_checkpoint_resumes_with_its_gathered_rng(tmp_path):
    """Runs checkpointed before per-rank files keep their RNG streams at a resume."""
    run_dir = tmp_path / "run"
    _two_rank_run(run_dir, 256)
    ranks_dir = run_dir / "checkpoints" / "ranks"
    saved = [torch.load(ranks_dir / f"rank{r:05d}.pt", weights_only=True) for r in (0, 1)]
    state = load_checkpoint(run_dir / "checkpoints" / "latest.pt")
    state.update(format_version=2, rng={"torch": [s["torch_rng"] for s in saved], "cuda": [None, None]},
                 compression=None)
    shutil.rmtree(ranks_dir)
    for path in (run_dir / "checkpoints").glob("ckpt_*"):
        path.unlink()
    save_checkpoint(run_dir, state, keep=3)
    out = _two_rank_run(run_dir, 512)
    assert "resuming from" in out and "per-rank state not restored" not in out
    assert read_jsonl(run_dir / "metrics.jsonl")[-1]["global_step"] == 512
    assert load_checkpoint(run_dir / "checkpoints" / "latest.pt")["format_version"] == 3
