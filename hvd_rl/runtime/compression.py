"""Gradient compression with error feedback, for slow interconnects: PowerSGD (low rank) and top-k
(sparse), on Horovod's collectives. `distributed.distributed_optimizer` (the one place gradients
are reduced) builds an optimizer around one of these for `distributed.compression = powersgd|topk`;
`none` and `fp16` stay with Horovod's own DistributedOptimizer.

Both keep every rank's parameters identical: what a rank adds to the step is the same on every
rank (an allreduced or allgathered result), while what compression dropped stays behind on the
rank that dropped it, as its residual (error feedback), and is added to its next gradient.

PowerSGD (Vogels et al. 2019; PyTorch's powerSGD_hook): each gradient reshaped to a matrix M
(n x m) plus its residual is approximated by P Q^T with P = M Q (allreduced, averaged,
orthonormalised) and Q = M^T P (allreduced, averaged); Q is kept to warm-start the next step.
Tensors that would not shrink by at least `MIN_COMPRESSION_RATE` (biases, small layers) are
averaged as they are, in one fused allreduce. At full rank P P^T is the identity on the column
space, so the step is the exact average (the ranks' residuals then sum to zero).

Top-k (Stich et al. 2018, DGC without its momentum correction): the gradients plus residuals, as
one vector, keep their k = ratio x size largest entries; values and indices are allgathered and
summed into the dense average. At ratio 1 that is the exact average.

State: PowerSGD's Q is the same on every rank (it is made of averages); the residuals are each
rank's own. Both are checkpointed (`state_dict`, residuals per rank). A resume onto another
number of ranks, or an elastic reset, cannot map residuals to ranks: they restart at zero (what
they held is the last steps' dropped part, not a divergence), Q is kept.
"""
from __future__ import annotations

import math
import time
from typing import Any, Sequence

import torch

import horovod.torch as hvd

MIN_COMPRESSION_RATE = 2.0  # as PyTorch's powerSGD_hook: compress a matrix only if P + Q is <= half of it


class Compressor:
    """Reduces the gradients of `params` in place to the compressed average over all ranks."""

    name = ""

    def __init__(self, params: Sequence[torch.nn.Parameter]):
        self.params = list(params)
        self.residuals: dict[int, torch.Tensor] = {}  # by parameter index: what compression dropped

    def reduce(self) -> int:
        """Collective. Returns the bytes this rank handed to the collectives."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {"residuals": {i: r.clone() for i, r in self.residuals.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.residuals = {int(i): r.clone() for i, r in state.get("residuals", {}).items()}

    def reset_residuals(self) -> None:
        self.residuals.clear()

    def _with_residual(self, index: int, grad: torch.Tensor) -> torch.Tensor:
        residual = self.residuals.get(index)
        return grad if residual is None else grad + residual


class CompressionClock:
    """Seconds of compression compute (everything in `reduce` but the collectives) and gradient
    bytes handed to collectives, by every reduction of this process (metrics: time_compress,
    comm_bytes)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.bytes = 0
        self.dense_bytes = 0  # what the same reductions would have sent uncompressed
        self.collective_seconds = 0.0  # inside reduce(): blocked in Horovod


CLOCK = CompressionClock()


def _collective(fn, *args, **kwargs):
    start = time.perf_counter()
    try:
        return fn(*args, **kwargs)
    finally:
        CLOCK.collective_seconds += time.perf_counter() - start


