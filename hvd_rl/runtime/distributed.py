"""Horovod helpers: topology, threads and devices per rank, named collectives, collective decisions.

Rules this module enforces for the rest of the package:
- ranks come from Horovod (global rank for identity, local rank only for device/thread placement);
- every collective has an explicit name and every rank calls it in the same order;
- control-flow decisions (errors, stop flags) are agreed with a collective, so no rank can be left
  waiting in an allreduce that the others never reach.
"""
from __future__ import annotations

import hashlib
import os
import time
from dataclasses import astuple, dataclass
from typing import Any, Sequence

import numpy as np
import torch

import horovod.torch as hvd

from hvd_rl.cluster.launch import launched


class LaunchError(RuntimeError):
    """The processes were started in a way that cannot work (wrong launcher flags, no GPU...)."""


@dataclass(frozen=True)
class Topology:
    rank: int  # global rank: identity, seeds, who writes files
    size: int
    local_rank: int  # rank within this node: GPU index, CPU share
    local_size: int
    cross_size: int  # number of nodes

    @property
    def is_root(self) -> bool:
        return self.rank == 0


# Settings read by Open MPI (in MPI_Init) and Horovod (in hvd.init) from the environment, so they
# must be in place before either starts. `apply_runtime_settings` puts them there from the config,
# in this process, which covers every launcher (mpirun, srun --mpi=pmix, horovodrun) at once.
#
# Why (benchmarks/results/history/runtime_settings/runtime_settings.json): Horovod's background thread coordinates with the
# other ranks every HOROVOD_CYCLE_TIME ms, also while the rank is stepping environments, and Open
# MPI busy-polls while it waits for the peer. With one core per rank that poll steals the core from
# the rank's own compute: 2 ranks of the Atari preset lost ~35% of the machine.
YIELD_VAR = "OMPI_MCA_mpi_yield_when_idle"
CYCLE_VAR = "HOROVOD_CYCLE_TIME"
# Reduce within each node, then across nodes (distributed.hierarchical_allreduce). Horovod 0.28.1
# honours it only in its NCCL (or DDL) GPU allreduce and only across more than one node; CPU
# builds force it off (horovod/common/operations.cc). See hierarchical_allreduce_status.
HIERARCHICAL_VAR = "HOROVOD_HIERARCHICAL_ALLREDUCE"


@dataclass(frozen=True)
class RuntimeSetting:
    name: str
    value: str
    source: str  # "config" (set here) or "environment" (already set by the user or launcher)


def apply_runtime_settings(yield_when_idle: bool = True, cycle_time_ms: float = 0.0,
                           hierarchical_allreduce: bool = False) -> list[RuntimeSetting]:
    """Puts the MPI/Horovod waiting settings into this process's environment before init.

    A value already in the environment wins (the user or the launcher chose it) and is reported
    as such. `cycle_time_ms = 0` leaves Horovod's own default (1 ms); `hierarchical_allreduce =
    False` leaves Horovod's default (flat allreduce).
    """
    wanted = {YIELD_VAR: "1" if yield_when_idle else "0"}
    if cycle_time_ms > 0:
        wanted[CYCLE_VAR] = f"{cycle_time_ms:g}"
    if hierarchical_allreduce:
        wanted[HIERARCHICAL_VAR] = "1"
    settings = []
    for name, value in wanted.items():
        if name in os.environ:
            settings.append(RuntimeSetting(name, os.environ[name], "environment"))
        else:
            os.environ[name] = value
            settings.append(RuntimeSetting(name, value, "config"))
    return settings


RUNTIME_SETTINGS: list[RuntimeSetting] = []  # what init() found or set, for the run's log


def init(yield_when_idle: bool = True, cycle_time_ms: float = 0.0,
         hierarchical_allreduce: bool = False) -> Topology:
    RUNTIME_SETTINGS[:] = apply_runtime_settings(yield_when_idle, cycle_time_ms, hierarchical_allreduce)
    tasks = os.environ.get("SLURM_STEP_NUM_TASKS", "")
    if tasks.isdigit() and int(tasks) > 1 and not launched():
        # srun without an MPI plugin: MPI could not find the other tasks (Open MPI aborts with a
        # misleading message, other MPIs start N lone rank-0 worlds that clobber each other's files).
        raise LaunchError(f"srun started {tasks} tasks without an MPI plugin, so the ranks cannot "
                          "find each other: launch with srun --mpi=pmix (or --mpi=pmi2)")
    hvd.init()
    topo = topology()
    check_launch(topo)
    return topo


