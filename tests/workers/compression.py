"""Worker: each rank's own gradients through PowerSGD / top-k, against the exact average.

usage: compression.py   (under mpirun -np N); rank 0 prints one JSON line per rank.
"""
import json

import torch

from hvd_rl.runtime import distributed as dist
from hvd_rl.runtime.compression import PowerSGD, TopK

topo = dist.init()
torch.manual_seed(0)
shapes = [(32, 3, 4, 4), (32,), (64, 48), (10, 64)]  # a conv kernel, a bias, two matrices
params = [torch.nn.Parameter(torch.zeros(s, dtype=torch.float64)) for s in shapes]


def own_grads(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + topo.rank)
    return [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]


def exact_average(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    import horovod.torch as hvd
    return [hvd.allreduce(g, op=hvd.Average, name=f"exact.{i}") for i, g in enumerate(grads)]


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
        for a, w, p, g in zip(applied, wanted, params, exact_average(grads)):
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


row = {"rank": topo.rank, "powersgd_full": full, "powersgd_low": low, "powersgd_ledger": low_ledger,
       "topk_dense": dense, "topk_sparse": sparse, "topk_ledger": sparse_ledger,
       "no_feedback_ledger": forgetful_ledger,
       "powersgd_resume_exact": resumed_equals_uninterrupted(lambda ps: PowerSGD(ps, rank=2, seed=3)),
       "topk_resume_exact": resumed_equals_uninterrupted(lambda ps: TopK(ps, ratio=0.05))}
# Gathered to rank 0, which prints them: lines written by several ranks at once can interleave.
rows = dist.allgather_object(row, name="test.rows")
if topo.rank == 0:
    print("\n".join(json.dumps(r) for r in rows), flush=True)
