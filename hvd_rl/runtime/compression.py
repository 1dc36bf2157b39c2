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
rank's own. Both live on the gradients' device and are checkpointed by each rank in its own file
(hvd_rl/runtime/rank_state.py) as CPU tensors (`state_dict`), loaded back onto each parameter's
device and dtype (`load_state_dict`). A resume onto another number of ranks, or an elastic reset,
cannot map residuals to ranks: they restart at zero (what they held is the last steps' dropped
part, not a divergence), Q is kept.

Determinism: every rank must compute the same step bit for bit. The reductions here are fixed-order
sums (top-k adds the ranks' sparse parts one rank after another, never an atomic scatter such as
CUDA's `index_add_`), and every index tensor is made on the gradients' device.
"""
from __future__ import annotations

import math
import time
from typing import Any, Sequence

import torch

import horovod.torch as hvd

from hvd_rl.runtime.distributed import CLOCK

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
        """CPU copies (a checkpoint loads anywhere: map_location='cpu', weights_only=True)."""
        return {"residuals": _to_cpu(self.residuals)}

    def shared_state_dict(self) -> dict[str, Any]:
        """The part that is the same on every rank (survives a change of rank count)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.residuals = self._on_params(state.get("residuals", {}))

    def _on_params(self, tensors: dict[Any, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Saved tensors by parameter index, onto that parameter's device and dtype (a checkpoint
        written on CPU resumed on CUDA, or the other way)."""
        return {int(i): t.to(device=self.params[int(i)].device, dtype=self.params[int(i)].dtype, copy=True)
                for i, t in tensors.items()}

    def reset_residuals(self) -> None:
        self.residuals.clear()

    def _with_residual(self, index: int, grad: torch.Tensor) -> torch.Tensor:
        residual = self.residuals.get(index)
        return grad if residual is None else grad + residual


def _collective(fn, *args, **kwargs):
    """A collective inside a compressed reduction, timed so that the compute around it can be told
    apart (the process's one clock: hvd_rl/runtime/distributed.py's CLOCK)."""
    start = time.perf_counter()
    try:
        return fn(*args, **kwargs)
    finally:
        CLOCK.compression_collective_seconds += time.perf_counter() - start


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
        return {**super().state_dict(), **self.shared_state_dict()}

    def shared_state_dict(self) -> dict[str, Any]:
        return {"q": _to_cpu(self.q)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.q = self._on_params(state.get("q", {}))


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
        k = self.kept(flat.numel())
        if k < flat.numel():
            indices = torch.topk(flat.abs(), k, sorted=False).indices.sort().values
        else:
            indices = torch.arange(flat.numel(), device=flat.device)
        values = flat[indices]
        wire_indices = indices.to(torch.int32 if flat.numel() < 2 ** 31 else torch.int64)
        all_values = _collective(hvd.allgather, values, name="compression.topk_values")
        all_indices = _collective(hvd.allgather, wire_indices, name="compression.topk_indices")
        dense = _sum_sparse_by_rank(flat, all_indices.long().view(-1, k), all_values.view(-1, k)) / hvd.size()
        residual = flat.clone()
        residual[indices] = 0  # what this rank kept went out; the rest stays behind
        offset = 0
        for (i, p), v in zip(items, vectors):
            size = v.numel()
            self.residuals[i] = residual[offset:offset + size].view_as(p.grad).clone()
            p.grad.copy_(dense[offset:offset + size].view_as(p.grad))
            offset += size
        return values.numel() * values.element_size() + wire_indices.numel() * wire_indices.element_size()

    def kept(self, size: int) -> int:
        """Entries each rank sends of a flattened gradient of `size` (the same on every rank)."""
        return max(1, math.ceil(self.ratio * size))


def _sum_sparse_by_rank(like: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """sum over ranks r of the sparse vector (indices[r], values[r]), added rank after rank: each
    rank's indices are distinct, so each addition is a plain gather-add-scatter with no races, and
    the order of the float additions is the same on every rank and every device (an atomic scatter
    such as `index_add_` on CUDA adds in whatever order the threads arrive)."""
    dense = torch.zeros_like(like)
    for rank_indices, rank_values in zip(indices, values):
        dense[rank_indices] = dense[rank_indices] + rank_values
    return dense


def _to_cpu(tensors: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    return {i: t.detach().to("cpu", copy=True) for i, t in tensors.items()}


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
            start, blocked = time.perf_counter(), CLOCK.compression_collective_seconds
            sent = self.compressor.reduce()
            dense = sum(p.grad.numel() * p.grad.element_size() for p in self.compressor.params if p.grad is not None)
            compute = time.perf_counter() - start - (CLOCK.compression_collective_seconds - blocked)
            CLOCK.add_compression(compute, sent, dense)
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


# ---- state across resumes and elastic resets (the runtime calls these) ----

def compressors_of(optimizers: Sequence[torch.optim.Optimizer]) -> list[Compressor]:
    return [o.compressor for o in optimizers if isinstance(getattr(o, "compressor", None), Compressor)]


def broadcast_shared_state(compressors: list[Compressor]) -> None:
    """Collective: rank 0's shared state (PowerSGD's Q) to every rank (a worker that just joined
    has none). Residuals are each rank's own and are not touched here."""
    for index, compressor in enumerate(compressors):
        shared = hvd.broadcast_object(compressor.shared_state_dict(), root_rank=0, name=f"compression.shared.{index}")
        residuals = compressor.residuals
        compressor.load_state_dict(shared)
        compressor.residuals = residuals
