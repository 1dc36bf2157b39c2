"""`hvd-rl sweep create | worker | status | report | seeds`: the command line of a study."""
from __future__ import annotations

import argparse
import json
import sys

from hvd_rl.cluster.sweeps.spec import SweepError

EXIT_BAD_INPUT = 2


def add_sweep_parser(sub: argparse._SubParsersAction) -> None:
    sweep = sub.add_parser("sweep", help="hyperparameter sweeps and seed studies with Optuna (docs/sweeps.md)",
                           description="Hyperparameter sweeps: every trial a multi-rank hvd-rl train run, trials "
                                       "shared by any number of workers (SLURM array tasks) through one study "
                                       "directory.")
    actions = sweep.add_subparsers(dest="sweep_command", required=True, metavar="ACTION")

    def study_dir(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--study-dir", required=True, help="the study's directory (on a shared filesystem)")

    create = actions.add_parser("create", help="check a sweep file and create its study directory")
    create.add_argument("--sweep", required=True, help="sweep file (TOML), e.g. configs/sweeps/acrobot_ppo.toml")
    study_dir(create)
    create.add_argument("--storage", default="journal",
                        help="'journal' (Optuna's journal file in the study directory, default) or an RDB URL "
                             "(sqlite:///path for one node, postgresql://... for a site database)")
    create.add_argument("--heartbeat", type=int, default=10, help="seconds between a worker's heartbeats")
    create.add_argument("--grace", type=int, default=60,
                        help="seconds without a heartbeat after which a trial's worker is taken for dead")

    worker = actions.add_parser("worker", help="take trials until the study's budget is reached")
    study_dir(worker)
    worker.add_argument("--np", type=int, help="ranks per trial (default: the sweep file's ranks)")
    worker.add_argument("--launcher", choices=("local", "slurm"), default="local",
                        help="local: mpirun on this machine; slurm: srun steps of this allocation "
                             "(slurm/lib.sh's launcher: LAUNCHER, CONTAINER)")
    worker.add_argument("--max-trials", type=int, help="leave after this many trials (default: until done)")

    status = actions.add_parser("status", help="trial counts and what runs now")
    study_dir(status)

    report = actions.add_parser("report", help="best config, table of trials, plots (report/ in the study)")
    study_dir(report)

    seeds = actions.add_parser("seeds", help="seed study of the best trial's config against the defaults")
    study_dir(seeds)
    seeds.add_argument("--seeds", type=int, default=5, help="seeds per config (default 5)")
    seeds.add_argument("--first-seed", type=int, default=1000,
                       help="first seed (default 1000: not the seeds the trials were chosen on)")
    seeds.add_argument("--np", type=int, help="ranks per run (default: the sweep file's ranks)")
    seeds.add_argument("--launcher", choices=("local", "slurm"), default="local")
    seeds.add_argument("--no-defaults", action="store_true", help="only the best config, not the defaults too")


def cmd_sweep(args: argparse.Namespace) -> int:
    from hvd_rl.cli import error_exit

    try:
        return _run(args)
    except SweepError as exc:
        return error_exit(f"sweep: {exc}", EXIT_BAD_INPUT)


def _run(args: argparse.Namespace) -> int:
    from hvd_rl.cluster.sweeps import storage

    if args.sweep_command == "create":
        if args.heartbeat <= 0 or args.grace <= args.heartbeat:
            raise SweepError("--grace must exceed --heartbeat, both positive seconds")
        study = storage.create_study(args.sweep, args.study_dir, args.storage, args.heartbeat, args.grace)
        print(f"study {study.spec.name!r} in {study.dir}: {study.spec.trials} trial(s) x {len(study.spec.runs())} "
              f"run(s) x {study.spec.ranks} rank(s), sampler {study.spec.sampler}, pruner {study.spec.pruner}")
        return 0
    study = storage.Study(args.study_dir)
    if args.sweep_command == "worker":
        from hvd_rl.cluster.sweeps.worker import Worker

        if args.np is not None and args.np <= 0:
            raise SweepError("--np must be a positive number of ranks")
        return Worker(study, args.launcher, args.np).work(args.max_trials)
    if args.sweep_command == "status":
        from hvd_rl.cluster.sweeps.report import status_lines

        print("\n".join(status_lines(study)))
        return 0
    if args.sweep_command == "report":
        from hvd_rl.cluster.sweeps.report import write_report

        print(write_report(study))
        return 0
    if args.sweep_command == "seeds":
        from hvd_rl.cluster.sweeps.seeds import run_seed_study

        if args.seeds <= 0:
            raise SweepError("--seeds must be positive")
        path = run_seed_study(study, args.seeds, args.first_seed, args.np, args.launcher, not args.no_defaults)
        print(path)
        return 0
    print(json.dumps(vars(args)), file=sys.stderr)
    return EXIT_BAD_INPUT
