"""Checkpoints: atomic writes, a verified manifest, retention, a `latest` pointer, safe loading.

Layout under <run_dir>/checkpoints/:
    ckpt_00000120.pt     torch.save of plain containers and tensors (loaded with weights_only=True)
    ckpt_00000120.json   manifest: sha256 and size of the .pt, iteration, global step, and a
                         sequence number that orders checkpoints by when they were written
    latest.pt            symlink to the newest complete checkpoint

"Newest" is by sequence, not by iteration: after a deliberate rollback (`--resume` from an older
checkpoint) the new branch's checkpoints are newer than the abandoned branch's higher-numbered
ones, and `--resume auto` and pruning must follow the new branch.

Write order: .pt to a temporary file + fsync, manifest (atomic), rename the .pt into place,
fsync the directory, move `latest.pt`, prune. A crash at any point leaves either the previous
checkpoint set or a complete new one; a stray manifest without its .pt is ignored.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import sys
import time
from pathlib import Path
from typing import Any, BinaryIO, Callable

import torch

# 2: algorithm-independent layout ("algorithm", "state", "env_counts"), every rank's RNG and
#    compression state gathered into it; 3: those in per-rank files (hvd_rl/runtime/checkpointing.py)
FORMAT_VERSION = 3
READABLE_VERSIONS = (2, 3)
REQUIRED_KEYS = ("format_version", "iteration", "global_step", "seed_offset", "world_size",
                 "env_counts", "config", "signature", "state")
_V1_KEYS = ("format_version", "iteration", "global_step", "seed_offset", "world_size",
            "envs_per_rank", "config", "signature", "model", "optimizer", "rng")
_NAME = re.compile(r"^ckpt_(\d{8,})\.pt$")
RANK_DIR = "ranks"  # checkpoints/ranks/rank<r>.pt: each rank's RNG and compression state


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, damaged or does not fit this run."""


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(run_dir: str | Path, state: dict[str, Any], keep: int) -> Path:
    """Writes state atomically as ckpt_<iteration>.pt and returns its path (rank 0 only)."""
    directory = checkpoint_dir(run_dir)
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"ckpt_{state['iteration']:08d}.pt"
    tmp = directory / f".{final.name}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        manifest = {
            "file": final.name, "sha256": _sha256(tmp), "bytes": tmp.stat().st_size,
            "iteration": state["iteration"], "global_step": state["global_step"],
            "format_version": FORMAT_VERSION, "written_at": time.time(),
            "sequence": 1 + max((_sequence(p) for p in list_checkpoints(run_dir)), default=0),
            "hostname": socket.gethostname(),  # the writer's node (rank 0's)
        }
        _atomic_write_text(final.with_suffix(".json"), json.dumps(manifest, indent=1))
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            tmp.unlink()
    _fsync_dir(directory)
    link_tmp = directory / f".latest.tmp.{os.getpid()}"
    if link_tmp.is_symlink() or link_tmp.exists():
        link_tmp.unlink()
    os.symlink(final.name, link_tmp)
    os.replace(link_tmp, directory / "latest.pt")
    _fsync_dir(directory)
    prune(directory, keep)
    return final


