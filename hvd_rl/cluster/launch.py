"""Starting ranks from Python: the environment Open MPI needs, and re-running a script under mpirun.

Light on purpose (no torch, no Horovod): `hvd-rl doctor` uses it to diagnose broken installs.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

# Set by the launchers that let ranks find each other (PMIx/PMI for srun, mpirun, horovodrun).
PEER_DISCOVERY_VARS = ("PMIX_RANK", "PMI_RANK", "PMI_FD", "OMPI_COMM_WORLD_RANK", "HOROVOD_RANK")


def launched() -> bool:
    """True inside a process started by mpirun, srun --mpi=..., or horovodrun."""
    return any(var in os.environ for var in PEER_DISCOVERY_VARS)


def mpi_env() -> dict[str, str]:
    """This environment, plus what Open MPI needs to start ranks as root (containers, CI), with
    this interpreter's bin directory (hvd-rl, horovodrun) first on PATH."""
    env = dict(os.environ)
    if os.geteuid() == 0:  # Open MPI refuses root unless told it is deliberate
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    return env


def relaunch_under_mpirun(num_ranks: int) -> int:
    """Runs this script again as `num_ranks` ranks on this machine; returns mpirun's exit code."""
    cmd = [shutil.which("mpirun") or "mpirun", "-np", str(num_ranks), "--oversubscribe", "--bind-to", "none",
           sys.executable, *sys.argv]
    return subprocess.call(cmd, env=mpi_env())
