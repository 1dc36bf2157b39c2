"""Peer watchdog: a rank whose peers stop answering exits instead of waiting forever.

Why it is needed. A peer process that crashes is noticed at once: its kernel resets the TCP
connections, Open MPI or Gloo fail, the launcher ends the job. A node that goes *silent* (power
loss, a dead link or switch port, a frozen kernel) sends nothing. Then every rank waits in its
next collective until TCP gives up retransmitting, about 15 minutes on Linux (tcp_retries2): Open
MPI's TCP transport has no timeout or keepalive of its own; Horovod's stall check
(HOROVOD_STALL_CHECK_TIME_SECONDS / HOROVOD_STALL_SHUTDOWN_TIME_SECONDS) runs on the coordinator
*after* the per-cycle exchange with every rank, which is exactly what blocks; `srun` waits for
SLURM to declare the node dead (SlurmdTimeout, 300 s by default); mpirun's daemon keepalive
starts after 300 s idle. (Measured on the simulated cluster: a link down for 60 s stalls an
mpirun job for 60 s, which then carries on.)

How it works. A thread on every rank submits a tiny named allreduce (the heartbeat) to Horovod,
waits for it, sleeps `interval` seconds and submits the next. Horovod negotiates collectives by
name in its background thread, independently of what the main thread does, so a heartbeat
completes within about one interval on a healthy job however long the ranks wait for each other
in the training's own collectives (a straggler, rank 0 writing a checkpoint, a slow environment):
waiting for a *tensor* does not block Horovod's background loop, only a dead or unreachable peer
does. If a heartbeat stays unanswered for `timeout` seconds, the rank prints why and exits with
EXIT_PEER_LOST at once (os._exit: the MPI teardown would wait for the lost peer too); the launcher
then ends the job. The one healthy case that delays a heartbeat is a single Horovod operation
that itself runs longer than `timeout` (Horovod executes operations one after another), e.g. a
broadcast of gigabytes over a slow link: choose `distributed.peer_timeout` above that. The
training's own collectives are small (the Nature CNN's gradient is 6.5 MiB).

Not used in elastic mode, where Horovod itself turns a lost peer into a reset (Gloo's timeout).
"""
from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable

import torch

import horovod.torch as hvd

EXIT_PEER_LOST = 4  # a peer rank stopped answering (node down or unreachable); see docs/outputs.md
HEARTBEAT_NAME = "hvd_rl.peer_heartbeat"  # one name, reused: Horovod caches its negotiation


def default_interval(timeout_s: float) -> float:
    """Seconds between heartbeats: a sixth of the timeout, between 0.2 and 5 s."""
    return min(5.0, max(0.2, timeout_s / 6.0))


def exit_peer_lost(rank: int, waited_s: float, timeout_s: float) -> None:
    print(f"[rank {rank}] hvd-rl: error: the other ranks have not answered for {waited_s:.0f} s "
          f"(distributed.peer_timeout = {timeout_s:g} s): a node is down, unreachable or frozen; "
          f"exiting with code {EXIT_PEER_LOST} so that the launcher ends the job (resume with "
          "--resume auto)", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(EXIT_PEER_LOST)


class PeerWatchdog:
    """Heartbeats over Horovod; calls `on_lost(rank, waited_s, timeout_s)` when one goes
    unanswered for `timeout_s` seconds (default: print and exit EXIT_PEER_LOST).

    Start it on every rank at the same point of the program (after a collective, so the ranks
    are aligned) and stop it before the last collective's ranks may leave."""

    def __init__(self, timeout_s: float, interval_s: float | None = None,
                 on_lost: Callable[[int, float, float], None] = exit_peer_lost) -> None:
        self.timeout = float(timeout_s)
        self.interval = default_interval(self.timeout) if interval_s is None else float(interval_s)
        self.on_lost = on_lost
        self.beats = 0  # heartbeats answered by every rank
        self.longest_wait = 0.0  # seconds, of any answered heartbeat
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def active(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> "PeerWatchdog":
        if self.timeout > 0 and hvd.size() > 1 and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="hvd_rl-peer-watchdog", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        self._thread = None

    def _run(self) -> None:
        rank = hvd.rank()
        tensor = torch.zeros(1)
        while not self._stop.is_set():
            try:
                handle = hvd.allreduce_async(tensor, op=hvd.Sum, name=HEARTBEAT_NAME)
            except Exception:  # noqa: BLE001 - Horovod shut down: nothing left to watch
                return
            sent = time.monotonic()
            while True:
                try:
                    done = hvd.poll(handle)
                except Exception:  # noqa: BLE001
                    return
                if done:
                    break
                waited = time.monotonic() - sent
                if waited > self.timeout:
                    self.on_lost(rank, waited, self.timeout)
                    return
                if self._stop.wait(min(0.25, self.interval)):
                    return  # the heartbeat stays pending; Horovod drops it at shutdown
            try:
                hvd.synchronize(handle)
            except Exception:  # noqa: BLE001 - shut down meanwhile
                return
            self.beats += 1
            self.longest_wait = max(self.longest_wait, time.monotonic() - sent)
            if self._stop.wait(self.interval):
                return
