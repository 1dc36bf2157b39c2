"""The training loop: setup, resume, iterations, collective stop decisions, checkpoints, elastic mode.

One iteration on every rank: collect `num_steps` x `num_envs` transitions, compute GAE, run the
PPO epochs (gradients averaged by Horovod), then one allreduce of the iteration's metrics that
also carries the stop flags (preemption signal, non-finite loss). Every rank therefore leaves the
loop at the same iteration boundary, and none is left waiting in a collective.
"""
from __future__ import annotations

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
import torch

from hvd_rl import __version__, distributed as dist
from hvd_rl.checkpoint import (CheckpointError, check_compatible, find_resumable, list_checkpoints,
                               load_checkpoint, save_checkpoint, warn)
from hvd_rl.config import TrainConfig
from hvd_rl.envs import RankEnvs, env_seeds
from hvd_rl.metrics import METRICS_FILE, MetricsLogger, log_line, truncate_metrics
from hvd_rl.models import build_model, model_signature
from hvd_rl.ppo import NonFiniteLossError, PPOLearner
from hvd_rl.precision import precision_for
from hvd_rl.rollout import RolloutBuffer, RolloutCollector

# Exit codes, identical on every rank (documented in the README and used by the SLURM templates).
EXIT_OK = 0
EXIT_FAILURE = 1  # unexpected error (a bug, a crashed rank)
EXIT_BAD_INPUT = 2  # config, environment, checkpoint or run-directory problem
EXIT_NONFINITE = 3  # NaN/Inf loss: the last good checkpoint is left untouched
EXIT_PREEMPTED = 75  # checkpointed after SIGTERM/SIGUSR1; rerun with --resume auto (EX_TEMPFAIL)

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
PREEMPTED_MARKER = "preempted.json"  # written by rank 0 next to the checkpoint when preempted


class Preempted(Exception):
    """All ranks agreed to stop after a preemption signal; a checkpoint was written."""