def _allreduce_average(tensors: list[torch.Tensor], name: str) -> tuple[list[torch.Tensor], int]:
    """One fused allreduce (average) of several tensors; returns them and the bytes sent."""
    if not tensors:
        return [], 0
    flat = torch.cat([t.reshape(-1) for t in tensors])
    flat = _collective(hvd.allreduce, flat, op=hvd.Average, name=name)
    out, offset = [], 0
    for t in tensors:
        out.append(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
    return out, flat.numel() * flat.element_size()


def orthonormalize(matrix: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning `matrix`'s columns (reduced QR). Every rank holds the same
    averaged matrix and uses the same thread count (runtime._agree_on_numerics), so the same Q."""
    return torch.linalg.qr(matrix, mode="reduced").Q


class PowerSGD(Compressor):
    name = "powersgd"

    def __init__(self, params: Sequence[torch.nn.Parameter], rank: int, seed: int = 0,
                 min_compression_rate: float = MIN_COMPRESSION_RATE):
        super().__init__(params)
        self.rank = rank
        self.seed = seed
        self.min_compression_rate = min_compression_rate
        self.q: dict[int, torch.Tensor] = {}  # warm-started right factors, identical on every rank

    def _compressed(self, p: torch.Tensor) -> tuple[int, int] | None:
        """(n, m) of the matrix a parameter is compressed as, or None when it is sent as is."""
        if p.dim() < 2:
            return None
        n, m = p.shape[0], p.numel() // p.shape[0]
        r = min(self.rank, n, m)
        return (n, m) if n * m >= self.min_compression_rate * r * (n + m) else None

    def _initial_q(self, index: int, m: int, r: int, like: torch.Tensor) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)  # the same on every rank
        return orthonormalize(torch.randn(m, r, generator=generator, dtype=like.dtype)).to(like.device)

    def reduce(self) -> int:
        plain, matrices = [], []
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            shape = self._compressed(p)
            (plain if shape is None else matrices).append((i, p, shape))
        ms, qs = [], []
        for i, p, (n, m) in matrices:
            r = min(self.rank, n, m)
            ms.append(self._with_residual(i, p.grad).reshape(n, m))
            q = self.q.get(i)
            qs.append(q if q is not None and q.shape == (m, r) else self._initial_q(i, m, r, p.grad))
        # Two collectives per step: the uncompressed tensors travel with the P factors.
        averaged, sent_p = _allreduce_average([p.grad for _, p, _ in plain] + [mat @ q for mat, q in zip(ms, qs)],
                                              "compression.powersgd_p")
        for (_, p, _), value in zip(plain, averaged):
            p.grad.copy_(value)
        if not matrices:
            return sent_p
        ps = [orthonormalize(x) for x in averaged[len(plain):]]
        qs, sent_q = _allreduce_average([mat.T @ x for mat, x in zip(ms, ps)], "compression.powersgd_q")
        sent = sent_p + sent_q
        for (i, p, _), mat, x, q in zip(matrices, ms, ps, qs):
            approx = x @ q.T
            self.residuals[i] = (mat - approx).reshape(p.shape)
            self.q[i] = q.clone()
            p.grad.copy_(approx.reshape(p.shape))
        return sent

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "q": {i: q.clone() for i, q in self.q.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.q = {int(i): q.clone() for i, q in state.get("q", {}).items()}


class TopK(Compressor):
    name = "topk"

    def __init__(self, params: Sequence[torch.nn.Parameter], ratio: float):
        super().__init__(params)
        self.ratio = ratio

    def reduce(self) -> int:
        items = [(i, p) for i, p in enumerate(self.params) if p.grad is not None]
        if not items:
            return 0
        vectors = [self._with_residual(i, p.grad).reshape(-1) for i, p in items]
        flat = torch.cat(vectors)
        k = max(1, math.ceil(self.ratio * flat.numel()))
        indices = torch.topk(flat.abs(), k, sorted=False).indices if k < flat.numel() else torch.arange(flat.numel())
        indices = indices.sort().values  # a fixed order: every rank sums the gathered entries alike
        values = flat[indices]
        all_values = _collective(hvd.allgather, values, name="compression.topk_values")
        all_indices = _collective(hvd.allgather, indices.to(torch.int32 if flat.numel() < 2 ** 31 else torch.int64),
                                  name="compression.topk_indices")
        dense = torch.zeros_like(flat).index_add_(0, all_indices.long(), all_values) / hvd.size()
        kept = torch.zeros_like(flat).index_copy_(0, indices, values)
        residual = flat - kept
        offset = 0
        for (i, p), v in zip(items, vectors):
            size = v.numel()
            self.residuals[i] = residual[offset:offset + size].view_as(p.grad).clone()
            p.grad.copy_(dense[offset:offset + size].view_as(p.grad))
            offset += size
        return values.numel() * values.element_size() + indices.numel() * (4 if flat.numel() < 2 ** 31 else 8)


class _CompressingOptimizer:
    """Methods of a dynamic subclass of the wrapped optimizer's class (as Horovod builds its
    DistributedOptimizer), with the same synchronize / skip_synchronize contract: gradients
    accumulate over backward passes until `synchronize`, which reduces them once."""

    def __init__(self, params, compressor: Compressor):
        super(self.__class__, self).__init__(params)
        self.compressor = compressor
        self._synchronized = False
        self._skip = False

    def synchronize(self) -> None:
        if not self._synchronized:
            start, blocked = time.perf_counter(), CLOCK.collective_seconds
            CLOCK.bytes += self.compressor.reduce()
            CLOCK.dense_bytes += sum(p.grad.numel() * p.grad.element_size() for p in self.compressor.params
                                     if p.grad is not None)
            CLOCK.seconds += time.perf_counter() - start - (CLOCK.collective_seconds - blocked)
            self._synchronized = True

    def skip_synchronize(self):
        import contextlib

        @contextlib.contextmanager
        def skipping():
            self._skip = True
            try:
                yield
            finally:
                self._skip = False
        return skipping()

    def step(self, closure=None):
        if not self._skip:
            self.synchronize()
        self._synchronized = False
        return super(self.__class__, self).step(closure)

    def zero_grad(self, set_to_none: bool = True):
        self._synchronized = False
        return super(self.__class__, self).zero_grad(set_to_none=set_to_none)


def compressing_optimizer(optimizer: torch.optim.Optimizer, compressor: Compressor) -> torch.optim.Optimizer:
    methods = {k: v for k, v in _CompressingOptimizer.__dict__.items() if k not in ("__dict__", "__weakref__")}
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), methods)
    return cls(optimizer.param_groups, compressor)


# ---- state across checkpoints, resumes and elastic resets (collective; the runtime calls these) ----

def compressors_of(optimizers: Sequence[torch.optim.Optimizer]) -> list[Compressor]:
    return [o.compressor for o in optimizers if isinstance(getattr(o, "compressor", None), Compressor)]


def gather_states(compressors: list[Compressor]) -> dict[str, Any] | None:
    """Every rank's compressor states (its own residuals; Q is the same everywhere), for rank 0's
    checkpoint. None without compression (every rank runs the same configuration)."""
    if not compressors:
        return None
    states = hvd.allgather_object([c.state_dict() for c in compressors], name="checkpoint.compression")
    return {"world_size": len(states), "by_rank": states}


def restore_states(compressors: list[Compressor], saved: dict[str, Any] | None) -> str | None:
    """After a resume: each rank its own residuals if the rank count is the checkpoint's; on
    another rank count they cannot be mapped to ranks and start at zero (PowerSGD's Q, the same on
    every rank, is kept). Returns a note for the log, or None."""
    if not compressors or not saved:
        return None
    same_world = saved["world_size"] == hvd.size()
    mine = saved["by_rank"][hvd.rank() if same_world else 0]
    for compressor, state in zip(compressors, mine):
        compressor.load_state_dict(state)
        if not same_world:
            compressor.reset_residuals()
    return ("compression residuals and state restored" if same_world else
            f"compression residuals restarted at zero ({saved['world_size']} -> {hvd.size()} ranks), state kept")


def sync_after_reset(compressors: list[Compressor]) -> None:
    """Elastic reset: ranks were renumbered or joined, so residuals restart at zero and rank 0's
    PowerSGD Q goes to everyone (a joined worker has none)."""
    for index, compressor in enumerate(compressors):
        compressor.reset_residuals()
        if isinstance(compressor, PowerSGD):
            compressor.q = hvd.broadcast_object(compressor.q, root_rank=0, name=f"elastic.compression.{index}")
