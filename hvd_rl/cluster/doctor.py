"""`hvd-rl doctor`: what is installed, what Horovod was built with, and a real 2-rank allreduce.

Exit 0 only when every required part works; otherwise one line per problem saying what to do.
"""
from __future__ import annotations

import json
import os
import platform
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from hvd_rl.cluster.launch import mpi_env

# Initialises exactly as the trainer does (hvd_rl.runtime.distributed.init applies the waiting settings
# before MPI starts), then reports the settings in effect on the rank.
ALLREDUCE_SNIPPET = (
    "import json, os, sys, torch, horovod.torch as hvd; from hvd_rl.runtime import distributed as d; "
    "from hvd_rl.config import DistributedConfig as C; c = C(); d.init(c.mpi_yield_when_idle, c.cycle_time_ms); "
    "s = hvd.allreduce(torch.ones(4) * (hvd.rank() + 1), op=hvd.Sum, name='doctor'); "
    "w = {v: os.environ.get(v) for v in (d.YIELD_VAR, d.CYCLE_VAR)}; "
    "sys.stdout.write('HVD_RL_DOCTOR ' + json.dumps({'rank': hvd.rank(), 'size': hvd.size(), 'sum': s.tolist(), 'waiting': w}) + chr(10)); sys.stdout.flush()"
)


@dataclass
class Report:
    lines: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def info(self, label: str, value: object) -> None:
        self.lines.append(f"  {label:<22} {value}")

    def problem(self, message: str) -> None:
        self.problems.append(message)


def _allreduce_check(report: Report, label: str, cmd: list[str], num_ranks: int, timeout: float) -> None:
    expected = [float(sum(range(1, num_ranks + 1)))] * 4
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=mpi_env())
    except subprocess.TimeoutExpired:
        report.info(label, "TIMEOUT")
        report.problem(f"{label}: {num_ranks}-rank allreduce did not finish in {timeout:.0f}s "
                       f"(try by hand: {' '.join(cmd[:6])} ...)")
        return
    except OSError as exc:
        report.info(label, "FAILED")
        report.problem(f"{label}: cannot start {cmd[0]}: {exc}")
        return
    results = []
    decoder = json.JSONDecoder()
    for chunk in proc.stdout.split("HVD_RL_DOCTOR ")[1:]:  # robust to interleaved rank output
        try:
            results.append(decoder.raw_decode(chunk.lstrip())[0])
        except ValueError:
            continue
    ok = (proc.returncode == 0 and len(results) == num_ranks
          and all(r["size"] == num_ranks and r["sum"] == expected for r in results))
    report.info(label, f"ok ({num_ranks} ranks, sum {expected[0]:g})" if ok else "FAILED")
    if ok and "mpirun" in label:
        _report_waiting(report, results[0].get("waiting", {}))
    if not ok:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        report.problem(f"{label}: {num_ranks}-rank allreduce failed (exit {proc.returncode}): {tail[0]}")


def _report_waiting(report: Report, waiting: dict[str, str | None]) -> None:
    """How ranks wait for each other: a core lost to busy-polling costs ~35% with 1 core per rank."""
    from hvd_rl.runtime.distributed import CYCLE_VAR, YIELD_VAR

    report.info("  rank waiting", f"{YIELD_VAR}={waiting.get(YIELD_VAR)}, {CYCLE_VAR}={waiting.get(CYCLE_VAR)} ms")
    if waiting.get(YIELD_VAR) == "0":
        report.info("  warning", f"{YIELD_VAR}=0 in the environment: ranks busy-poll while they "
                                 "wait and take the core from their own compute (unset it)")
    cycle = waiting.get(CYCLE_VAR)
    if cycle is not None and float(cycle) > 10:
        report.info("  warning", f"{CYCLE_VAR}={cycle}: every gradient allreduce waits up to that long")


def _report_precision(report: Report) -> None:
    import torch

    from hvd_rl.runtime.precision import cpu_has_native_bf16, resolve_amp

    native = cpu_has_native_bf16()
    chosen = resolve_amp("auto", torch.device("cpu"), convolutional=True)
    report.info("cpu bf16", f"{'native (avx512_bf16/amx)' if native else 'not native'}; "
                            f"amp=auto trains CNNs in {'bf16' if chosen == 'bf16' else 'fp32'} on CPU")


def _check_mpi4py(report: Report, have_mpirun: bool, timeout: float) -> None:
    """Imports mpi4py's MPI in a child: a broken MPI aborts the process that initialises it."""
    try:
        import mpi4py
    except ImportError as exc:
        report.problem(f"mpi4py is not installed ({exc}); run scripts/setup.sh")
        return
    if not have_mpirun:
        report.info("mpi4py", f"{mpi4py.__version__} (MPI not initialised: no mpirun)")
        return
    code = "from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0].strip())"
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=timeout, env=mpi_env())
    except subprocess.TimeoutExpired:
        proc = None
    if proc is None or proc.returncode != 0:
        report.info("mpi4py", f"{mpi4py.__version__} (MPI init FAILED)")
        report.problem("mpi4py cannot initialise MPI; reinstall mpi4py against the MPI on PATH")
        return
    report.info("mpi4py", f"{mpi4py.__version__} ({proc.stdout.strip()})")


