"""summary.json: what a finished run was (status, steps, ranks, their machines, communication).

Written by rank 0 at the end of every run that did any work; the scaling and learning reports
read it (hvd_rl/analysis/), and W&B gets it as the run's summary.
"""
from __future__ import annotations

import os
import platform
from typing import Any

import horovod
import numpy as np
import torch

from hvd_rl.config import DistributedConfig
from hvd_rl.runtime import distributed as dist


class CommunicationLog:
    """Gradient traffic per iteration of this invocation: (comm_bytes, time_compress, compression_ratio)."""

    def __init__(self) -> None:
        self.rows: list[tuple[float, float, float | None]] = []

    def add(self, record: dict[str, Any]) -> None:
        self.rows.append((record["comm_bytes"], record["time_compress"], record["compression_ratio"]))

    def summary(self, d: DistributedConfig) -> dict[str, Any]:
        """Means per iteration and rank, for the scaling report: what was sent, the ratio to the
        uncompressed gradient, the compression compute."""
        out: dict[str, Any] = {"compression": d.compression, "iterations": len(self.rows)}
        if d.compression == "powersgd":
            out["powersgd_rank"] = d.powersgd_rank
        if d.compression == "topk":
            out["topk_ratio"] = d.topk_ratio
        if self.rows:
            sent, compress, ratios = zip(*self.rows)
            ratios = [r for r in ratios if r is not None]
            out.update({"comm_bytes": float(np.mean(sent)), "time_compress": float(np.mean(compress)),
                        "compression_ratio": float(np.mean(ratios)) if ratios else None})
        return out


def layout_topology(threads: int, device: torch.device, precision: str) -> dict[str, Any]:
    """What this rank knows of the run's layout without a collective (W&B's config at start)."""
    topo = dist.topology()
    return {"ranks": topo.size, "nodes": topo.cross_size, "ranks_per_node": topo.local_size,
            "threads_per_rank": threads, "device": str(device), "precision": precision}


def run_topology(ranks: list[dict[str, Any]], layout: dict[str, Any], device: torch.device,
                 heap_retained: bool) -> dict[str, Any]:
    """The whole layout, from every rank's hostname and local rank (gathered by the caller)."""
    topo = dist.topology()
    hostnames = [r["hostname"] for r in ranks]
    return {**layout,
            "runtime_settings": {name: os.environ.get(name) for name in (dist.YIELD_VAR, dist.CYCLE_VAR)},
            "hierarchical_allreduce": dist.hierarchical_allreduce_status(topo, device),
            "freed_memory_retained": heap_retained,
            "cpus_per_node": os.cpu_count(), "hostnames": sorted(set(hostnames)),
            "per_rank": [{"rank": i, **r} for i, r in enumerate(ranks)],
            "versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "horovod": horovod.__version__}}


def run_summary(*, algorithm: str, iteration: int, global_step: int, total_timesteps: int, identical: bool,
                digests: list[int], wall_seconds: float, parameters: torch.nn.Module,
                topology: dict[str, Any], communication: dict[str, Any]) -> dict[str, Any]:
    return {
        "status": "completed", "algorithm": algorithm, "iteration": iteration,
        "global_step": global_step, "total_timesteps": total_timesteps,
        "world_size": dist.topology().size, "parameters_identical": identical,
        "parameter_digests": digests, "wall_seconds": wall_seconds,
        # What one gradient allreduce moves (the scaling report's projection uses it).
        "gradient_bytes": sum(p.numel() * p.element_size() for p in parameters.parameters() if p.requires_grad),
        "topology": topology, "communication": communication,
    }
