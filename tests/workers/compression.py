"""Worker: each rank's own gradients through PowerSGD / top-k, against the exact average.

usage: compression.py [RUN_DIR]   (under mpirun -np N); rank 0 prints one JSON line per rank.
RUN_DIR: where the per-rank checkpoint files go (a shared directory); without it those checks are left out.
"""
import json

import torch

from hvd_rl.runtime import distributed as dist
from hvd_rl.runtime.compression import PowerSGD, TopK

topo = dist.init()
torch.manual_seed(0)
shapes = [(32, 3, 4, 4), (32,), (64, 48), (10, 64)]  # a conv kernel, a bias, two matrices
params = [torch.nn.Parameter(torch.zeros(s, dtype=torch.float64)) for s in shapes]


def own_grads(step: int, rank: int | None = None) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + (topo.rank if rank is None else rank))
    return [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]


def average_over_ranks(per_rank: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """The exact average, summed here in rank order: no collective of the code under test."""
    return [sum(ts) / topo.size for ts in zip(*per_rank)]


def gathered(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Every rank's tensors (to average them here, outside the compressors' reductions)."""
    return dist.allgather_object([t.clone() for t in tensors], name="test.gather")


def exact_average(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    return average_over_ranks(gathered(grads))


def run(compressor, steps: int = 4, forget: bool = False):
    """Per step, max |compressed average - exact average of (gradient + the residual held before)|;
    and the error-feedback ledger: sum of the compressed averages + the ranks' mean residual
    minus the sum of the exact averages of the raw gradients (0: nothing lost, only delayed)."""
    errors = []
    applied = [torch.zeros(s, dtype=torch.float64) for s in shapes]
    wanted = [torch.zeros(s, dtype=torch.float64) for s in shapes]
    for step in range(steps):
        grads = own_grads(step)
        before = {i: r.clone() for i, r in compressor.residuals.items()}
        with_residual = [g + before.get(i, torch.zeros_like(g)) for i, g in enumerate(grads)]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        compressor.reduce()
        if forget:  # the control: no error feedback
            compressor.reset_residuals()
        errors.append(max(float((p.grad - e).abs().max()) for p, e in zip(params, exact_average(with_residual))))
        # What every rank's raw gradients average to, regenerated here from their seeds.
        raw = average_over_ranks([own_grads(step, rank) for rank in range(topo.size)])
        for a, w, p, g in zip(applied, wanted, params, raw):
            a += p.grad
            w += g
    held = exact_average([compressor.residuals.get(i, torch.zeros(s, dtype=torch.float64)) for i, s in enumerate(shapes)])
    ledger = max(float((a + h - w).abs().max()) for a, h, w in zip(applied, held, wanted))
    return errors, ledger


full, _ = run(PowerSGD(params, rank=64, seed=3, min_compression_rate=0))  # every matrix compressed
low, low_ledger = run(PowerSGD(params, rank=2, seed=3))
dense, _ = run(TopK(params, ratio=1.0))
sparse, sparse_ledger = run(TopK(params, ratio=0.05))
_, forgetful_ledger = run(TopK(params, ratio=0.05), forget=True)


def resumed_equals_uninterrupted(make) -> bool:
    """4 steps in one go, against 2 steps, the state through a checkpoint file, 2 more steps in a
    new compressor: the same gradients bit for bit (float32, as training runs)."""
    import io

    params32 = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    results = []
    for split in (None, 2):
        compressor, out = make(params32), []
        for step in range(4):
            if step == split:
                buffer = io.BytesIO()
                torch.save(compressor.state_dict(), buffer)
                buffer.seek(0)
                compressor = make(params32)
                compressor.load_state_dict(torch.load(buffer, weights_only=True))
            for p, g in zip(params32, own_grads(step)):
                p.grad = g.float()
            compressor.reduce()
            out.append([p.grad.clone() for p in params32])
        results.append(out)
    return all(torch.equal(a, b) for sa, sb in zip(*results) for a, b in zip(sa, sb))


def sgd_steps(compressor, params32, first: int, count: int) -> None:
    """Steps first..first+count-1: each rank's own gradients, compressed and reduced, SGD."""
    for step in range(first, first + count):
        for p, g in zip(params32, own_grads(step)):
            p.grad = g.float()
        compressor.reduce()
        with torch.no_grad():
            for p in params32:
                p -= 0.1 * p.grad


def resumed_from_rank_files_equals_uninterrupted(make, run_dir: str) -> dict:
    """The runtime's own per-rank files (checkpointing.save_rank_state / restore_rank_state, with
    their manifests): 3 SGD steps, a checkpoint, 3 more; against fresh compressors restored from the
    files doing the same 3: parameters and residuals bit for bit, on every rank (all ranks' digests
    compared). Also: a damaged file on one rank makes every rank start its residuals at zero."""
    from pathlib import Path

    from hvd_rl.runtime.checkpointing import rank_file, restore_rank_state, save_rank_state

    device = torch.device("cpu")
    params32 = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    compressor = make(params32)
    sgd_steps(compressor, params32, 0, 3)
    save_rank_state(run_dir, 3, topo.rank, topo.size, device, [compressor])
    at_checkpoint = [p.detach().clone() for p in params32]
    sgd_steps(compressor, params32, 3, 3)
    uninterrupted = [p.detach().clone() for p in params32], {i: r.clone() for i, r in compressor.residuals.items()}

    resumed_params = [torch.nn.Parameter(t.clone()) for t in at_checkpoint]
    resumed = make(resumed_params)
    restored, note = restore_rank_state(run_dir, 3, topo.size, device, [resumed])
    held_after_restore = len(resumed.residuals)
    sgd_steps(resumed, resumed_params, 3, 3)
    same = (all(torch.equal(a, b) for a, b in zip(uninterrupted[0], resumed_params))
            and uninterrupted[1].keys() == resumed.residuals.keys()
            and all(torch.equal(uninterrupted[1][i], resumed.residuals[i]) for i in uninterrupted[1]))
    digest = hash(tuple(float(p.sum()) for p in resumed_params))
    digests = dist.allgather_object(digest, name="test.digests")

    if topo.rank == 1:  # one rank's file damaged: nobody uses its own
        path = rank_file(run_dir, 1)
        path.write_bytes(path.read_bytes()[:-10])
    damaged = make([torch.nn.Parameter(t.clone()) for t in at_checkpoint])
    damaged_restored, damaged_note = restore_rank_state(run_dir, 3, topo.size, device, [damaged])
    return {"restored": restored, "note": note, "held_after_restore": held_after_restore, "same": same,
            "identical_on_all_ranks": len(set(digests)) == 1,
            "damaged_restored": damaged_restored, "damaged_note": damaged_note,
            "damaged_residuals": len(damaged.residuals), "files": sorted(p.name for p in Path(run_dir).rglob("rank*") if p.is_file())}


def topk_deterministic_steps() -> bool:
    """K top-k steps of SGD under torch.use_deterministic_algorithms: every rank ends with the same
    parameter bytes (the sparse parts are summed rank after rank, never by an atomic scatter)."""
    torch.use_deterministic_algorithms(True)
    try:
        params32 = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
        sgd_steps(TopK(params32, ratio=0.05), params32, 0, 5)
        mine = b"".join(p.detach().numpy().tobytes() for p in params32)
        return len(set(dist.allgather_object(mine, name="test.topk_bytes"))) == 1
    finally:
        torch.use_deterministic_algorithms(False)


import sys  # noqa: E402

rank_dir = sys.argv[1] if len(sys.argv) > 1 else None
files = ({"powersgd_files": resumed_from_rank_files_equals_uninterrupted(lambda ps: PowerSGD(ps, rank=2, seed=3),
                                                                          f"{rank_dir}/powersgd"),
          "topk_files": resumed_from_rank_files_equals_uninterrupted(lambda ps: TopK(ps, ratio=0.05),
                                                                     f"{rank_dir}/topk")}
         if rank_dir else {})

row = {"rank": topo.rank, **files, "topk_deterministic": topk_deterministic_steps(), "powersgd_full": full, "powersgd_low": low, "powersgd_ledger": low_ledger,
       "topk_dense": dense, "topk_sparse": sparse, "topk_ledger": sparse_ledger,
       "no_feedback_ledger": forgetful_ledger,
       "powersgd_resume_exact": resumed_equals_uninterrupted(lambda ps: PowerSGD(ps, rank=2, seed=3)),
       "topk_resume_exact": resumed_equals_uninterrupted(lambda ps: TopK(ps, ratio=0.05))}
# Gathered to rank 0, which prints them: lines written by several ranks at once can interleave.
rows = dist.allgather_object(row, name="test.rows")
if topo.rank == 0:
    print("\n".join(json.dumps(r) for r in rows), flush=True)
