"""The shared runtime: one training run of any algorithm, on every rank, under any launcher.

What happens, in order (every step collective unless marked):
1. local   Horovod start-up with the waiting settings, threads, device, the algorithm's networks
           (no collective before here: a late elastic worker must reach `hvd.elastic.run` first)
2. setup   rank 0 prepares the run directory and reads the checkpoint; every rank agrees on any
           error; resume info and the algorithm's state are broadcast; per-rank RNG restored
3. loop    (re)build environments when the layout changed, `Algorithm.iterate`, one allgather of
           every rank's metrics and episodes (which also carries the stop flags), checkpoints
           every `checkpoint.every` iterations; the run ends exactly at total_timesteps
4. finish  parameters checked identical on all ranks, final checkpoint, summary.json

Stop decisions are collective: a preemption signal (or a stop file written by the batch script)
on any rank makes every rank checkpoint at the same iteration and exit 75; a non-finite loss on
any rank makes every rank exit 3. In elastic mode (`hvd-rl train --elastic` under horovodrun)
steps 2-4 run inside `hvd.elastic.run`, so a worker that joins later or replaces a lost one
takes part in every collective.
"""
from __future__ import annotations

import copy
import json
import math
import os
import platform
import signal
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import horovod
import numpy as np
from horovod.common.elastic import ObjectState
import torch

from hvd_rl import __version__
from hvd_rl.runtime import compression
from hvd_rl.runtime import distributed as dist
from hvd_rl.runtime import watchdog
from hvd_rl.algorithms import build_algorithm
from hvd_rl.algorithms.base import Algorithm, IterationContext, IterationReport, NonFiniteLossError
from hvd_rl.runtime.balance import Balancer
from hvd_rl.runtime.checkpoint import (CheckpointError, check_compatible, find_resumable, list_checkpoints,
                               load_checkpoint, remove_stale_temporaries, save_checkpoint, warn)
from hvd_rl.config import TrainConfig
from hvd_rl.envs.vector import EnvLayout, RankEnvs, env_seeds
from hvd_rl.runtime.heap import page_faults, retain_freed_memory
from hvd_rl.runtime.metrics import (BALANCE_FILE, ENV_SEEDS_FILE, METRICS_FILE, MetricsLogger, RemainingTime, log_line,
                            truncate_metrics)

# Exit codes, identical on every rank (documented in docs/outputs.md, used by the SLURM templates).
EXIT_OK = 0
EXIT_FAILURE = 1  # unexpected error (a bug, a crashed rank)
EXIT_BAD_INPUT = 2  # config, environment, checkpoint or run-directory problem
EXIT_NONFINITE = 3  # NaN/Inf loss: the last good checkpoint is left untouched
EXIT_PREEMPTED = 75  # checkpointed after SIGTERM/SIGUSR1; rerun with --resume auto (EX_TEMPFAIL)
EXIT_PEER_LOST = watchdog.EXIT_PEER_LOST  # 4: the other ranks stopped answering (a node down)

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
PREEMPTED_MARKER = "preempted.json"  # written by rank 0 next to the checkpoint when preempted
STOP_FILE = "stop.request"  # created by a batch script (any launcher) to ask for a checkpoint + exit 75


class Preempted(Exception):
    """All ranks agreed to stop after a preemption signal; a checkpoint was written."""


def preempted_exit_code() -> int:
    """75, unless HVD_RL_PREEMPTED_EXIT_CODE says otherwise: the SLURM template sets 0 under
    mpirun, which would otherwise abort the job at the first rank's exit 75 and kill the others
    (it requeues on preempted.json instead)."""
    value = os.environ.get("HVD_RL_PREEMPTED_EXIT_CODE", "")
    return int(value) if value.isdigit() else EXIT_PREEMPTED


class BadInput(ValueError):
    """Something the user must fix (model/observation mismatch...); the same on every rank."""


class PreemptionFlag:
    """SIGTERM/SIGUSR1, or a stop file in the run directory, acted on collectively.

    The signal handler only records the signal: it may run between any two bytecodes, where a
    print can raise a reentrant-call error and Horovod may be mid-reset. Rank 0 also looks for
    the stop file (at most once a second), which works whatever the launcher does with signals
    (horovodrun does not forward SIGUSR1; mpirun answers SIGTERM by killing the job).
    """

    def __init__(self, stop_file: Path | None = None) -> None:
        self.signum: int | None = None
        self.stop_file = stop_file
        self._file_seen = False
        self._next_file_check = 0.0

    def install(self) -> None:
        for sig in PREEMPTION_SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame: Any) -> None:
        if self.signum is None:
            self.signum = signum

    @property
    def raised(self) -> bool:
        if self.signum is not None or self._file_seen:
            return True
        if self.stop_file is not None and time.monotonic() >= self._next_file_check:
            self._next_file_check = time.monotonic() + 1.0
            self._file_seen = self.stop_file.exists()
        return self._file_seen

    def describe(self) -> str:
        if self.signum is not None:
            return f"received {signal.Signals(self.signum).name}"
        return f"found {self.stop_file}" if self._file_seen else "another rank asked to stop"


