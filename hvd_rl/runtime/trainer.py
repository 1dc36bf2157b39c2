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

Each part lives in the module that owns it; this file is the loop that calls them: resume
(resume.py), checkpoints written and per-rank state (checkpointing.py), the iteration's metrics
(iteration_metrics.py), preemption (preemption.py), load balancing (balance.py), elastic state
(elastic.py), the run summary (summary.py).

Stop decisions are collective: a preemption signal (or a stop file written by the batch script)
on any rank makes every rank checkpoint at the same iteration and exit 75; a non-finite loss on
any rank makes every rank exit 3. In elastic mode (`hvd-rl train --elastic` under horovodrun)
steps 2-4 run inside `hvd.elastic.run`, so a worker that joins later or replaces a lost one
takes part in every collective.
"""
from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from hvd_rl import __version__
from hvd_rl.algorithms import build_algorithm
from hvd_rl.algorithms.base import Algorithm, IterationContext, NonFiniteLossError  # noqa: F401 - cli's names
from hvd_rl.config import TrainConfig
from hvd_rl.envs.multiagent import describe as describe_multiagent, is_multiagent_id
from hvd_rl.envs.vector import EnvLayout, RankEnvs, env_seeds
from hvd_rl.runtime import compression, elastic, iteration_metrics, resume, summary, watchdog
from hvd_rl.runtime import distributed as dist
from hvd_rl.runtime.balance import Balancer, agree_on_layout
from hvd_rl.runtime.checkpoint import CheckpointError, check_compatible
from hvd_rl.runtime.checkpointing import restore_rank_state, write_checkpoint
from hvd_rl.runtime.heap import retain_freed_memory
from hvd_rl.runtime.metrics import BALANCE_FILE, ENV_SEEDS_FILE, MetricsLogger, RemainingTime
from hvd_rl.runtime.preemption import (EXIT_PREEMPTED, PRUNE_FILE, STOP_FILE, Preempted,  # noqa: F401 - cli's
                                       PreemptionFlag, Pruned, preempted_exit_code, stop_after_checkpoint)

# Exit codes, identical on every rank (documented in docs/outputs.md, used by the SLURM templates).
EXIT_OK = 0
EXIT_FAILURE = 1  # unexpected error (a bug, a crashed rank)
EXIT_BAD_INPUT = 2  # config, environment, checkpoint or run-directory problem
EXIT_NONFINITE = 3  # NaN/Inf loss: the last good checkpoint is left untouched
EXIT_PEER_LOST = watchdog.EXIT_PEER_LOST  # 4: the other ranks stopped answering (a node down)
# EXIT_PREEMPTED = 75: checkpointed after SIGTERM/SIGUSR1 (hvd_rl/runtime/preemption.py)


class BadInput(ValueError):
    """Something the user must fix (model/observation mismatch...); the same on every rank."""


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
    """Observation and action spaces of the configured environment (one env, no collective); for
    a multi-agent environment, one agent's."""
    if is_multiagent_id(cfg.env.id):
        spec = describe_multiagent(cfg.env.id, cfg.multiagent.num_agents, cfg.env.max_episode_steps)
        return spec.observation_space, spec.action_space
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
        self.preemption = PreemptionFlag(self.run_dir / STOP_FILE, self.run_dir / PRUNE_FILE)
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
        self._communication = summary.CommunicationLog()
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
                ckpt_path, ckpt = resume.prepare_run_dir(self.run_dir, self.resume)
            except (OSError, CheckpointError) as exc:
                error = str(exc)
        dist.agree_on_error(error, name="setup.run_dir")
        info_dict = resume.resume_info(self.run_dir, ckpt, ckpt_path, cfg).to_dict() if topo.rank == 0 else None
        info = resume.ResumeInfo(**dist.broadcast_object(info_dict, name="setup.resume_info"))

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
        progress.rng_restored, rank_state_note = restore_rank_state(
            self.run_dir, info.iteration if info.path else None, info.world_size, self.device,
            self._compressors(), legacy=info.legacy_rank_state)

        progress.iteration, progress.global_step = info.iteration, info.global_step
        progress.seed_offset = info.seed_offset
        # The checkpoint's layout (the balancer's choice) survives a resume unless the user changed
        # the layout settings since: then those decide (_wanted_layout).
        progress.env_counts = () if info.layout_changed else tuple(info.env_counts or ())
        self._start_step = progress.global_step
        self._remaining.start(time.time(), progress.global_step)
        # From the broadcast info, never from rank 0's local view: every rank must take the same
        # branch in _finish (a resumed, already finished run must not checkpoint on one rank only).
        self._last_checkpoint_iteration = info.iteration if info.path else -1
        self._summary_step = info.summary_step
        self._local_state_iteration = info.iteration if info.path else None
        if topo.rank == 0:
            resume.prepare_run_files(self.run_dir, info, cfg, self._start_time)
            self.logger = self._new_logger(purge_step=info.global_step + 1 if info.path else None)
            self._note_start(info, self._wanted_layout(progress))
            if rank_state_note:
                self.logger.note(rank_state_note)

    def _note_start(self, info: resume.ResumeInfo, layout: EnvLayout) -> None:
        """Rank 0's first lines: what runs where, warnings about the settings, what was resumed."""
        cfg, topo = self.cfg, dist.topology()
        self.logger.note(
            f"{self.algorithm.name}: {topo.size} rank(s) on {topo.cross_size} node(s), "
            f"{self.threads} thread(s)/rank, device {self.device}, {self.algorithm.describe()}, "
            f"{self._runtime_note()}, env {cfg.env.id} ({cfg.env.backend})")
        for setting in dist.RUNTIME_SETTINGS:
            if setting.source == "environment" and setting.name == dist.YIELD_VAR and setting.value == "0":
                self.logger.note(f"warning: {setting.name}=0 from the environment: ranks busy-poll while "
                                 "they wait and take the core from their own compute (~35% slower with one "
                                 "core per rank); unset it to let distributed.mpi_yield_when_idle decide")
        if info.path:
            self.logger.note(resume.resume_line(info, topo.size, list(layout.counts), self.algorithm.global_batch,
                                                self._numerics()))

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

    def _layout_topology(self) -> dict[str, Any]:
        return summary.layout_topology(self.threads, self.device, getattr(self.algorithm, "precision_mode", "off"))

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
        meter = iteration_metrics.RankMeter.start()
        context = IterationContext(iteration=iteration, global_step=progress.global_step,
                                   env_steps=env_steps, layout=layout, rank=topo.rank,
                                   world_size=topo.size, stop_requested=lambda: self.preemption.raised)
        report = self.algorithm.iterate(context)
        values, _ = meter.values()
        gathered = iteration_metrics.gather(report, values, self.preemption.raised)
        collectives = (dist.CLOCK.reading() - meter.clock_start).count
        if cfg.debug.iteration_sleep:
            time.sleep(cfg.debug.iteration_sleep)
        progress.iteration = iteration
        progress.global_step += layout.total * env_steps
        wall = time.perf_counter() - meter.wall_start
        iteration_metrics.check_finite(report, gathered, iteration)
        record = iteration_metrics.iteration_record(
            report, gathered, iteration=iteration, global_step=progress.global_step, world_size=topo.size,
            layout=layout, env_steps=env_steps, wall=wall, collectives=collectives,
            global_metrics=self.algorithm.global_metrics)
        if cfg.distributed.verify_every and iteration % cfg.distributed.verify_every == 0:
            record["parameters_identical"] = dist.parameters_agree(self.algorithm.parameters_module(),
                                                                   "verify.params")[0]
        if topo.rank == 0:
            logger = self._logger()
            total = cfg.total_timesteps
            logger.log(record, total, self._remaining.update(time.time(), progress.global_step, total))
            logger.episodes(progress.global_step, gathered.episodes[:, 0], gathered.episodes[:, 1])
        self._communication.add(record)
        return record, report.stop_agreed or gathered.stop_requested

    # ---- checkpoints ------------------------------------------------------------------------

    def _checkpoint(self, progress: Any) -> None:
        """Collective (hvd_rl/runtime/checkpointing.py): every rank's own state, rank 0's file."""
        topo = dist.topology()
        self.algorithm.settle()

        def rank_zero_state() -> dict[str, Any]:
            return {
                "format_version": 3, "hvd_rl_version": __version__, "algorithm": self.algorithm.name,
                "iteration": progress.iteration, "global_step": progress.global_step,
                "seed_offset": progress.seed_offset, "world_size": topo.size,
                "env_counts": list(progress.env_counts), "config": self.cfg.to_dict(),
                "signature": self.algorithm.signature(), "state": self.algorithm.state_dict(),
                "lr_schedule": {"global_step": progress.global_step, "total_timesteps": self.cfg.total_timesteps},
                "numerics": self._numerics(), "saved_at": time.time(),
            }

        path = write_checkpoint(self.run_dir, progress.iteration, rank_zero_state, self.cfg.checkpoint.keep,
                                self.device, self._compressors(),
                                lambda: self.algorithm.save_local(self.run_dir, progress.iteration, topo.rank))
        if path is not None:
            self._logger().note(f"checkpoint {path}")
        self._last_checkpoint_iteration = progress.iteration

    def _preempt(self, progress: Any) -> None:
        """Checkpoint, marker, and only then (after a collective) may any rank exit."""
        if self._last_checkpoint_iteration != progress.iteration:
            self._checkpoint(progress)
        stop_after_checkpoint(self.run_dir, progress.iteration, progress.global_step, self.preemption)

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
        """Every rank adopts the balancer's decision (environments rebuilt with fresh seeds before
        the next iteration); rank 0 logs it."""
        decision = agree_on_layout(self.balancer, progress.iteration, layout.counts,
                                   np.asarray(record["time_busy_by_rank"]))
        if decision is None:
            return
        progress.env_counts = decision.counts
        if dist.topology().rank == 0:
            self._logger().note(f"rebalance after iteration {progress.iteration}: envs per rank "
                                f"{resume.counts_text(list(layout.counts))} -> "
                                f"{resume.counts_text(list(decision.counts))}; {decision.reason}")
            with open(self.run_dir / BALANCE_FILE, "a") as f:
                f.write(json.dumps({"iteration": progress.iteration, "global_step": progress.global_step,
                                    "from": list(layout.counts), "to": list(decision.counts),
                                    "reason": decision.reason}) + "\n")

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
            data = summary.run_summary(
                algorithm=self.algorithm.name, iteration=progress.iteration, global_step=progress.global_step,
                total_timesteps=self.cfg.total_timesteps, identical=identical, digests=digests,
                wall_seconds=time.time() - self._start_time, parameters=self.algorithm.parameters_module(),
                topology=summary.run_topology(ranks, self._layout_topology(), self.device, self.heap_retained),
                communication=self._communication.summary(self.cfg.distributed))
            (self.run_dir / "summary.json").write_text(json.dumps(data, indent=1) + "\n")
            self._logger().summary(data)
            self._logger().note(f"done: global step {progress.global_step}, parameters identical "
                                f"on all ranks: {identical}")
        if not identical:
            raise RuntimeError(f"ranks ended with different parameters: {digests}")

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

        state = elastic.ElasticRunState(self.algorithm, iteration=0, global_step=0, seed_offset=0, env_counts=(),
                                        rng_restored=False, setup_done=False)
        reset_notes: list[str] = []

        def on_reset() -> None:
            # The rank layout may have changed: rebuild environments. The device stays: this
            # process's networks, optimizer state and CUDA RNG live on it (re-selecting it from a
            # new local rank moved the current device away from them).
            self._layout = None
            if elastic.reset_compression(self.algorithm):
                reset_notes.append("compression residuals restarted at zero")

        state.register_reset_callbacks([on_reset])
        commit = state.commit

        @hvd.elastic.run
        def run(state: elastic.ElasticRunState) -> None:
            if not state.setup_done:
                self._setup(state)  # the first start: every worker of the job takes part
                state.setup_done = True
                commit()
            else:
                self._agree_on_numerics()  # a worker that joined decided on its own machine
                if dist.topology().rank == 0:
                    extra = f"; {reset_notes[-1]}" if reset_notes else ""
                    self._logger().note(f"elastic reset: now {dist.world_size()} rank(s){extra}")
                reset_notes.clear()
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