def check_launch(topo: Topology) -> None:
    """Catches launches where every process thinks it is alone (and would clobber rank 0's files)."""
    for var, launcher in (("SLURM_STEP_NUM_TASKS", "srun --mpi=pmix (or pmi2)"),
                          ("OMPI_COMM_WORLD_SIZE", "mpirun"), ("HOROVOD_SIZE", "horovodrun")):
        value = os.environ.get(var, "")
        if value.isdigit() and int(value) > 1 and topo.size == 1:
            raise LaunchError(f"{var}={value} processes were started but Horovod sees a 1-rank world: "
                              f"launch with {launcher} so that the ranks find each other")


def check_adasum(topo: Topology) -> None:
    """Horovod's CPU Adasum needs the MPI controller and a power-of-2 number of ranks."""
    if not hvd.mpi_enabled():
        raise LaunchError("distributed.reduction = 'adasum' needs the MPI controller (mpirun, srun "
                          "--mpi=pmix, or horovodrun --mpi), not Gloo")
    if topo.size & (topo.size - 1):
        raise LaunchError(f"distributed.reduction = 'adasum' needs a power-of-2 number of ranks, "
                          f"got {topo.size}")


def hierarchical_allreduce_status(topo: Topology, device: torch.device) -> dict[str, Any]:
    """Whether Horovod reduces hierarchically, by Horovod 0.28.1's own rule (operations.cc): when
    HOROVOD_HIERARCHICAL_ALLREDUCE > 0, the job spans more than one node, Horovod was built with
    NCCL (or DDL) and the tensors are on the GPU. Otherwise the allreduce is flat (MPI or Gloo)."""
    value = os.environ.get(HIERARCHICAL_VAR, "")
    try:
        requested = int(value) > 0
    except ValueError:
        requested = False
    reasons = []
    if topo.size == topo.local_size:
        reasons.append("all ranks on one node")
    if not (hvd.nccl_built() or hvd.ddl_built()):
        reasons.append("this Horovod build has no NCCL/DDL allreduce, the only one that reduces hierarchically")
    elif device.type != "cuda":
        reasons.append("tensors are on the CPU")
    return {"requested": requested, "active": requested and not reasons,
            "why_not": "; ".join(reasons) if requested and reasons else None}


def world_size() -> int:
    return hvd.size()


def topology() -> Topology:
    return Topology(rank=hvd.rank(), size=hvd.size(), local_rank=hvd.local_rank(),
                    local_size=hvd.local_size(), cross_size=hvd.cross_size())


