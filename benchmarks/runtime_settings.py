"""How ranks should wait for each other: launch variants of the 2-rank Atari preset, one run.

    python benchmarks/runtime_settings.py --out benchmarks/results/throughput/runtime_settings.json

Compares Open MPI's and Horovod's own defaults (busy-polling MPI, 1 ms Horovod cycle) with
Open MPI's yield_when_idle, longer and shorter Horovod cycle times, fp16 gradient compression,
process binding, Horovod's background thread affinity and the Gloo controller (horovodrun
--gloo). Every variant runs once per round, the order rotating from round to round; the table
gives the median SPS over rounds and the ratio to the project default measured in the same
rounds. The chosen defaults live in
`distributed.mpi_yield_when_idle` and `distributed.cycle_time_ms` and are put into the
environment by the trainer itself before MPI starts (hvd_rl.runtime.distributed.apply_runtime_settings).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import REPO, VENV_BIN, measure_run, repo_relative, train_command  # noqa: E402

MPIRUN = ["mpirun", "-np", "2", "--oversubscribe"]
NO_DEFAULTS = ["distributed.mpi_yield_when_idle=false", "distributed.cycle_time_ms=0"]

# name -> (launcher prefix, extra --set overrides)
VARIANTS: dict[str, tuple[list[str], list[str]]] = {
    "Open MPI + Horovod defaults (busy poll, 1 ms cycle)": (MPIRUN, NO_DEFAULTS),
    "yield_when_idle only": (MPIRUN, ["distributed.cycle_time_ms=0"]),
    "cycle 10 ms only": (MPIRUN, ["distributed.mpi_yield_when_idle=false", "distributed.cycle_time_ms=10"]),
    "yield + cycle 5 ms": (MPIRUN, ["distributed.cycle_time_ms=5"]),
    "yield + cycle 2 ms": (MPIRUN, ["distributed.cycle_time_ms=2"]),
    "yield + cycle 1 ms (default)": (MPIRUN, []),
    "yield + cycle 0.5 ms": (MPIRUN, ["distributed.cycle_time_ms=0.5"]),
    "default + fp16 gradient compression": (MPIRUN, ['distributed.compression="fp16"']),
    "default + --bind-to none": (MPIRUN + ["--bind-to", "none"], []),
    "default + --bind-to none + HOROVOD_THREAD_AFFINITY=0,1": (
        MPIRUN + ["--bind-to", "none", "-x", "HOROVOD_THREAD_AFFINITY=0,1"], []),
    "horovodrun --gloo (default settings)": (
        [str(VENV_BIN / "horovodrun"), "--gloo", "-np", "2", "-H", "localhost:2"], []),
}
DEFAULT = "yield + cycle 1 ms (default)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/atari_ppo.toml")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--variant", action="append", default=[],
                        help="run only this variant (repeatable; the default is always run, as the reference)")
    parser.add_argument("--out")
    args = parser.parse_args()
    os.chdir(REPO)
    args.config = repo_relative(args.config)
    unknown = [name for name in args.variant if name not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant {unknown[0]!r}; one of: {', '.join(VARIANTS)}")
    names = [name for name in VARIANTS if not args.variant or name in args.variant or name == DEFAULT]
    results: dict[str, list[dict]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        for index in range(args.rounds):
            for name in names[index % len(names):] + names[:index % len(names)]:
                launcher, sets = VARIANTS[name]
                run_dir = Path(tmp) / f"{len(results[name])}-{names.index(name)}"
                cmd = [shutil.which(launcher[0]) or launcher[0], *launcher[1:],
                       *train_command(args.config, sets, 2, run_dir, args.warmup + args.iterations)]
                results[name].append(measure_run(cmd, run_dir, args.warmup, args.timeout))
                print(f"round {index + 1}: {name}: {results[name][-1]['sps']:.0f} SPS", flush=True)
    table = []
    for name in names:
        ratios = [r["sps"] / d["sps"] for r, d in zip(results[name], results[DEFAULT])]
        launcher = VARIANTS[name][0]
        table.append({"variant": name, "launch": " ".join([Path(launcher[0]).name, *launcher[1:]]),
                      "overrides": VARIANTS[name][1], "median_sps": statistics.median(r["sps"] for r in results[name]),
                      "median_ratio_to_default": statistics.median(ratios),
                      "update_s": statistics.median(r["phases_s"]["time_update"] for r in results[name]),
                      "env_plus_inference_s": statistics.median(
                          r["phases_s"]["time_env"] + r["phases_s"]["time_inference"] for r in results[name]),
                      "runs": results[name]})
    print(f"\n| variant | SPS (median of {args.rounds}) | vs default | update s/it | env+inference s/it |")
    print("|---|---:|---:|---:|---:|")
    for row in table:
        print(f"| {row['variant']} | {row['median_sps']:.0f} | {row['median_ratio_to_default']:.2f} | "
              f"{row['update_s']:.2f} | {row['env_plus_inference_s']:.2f} |")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "command": shlex.join(["python", "benchmarks/runtime_settings.py", *sys.argv[1:]]),
            "config": args.config, "rounds": args.rounds, "iterations": args.iterations,
            "cpus": os.cpu_count(), "variants": table}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
