"""Asynchronous sampling (`ppo.pipeline = "overlap"`): the next rollout is collected in a sampler
thread while the learner works on this one.

With theta_k the weights after update k, every rank runs

    sync     collect k with theta_{k-1} | update k | collect k+1 with theta_k | update k+1 ...
    overlap  collect k with theta_{k-1} | update k             | update k+1 ...
                                        | collect k+1 with theta_{k-1} | collect k+2 with theta_k

so a rollout's behaviour policy lags the learner by one update (Cleanba's and Sample Factory's
one-step policy lag). PPO stays correct: its ratio is taken against the log-probabilities stored
when the actions were sampled, i.e. the behaviour policy's, and GAE uses the values stored with
them. The first rollout of a run (and of a resume) is collected synchronously.

Threads: ALE, NumPy and PyTorch release the GIL inside their kernels. The sampler's weights are a
copy of their own (models.InferencePolicy(separate=True)), refreshed in the main thread before the
thread starts, so the learner's in-place optimizer steps never race with inference; collectives
(gradients, normalisation statistics, stop votes) stay in the main thread. The sampler draws
actions from the process's torch generator and the learner draws nothing from it (minibatches come
from seeded NumPy), so a run is the same whatever the threads' timing.

Checkpoints: `settle()` waits for the rollout in flight, so that the RNG state a checkpoint records
is the same in every run, and keeps it for the run that goes on. A resumed run rebuilds its
environments with fresh seeds (as every resume does), so the in-flight rollout is discarded and the
resumed run starts with a synchronous rollout from exactly what was checkpointed.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from hvd_rl.algorithms.rollout import Episodes, RolloutBuffer, RolloutCollector, RolloutTimes


@dataclass
class Rollout:
    buffer: RolloutBuffer  # holds the rollout in its first steps
    last_value: torch.Tensor
    times: RolloutTimes
    episodes: Episodes
    waited: float = 0.0  # seconds the learner waited for it (0 when collected synchronously)


class OverlappedSampler:
    """Double-buffered rollouts for one rank: the learner reads one buffer while the sampler
    thread fills the other."""

    def __init__(self, collector: RolloutCollector, spare: RolloutBuffer):
        self.collector = collector
        self.buffers = (collector.buffer, spare)
        self._next = 0  # index of the buffer the next rollout fills
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hvd_rl-sampler")
        self._in_flight: tuple[Future, int] | None = None  # (future of a Rollout, its steps)

    def _fill(self) -> RolloutBuffer:
        buffer = self.buffers[self._next]
        self._next = 1 - self._next
        return buffer

    def _collect(self, buffer: RolloutBuffer, steps: int, sync_weights: bool) -> Rollout:
        return Rollout(buffer, *self.collector.collect(steps, buffer, sync_weights=sync_weights))

    def start(self, steps: int) -> None:
        """Starts collecting the next rollout with the weights the model holds now (call it
        before the update that will change them)."""
        assert self._in_flight is None, "one rollout in flight at a time"
        self.collector.policy.sync()
        buffer = self._fill()
        self._in_flight = (self._executor.submit(self._collect, buffer, steps, False), steps)

    def take(self, steps: int) -> Rollout:
        """The rollout of `steps` steps per environment for this iteration: the one in flight,
        or (first iteration, or the one in flight has another length) one collected now."""
        if self._in_flight is not None:
            future, in_flight_steps = self._in_flight
            self._in_flight = None
            t0 = time.perf_counter()
            rollout = future.result()  # re-raises what the sampler raised
            if in_flight_steps == steps:
                rollout.waited = time.perf_counter() - t0
                return rollout
        return self._collect(self._fill(), steps, True)

    def settle(self) -> None:
        """Waits until no rollout is being collected (the result stays for `take`)."""
        if self._in_flight is not None:
            self._in_flight[0].exception()  # waits; any error is raised by `take`

    def close(self) -> None:
        """Waits for the sampler thread and stops it; a rollout in flight is discarded."""
        self.settle()
        self._in_flight = None
        self._executor.shutdown(wait=True)