class PreemptionFlag:
    """Records that SIGTERM/SIGUSR1 arrived; acted on collectively at the next iteration boundary."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def install(self) -> None:
        for sig in PREEMPTION_SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame: Any) -> None:
        if self.signum is None:
            self.signum = signum
            log_line(f"rank {dist.topology().rank}: received {signal.Signals(signum).name}; "
                     "checkpointing at the end of this iteration")

    @property
    def raised(self) -> bool:
        return self.signum is not None


@dataclass
class Progress:
    """Counters that checkpoints and elastic commits carry (hvd.elastic.TorchState mirrors them)."""

    iteration: int = 0
    global_step: int = 0
    seed_offset: int = 0  # first env seed offset not used yet by any earlier environment build


def _rank_seed(base: int, seed_offset: int, rank: int) -> int:
    """Action-sampling RNG seed for a rank; distinct per rank and per environment build."""
    return int(np.random.SeedSequence([base, seed_offset, rank]).generate_state(1)[0])


class Trainer:
    def __init__(self, cfg: TrainConfig, resume: str | None = None):
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        self.topo = dist.init(cfg.distributed.mpi_yield_when_idle, cfg.distributed.cycle_time_ms,
                              cfg.distributed.hierarchical_allreduce)
        if cfg.distributed.reduction == "adasum":
            dist.check_adasum(self.topo)
        self.threads = dist.configure_threads(self.topo, cfg.distributed.threads_per_rank)
        self.device = dist.select_device(self.topo, cfg.distributed.device)
        self.preemption = PreemptionFlag()
        self.preemption.install()
        self.logger: MetricsLogger | None = None
        self.collector: RolloutCollector | None = None
        self._env_layout: tuple[int, int] | None = None
        self._last_checkpoint_iteration = -1
        self._start_time = time.time()
        self._start_step = 0

        # 1. Rank 0 prepares the run directory and reads the checkpoint; everybody agrees on errors.
        ckpt, ckpt_path, error = None, None, None
        if self.topo.is_root:
            try:
                ckpt_path, ckpt = self._prepare_run_dir(resume)
            except (OSError, CheckpointError) as exc:
                error = str(exc)
        dist.agree_on_error(error, name="setup.run_dir")
        info = dist.broadcast_object(self._resume_info(ckpt, ckpt_path), name="setup.resume_info")
        self.progress = Progress(info["iteration"], info["global_step"], info["seed_offset"])
        self._start_step = self.progress.global_step
        self._last_checkpoint_iteration = info["iteration"] if ckpt_path else -1

        # 2. Model and optimizer, identical on every rank (rank 0's values are broadcast below).
        torch.manual_seed(cfg.seed)
        probe = RankEnvs(_single_env_cfg(cfg), threads=1)
        self.obs_space, self.action_space = probe.single_observation_space, probe.single_action_space
        probe.close()
        self.model = build_model(cfg.model, self.obs_space, self.action_space).to(self.device)
        self.precision = precision_for(cfg.distributed.amp, self.device,
                                       convolutional=len(self.obs_space.shape) == 3)
        self.model.precision = self.precision
        self.signature = model_signature(self.obs_space, self.action_space, self.model)
        base_optimizer = torch.optim.Adam(self.model.parameters(), lr=cfg.ppo.learning_rate,
                                          eps=cfg.ppo.adam_eps)
        self.optimizer = dist.distributed_optimizer(
            base_optimizer, self.model, reduction=cfg.distributed.reduction,
            compression=cfg.distributed.compression,
            backward_passes_per_step=cfg.ppo.backward_passes_per_step)
        self.learner = PPOLearner(self.model, self.optimizer, cfg.ppo, cfg.seed,
                                  scaler=self.precision.grad_scaler(), device=self.device,
                                  adasum=cfg.distributed.reduction == "adasum")

        error = None
        if ckpt is not None:
            try:
                check_compatible(ckpt, self.signature, cfg.env.id)
                self.model.load_state_dict(ckpt["model"])
                self.optimizer.load_state_dict(ckpt["optimizer"])
                if self.learner.scaler is not None and ckpt.get("scaler"):
                    self.learner.scaler.load_state_dict(ckpt["scaler"])
            except (CheckpointError, RuntimeError, ValueError, KeyError) as exc:
                error = f"cannot resume from {ckpt_path}: {exc}"
        dist.agree_on_error(error, name="setup.checkpoint")
        dist.broadcast_state(self.model, self.optimizer, has_optimizer_state=info["path"] is not None)

        # 3. Per-rank RNG: restored exactly when the rank layout is unchanged, else reseeded.
        rng_states, cuda_states = info["rng"], info["cuda_rng"]
        if rng_states and len(rng_states) == self.topo.size:
            torch.set_rng_state(rng_states[self.topo.rank])
            if self.device.type == "cuda" and cuda_states and cuda_states[self.topo.rank] is not None:
                torch.cuda.set_rng_state(cuda_states[self.topo.rank], self.device)
        else:
            # manual_seed also seeds every CUDA device.
            torch.manual_seed(_rank_seed(cfg.seed, self.progress.seed_offset, self.topo.rank))

        if self.topo.is_root:
            self._write_run_files(info)
        self.buffer: RolloutBuffer | None = None

    # ---- setup helpers ----------------------------------------------------------------------

    def _prepare_run_dir(self, resume: str | None) -> tuple[Path | None, dict | None]:
        run_dir = self.run_dir
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=run_dir, prefix=".write_test"):
                pass
        except OSError as exc:
            raise OSError(f"cannot write to run directory {run_dir}: {exc.strerror or exc}") from None
        if resume is None:
            if list_checkpoints(run_dir) or (run_dir / METRICS_FILE).exists():
                raise CheckpointError(
                    f"run directory {run_dir} already holds a run; pass --resume auto to continue "
                    "it, or choose another --run-dir")
            return None, None
        if resume == "auto":
            path, state, warnings = find_resumable(run_dir)
            for message in warnings:
                warn(message)
            if path is None:
                log_line(f"no checkpoint in {run_dir}; starting a new run")
                return None, None
        else:
            path, state = Path(resume), load_checkpoint(resume)
        return path, state

    def _resume_info(self, ckpt: dict | None, path: Path | None) -> dict[str, Any]:
        if ckpt is None:
            return {"iteration": 0, "global_step": 0, "seed_offset": 0, "rng": None, "cuda_rng": None, "path": None,
                    "world_size": None, "envs_per_rank": None}
        return {"iteration": int(ckpt["iteration"]), "global_step": int(ckpt["global_step"]),
                "seed_offset": int(ckpt["seed_offset"]), "rng": ckpt["rng"].get("torch"),
                "cuda_rng": ckpt["rng"].get("cuda"),
                "path": str(path), "world_size": int(ckpt["world_size"]),
                "envs_per_rank": int(ckpt["envs_per_rank"])}

    def _write_run_files(self, info: dict[str, Any]) -> None:
        """Rank 0, once every check passed: only now are existing run files touched."""
        cfg, topo = self.cfg, self.topo
        # Metrics of iterations after the checkpoint will be produced again: drop them.
        truncate_metrics(self.run_dir, info["iteration"], info["global_step"])
        (self.run_dir / PREEMPTED_MARKER).unlink(missing_ok=True)
        tmp = self.run_dir / ".config.toml.tmp"
        tmp.write_text(cfg.to_toml())
        os.replace(tmp, self.run_dir / "config.toml")
        self.logger = MetricsLogger(self.run_dir, cfg.logging.tensorboard, cfg.logging.console)
        self.logger.note(
            f"{topo.size} rank(s) on {topo.cross_size} node(s), {self.threads} thread(s)/rank, "
            f"device {self.device}, precision {self.precision.mode}, {self._runtime_note()}, env {cfg.env.id} ({cfg.env.backend}), "
            f"global batch {cfg.global_batch_size(topo.size)}")
        if info["path"]:
            line = (f"resuming from {info['path']} at iteration {info['iteration']}, "
                    f"global step {info['global_step']}")
            if info["world_size"] != topo.size or info["envs_per_rank"] != cfg.env.num_envs:
                old_batch = info["world_size"] * info["envs_per_rank"] * cfg.ppo.num_steps
                line += (f"; ranks {info['world_size']} -> {topo.size}, envs per rank "
                         f"{info['envs_per_rank']} -> {cfg.env.num_envs}, global batch "
                         f"{old_batch} -> {cfg.global_batch_size(topo.size)}")
            self.logger.note(line)

    # ---- environments -----------------------------------------------------------------------

    def _ensure_envs(self, progress: Any) -> bool:
        """(Re)builds this rank's environments when the rank layout changed. Returns True if built."""
        topo = dist.topology()
        layout = (topo.rank, topo.size)
        if self.collector is not None and layout == self._env_layout:
            return False
        if self.collector is not None:
            self.collector.close()
        cfg = self.cfg
        seeds = env_seeds(cfg.seed, progress.seed_offset, topo.rank, cfg.env.num_envs)
        envs = RankEnvs(cfg.env, threads=self.threads)
        obs_dtype = torch.uint8 if envs.single_observation_space.dtype == np.uint8 else torch.float32
        self.buffer = RolloutBuffer(cfg.ppo.num_steps, cfg.env.num_envs,
                                    tuple(envs.single_observation_space.shape), obs_dtype, self.device)
        self.collector = RolloutCollector(envs, self.model, self.buffer, self.device, seeds)
        all_seeds = dist.allgather_object(seeds, name="envs.seeds")
        if topo.rank == 0:
            self._record_seeds(progress, all_seeds)
        progress.seed_offset += topo.size * cfg.env.num_envs
        self._env_layout = layout
        return True

    def _record_seeds(self, progress: Any, all_seeds: list[list[int]]) -> None:
        path = self.run_dir / "env_seeds.jsonl"
        with open(path, "a") as f:
            f.write(json.dumps({"iteration": progress.iteration, "world_size": len(all_seeds),
                                "seeds_by_rank": all_seeds}) + "\n")

    # ---- one iteration ----------------------------------------------------------------------

    def _iteration(self, progress: Any, num_steps: int | None = None) -> tuple[dict[str, Any], bool]:
        """Runs one PPO iteration on every rank; returns its metrics and whether all ranks agreed
        to preempt (a signal arrived on any rank). `num_steps` shortens the rollout (the last
        iteration, so that the run ends exactly at total_timesteps)."""
        cfg, ppo = self.cfg, self.cfg.ppo
        topo = dist.topology()
        num_envs = cfg.env.num_envs
        num_steps = num_steps or ppo.num_steps
        global_batch = topo.size * num_envs * num_steps
        iteration = progress.iteration + 1
        t_start = time.perf_counter()

        lr = ppo.learning_rate
        if ppo.anneal_lr:  # by global step, so a resume with another rank count keeps the schedule
            lr *= 1.0 - progress.global_step / ppo.total_timesteps
        for group in self.optimizer.param_groups:
            group["lr"] = lr

        clock_before = (dist.CLOCK.count, dist.CLOCK.seconds)
        last_value, rollout_times, episodes = self.collector.collect(num_steps)
        batch = self.buffer.to_batch(last_value, ppo.gamma, ppo.gae_lambda, num_steps)
        inject = cfg.debug.nan_at_iteration == iteration and cfg.debug.nan_rank == topo.rank
        self.learner.loss_hook = (lambda loss: loss * float("nan")) if inject else None
        stats = self.learner.update(batch, iteration, topo.rank * num_envs, num_envs, num_steps,
                                    stop_requested=lambda: self.preemption.raised)

        returns, values = batch.returns.double(), batch.values.double()
        residual = returns - values
        blocked = dist.CLOCK.seconds - clock_before[1]
        local = [
            stats.policy_loss, stats.value_loss, stats.entropy, stats.old_approx_kl, stats.clipfrac,
            rollout_times.env, rollout_times.inference, stats.time_update, blocked,
            float(returns.sum()), float((returns ** 2).sum()), float(residual.sum()),
            float((residual ** 2).sum()), float(returns.numel()),
            1.0 if self.preemption.raised else 0.0,
        ]
        per_rank, all_episodes = self._gather_iteration(local, episodes)
        collectives = dist.CLOCK.count - clock_before[0]
        if cfg.debug.iteration_sleep:
            time.sleep(cfg.debug.iteration_sleep)

        progress.iteration = iteration
        progress.global_step += global_batch
        wall = time.perf_counter() - t_start
        n = topo.size
        sums = per_rank.sum(axis=0)
        mean = sums / n
        count = sums[13]
        var_y = sums[10] / count - (sums[9] / count) ** 2
        var_res = sums[12] / count - (sums[11] / count) ** 2
        # Time blocked in collectives: the fastest rank's is communication (it never waited for
        # anybody); what the others spent beyond that was waiting for slower ranks.
        comm = float(per_rank[:, 8].min())
        waits = per_rank[:, 8] - comm
        record = {
            "iteration": iteration, "global_step": progress.global_step, "world_size": n,
            "sps": global_batch / wall, "sps_per_rank": global_batch / n / wall,
            "episodic_return_mean": float(all_episodes[:, 0].mean()) if len(all_episodes) else None,
            "episodic_length_mean": float(all_episodes[:, 1].mean()) if len(all_episodes) else None,
            "episodes": int(len(all_episodes)),
            "policy_loss": mean[0], "value_loss": mean[1], "entropy": mean[2],
            "approx_kl": stats.approx_kl, "old_approx_kl": mean[3], "clipfrac": mean[4],
            "explained_variance": float(1.0 - var_res / var_y) if var_y > 0 else None,
            "learning_rate": lr, "epochs_run": stats.epochs_run, "grad_norm": stats.grad_norm,
            "precision": self.precision.mode, "collectives": collectives,
            "time_env": mean[5], "time_inference": mean[6], "time_update": mean[7],
            "time_allreduce": comm, "time_wait": float(waits.mean()), "time_iteration": wall,
            "time_wait_by_rank": [float(w) for w in waits],
        }
        if not np.all(np.isfinite(sums[:5])):
            raise NonFiniteLossError(f"non-finite loss at iteration {iteration}; stopping all ranks")
        if cfg.distributed.verify_every and iteration % cfg.distributed.verify_every == 0:
            record["parameters_identical"] = dist.parameters_agree(self.model, "verify.params")[0]
        if topo.rank == 0:
            logger = self._logger()
            elapsed = time.time() - self._start_time
            done = progress.global_step - self._start_step
            eta = (ppo.total_timesteps - progress.global_step) * elapsed / done if done else float("nan")
            logger.log(record, ppo.total_timesteps, eta)
            logger.episodes(progress.global_step, all_episodes[:, 0], all_episodes[:, 1])
        return record, stats.stop_requested or bool(sums[14] > 0)

    @staticmethod
    def _gather_iteration(local: list[float], episodes: Any) -> tuple[np.ndarray, np.ndarray]:
        """ONE allgather per iteration: every rank's metric vector and its finished episodes.

        Rows are [kind, values...]: kind 0 holds the rank's metrics (ranks in order), kind 1 an
        episode (return, length). Returns (metrics [ranks, len(local)], episodes [n, 2]).
        """
        width = len(local) + 1
        rows = np.zeros((1 + len(episodes.returns), width), dtype=np.float64)
        rows[0, 1:] = local
        if episodes.returns:
            rows[1:, 0] = 1.0
            rows[1:, 1] = episodes.returns
            rows[1:, 2] = episodes.lengths
        gathered = dist.allgather_rows(rows, name="iteration.metrics")
        kinds = gathered[:, 0]
        return gathered[kinds == 0, 1:], gathered[kinds == 1, 1:3]

    def iterate(self) -> dict[str, Any]:
        """One iteration outside the training loop (used by benchmarks); returns its metrics."""
        self._ensure_envs(self.progress)
        return self._iteration(self.progress)[0]

    def _runtime_note(self) -> str:
        note = ", ".join(f"{name}={os.environ.get(name, 'unset')}"
                         for name in (dist.YIELD_VAR, dist.CYCLE_VAR))
        hierarchical = dist.hierarchical_allreduce_status(dist.topology(), self.device)
        if hierarchical["requested"]:
            note += (", hierarchical allreduce " + ("active" if hierarchical["active"] else
                                                    f"requested but inactive ({hierarchical['why_not']})"))
        return note

    def _logger(self) -> MetricsLogger:
        if self.logger is None:  # elastic: this process may have become rank 0 after a reset
            self.logger = MetricsLogger(self.run_dir, self.cfg.logging.tensorboard,
                                        self.cfg.logging.console)
        return self.logger

    # ---- checkpoints ------------------------------------------------------------------------

    def _checkpoint(self, progress: Any) -> None:
        """Collective: gathers every rank's RNG state, then rank 0 writes atomically."""
        rng = dist.allgather_object(torch.get_rng_state(), name="checkpoint.rng")
        cuda_rng = dist.allgather_object(
            torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None,
            name="checkpoint.cuda_rng")
        topo = dist.topology()
        if topo.rank == 0:
            state = {
                "format_version": 1, "hvd_rl_version": __version__,
                "iteration": progress.iteration, "global_step": progress.global_step,
                "seed_offset": progress.seed_offset, "world_size": topo.size,
                "envs_per_rank": self.cfg.env.num_envs, "config": self.cfg.to_dict(),
                "signature": self.signature, "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scaler": self.learner.scaler.state_dict() if self.learner.scaler else {},
                "precision": self.precision.mode,
                "lr_schedule": {"global_step": progress.global_step,
                                "total_timesteps": self.cfg.ppo.total_timesteps},
                "rng": {"torch": rng, "cuda": cuda_rng}, "saved_at": time.time(),
            }
            path = save_checkpoint(self.run_dir, state, keep=self.cfg.checkpoint.keep)
            self._logger().note(f"checkpoint {path}")
        # Nobody moves on (or exits, which makes mpirun/srun kill the job) before the file is down.
        dist.allreduce_sum([0.0], name="checkpoint.written")
        self._last_checkpoint_iteration = progress.iteration

    # ---- loops ------------------------------------------------------------------------------

    def _rollout_length(self, progress: Any) -> int:
        """Steps per env for the next iteration: num_steps, or fewer for the last one, so that the
        run ends exactly at total_timesteps (when the remainder splits into whole minibatches),
        also after a resume or an elastic resize changed the global batch. 0: nothing fits."""
        ppo, num_envs = self.cfg.ppo, self.cfg.env.num_envs
        remaining = ppo.total_timesteps - progress.global_step
        steps = min(ppo.num_steps, remaining // (dist.world_size() * num_envs))
        # Whole minibatches, each splitting evenly into backward_passes_per_step micro-batches.
        granule = ppo.num_minibatches * (ppo.backward_passes_per_step
                                         // math.gcd(num_envs, ppo.backward_passes_per_step))
        return steps - steps % granule

    def _run(self, progress: Any, commit: Callable[[], None]) -> None:
        cfg = self.cfg
        while (num_steps := self._rollout_length(progress)) > 0:
            if self._ensure_envs(progress):
                commit()  # elastic: the new seed offset survives a reset
            _, preempt = self._iteration(progress, num_steps)
            commit()
            every = cfg.checkpoint.every
            if preempt or (every and progress.iteration % every == 0):
                self._checkpoint(progress)
            if preempt:
                message = (f"preempted at iteration {progress.iteration}, global step "
                           f"{progress.global_step}; resume with --resume auto")
                if dist.topology().rank == 0:
                    # For launchers that do not pass exit code 75 through (horovodrun returns 1).
                    (self.run_dir / PREEMPTED_MARKER).write_text(json.dumps(
                        {"iteration": progress.iteration, "global_step": progress.global_step}) + "\n")
                raise Preempted(message)

    def _finish(self, progress: Any) -> None:
        identical, digests = dist.parameters_agree(self.model, "final.verify")
        topo = dist.topology()
        ranks = dist.allgather_object({"hostname": socket.gethostname(), "local_rank": topo.local_rank,
                                       "local_size": topo.local_size}, name="final.hostnames")
        if self._last_checkpoint_iteration != progress.iteration:
            self._checkpoint(progress)
        if dist.topology().rank == 0:
            summary = {
                "status": "completed", "iteration": progress.iteration,
                "global_step": progress.global_step, "total_timesteps": self.cfg.ppo.total_timesteps,
                "world_size": dist.world_size(), "parameters_identical": identical,
                "parameter_digests": digests, "wall_seconds": time.time() - self._start_time,
                "topology": self._topology(ranks),
            }
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
            self._logger().note(f"done: global step {progress.global_step}, parameters identical "
                                f"on all ranks: {identical}")
        if not identical:
            raise RuntimeError(f"ranks ended with different parameters: {digests}")

    def _topology(self, ranks: list[dict[str, Any]]) -> dict[str, Any]:
        topo = dist.topology()
        hostnames = [r["hostname"] for r in ranks]
        return {"ranks": topo.size, "nodes": topo.cross_size, "ranks_per_node": topo.local_size,
                "threads_per_rank": self.threads, "device": str(self.device),
                "precision": self.precision.mode,
                "runtime_settings": {name: os.environ.get(name) for name in (dist.YIELD_VAR, dist.CYCLE_VAR)},
                "hierarchical_allreduce": dist.hierarchical_allreduce_status(topo, self.device),
                "cpus_per_node": os.cpu_count(), "hostnames": sorted(set(hostnames)),
                "per_rank": [{"rank": i, **r} for i, r in enumerate(ranks)],
                "versions": {"python": platform.python_version(), "torch": torch.__version__,
                             "horovod": horovod.__version__}}

    def train(self) -> None:
        try:
            self._run(self.progress, commit=lambda: None)
            self._finish(self.progress)
        finally:
            self.close()

    def train_elastic(self) -> None:
        import horovod.torch as hvd

        progress = self.progress
        state = hvd.elastic.TorchState(model=self.model, optimizer=self.optimizer,
                                       iteration=progress.iteration,
                                       global_step=progress.global_step,
                                       seed_offset=progress.seed_offset)

        def on_reset() -> None:
            self._env_layout = None  # rank layout may have changed: rebuild environments
            if dist.topology().rank == 0:
                self._logger().note(f"elastic reset: now {dist.world_size()} rank(s)")

        state.register_reset_callbacks([on_reset])

        @hvd.elastic.run
        def run(state: Any) -> None:
            self._run(state, commit=state.commit)

        try:
            run(state)
            self._finish(state)
        finally:
            self.close()

    def close(self) -> None:
        if self.collector is not None:
            self.collector.close()
            self.collector = None
        if self.logger is not None:
            self.logger.close()
            self.logger = None


def _single_env_cfg(cfg: TrainConfig):
    """A one-environment copy of the env config, used only to read the spaces."""
    from dataclasses import replace

    return replace(cfg.env, num_envs=1, backend="sync" if cfg.env.backend == "async" else cfg.env.backend)
