"""Where checkpoints are written and read back, collectively: rank 0's file and each rank's own.

A checkpoint of iteration k is (checkpoints/, hvd_rl/runtime/checkpoint.py for the file format):
    ckpt_<k>.pt + .json       rank 0: networks, optimizer, statistics, counters, config
    ranks/rank<r>.pt + .json  every rank r: its RNG streams and its gradient-compression state
                              (error-feedback residuals; PowerSGD's Q), as CPU tensors
    replay/rank<r>.npz + .json DQN's replay shards, when checkpointed (Algorithm.save_local)
Per-rank state is only ever saved this way, per rank: nothing of it passes through rank 0, so the
checkpoint does not grow with the rank count (the Atari net's residuals are ~7 MB a rank).

At a resume the per-rank file must belong to the checkpoint being resumed (its manifest's
iteration) and be intact on every rank, or no rank uses its own: RNG streams are then reseeded
from the seed (as on another rank count) and compression residuals restart at zero, with one
warning. PowerSGD's Q, the same on every rank, survives a change of rank count: rank 0's is
broadcast.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from hvd_rl.runtime import compression
from hvd_rl.runtime import distributed as dist
from hvd_rl.runtime.checkpoint import (RANK_DIR, checkpoint_dir, save_checkpoint, save_rank_file,
                                      verified_rank_file)


def rank_file(run_dir: str | Path, rank: int) -> Path:
    return checkpoint_dir(run_dir) / RANK_DIR / f"rank{rank:05d}.pt"


def save_rank_state(run_dir: str | Path, iteration: int, rank: int, world_size: int, device: torch.device,
                    compressors: list[compression.Compressor]) -> None:
    """This rank's state for the checkpoint of `iteration` (CPU tensors only: loadable anywhere)."""
    state = {"iteration": iteration, "rank": rank, "world_size": world_size,
             "torch_rng": torch.get_rng_state(),
             "cuda_rng": torch.cuda.get_rng_state(device).cpu() if device.type == "cuda" else None,
             "compression": [c.state_dict() for c in compressors]}
    save_rank_file(rank_file(run_dir, rank), lambda f: torch.save(state, f), iteration)


def _load_own(run_dir: Path, iteration: int, rank: int, world_size: int) -> tuple[dict | None, str | None]:
    path = rank_file(run_dir, rank)
    problem = verified_rank_file(path, iteration)
    if problem is None:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any unpickling/zip error: unusable
            return None, f"{path.name} cannot be read ({type(exc).__name__})"
        if state.get("world_size") != world_size or state.get("rank") != rank:
            return None, f"{path.name} belongs to rank {state.get('rank')} of {state.get('world_size')}"
        return state, None
    return None, problem


def restore_rank_state(run_dir: str | Path, iteration: int | None, saved_world_size: int | None, device: torch.device,
            compressors: list[compression.Compressor],
            legacy: dict[str, Any] | None = None) -> tuple[bool, str | None]:
    """Collective, after a resume's broadcast. Returns (RNG restored, a note for rank 0's log).

    `legacy`: a format-2 checkpoint's gathered lists ({"rng": {...}, "compression": {...}}), read
    by rank 0 and broadcast, for runs written before per-rank files."""
    topo = dist.topology()
    if iteration is None:  # a new run
        return False, None
    same_world = saved_world_size == topo.size
    state, problem = None, None
    if legacy is not None:
        state, problem = _from_legacy(legacy, topo.rank) if same_world else (None, None)
    elif same_world:
        state, problem = _load_own(Path(run_dir), iteration, topo.rank, topo.size)
    problems = [p for p in dist.allgather_object(problem, name="resume.rank_state") if p]
    usable = same_world and not problems
    if usable:
        torch.set_rng_state(state["torch_rng"])
        if device.type == "cuda" and state.get("cuda_rng") is not None:
            torch.cuda.set_rng_state(state["cuda_rng"], device)
        for compressor, saved in zip(compressors, state["compression"]):
            compressor.load_state_dict(saved)
    else:
        _broadcast_shared_state(compressors, state if topo.rank == 0 else None, run_dir, iteration, legacy)
    note = None
    if problems:
        note = (f"warning: per-rank state not restored ({problems[0]}" + (f"; and {len(problems) - 1} more"
                if len(problems) > 1 else "") + "): RNG reseeded" + (", compression residuals at zero"
                                                                      if compressors else ""))
    elif compressors:
        note = ("compression residuals and state restored" if same_world else
                f"compression residuals restarted at zero ({saved_world_size} -> {topo.size} ranks), state kept")
    return usable, note


def _broadcast_shared_state(compressors: list[compression.Compressor], state: dict | None,
                            run_dir: str | Path, iteration: int, legacy: dict | None) -> None:
    """Another rank count (or unusable files): residuals start at zero; rank 0's PowerSGD Q (the same
    on every rank) goes to everyone if rank 0 can read it."""
    if not compressors:
        return
    if dist.topology().rank == 0:
        if state is None and legacy is not None:
            state, _ = _from_legacy(legacy, 0)
        elif state is None and verified_rank_file(rank_file(run_dir, 0), iteration) is None:
            try:
                state = torch.load(rank_file(run_dir, 0), map_location="cpu", weights_only=True)
            except Exception:  # noqa: BLE001 - Q then starts afresh, like the residuals
                state = None
        for compressor, saved in zip(compressors, state["compression"] if state else []):
            compressor.load_state_dict(saved)
    compression.broadcast_shared_state(compressors)
    for compressor in compressors:
        compressor.reset_residuals()


def _from_legacy(legacy: dict[str, Any], rank: int) -> tuple[dict | None, str | None]:
    rng = legacy.get("rng") or {}
    torch_rng, cuda_rng = rng.get("torch"), rng.get("cuda")
    saved_compression = legacy.get("compression")
    if not torch_rng or rank >= len(torch_rng):
        return None, "the checkpoint holds no RNG state for this rank"
    return {"torch_rng": torch_rng[rank], "cuda_rng": cuda_rng[rank] if cuda_rng else None,
            "compression": saved_compression["by_rank"][rank] if saved_compression else []}, None



def write_checkpoint(run_dir: Path, iteration: int, rank_zero_state: Callable[[], dict[str, Any]], keep: int,
                     device: torch.device, compressors: list[compression.Compressor],
                     save_local: Callable[[], None]) -> Path | None:
    """Collective: every rank writes its own state, rank 0 the checkpoint file (`rank_zero_state()`
    is called on rank 0 only), the algorithm its local shards; nobody moves on (or exits, which
    makes mpirun/srun kill the job) before every file is down. Returns rank 0's path."""
    topo = dist.topology()
    save_rank_state(run_dir, iteration, topo.rank, topo.size, device, compressors)
    path = save_checkpoint(run_dir, rank_zero_state(), keep=keep) if topo.rank == 0 else None
    save_local()
    dist.allreduce_sum([0.0], name="checkpoint.written")
    return path
