"""Elastic training (`hvd-rl train --elastic` under horovodrun with host discovery): the state
Horovod saves on every commit, restores after a failure and syncs to workers, and what a reset
does to the runtime.

Horovod's `hvd.elastic.run` calls `state.sync()` at the start and after a failure or an added
host, but skips it when hosts were only removed (HostsUpdatedInterrupt(skip_sync=True)); the
reset callbacks run after every reset. So anything that must happen at every reset (residuals
of gradient compression restart at zero: ranks were renumbered, one rank's dropped part is gone,
and after a failure the algorithm is rolled back past the steps they came from) is done in
`on_reset`, and `sync` only makes the ranks agree (rank 0's networks, optimizer, PowerSGD's Q).
"""
from __future__ import annotations

import copy
from typing import Any

from horovod.common.elastic import ObjectState

from hvd_rl.algorithms.base import Algorithm
from hvd_rl.runtime import compression


def reset_compression(algorithm: Algorithm) -> int:
    """Every reset: each compressor's residuals restart at zero. Returns how many compressors."""
    compressors = compression.compressors_of(algorithm.distributed_optimizers())
    for compressor in compressors:
        compressor.reset_residuals()
    return len(compressors)


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
        compression.broadcast_shared_state(compression.compressors_of(self._algorithm.distributed_optimizers()))
        super().sync()