@dataclass
class Progress:
    """Counters that checkpoints and elastic commits carry."""

    iteration: int = 0
    global_step: int = 0
    seed_offset: int = 0  # first env seed offset not used yet by any earlier environment build
    env_counts: tuple[int, ...] = ()  # environments per rank of the current layout
    rng_restored: bool = False


def _rank_seed(base: int, seed_offset: int, rank: int) -> int:
    """Action-sampling RNG seed for a rank; distinct per rank and per environment build."""
    return int(np.random.SeedSequence([base, seed_offset, rank]).generate_state(1)[0])


def probe_spaces(cfg: TrainConfig):
    """Observation and action spaces of the configured environment (one env, no collective)."""
    from dataclasses import replace

    env_cfg = replace(cfg.env, num_envs=1, backend="sync" if cfg.env.backend == "async" else cfg.env.backend)
    probe = RankEnvs(env_cfg, threads=1)
    try:
        return probe.single_observation_space, probe.single_action_space
    finally:
        probe.close()


class Runtime:
    def __init__(self, cfg: TrainConfig, resume: str | None = None):
        self.cfg = cfg
        self.resume = resume
        self.run_dir = Path(cfg.run_dir)
        d = cfg.distributed
        self.topo = dist.init(d.mpi_yield_when_idle, d.cycle_time_ms, d.hierarchical_allreduce)
        if d.reduction == "adasum":
            dist.check_adasum(self.topo)
        self.threads = dist.configure_threads(self.topo, d.threads_per_rank)
        self.heap_retained = d.retain_freed_memory and retain_freed_memory()
        self.device = dist.select_device(self.topo, d.device)
        self.preemption = PreemptionFlag(self.run_dir / STOP_FILE)
        self.preemption.install()
        torch.manual_seed(cfg.seed)  # identical initial networks everywhere (rank 0's win anyway)
        obs_space, action_space = probe_spaces(cfg)
        self.algorithm: Algorithm = build_algorithm(cfg, self.device, self.threads, obs_space, action_space)
        self.balancer = Balancer(d.balance, d.balance_every, d.balance_threshold, d.balance_min_envs)
        self.logger: MetricsLogger | None = None
        self._layout: EnvLayout | None = None  # layout of the environments built on this rank
        self._built_rank = -1  # the rank they were built for (an elastic reset can renumber)
        self._local_state_iteration: int | None = None  # resumed checkpoint, for Algorithm.load_local
        self._last_checkpoint_iteration = -1
        self._summary_step: int | None = None  # global step of the run directory's summary.json
        self._communication: list[tuple] = []  # (comm_bytes, time_compress, compression_ratio) per iteration
        self._start_time = time.time()
        self._start_step = 0
        self._remaining = RemainingTime()

    # ---- setup (collective) -----------------------------------------------------------------

    def _compressors(self) -> list[compression.Compressor]:
        return compression.compressors_of(self.algorithm.distributed_optimizers())

    def _numerics(self) -> dict[str, Any]:
        """What this rank chose from its own machine that changes the numbers it computes."""
        return {"precision": getattr(self.algorithm, "precision_mode", "off"), "device": self.device.type,
                "threads": self.threads}

    def _agree_on_numerics(self) -> None:
        """Collective: every rank must have chosen the same precision (hence Adam kernel), device
        kind and thread count (float sums depend on it), or the replicas drift apart; a mixed
        partition (CPU types, GPU and CPU nodes) is refused on every rank with one line."""
        choices = dist.allgather_object(self._numerics(), name="setup.numerics")
        fixes = {"precision": "distributed.amp = 'auto' follows each CPU's bf16 support: set 'bf16' or 'off'",
                 "device": "set distributed.device", "threads": "set distributed.threads_per_rank"}
        problems = []
        for key, fix in fixes.items():
            ranks_by_value: dict[Any, list[int]] = {}
            for rank, choice in enumerate(choices):
                ranks_by_value.setdefault(choice[key], []).append(rank)
            if len(ranks_by_value) > 1:
                seen = ", ".join(f"{value} on rank{'s' if len(r) > 1 else ''} {_ranks_text(r)}"
                                 for value, r in ranks_by_value.items())
                problems.append(f"{key} {seen} ({fix})")
        if problems:
            raise BadInput("ranks chose differently from their own machines: " + "; ".join(problems))

    def _setup(self, progress: Any) -> None:
        """Run directory, resume and initial broadcast; fills `progress`."""
        cfg, topo = self.cfg, dist.topology()
        self._agree_on_numerics()
        ckpt, ckpt_path, error = None, None, None
        if topo.rank == 0:
            try:
                ckpt_path, ckpt = self._prepare_run_dir()
            except (OSError, CheckpointError) as exc:
                error = str(exc)
        dist.agree_on_error(error, name="setup.run_dir")
        info = dist.broadcast_object(self._resume_info(ckpt, ckpt_path, cfg), name="setup.resume_info")

        error = None
        if ckpt is not None:
            try:
                if ckpt.get("algorithm", "ppo") != self.algorithm.name:
                    raise CheckpointError(f"checkpoint was trained with {ckpt.get('algorithm')!r}, "
                                          f"this run uses {self.algorithm.name!r}")
                check_compatible(ckpt, self.algorithm.signature(), cfg.env.id)
                self.algorithm.load_state_dict(ckpt["state"])
            except (CheckpointError, RuntimeError, ValueError, KeyError) as exc:
                error = f"cannot resume from {ckpt_path}: {exc}"
        dist.agree_on_error(error, name="setup.checkpoint")
        self.algorithm.broadcast()
        compression_note = compression.restore_states(self._compressors(), info.get("compression"))

        progress.iteration, progress.global_step = info["iteration"], info["global_step"]
        progress.seed_offset = info["seed_offset"]
        # The checkpoint's layout (the balancer's choice) survives a resume unless the user changed
        # the layout settings since: then those decide (_wanted_layout).
        progress.env_counts = () if info["layout_changed"] else tuple(info["env_counts"] or ())
        self._start_step = progress.global_step
        self._remaining.start(time.time(), progress.global_step)
        # From the broadcast info, never from rank 0's local view: every rank must take the same
        # branch in _finish (a resumed, already finished run must not checkpoint on one rank only).
        self._last_checkpoint_iteration = info["iteration"] if info["path"] else -1
        self._summary_step = info["summary_step"]
        self._local_state_iteration = info["iteration"] if info["path"] else None

        rng_states, cuda_states = info["rng"], info["cuda_rng"]
        progress.rng_restored = bool(rng_states) and len(rng_states) == topo.size
        if progress.rng_restored:
            torch.set_rng_state(rng_states[topo.rank])
            if self.device.type == "cuda" and cuda_states and cuda_states[topo.rank] is not None:
                torch.cuda.set_rng_state(cuda_states[topo.rank], self.device)
        if topo.rank == 0:
            self._write_run_files(info, self._wanted_layout(progress))
            if compression_note:
                self._logger().note(compression_note)

    def _prepare_run_dir(self) -> tuple[Path | None, dict | None]:
        run_dir = self.run_dir
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=run_dir, prefix=".write_test"):
                pass
        except OSError as exc:
            raise OSError(f"cannot write to run directory {run_dir}: {exc.strerror or exc}") from None
        if self.resume is None:
            if list_checkpoints(run_dir) or (run_dir / METRICS_FILE).exists():
                raise CheckpointError(
                    f"run directory {run_dir} already holds a run; pass --resume auto to continue "
                    "it, or choose another --run-dir")
            return None, None
        if self.resume == "auto":
            path, state, warnings = find_resumable(run_dir)
            for message in warnings:
                warn(message)
            if path is None:
                log_line(f"no checkpoint in {run_dir}; starting a new run")
                return None, None
        else:
            path, state = Path(self.resume), load_checkpoint(self.resume)
        return path, state

    def _resume_info(self, ckpt: dict | None, path: Path | None, cfg: TrainConfig) -> dict[str, Any]:
        """What every rank needs from rank 0's view of the run directory (broadcast)."""
        summary_step = None
        try:
            summary_step = json.loads((self.run_dir / "summary.json").read_text())["global_step"]
        except (OSError, ValueError, KeyError, TypeError):
            pass
        if ckpt is None:
            return {"iteration": 0, "global_step": 0, "seed_offset": 0, "rng": None, "cuda_rng": None,
                    "path": None, "world_size": None, "env_counts": None, "layout_changed": False,
                    "summary_step": summary_step}
        saved = ckpt.get("config", {})
        # An env_counts left out at resume is no change (the balancer's or the first run's layout
        # stays); a different num_envs, or a different env_counts given, is.
        layout_changed = (saved.get("env", {}).get("num_envs") != cfg.env.num_envs
                          or bool(cfg.distributed.env_counts)
                          and list(saved.get("distributed", {}).get("env_counts", [])) != list(cfg.distributed.env_counts))
        return {"iteration": int(ckpt["iteration"]), "global_step": int(ckpt["global_step"]),
                "seed_offset": int(ckpt["seed_offset"]), "rng": ckpt["rng"].get("torch"),
                "cuda_rng": ckpt["rng"].get("cuda"), "path": str(path),
                "world_size": int(ckpt["world_size"]), "env_counts": list(ckpt["env_counts"]),
                "layout_changed": layout_changed, "summary_step": summary_step,
                "numerics": ckpt.get("numerics"), "compression": ckpt.get("compression")}

    def _write_run_files(self, info: dict[str, Any], layout: EnvLayout) -> None:
        """Rank 0, once every check passed: only now are existing run files touched."""
        cfg, topo = self.cfg, dist.topology()
        # Rows and TensorBoard events of iterations after the checkpoint will be produced again.
        truncate_metrics(self.run_dir, info["iteration"], info["global_step"])
        (self.run_dir / PREEMPTED_MARKER).unlink(missing_ok=True)
        stop_file = self.run_dir / STOP_FILE
        if stop_file.exists() and stop_file.stat().st_mtime < self._start_time:
            stop_file.unlink(missing_ok=True)  # left by an earlier run; a new request stays
        remove_stale_temporaries(self.run_dir)
        tmp = self.run_dir / ".config.toml.tmp"
        tmp.write_text(cfg.to_toml())
        os.replace(tmp, self.run_dir / "config.toml")
        self.logger = self._new_logger(purge_step=info["global_step"] + 1 if info["path"] else None)
        self.logger.note(
            f"{self.algorithm.name}: {topo.size} rank(s) on {topo.cross_size} node(s), "
            f"{self.threads} thread(s)/rank, device {self.device}, {self.algorithm.describe()}, "
            f"{self._runtime_note()}, env {cfg.env.id} ({cfg.env.backend})")
        for setting in dist.RUNTIME_SETTINGS:
            if setting.source == "environment" and setting.name == dist.YIELD_VAR and setting.value == "0":
                self.logger.note(f"warning: {setting.name}=0 from the environment: ranks busy-poll while "
                                 "they wait and take the core from their own compute (~35% slower with one "
                                 "core per rank); unset it to let distributed.mpi_yield_when_idle decide")
        if info["path"]:
            line = (f"resuming from {info['path']} at iteration {info['iteration']}, "
                    f"global step {info['global_step']}")
            old_counts, new_counts = info["env_counts"], list(layout.counts)
            if old_counts != new_counts:
                line += (f"; ranks {info['world_size']} -> {topo.size}, envs per rank "
                         f"{_counts_text(old_counts)} -> {_counts_text(new_counts)}")
                old, new = (self.algorithm.global_batch(n) for n in (sum(old_counts), layout.total))
                if old is not None and old != new:
                    line += f", global batch {old} -> {new}"
            saved, now = info["numerics"] or {}, self._numerics()
            changed = [f"{key} {saved[key]} -> {now[key]}" for key in now if key in saved and saved[key] != now[key]]
            if changed:  # allowed (the user changed a setting or the hardware), but said
                line += f"; since the checkpoint: {', '.join(changed)} (the Adam kernel follows the precision)"
            self.logger.note(line)

    def _runtime_note(self) -> str:
        note = ", ".join(f"{name}={os.environ.get(name, 'unset')}" for name in (dist.YIELD_VAR, dist.CYCLE_VAR))
        hierarchical = dist.hierarchical_allreduce_status(dist.topology(), self.device)
        if hierarchical["requested"]:
            note += (", hierarchical allreduce " + ("active" if hierarchical["active"] else
                                                    f"requested but inactive ({hierarchical['why_not']})"))
        return note

    def _logger(self) -> MetricsLogger:
        if self.logger is None:  # elastic: this process may have become rank 0 after a reset
            self.logger = self._new_logger(purge_step=None)
        return self.logger

    def _new_logger(self, purge_step: int | None) -> MetricsLogger:
        """Rank 0's outputs; with [logging] wandb, the W&B run of this run directory too."""
        cfg = self.cfg
        tracker = None
        if cfg.logging.wandb:
            from hvd_rl.runtime.tracking import WandbTracker

            tracker = WandbTracker(self.run_dir, cfg.logging, cfg.to_dict(), self._layout_topology())
        return MetricsLogger(self.run_dir, cfg.logging.tensorboard, cfg.logging.console, purge_step=purge_step,
                             tracker=tracker)

    # ---- environments -----------------------------------------------------------------------

    def _wanted_layout(self, progress: Any) -> EnvLayout:
        """The current layout (restored, or chosen by the load balancer) if it fits this world;
        else distributed.env_counts if it does; else env.num_envs on every rank."""
        world = dist.world_size()
        for counts in (tuple(progress.env_counts), tuple(self.cfg.distributed.env_counts)):
            if len(counts) == world:
                return EnvLayout(counts)
        return EnvLayout.even(world, self.cfg.env.num_envs)

    def _ensure_envs(self, progress: Any, layout: EnvLayout) -> bool:
        """(Re)builds this rank's environments when the layout changed. Returns True if built."""
        topo = dist.topology()
        if self._layout == layout and self._built_rank == topo.rank:
            return False
        cfg = self.cfg
        seeds = env_seeds(cfg.seed, progress.seed_offset, layout.first(topo.rank), layout.counts[topo.rank])
        if not progress.rng_restored:
            torch.manual_seed(_rank_seed(cfg.seed, progress.seed_offset, topo.rank))
        progress.rng_restored = False  # a later rebuild (resize) reseeds
        self.algorithm.build_envs(layout, topo.rank, seeds)
        if self._local_state_iteration is not None:  # first build after a resume: replay shards
            ok = layout.counts == progress.env_counts and self.algorithm.load_local(self.run_dir, self._local_state_iteration, topo.rank)
            missing = dist.allreduce_sum([0.0 if ok else 1.0], name="envs.local_state")[0]
            if missing:
                self.algorithm.discard_local()
            if topo.rank == 0 and self.cfg.algorithm == "dqn":
                self._logger().note("replay shards restored" if not missing else
                                    "replay shards not restored: refilling before learning")
            self._local_state_iteration = None
        all_seeds = dist.allgather_object(seeds, name="envs.seeds")
        if topo.rank == 0:
            with open(self.run_dir / ENV_SEEDS_FILE, "a") as f:
                f.write(json.dumps({"iteration": progress.iteration, "world_size": layout.world_size,
                                    "env_counts": list(layout.counts), "seeds_by_rank": all_seeds}) + "\n")
        progress.seed_offset += layout.total
        progress.env_counts = layout.counts
        self._layout, self._built_rank = layout, topo.rank
        return True

    # ---- one iteration ----------------------------------------------------------------------

    def _iteration(self, progress: Any, env_steps: int) -> tuple[dict[str, Any], bool]:
        """Runs one iteration on every rank; returns its metrics and whether all ranks agreed to
        stop (a preemption request arrived on any rank)."""
        cfg, topo = self.cfg, dist.topology()
        layout = self._layout
        iteration = progress.iteration + 1
        t_start = time.perf_counter()
        cpu_start = time.process_time()
        faults_start = page_faults()
        clock_before = (dist.CLOCK.count, dist.CLOCK.seconds)
        compression_before = (compression.CLOCK.seconds, compression.CLOCK.bytes, compression.CLOCK.dense_bytes)
        context = IterationContext(iteration=iteration, global_step=progress.global_step,
                                   env_steps=env_steps, layout=layout, rank=topo.rank,
                                   world_size=topo.size, stop_requested=lambda: self.preemption.raised)
        report = self.algorithm.iterate(context)
        # Compression compute runs inside the gradient reduction, which the algorithm timed as
        # blocked: it is this rank's work (time_compress), not communication or waiting.
        compress = compression.CLOCK.seconds - compression_before[0]
        sent = compression.CLOCK.bytes - compression_before[1]
        dense = compression.CLOCK.dense_bytes - compression_before[2]
        blocked = dist.CLOCK.seconds - clock_before[1] - compress
        cpu = time.process_time() - cpu_start
        faults = page_faults() - faults_start
        per_rank, sums, episodes = self._gather(report, [blocked, cpu, faults, compress, sent, dense],
                                                self.preemption.raised)
        collectives = dist.CLOCK.count - clock_before[0]
        if cfg.debug.iteration_sleep:
            time.sleep(cfg.debug.iteration_sleep)

        global_batch = layout.total * env_steps
        progress.iteration = iteration
        progress.global_step += global_batch
        wall = time.perf_counter() - t_start
        keys = list(report.metrics)
        means = dict(zip(keys, per_rank[:, :len(keys)].mean(axis=0).tolist()))
        bad = [k for k in report.finite
               if not all(math.isfinite(v) for v in (per_rank[:, keys.index(k)] if k in means else [sums[k]]))]
        if bad:
            raise NonFiniteLossError(f"non-finite loss/gradient at iteration {iteration} ({', '.join(bad)}); "
                                     "stopping all ranks")
        # Time blocked in collectives: the fastest rank's is communication (it never waited for
        # anybody); what the others spent beyond that was waiting for slower ranks.
        blocked_by_rank, cpu_by_rank, faults_by_rank, compress_by_rank, sent_by_rank, dense_by_rank = (
            per_rank[:, i] for i in range(-7, -1))
        comm = float(blocked_by_rank.min())
        waits = blocked_by_rank - comm
        busy = per_rank[:, [i for i, k in enumerate(keys) if k.startswith("time_")]].sum(axis=1) + compress_by_rank
        local_steps = np.asarray(layout.counts, dtype=np.float64) * env_steps
        record: dict[str, Any] = {
            "iteration": iteration, "global_step": progress.global_step, "world_size": topo.size,
            "sps": global_batch / wall, "sps_per_rank": global_batch / topo.size / wall,
            "episodic_return_mean": float(episodes[:, 0].mean()) if len(episodes) else None,
            "episodic_length_mean": float(episodes[:, 1].mean()) if len(episodes) else None,
            "episodes": int(len(episodes)),
        }
        record.update(self.algorithm.global_metrics(means, sums))
        record.update(report.extra)
        record.update({
            "collectives": collectives, "time_allreduce": comm, "time_wait": float(waits.mean()),
            # Gradient bytes each rank handed to the collectives (mean over ranks), the ratio to
            # the uncompressed fp32 gradients of the same reductions, and the compression compute.
            "comm_bytes": float(sent_by_rank.mean()), "time_compress": float(compress_by_rank.mean()),
            "compression_ratio": float(dense_by_rank.sum() / sent_by_rank.sum()) if sent_by_rank.sum() else None,
            "time_iteration": wall, "env_counts": list(layout.counts),
            # Load monitoring, one value per rank: waiting at collectives, busy (compute) time,
            # speed (env steps per busy second) and CPU use (cores busy on average).
            "time_wait_by_rank": [float(w) for w in waits],
            "time_busy_by_rank": [float(b) for b in busy],
            "env_steps_per_busy_s_by_rank": [float(s) for s in local_steps / np.maximum(busy, 1e-9)],
            "cpu_util_by_rank": [float(c) for c in cpu_by_rank / wall],
            # Memory touched anew (hvd_rl/runtime/heap.py): near 0 in steady state when freed memory is kept.
            "page_faults_by_rank": [int(f) for f in faults_by_rank],
        })
        if cfg.distributed.verify_every and iteration % cfg.distributed.verify_every == 0:
            record["parameters_identical"] = dist.parameters_agree(self.algorithm.parameters_module(),
                                                                   "verify.params")[0]
        if topo.rank == 0:
            logger = self._logger()
            total = cfg.total_timesteps
            logger.log(record, total, self._remaining.update(time.time(), progress.global_step, total))
            logger.episodes(progress.global_step, episodes[:, 0], episodes[:, 1])
        stop = report.stop_agreed or bool(per_rank[:, -1].max() > 0)
        self._communication.append((record["comm_bytes"], record["time_compress"], record["compression_ratio"]))
        return record, stop

    @staticmethod
    def _gather(report: IterationReport, runtime_values: list[float], stop: bool) -> tuple[np.ndarray, dict, np.ndarray]:
        """ONE allgather per iteration: every rank's metrics, sums, finished games and stop flag.

        Rows are [kind, values...]: kind 0 holds a rank's [metrics..., sums..., runtime values
        (blocked seconds, CPU seconds, page faults, compression seconds, gradient bytes sent and
        uncompressed), stop] (ranks in order), kind 1 a finished game (return,
        length). Returns (per-rank [metrics..., runtime values..., stop] rows, summed sums,
        games [n, 2]).
        """
        values = list(report.metrics.values()) + list(report.sums.values()) + runtime_values + [1.0 if stop else 0.0]
        width = max(len(values), 2) + 1
        rows = np.zeros((1 + len(report.episode_returns), width), dtype=np.float64)
        rows[0, 1:1 + len(values)] = values
        if report.episode_returns:
            rows[1:, 0] = 1.0
            rows[1:, 1] = report.episode_returns
            rows[1:, 2] = report.episode_lengths
        gathered = dist.allgather_rows(rows, name="iteration.metrics")
        kinds = gathered[:, 0]
        ranks = gathered[kinds == 0, 1:1 + len(values)]
        n_metrics, n_sums = len(report.metrics), len(report.sums)
        sums = dict(zip(report.sums, ranks[:, n_metrics:n_metrics + n_sums].sum(axis=0).tolist()))
        per_rank = np.concatenate([ranks[:, :n_metrics], ranks[:, n_metrics + n_sums:]], axis=1)
        return per_rank, sums, gathered[kinds == 1, 1:3]

    # ---- checkpoints ------------------------------------------------------------------------

    def _checkpoint(self, progress: Any) -> None:
        """Collective: gathers every rank's RNG state, then rank 0 writes atomically."""
        rng = dist.allgather_object(torch.get_rng_state(), name="checkpoint.rng")
        cuda_rng = dist.allgather_object(
            torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None,
            name="checkpoint.cuda_rng")
        compression_states = compression.gather_states(self._compressors())
        topo = dist.topology()
        if topo.rank == 0:
            state = {
                "format_version": 2, "hvd_rl_version": __version__, "algorithm": self.algorithm.name,
                "iteration": progress.iteration, "global_step": progress.global_step,
                "seed_offset": progress.seed_offset, "world_size": topo.size,
                "env_counts": list(progress.env_counts), "config": self.cfg.to_dict(),
                "signature": self.algorithm.signature(), "state": self.algorithm.state_dict(),
                "lr_schedule": {"global_step": progress.global_step, "total_timesteps": self.cfg.total_timesteps},
                "rng": {"torch": rng, "cuda": cuda_rng}, "numerics": self._numerics(), "saved_at": time.time(),
                "compression": compression_states,  # every rank's residuals (error feedback), PowerSGD's Q
            }
            path = save_checkpoint(self.run_dir, state, keep=self.cfg.checkpoint.keep)
            self._logger().note(f"checkpoint {path}")
        self.algorithm.save_local(self.run_dir, progress.iteration, topo.rank)
        # Nobody moves on (or exits, which makes mpirun/srun kill the job) before the file is down.
        dist.allreduce_sum([0.0], name="checkpoint.written")
        self._last_checkpoint_iteration = progress.iteration

    def _preempt(self, progress: Any) -> None:
        """Checkpoint, marker, and only then (after a collective) may any rank exit."""
        if self._last_checkpoint_iteration != progress.iteration:
            self._checkpoint(progress)
        message = (f"preempted at iteration {progress.iteration}, global step {progress.global_step} "
                   f"({self.preemption.describe()}); resume with --resume auto")
        if dist.topology().rank == 0:
            # For launchers that do not pass exit code 75 through (horovodrun returns 1). Written
            # before any rank exits: srun --kill-on-bad-exit kills the others at the first exit.
            (self.run_dir / PREEMPTED_MARKER).write_text(json.dumps(
                {"iteration": progress.iteration, "global_step": progress.global_step}) + "\n")
            (self.run_dir / STOP_FILE).unlink(missing_ok=True)  # acted on
        dist.allreduce_sum([0.0], name="preempted.marker_written")
        raise Preempted(message)

    # ---- loops ------------------------------------------------------------------------------

    def _next_env_steps(self, progress: Any, layout: EnvLayout) -> int:
        return self.algorithm.rollout_length(self.cfg.total_timesteps - progress.global_step, layout)

    def _run(self, progress: Any, commit: Callable[[], None]) -> bool:
        """The iteration loop. Returns False when there was nothing left to run at all."""
        cfg = self.cfg
        ran = False
        while True:
            layout = self._wanted_layout(progress)
            env_steps = self._next_env_steps(progress, layout)
            if env_steps <= 0:
                return ran
            if self._ensure_envs(progress, layout):
                commit()  # elastic: the new seed offset survives a reset
            record, stop = self._iteration(progress, env_steps)
            ran = True
            self._rebalance(progress, layout, record)
            commit()
            every = cfg.checkpoint.every
            if stop and self._next_env_steps(progress, layout) <= 0:
                return ran  # the last iteration: finishing (checkpoint, summary) is the checkpoint asked for
            if stop:
                self._preempt(progress)
            if every and progress.iteration % every == 0:
                self._checkpoint(progress)

    def _rebalance(self, progress: Any, layout: EnvLayout, record: dict[str, Any]) -> None:
        """Feeds the balancer; when a decision is due, rank 0 decides and every rank adopts it
        (the environments are rebuilt with fresh seeds before the next iteration)."""
        if not self.balancer.enabled:
            return
        self.balancer.observe(layout.counts, np.asarray(record["time_busy_by_rank"]))
        if not self.balancer.due(progress.iteration):
            return
        decision = self.balancer.decide(layout.counts) if dist.topology().rank == 0 else None
        decision = dist.broadcast_object(decision and (decision.counts, decision.reason), name="balance.decision")
        if decision is None:
            return
        counts, reason = decision
        progress.env_counts = tuple(counts)
        if dist.topology().rank == 0:
            self._logger().note(f"rebalance after iteration {progress.iteration}: envs per rank "
                                f"{_counts_text(list(layout.counts))} -> {_counts_text(list(counts))}; {reason}")
            with open(self.run_dir / BALANCE_FILE, "a") as f:
                f.write(json.dumps({"iteration": progress.iteration, "global_step": progress.global_step,
                                    "from": list(layout.counts), "to": list(counts), "reason": reason}) + "\n")

    def _finish(self, progress: Any, ran: bool) -> None:
        topo = dist.topology()
        finished_before = self._summary_step == progress.global_step  # else summary.json is due
        if (not ran and finished_before and self._start_step == progress.global_step
                and self._last_checkpoint_iteration == progress.iteration):
            if topo.rank == 0:
                left = self.cfg.total_timesteps - progress.global_step
                extra = f" ({left} steps remain, less than one iteration of whole minibatches)" if left else ""
                self._logger().note(f"run already complete at global step {progress.global_step}{extra}; "
                                    "nothing to do")
            return
        identical, digests = dist.parameters_agree(self.algorithm.parameters_module(), "final.verify")
        ranks = dist.allgather_object({"hostname": socket.gethostname(), "local_rank": topo.local_rank,
                                       "local_size": topo.local_size}, name="final.hostnames")
        if self._last_checkpoint_iteration != progress.iteration:
            self._checkpoint(progress)
        if topo.rank == 0:
            summary = {
                "status": "completed", "algorithm": self.algorithm.name, "iteration": progress.iteration,
                "global_step": progress.global_step, "total_timesteps": self.cfg.total_timesteps,
                "world_size": topo.size, "parameters_identical": identical,
                "parameter_digests": digests, "wall_seconds": time.time() - self._start_time,
                # What one gradient allreduce moves (the scaling report's projection uses it).
                "gradient_bytes": sum(p.numel() * p.element_size()
                                      for p in self.algorithm.parameters_module().parameters() if p.requires_grad),
                "topology": self._topology(ranks),
                "communication": self._communication_summary(),
            }
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
            self._logger().summary(summary)
            self._logger().note(f"done: global step {progress.global_step}, parameters identical "
                                f"on all ranks: {identical}")
        if not identical:
            raise RuntimeError(f"ranks ended with different parameters: {digests}")

    def _communication_summary(self) -> dict[str, Any]:
        """Gradient traffic of this invocation's iterations (means per iteration and rank), for
        the scaling report: what was sent, the ratio to the uncompressed gradient, compress time."""
        d = self.cfg.distributed
        out: dict[str, Any] = {"compression": d.compression, "iterations": len(self._communication)}
        if d.compression == "powersgd":
            out["powersgd_rank"] = d.powersgd_rank
        if d.compression == "topk":
            out["topk_ratio"] = d.topk_ratio
        if self._communication:
            sent, compress, ratios = zip(*self._communication)
            ratios = [r for r in ratios if r is not None]
            out.update({"comm_bytes": float(np.mean(sent)), "time_compress": float(np.mean(compress)),
                        "compression_ratio": float(np.mean(ratios)) if ratios else None})
        return out

    def _layout_topology(self) -> dict[str, Any]:
        """What this rank knows of the run's layout without a collective (W&B's config at start)."""
        topo = dist.topology()
        return {"ranks": topo.size, "nodes": topo.cross_size, "ranks_per_node": topo.local_size,
                "threads_per_rank": self.threads, "device": str(self.device),
                "precision": getattr(self.algorithm, "precision_mode", "off")}

    def _topology(self, ranks: list[dict[str, Any]]) -> dict[str, Any]:
        topo = dist.topology()
        hostnames = [r["hostname"] for r in ranks]
        return {**self._layout_topology(),
                "runtime_settings": {name: os.environ.get(name) for name in (dist.YIELD_VAR, dist.CYCLE_VAR)},
                "hierarchical_allreduce": dist.hierarchical_allreduce_status(topo, self.device),
                "freed_memory_retained": self.heap_retained,
                "cpus_per_node": os.cpu_count(), "hostnames": sorted(set(hostnames)),
                "per_rank": [{"rank": i, **r} for i, r in enumerate(ranks)],
                "versions": {"python": platform.python_version(), "torch": torch.__version__,
                             "horovod": horovod.__version__}}

    def train(self) -> None:
        progress = Progress()
        peers = watchdog.PeerWatchdog(self.cfg.distributed.peer_timeout)
        try:
            self._setup(progress)
            peers.start()  # after setup's collectives: the ranks are in step
            ran = self._run(progress, commit=lambda: None)
            self._finish(progress, ran)
        finally:
            peers.stop()
            self.close()

    def train_elastic(self) -> None:
        """Under `horovodrun --min-np/--max-np/--host-discovery-script`: every collective runs
        inside the function hvd.elastic.run retries, so workers can join, leave and be replaced."""
        import horovod.torch as hvd

        state = ElasticRunState(self.algorithm, iteration=0, global_step=0, seed_offset=0, env_counts=(),
                                rng_restored=False, setup_done=False)

        def on_reset() -> None:
            # The rank layout may have changed: rebuild environments. The device stays: this
            # process's networks, optimizer state and CUDA RNG live on it (re-selecting it from a
            # new local rank moved the current device away from them).
            self._layout = None

        state.register_reset_callbacks([on_reset])

        commit = state.commit

        @hvd.elastic.run
        def run(state: ElasticRunState) -> None:
            if not state.setup_done:
                self._setup(state)  # the first start: every worker of the job takes part
                state.setup_done = True
                commit()
            else:
                self._agree_on_numerics()  # a worker that joined decided on its own machine
                if dist.topology().rank == 0:
                    self._logger().note(f"elastic reset: now {dist.world_size()} rank(s)")
            ran = self._run(state, commit)
            self._finish(state, ran)

        try:
            run(state)
        finally:
            self.close()

    def close(self) -> None:
        self.algorithm.close()
        if self.logger is not None:
            self.logger.close()
            self.logger = None