def available_cpus() -> int:
    """CPUs this process may run on, honouring affinity masks and SLURM's per-task CPUs."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def threads_per_rank(topo: Topology, requested: int = 0) -> int:
    """Compute threads per rank: explicit request, else SLURM_CPUS_PER_TASK, else a fair share.

    A launcher that binds each rank to its own cores (mpirun's default for <= 2 ranks, srun with
    --cpus-per-task) already shrinks the affinity mask, so we only divide when the mask still
    covers the whole node and the ranks on it would otherwise oversubscribe it.
    """
    if requested > 0:
        return requested
    slurm = os.environ.get("SLURM_CPUS_PER_TASK")
    if slurm and slurm.isdigit() and int(slurm) > 0:
        return int(slurm)
    cpus = available_cpus()
    node_cpus = os.cpu_count() or cpus
    if cpus >= node_cpus:
        return max(1, cpus // max(1, topo.local_size))
    return max(1, cpus)


def configure_threads(topo: Topology, requested: int = 0) -> int:
    threads = threads_per_rank(topo, requested)
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set (e.g. second trainer in one process, tests)
        pass
    return threads


def select_device(topo: Topology, requested: str = "auto") -> torch.device:
    """One CUDA device per local rank; CPU otherwise."""
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise LaunchError("distributed.device = 'cuda' but no CUDA device is visible to this rank")
    count = torch.cuda.device_count()
    index = topo.local_rank % count
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


# ---- collectives (always named; called in the same order on every rank) -------------------------

class CollectiveClock:
    """This process's one clock of communication: collectives counted, seconds blocked in them,
    the compression compute done inside gradient reductions, and the gradient bytes handed over.

    Every collective costs at least one Horovod coordination cycle, so their number per iteration
    is a cost of its own (the throughput benchmark reports it). The blocked time is later split
    into communication (the fastest rank's time: it never waits) and waiting for slower ranks.
    Algorithms time a whole gradient reduction as collective time (`add`); the compression
    compute inside it (`add_compression`) is this rank's work, so a reading's `blocked` leaves it
    out. Read it with `reading()` before and after, and subtract the two readings.
    """

    def __init__(self) -> None:
        self.count = 0
        self.seconds = 0.0
        self.compression_seconds = 0.0  # compute inside compressed reductions (not blocked)
        self.compression_collective_seconds = 0.0  # the collectives those reductions issued
        self.bytes = 0  # gradient bytes handed to collectives
        self.dense_bytes = 0  # what the same reductions would have sent uncompressed

    def add(self, count: int, seconds: float) -> None:
        self.count += count
        self.seconds += seconds

    def add_compression(self, compute_seconds: float, sent: int, dense: int) -> None:
        self.compression_seconds += compute_seconds
        self.bytes += sent
        self.dense_bytes += dense

    def reading(self) -> "ClockReading":
        return ClockReading(self.count, self.seconds, self.compression_seconds, self.bytes, self.dense_bytes)


@dataclass(frozen=True)
class ClockReading:
    """The clock at one moment; the difference of two readings is what happened between them."""

    count: int = 0
    seconds: float = 0.0
    compression_seconds: float = 0.0
    bytes: int = 0
    dense_bytes: int = 0

    def __sub__(self, earlier: "ClockReading") -> "ClockReading":
        return ClockReading(*(a - b for a, b in zip(astuple(self), astuple(earlier))))

    @property
    def blocked(self) -> float:
        """Seconds waiting in collectives (communication and slower ranks), compute left out."""
        return self.seconds - self.compression_seconds


CLOCK = CollectiveClock()


def _timed(count: int, fn, *args, **kwargs):
    start = time.perf_counter()
    try:
        return fn(*args, **kwargs)
    finally:
        CLOCK.add(count, time.perf_counter() - start)


def allreduce_sum(values: Sequence[float] | np.ndarray | torch.Tensor, name: str) -> np.ndarray:
    """Sum of a small float64 vector over all ranks."""
    tensor = torch.as_tensor(np.asarray(values, dtype=np.float64))
    return _timed(1, hvd.allreduce, tensor, op=hvd.Sum, name=name).numpy()


def allreduce_sum_async(values: Sequence[float] | np.ndarray, name: str) -> Any:
    """Starts a float64 sum; issued next to other pending allreduces (the gradients) it is
    negotiated in the same Horovod cycle and costs no extra round. Finish with `wait_sum`."""
    CLOCK.add(1, 0.0)
    return hvd.allreduce_async(torch.as_tensor(np.asarray(values, dtype=np.float64)), op=hvd.Sum, name=name)


def wait_sum(handle: Any) -> np.ndarray:
    return _timed(0, hvd.synchronize, handle).numpy()


def allgather_rows(array: np.ndarray, name: str) -> np.ndarray:
    """Concatenates each rank's rows (any count, including zero) in rank order."""
    return _timed(1, hvd.allgather, torch.as_tensor(np.ascontiguousarray(array)), name=name).numpy()


def broadcast_object(obj: Any, name: str, root_rank: int = 0) -> Any:
    """broadcast_object with a mandatory name: unnamed calls with a None payload can hang."""
    return _timed(2, hvd.broadcast_object, obj, root_rank=root_rank, name=name)


def allgather_object(obj: Any, name: str) -> list[Any]:
    return _timed(2, hvd.allgather_object, obj, name=name)


def any_rank(flag: bool, name: str) -> bool:
    return bool(allreduce_sum([1.0 if flag else 0.0], name=name)[0] > 0)


class CollectiveError(RuntimeError):
    """Raised identically on every rank when any rank reported a problem."""


def agree_on_error(local_error: str | None, name: str) -> None:
    """Every rank learns every rank's error; all raise the same CollectiveError, or none does.

    Use around work that only some ranks do (rank 0 reads a checkpoint, prepares the run
    directory) so that a failure there stops everybody instead of leaving them in the next
    collective.
    """
    errors = allgather_object(local_error, name=name)
    found = [(rank, err) for rank, err in enumerate(errors) if err]
    if found:
        rank, message = found[0]
        prefix = "" if len(errors) == 1 else f"rank {rank}: "
        raise CollectiveError(prefix + message)


def parameter_digest(module: torch.nn.Module) -> int:
    """A 63-bit digest of the exact parameter bytes (ranks must agree bit for bit)."""
    digest = hashlib.sha256()
    for name, param in sorted(module.state_dict().items()):
        digest.update(name.encode())
        digest.update(param.detach().cpu().contiguous().numpy().tobytes())
    return int.from_bytes(digest.digest()[:8], "little") & ((1 << 63) - 1)


def parameters_agree(module: torch.nn.Module, name: str) -> tuple[bool, list[int]]:
    """Allgathers each rank's parameter digest; True when all ranks hold identical parameters."""
    digests = allgather_rows(np.array([parameter_digest(module)], dtype=np.int64), name=name)
    values = [int(d) for d in digests]
    return len(set(values)) == 1, values


def broadcast_module(module: torch.nn.Module, name: str) -> None:
    """Rank 0's parameters and buffers of a module that has no optimizer (e.g. a target network)."""
    handles = [hvd.broadcast_async_(tensor, root_rank=0, name=f"{name}.{key}")
               for key, tensor in module.state_dict().items()]
    _timed(len(handles), lambda: [hvd.synchronize(h) for h in handles])


def distributed_optimizer(optimizer: torch.optim.Optimizer, model: torch.nn.Module, *,
                          reduction: str, compression: str, backward_passes_per_step: int,
                          powersgd_rank: int = 4, topk_ratio: float = 0.01, seed: int = 0) -> torch.optim.Optimizer:
    """Wraps the optimizer so gradients are averaged (or Adasum-combined) across ranks.

    This is the one place where gradients are reduced, whichever algorithm asks. `none`/`fp16`:
    Horovod's DistributedOptimizer, whose allreduces are issued from backward hooks as each
    gradient becomes ready and overlap the rest of the backward pass. `powersgd`/`topk`
    (hvd_rl/runtime/compression.py): gradients accumulate locally and are compressed and reduced at
    `synchronize`. Either way every rank then holds the same gradient, and the algorithm calls
    `synchronize()`, clips, and steps under `skip_synchronize()`.
    """
    from hvd_rl.runtime import compression as C

    if compression in ("powersgd", "topk"):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        compressor = C.PowerSGD(params, powersgd_rank, seed) if compression == "powersgd" else C.TopK(params, topk_ratio)
        return C.compressing_optimizer(optimizer, compressor)
    wrapped = hvd.DistributedOptimizer(
        optimizer,
        named_parameters=model.named_parameters(),
        compression=hvd.Compression.fp16 if compression == "fp16" else hvd.Compression.none,
        op=hvd.Adasum if reduction == "adasum" else hvd.Average,
        backward_passes_per_step=backward_passes_per_step,
    )
    # Bytes handed to Horovod per reduction (fp16 halves them), counted where the reduction is
    # awaited: synchronize (average) or step (Adasum reduces the parameter deltas inside it).
    dense = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    per_reduction = dense // 2 if compression == "fp16" else dense
    method = "step" if reduction == "adasum" else "synchronize"
    original = getattr(wrapped, method)

    def counted(*args, **kwargs):
        CLOCK.add_compression(0.0, per_reduction, dense)
        return original(*args, **kwargs)

    setattr(wrapped, method, counted)
    return wrapped


def broadcast_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    has_optimizer_state: bool) -> None:
    """Rank 0's parameters and optimizer state to every rank (start and resume).

    A fresh Adam holds no state, only hyperparameters; Horovod's broadcast_optimizer_state would
    first create state with a zero-gradient step, which advances Adam's step count and changes
    its bias correction. So on a fresh start only the hyperparameters travel.
    `has_optimizer_state` must be the same on every rank.
    """
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    if has_optimizer_state:
        # Ranks without state take a zero-gradient step first (Horovod's way to create it); a
        # compressing optimizer must not reduce in it: only those ranks take it.
        import contextlib

        local_step = optimizer.skip_synchronize() if hasattr(optimizer, "compressor") else contextlib.nullcontext()
        with local_step:
            hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    else:
        groups = broadcast_object([{k: v for k, v in g.items() if k != "params"}
                                   for g in optimizer.param_groups], name="setup.optimizer_hparams")
        for group, hparams in zip(optimizer.param_groups, groups):
            group.update(hparams)
