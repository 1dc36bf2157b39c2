"""Weak and strong scaling sweeps of the real trainer, locally or inside SLURM allocations.

    python benchmarks/scaling.py sweep --out results/sweep --ranks 1 2 4 --modes weak strong
    hvd-rl report results/sweep --out results/sweep/report

weak:   env.num_envs per rank stays fixed (--envs-per-rank); the global batch grows with ranks.
strong: the global number of environments is fixed (--global-envs, default envs-per-rank x the
        largest rank count) and split over the ranks; the global batch stays the same.
Each point runs `--warmup` + `--iterations` trainer iterations; the report uses only the measured
ones. A point is one run directory (metrics.jsonl, summary.json with the topology, config.toml)
plus point.json (mode, ranks, nodes, status, oversubscribed); sweep.json lists the plan, so a
point that failed or never ran is reported as missing, not dropped.

The SLURM job array in slurm/scaling_sweep.sbatch calls `point-args` and `record` per element.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hvd_rl.config import load_config  # noqa: E402
from hvd_rl.cluster.launch import mpi_env  # noqa: E402
from hvd_rl.analysis.projection import interconnect_from_environment  # noqa: E402

VENV_BIN = Path(sys.executable).parent


def point_name(mode: str, ranks: int, nodes: int = 1) -> str:
    return f"{mode}-r{ranks}" + (f"-n{nodes}" if nodes > 1 else "")


def envs_per_rank(mode: str, ranks: int, base_envs: int, global_envs: int) -> int:
    if mode == "weak":
        return base_envs
    if global_envs % ranks:
        raise ValueError(f"strong scaling: {global_envs} global envs do not split over {ranks} ranks")
    return global_envs // ranks


def point_overrides(mode: str, ranks: int, base_envs: int, global_envs: int, num_steps: int,
                    warmup: int, iterations: int, threads: int) -> list[str]:
    envs = envs_per_rank(mode, ranks, base_envs, global_envs)
    total = (warmup + iterations) * ranks * envs * num_steps
    return [f"env.num_envs={envs}", f"ppo.total_timesteps={total}", "checkpoint.every=0",
            "logging.tensorboard=false", f"distributed.threads_per_rank={threads}"]


def _sizes(args: argparse.Namespace) -> tuple[int, int]:
    """(weak-scaling envs per rank, rollout steps) from the config and the command line."""
    cfg = load_config(args.config, args.set)
    return args.envs_per_rank or cfg.env.num_envs, cfg.ppo.num_steps


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def write_plan(out: Path, modes: list[str], ranks: list[int], nodes: list[int], args_record: dict) -> None:
    points = [{"mode": m, "ranks": r, "nodes": n, "name": point_name(m, r, n)}
              for m in modes for r, n in zip(ranks, nodes)]
    write_json(out / "sweep.json", {"kind": "hvd_rl.scaling_sweep", "points": points, **args_record})


def record_point(run_dir: Path, mode: str, ranks: int, nodes: int, status: str, warmup: int,
                 oversubscribed: bool, launcher: str, seconds: float | None = None) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json(run_dir / "point.json", {
        "mode": mode, "ranks": ranks, "nodes": nodes, "status": status, "warmup_iterations": warmup,
        "oversubscribed": oversubscribed, "launcher": launcher, "wall_seconds": seconds,
        # The links between the nodes ($HVD_RL_INTERCONNECT, or the simulated cluster's shaping) while
        # the sweep ran; the report groups points by it (a 1-node point: its sweep's baseline).
        "interconnect": interconnect_from_environment()})


def launch_command(launcher: str, ranks: int, hvd_args: list[str]) -> list[str]:
    hvd_rl = str(VENV_BIN / "hvd-rl")
    if ranks == 1 and launcher != "srun":
        return [hvd_rl, *hvd_args]
    if launcher == "mpirun":
        return ["mpirun", "-np", str(ranks), "--oversubscribe", "--bind-to", "none", hvd_rl, *hvd_args]
    if launcher == "horovodrun":
        return [str(VENV_BIN / "horovodrun"), "-np", str(ranks), "-H", f"localhost:{ranks}", hvd_rl, *hvd_args]
    return ["srun", "--mpi=pmix", f"--ntasks={ranks}", hvd_rl, *hvd_args]


def cmd_sweep(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base, num_steps = _sizes(args)
    global_envs = args.global_envs or base * max(args.ranks)
    cpus = os.cpu_count() or 1
    nodes = [1] * len(args.ranks)
    write_plan(out, args.modes, args.ranks, nodes, {
        "config": args.config, "overrides": args.set, "envs_per_rank": base, "global_envs": global_envs,
        "threads_per_rank": args.threads_per_rank,
        "warmup": args.warmup, "iterations": args.iterations, "launcher": args.launcher,
        "machine": {"hostname": os.uname().nodename, "cpus": cpus}})
    env = mpi_env()
    failures = 0
    for mode in args.modes:
        for ranks in args.ranks:
            name = point_name(mode, ranks)
            run_dir = out / name
            if run_dir.exists():
                shutil.rmtree(run_dir)
            try:
                sets = point_overrides(mode, ranks, base, global_envs, num_steps, args.warmup, args.iterations,
                                       args.threads_per_rank)
            except ValueError as exc:
                print(f"[sweep] {name}: skipped: {exc}", flush=True)
                record_point(run_dir, mode, ranks, 1, f"invalid: {exc}", args.warmup, ranks * max(1, args.threads_per_rank) > cpus, args.launcher)
                continue
            hvd_args = ["train", "--config", args.config, "--run-dir", str(run_dir)]
            for s in [*args.set, *sets, "logging.console=false"]:
                hvd_args += ["--set", s]
            cmd = launch_command(args.launcher, ranks, hvd_args)
            print(f"[sweep] {name}: {' '.join(cmd)}", flush=True)
            start = time.time()
            try:
                proc = subprocess.run(cmd, env=env, timeout=args.timeout, capture_output=True, text=True)
                status = "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
                if proc.returncode:
                    print(proc.stdout[-2000:], proc.stderr[-2000:], file=sys.stderr)
            except subprocess.TimeoutExpired:
                status = f"failed (timeout {args.timeout}s)"
            failures += status != "ok"
            if not args.keep_checkpoints:  # benchmark runs: the final model is not worth megabytes
                shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
            record_point(run_dir, mode, ranks, 1, status, args.warmup,
                         ranks * max(1, args.threads_per_rank) > cpus, args.launcher,
                         time.time() - start)
            print(f"[sweep] {name}: {status} in {time.time() - start:.0f}s", flush=True)
    return 1 if failures and args.strict else 0


def cmd_point_args(args: argparse.Namespace) -> int:
    """Prints the --set arguments of one point (used by the SLURM sweep template)."""
    base, num_steps = _sizes(args)
    all_ranks = [int(r) for r in args.all_ranks.split()] if args.all_ranks else [args.ranks]
    global_envs = args.global_envs or base * max(all_ranks)
    sets = point_overrides(args.mode, args.ranks, base, global_envs, num_steps,
                           args.warmup, args.iterations, args.threads_per_rank)
    print(" ".join(f"--set {s}" for s in sets))
    return 0


def cmd_record(args: argparse.Namespace) -> int:
    """Writes point.json for a finished SLURM array element, and the sweep plan."""
    ranks = [int(r) for r in args.all_ranks.split()]
    nodes = [int(n) for n in args.all_nodes.split()] if args.all_nodes else [1] * len(ranks)
    sweep_dir = Path(args.sweep_dir)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    write_plan(sweep_dir, [args.mode], ranks, nodes, {
        "config": args.config, "warmup": args.warmup, "iterations": args.iterations, "launcher": "srun"})
    status = "ok" if args.exit_code == 0 else f"failed (exit {args.exit_code})"
    record_point(Path(args.run_dir), args.mode, args.ranks, args.nodes, status, args.warmup,
                 oversubscribed=False, launcher="srun")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--config", default=str(REPO / "configs" / "atari_ppo.toml"))
        p.add_argument("--set", action="append", default=[], help="config override for every point")
        p.add_argument("--envs-per-rank", type=int, default=0, help="weak scaling envs per rank (default: config)")
        p.add_argument("--global-envs", type=int, default=0, help="strong scaling global envs")
        p.add_argument("--warmup", type=int, default=2, help="warm-up iterations per point (not measured)")
        p.add_argument("--iterations", type=int, default=5, help="measured iterations per point")
        p.add_argument("--threads-per-rank", type=int, default=1,
                       help="compute threads of every rank at every point (fixed, so that N ranks use N "
                            "times the resources of 1; 0 = the trainer's automatic choice)")

    sweep = sub.add_parser("sweep", help="run a local sweep with mpirun/horovodrun")
    common(sweep)
    sweep.add_argument("--out", required=True)
    sweep.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    sweep.add_argument("--modes", nargs="+", choices=["weak", "strong"], default=["weak", "strong"])
    sweep.add_argument("--launcher", choices=["mpirun", "horovodrun", "srun"], default="mpirun")
    sweep.add_argument("--timeout", type=float, default=1800, help="seconds per point")
    sweep.add_argument("--strict", action="store_true", help="exit 1 if any point failed")
    sweep.add_argument("--keep-checkpoints", action="store_true", help="keep each point's final checkpoint")
    sweep.set_defaults(func=cmd_sweep)

    point = sub.add_parser("point-args", help="print the --set arguments of one point")
    common(point)
    point.add_argument("--mode", choices=["weak", "strong"], required=True)
    point.add_argument("--ranks", type=int, required=True)
    point.add_argument("--all-ranks", help="every rank count of the sweep (strong: sizes the global envs)")
    point.set_defaults(func=cmd_point_args)

    record = sub.add_parser("record", help="write point.json after a SLURM array element")
    common(record)
    record.add_argument("--sweep-dir", required=True)
    record.add_argument("--run-dir", required=True)
    record.add_argument("--mode", choices=["weak", "strong"], required=True)
    record.add_argument("--ranks", type=int, required=True)
    record.add_argument("--nodes", type=int, default=1)
    record.add_argument("--all-ranks", required=True)
    record.add_argument("--all-nodes", default="")
    record.add_argument("--exit-code", type=int, required=True)
    record.set_defaults(func=cmd_record)

    args = parser.parse_args()
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