def _ranks_text(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    spans: list[list[int]] = []
    for r in ranks:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _counts_text(counts: list[int]) -> str:
    return str(counts[0]) if len(set(counts)) == 1 else "/".join(map(str, counts))


class ElasticRunState(ObjectState):
    """hvd.elastic state: the algorithm's whole state (networks, optimizer, statistics) plus the
    run counters. Saved on every commit, restored after a failure, synced from rank 0 (also to
    a worker that just joined) through the algorithm's own broadcast, which knows that a fresh
    Adam must not be initialised by Horovod's zero-gradient step."""

    def __init__(self, algorithm: Algorithm, **counters: Any):
        import horovod.torch as hvd

        self._algorithm = algorithm
        self._saved_algorithm = copy.deepcopy(algorithm.state_dict())
        super().__init__(bcast_object=lambda obj: hvd.broadcast_object(obj, name="elastic.counters"),
                         get_rank=hvd.rank, **counters)

    def save(self) -> None:
        self._saved_algorithm = copy.deepcopy(self._algorithm.state_dict())
        super().save()

    def restore(self) -> None:
        self._algorithm.load_state_dict(self._saved_algorithm)
        super().restore()

    def sync(self) -> None:
        self._algorithm.broadcast()
        compression.sync_after_reset(compression.compressors_of(self._algorithm.distributed_optimizers()))
        super().sync()