def _sequence(path: Path) -> int:
    """Write order of a checkpoint: its manifest's sequence (older runs: the iteration)."""
    try:
        manifest = json.loads(path.with_suffix(".json").read_text())
        return int(manifest.get("sequence", manifest.get("iteration", 0)))
    except (OSError, ValueError):
        match = _NAME.match(path.name)
        return int(match.group(1)) if match else 0


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Checkpoint files, newest (last written) first."""
    directory = checkpoint_dir(run_dir)
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if _NAME.match(p.name)]
    return sorted(found, key=lambda p: (_sequence(p), p.name), reverse=True)


def prune(directory: Path, keep: int) -> None:
    """Keeps the `keep` newest checkpoints (never the one just written: it is the newest)."""
    for old in list_checkpoints(directory.parent)[keep:]:
        old.unlink(missing_ok=True)
        old.with_suffix(".json").unlink(missing_ok=True)
    for manifest in directory.glob("ckpt_*.json"):  # manifests whose .pt never landed
        if not manifest.with_suffix(".pt").exists():
            manifest.unlink(missing_ok=True)


def remove_stale_temporaries(run_dir: str | Path) -> list[Path]:
    """Deletes temporary files a crashed writer left behind (rank 0, before a run starts),
    also under replay/ (DQN's replay shards: `.rank<r>.tmp.npz` of a crash mid-save)."""
    removed = []
    for directory in (checkpoint_dir(run_dir), checkpoint_dir(run_dir) / RANK_DIR, Path(run_dir),
                      Path(run_dir) / "replay"):
        if directory.is_dir():
            for path in directory.glob(".*.tmp*"):
                if path.is_file() or path.is_symlink():
                    path.unlink(missing_ok=True)
                    removed.append(path)
    return removed


def load_checkpoint(path: str | Path, require_manifest: bool = False) -> dict[str, Any]:
    """Loads and checks a checkpoint; never executes code from the file (weights_only=True)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint not found: {path}")
    resolved = path.resolve()
    manifest_path = resolved.with_suffix(".json")
    if manifest_path.exists():
        try:
            manifest = json.loads(manifest_path.read_text())
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"checkpoint manifest {manifest_path} is unreadable: {exc}") from None
        size = resolved.stat().st_size
        if size != manifest.get("bytes"):
            raise CheckpointError(
                f"checkpoint {path} is truncated or damaged: {size} bytes, manifest says "
                f"{manifest.get('bytes')}")
        if _sha256(resolved) != manifest.get("sha256"):
            raise CheckpointError(f"checkpoint {path} is damaged: sha256 does not match its manifest")
    elif require_manifest:
        raise CheckpointError(f"checkpoint {path} has no manifest (incomplete write?)")
    try:
        state = torch.load(resolved, map_location="cpu", weights_only=True)
    except Exception as exc:  # any unpickling/zip error means the file is unusable
        raise CheckpointError(f"checkpoint {path} cannot be read ({type(exc).__name__}: {exc})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} is not an hvd_rl checkpoint")
    version = state.get("format_version")
    if version == 1 and all(k in state for k in _V1_KEYS):
        return _from_v1(state)
    missing = [k for k in REQUIRED_KEYS + (("rng",) if version == 2 else ()) if k not in state]
    if missing:
        raise CheckpointError(f"{path} is not an hvd_rl checkpoint (missing {', '.join(missing)})")
    if version not in READABLE_VERSIONS:
        raise CheckpointError(f"{path} has checkpoint format {version}, this hvd_rl reads "
                              f"{', '.join(map(str, READABLE_VERSIONS))}")
    return state


def _from_v1(state: dict[str, Any]) -> dict[str, Any]:
    """Format 1 (PPO only, before the runtime/algorithm split) in the current layout."""
    converted = {k: v for k, v in state.items() if k not in ("model", "optimizer", "scaler", "envs_per_rank")}
    converted.update(format_version=2, algorithm="ppo",
                     env_counts=[int(state["envs_per_rank"])] * int(state["world_size"]),
                     state={"model": state["model"], "optimizer": state["optimizer"],
                            "scaler": state.get("scaler") or {}})
    return converted


def find_resumable(run_dir: str | Path) -> tuple[Path | None, dict[str, Any] | None, list[str]]:
    """Newest valid checkpoint of a run, skipping damaged ones; returns (path, state, warnings)."""
    warnings: list[str] = []
    for path in list_checkpoints(run_dir):
        try:
            return path, load_checkpoint(path, require_manifest=True), warnings
        except CheckpointError as exc:
            warnings.append(f"skipping {path.name}: {exc}")
    return None, None, warnings


def check_compatible(state: dict[str, Any], signature: dict[str, Any], env_id: str) -> None:
    """Refuses a checkpoint whose environment or network differs from this run's."""
    theirs = state["signature"]
    their_env = state["config"].get("env", {}).get("id")
    if their_env != env_id:
        raise CheckpointError(f"checkpoint was trained on {their_env!r}, this run uses {env_id!r}")
    for key in ("observation_shape", "observation_dtype", "num_actions", "action_shape"):
        if key == "action_shape" and key not in theirs:  # format 1: discrete actions only
            continue
        if theirs.get(key) != signature[key]:
            raise CheckpointError(
                f"checkpoint {key} is {theirs.get(key)}, this run's is {signature[key]}")
    if theirs.get("parameters") != signature["parameters"]:
        mine, other = signature["parameters"], theirs.get("parameters") or {}
        diff = sorted(k for k in set(mine) | set(other) if mine.get(k) != other.get(k))
        raise CheckpointError(
            "checkpoint model does not match this run's model (differs in: "
            + ", ".join(diff[:5]) + (" ..." if len(diff) > 5 else "") + ")")


# ---- per-rank files: state each rank owns (RNG, compression residuals, replay shards) ----------

def save_rank_file(path: Path, write: Callable[[BinaryIO], None], iteration: int) -> None:
    """Every rank, at a checkpoint: its own state, written by `write`, with the checkpoint's write
    discipline (temporary file + fsync, manifest of sha256 and size written atomically, rename into
    place, directory fsync). Per rank rather than gathered to rank 0, whose file would otherwise grow
    with the rank count (residuals of the Atari net: ~7 MB a rank)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp{path.suffix}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        manifest = {"file": path.name, "sha256": _sha256(tmp), "bytes": tmp.stat().st_size,
                    "iteration": iteration, "written_at": time.time(), "hostname": socket.gethostname()}
        _atomic_write_text(path.with_suffix(".json"), json.dumps(manifest, indent=1))
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    _fsync_dir(path.parent)


def verified_rank_file(path: Path, iteration: int) -> str | None:
    """Why the per-rank file at `path` cannot be used for the checkpoint of `iteration` (missing,
    from another checkpoint, truncated or damaged), or None when it can."""
    manifest_path = path.with_suffix(".json")
    if not path.exists() or not manifest_path.exists():
        return f"{path.name} is missing"
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError):
        return f"{manifest_path.name} is unreadable"
    if manifest.get("iteration") != iteration:
        return f"{path.name} is from iteration {manifest.get('iteration')}, the checkpoint from {iteration}"
    if path.stat().st_size != manifest.get("bytes") or _sha256(path) != manifest.get("sha256"):
        return f"{path.name} is truncated or damaged (its manifest does not match)"
    return None


def warn(message: str) -> None:
    print(f"[hvd_rl] warning: {message}", file=sys.stderr, flush=True)