def _hostname_resolves() -> bool:
    try:
        socket.gethostbyname(socket.gethostname())
        return True
    except OSError:
        return False


def run_doctor(num_ranks: int = 2, timeout: float = 120) -> int:
    report = Report()
    report.lines.append("hvd_rl doctor")
    report.info("python", f"{platform.python_version()} ({sys.executable})")
    cpus = os.cpu_count()
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover
        usable = cpus
    report.info("cpus", f"{usable} usable of {cpus}")

    try:
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        report.info("torch", f"{torch.__version__} (CUDA {torch.version.cuda or 'none'}, {gpus} GPU(s))")
        for index in range(gpus):
            report.info(f"  gpu {index}", torch.cuda.get_device_name(index))
        _report_precision(report)
    except ImportError as exc:
        report.problem(f"PyTorch is not importable ({exc}); run scripts/setup.sh")

    horovod_ok = False
    try:
        import horovod
        import horovod.torch as hvd

        controllers = [n for n, ok in (("MPI", hvd.mpi_built()), ("Gloo", hvd.gloo_built())) if ok]
        ops = [n for n, ok in (("NCCL", hvd.nccl_built()), ("DDL", hvd.ddl_built()),
                               ("CCL", hvd.ccl_built()), ("MPI", hvd.mpi_built()),
                               ("Gloo", hvd.gloo_built())) if ok]
        report.info("horovod", f"{horovod.__version__} (frameworks: PyTorch)")
        report.info("  controllers", ", ".join(controllers) or "none")
        report.info("  tensor ops", ", ".join(ops) or "none")
        if "MPI" not in controllers:
            report.problem("Horovod was built without MPI; rebuild with scripts/setup.sh (HOROVOD_WITH_MPI=1)")
        if "Gloo" not in controllers:
            report.problem("Horovod was built without Gloo; rebuild with scripts/setup.sh (HOROVOD_WITH_GLOO=1)")
        horovod_ok = bool(controllers)
    except ImportError as exc:
        report.problem(f"Horovod's PyTorch extension does not import ({exc}); run scripts/setup.sh")

    mpirun = shutil.which("mpirun")
    if mpirun:
        first = subprocess.run([mpirun, "--version"], capture_output=True, text=True).stdout.splitlines()
        report.info("mpirun", f"{first[0] if first else '?'} ({mpirun})")
    else:
        report.info("mpirun", "NOT FOUND")
        report.problem("mpirun is not on PATH: install Open MPI (scripts/setup.sh does) or "
                       "'module load' your site's MPI")
    _check_mpi4py(report, have_mpirun=mpirun is not None, timeout=timeout)

    try:
        import gymnasium as gym
        import ale_py

        report.info("gymnasium", gym.__version__)
        report.info("ale-py", ale_py.__version__)
        gym.register_envs(ale_py)
        env = gym.make("ALE/Breakout-v5")
        env.reset(seed=0)
        env.close()
        report.info("atari roms", "ok (ALE/Breakout-v5 resets)")
    except Exception as exc:  # noqa: BLE001 - any failure here means Atari cannot run
        report.problem(f"Atari environments do not load ({type(exc).__name__}: {exc})")

    if horovod_ok and mpirun:
        python = sys.executable
        _allreduce_check(report, "allreduce (mpirun)",
                         [mpirun, "-np", str(num_ranks), "--oversubscribe", python, "-c", ALLREDUCE_SNIPPET],
                         num_ranks, timeout)
        horovodrun = shutil.which("horovodrun", path=str(Path(python).parent)) or shutil.which("horovodrun")
        if horovodrun and not _hostname_resolves():
            report.info("allreduce (gloo)", "FAILED")
            report.problem(f"this host's name {socket.gethostname()!r} does not resolve: Horovod's Gloo ranks crash "
                           "(SIGSEGV) without it; add it to /etc/hosts")
        elif horovodrun:
            _allreduce_check(report, "allreduce (gloo)",
                             [horovodrun, "--gloo", "-np", str(num_ranks), "-H", f"localhost:{num_ranks}",
                              python, "-c", ALLREDUCE_SNIPPET], num_ranks, timeout)
        else:
            report.problem("horovodrun is not on PATH (it is installed with Horovod)")
    elif horovod_ok:
        report.info("allreduce", "skipped (no mpirun)")

    print("\n".join(report.lines), flush=True)
    if report.problems:
        for problem in report.problems:
            print(f"PROBLEM: {problem}", file=sys.stderr, flush=True)
        return 1
    print("all checks passed", flush=True)
    return 0
