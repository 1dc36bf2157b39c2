"""`hvd-rl` command line: train, evaluate, doctor, report, slurm.

The same `hvd-rl train` runs alone, under horovodrun (MPI or Gloo), mpirun or srun: Horovod
finds the ranks from whichever launcher started it.
"""
from __future__ import annotations

import argparse
import sys
import traceback
from typing import Sequence

TRAIN_EPILOG = """\
exit codes (the same on every rank):
  0   finished: total_timesteps reached, final checkpoint written
  2   bad input: config, environment id, checkpoint or run directory (one message, nothing damaged)
  3   NaN/Inf loss: all ranks stopped; the last good checkpoint is untouched
  75  preempted (SIGTERM/SIGUSR1): checkpoint written; rerun with --resume auto

examples:
  hvd-rl train --config configs/cartpole_ppo.toml
  horovodrun -np 4 hvd-rl train --config configs/atari_ppo.toml --set env.id=ALE/Pong-v5 --run-dir runs/pong
  mpirun -np 4 hvd-rl train --config configs/atari_ppo.toml
  srun --mpi=pmix hvd-rl train --config configs/atari_ppo.toml --resume auto
  horovodrun -np 3 --min-np 2 --max-np 4 --host-discovery-script ./hosts.sh hvd-rl train --elastic ...
"""


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", "-c", help="TOML config file (see configs/)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config value; repeatable (e.g. --set ppo.total_timesteps=1e6)")
    parser.add_argument("--run-dir", help="output directory (overrides run_dir in the config)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hvd-rl", description="Distributed PPO with Horovod for Atari and Gymnasium.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = sub.add_parser("train", help="train a PPO agent (any launcher, or none)",
                           description="Train a PPO agent; every rank runs its own environments.",
                           epilog=TRAIN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_config_args(train)
    train.add_argument("--resume", metavar="auto|PATH",
                       help="'auto': newest valid checkpoint in the run directory (fresh start if "
                            "none); or a checkpoint file")
    train.add_argument("--elastic", action="store_true",
                       help="elastic Horovod (run under horovodrun --min-np/--max-np/--host-discovery-script)")
    train.add_argument("--check-config", action="store_true",
                       help="validate the config, print it resolved, and exit")

    evaluate = sub.add_parser("evaluate", help="run a checkpoint's policy and print a JSON summary",
                              description="Evaluate a checkpoint on fresh episodes (single process).")
    evaluate.add_argument("--checkpoint", required=True, help="checkpoint file, e.g. runs/x/checkpoints/latest.pt")
    evaluate.add_argument("--episodes", type=int, default=10, help="episodes to finish (default 10)")
    evaluate.add_argument("--num-envs", type=int, default=0, help="parallel envs (default min(episodes, 8))")
    evaluate.add_argument("--seed", type=int, default=10_000, help="first environment seed")
    evaluate.add_argument("--greedy", action="store_true", help="argmax actions instead of sampling")
    evaluate.add_argument("--set", dest="overrides", action="append", default=[],
                          metavar="SECTION.KEY=VALUE", help="override the checkpoint's env config")

    doctor = sub.add_parser("doctor", help="check the installation and run a 2-rank allreduce",
                            description="Report versions and capabilities; exit 0 only if all "
                                        "required parts work.")
    doctor.add_argument("--np", type=int, default=2, help="ranks for the allreduce checks (default 2)")
    doctor.add_argument("--timeout", type=float, default=120, help="seconds per launcher check")

    report = sub.add_parser("report", help="scaling-study report (Markdown + PNG) from sweep results",
                            description="Build report.md and plots from scaling sweep results.")
    report.add_argument("results", nargs="+", help="sweep result files or directories (JSON/JSONL)")
    report.add_argument("--out", required=True, help="output directory")
    report.add_argument("--title", default="hvd_rl scaling study")

    slurm = sub.add_parser("slurm", help="render ready-to-submit SLURM scripts",
                           description="Render a SLURM batch script from the templates in slurm/.")
    slurm_sub = slurm.add_subparsers(dest="slurm_command", required=True, metavar="ACTION")
    render = slurm_sub.add_parser("render", help="write an sbatch script",
                                  description="Write a ready-to-submit sbatch script.")
    from hvd_rl.slurm import add_render_arguments

    add_render_arguments(render)
    return parser


def _load_train_config(args: argparse.Namespace):
    from hvd_rl.config import load_config, validate

    overrides = list(args.overrides)
    if getattr(args, "run_dir", None):
        overrides.append(f"run_dir={_toml_string(args.run_dir)}")
    cfg = load_config(args.config, overrides)
    validate(cfg, world_size=_launcher_rank()[1])  # the launcher says the rank count before Horovod starts
    return cfg


def _toml_string(text: str) -> str:
    from hvd_rl.config import toml_string  # json.dumps is not TOML beyond the BMP

    return toml_string(text)


# Each launcher's rank variable, and where the same launcher puts the number of ranks.
_LAUNCHER_VARS = (("HOROVOD_RANK", ("HOROVOD_SIZE",)),
                  ("OMPI_COMM_WORLD_RANK", ("OMPI_COMM_WORLD_SIZE",)),
                  ("PMIX_RANK", ("OMPI_COMM_WORLD_SIZE", "SLURM_STEP_NUM_TASKS")),
                  ("PMI_RANK", ("PMI_SIZE",)),
                  ("SLURM_PROCID", ("SLURM_STEP_NUM_TASKS",)))
ERROR_WAIT_S = 30.0  # see _leave_it_to_rank_0; HVD_RL_ERROR_WAIT_S overrides it


def _launcher_rank() -> tuple[str | None, int | None]:
    """(this process's rank, the number of ranks) as the launcher set them; None where unset."""
    import os

    for rank_var, size_vars in _LAUNCHER_VARS:
        if rank_var in os.environ:
            size = next((os.environ[v] for v in size_vars if v in os.environ), "")
            return os.environ[rank_var].strip(), int(size) if size.strip().isdigit() else None
    return None, None


def _rank_prefix() -> str:
    rank, _ = _launcher_rank()
    return "" if rank is None else f"[rank {rank}] "


def _write_stderr(text: str) -> None:
    """The text, ended by a newline, in one write: ranks that share a stream (mpirun, srun) do not
    run into each other's lines, which two writes (print's text, then its newline) allowed."""
    import os

    data = (text if text.endswith("\n") else text + "\n").encode("utf-8", "backslashreplace")
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # replaced by an object without a descriptor
        sys.stderr.write(data.decode("utf-8"))
        sys.stderr.flush()
        return
    while data:
        data = data[os.write(fd, data):]


def _leave_it_to_rank_0(message: str, rank: str, code: int) -> None:
    """A rank other than 0 with an error every rank has prints nothing, but must not exit before
    rank 0 printed it: the launcher would end the job, rank 0 included, at the first exit. So it
    waits until the launcher ends it (SIGTERM/SIGINT/SIGHUP: exit `code` at once) or ERROR_WAIT_S
    have passed; then rank 0 is slow or the launcher does not end jobs, and it prints its own
    copy, so that the message is never lost."""
    import os
    import signal
    import time

    def leave(_signum, _frame):
        sys.stdout.flush()
        os._exit(code)

    try:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, leave)
        wait = float(os.environ.get("HVD_RL_ERROR_WAIT_S", ERROR_WAIT_S))
    except ValueError:  # not the main thread, or a bad HVD_RL_ERROR_WAIT_S
        wait = ERROR_WAIT_S
    time.sleep(max(0.0, wait))
    _write_stderr(f"[rank {rank}] hvd-rl: error: {message}")


def error_exit(message: str, code: int, agreed: bool = False) -> int:
    """Prints `message` and returns `code`. `agreed`: every rank has this same error (a refused
    configuration, a CollectiveError), so one copy is printed, by rank 0, naming the rank count;
    every rank still returns `code`. A process without launcher variables prints as always."""
    rank, size = _launcher_rank()
    if agreed and size is not None and size > 1 and rank is not None:
        if rank == "0":
            _write_stderr(f"hvd-rl: error (all {size} ranks): {message}")
        else:
            _leave_it_to_rank_0(message, rank, code)
        return code
    _write_stderr(f"{_rank_prefix()}hvd-rl: error: {message}")
    return code


def cmd_train(args: argparse.Namespace) -> int:
    from hvd_rl.config import ConfigError
    from hvd_rl import runtime as R

    try:
        cfg = _load_train_config(args)  # before hvd.init: a bad config fails the same on every rank
    except ConfigError as exc:
        return error_exit(str(exc), R.EXIT_BAD_INPUT, agreed=True)
    if args.check_config:
        print(cfg.to_toml(), end="")
        return 0
    from hvd_rl.algorithms.base import UnsupportedSetup
    from hvd_rl.checkpoint import CheckpointError
    from hvd_rl.distributed import CollectiveError, LaunchError
    from hvd_rl.models import ModelError
    from hvd_rl.precision import PrecisionError

    try:
        # Errors before the first collective (config, model/observation mismatch, precision,
        # launch) are deterministic: every rank raises the same one and exits 2 on its own.
        runtime = R.Runtime(cfg, resume=args.resume)
        runtime.train_elastic() if args.elastic else runtime.train()
    except (CollectiveError, ConfigError, ModelError, UnsupportedSetup) as exc:
        # The same on every rank (agreed through a collective, or decided by the config and the
        # environment alone): printed once.
        return error_exit(str(exc), R.EXIT_BAD_INPUT, agreed=True)
    except (CheckpointError, LaunchError, PrecisionError, R.BadInput) as exc:
        # May be one rank's own (its files, its device, its launch): each rank says its own.
        return error_exit(str(exc), R.EXIT_BAD_INPUT)
    except R.NonFiniteLossError as exc:
        return error_exit(str(exc), R.EXIT_NONFINITE)
    except R.Preempted as exc:
        _write_stderr(f"{_rank_prefix()}hvd-rl: {exc}")
        return R.preempted_exit_code()
    return R.EXIT_OK


def cmd_evaluate(args: argparse.Namespace) -> int:
    import json

    from hvd_rl.checkpoint import CheckpointError
    from hvd_rl.config import ConfigError
    from hvd_rl.evaluate import evaluate_checkpoint

    try:
        summary = evaluate_checkpoint(args.checkpoint, episodes=args.episodes, num_envs=args.num_envs,
                                      seed=args.seed, greedy=args.greedy, overrides=args.overrides)
    except (CheckpointError, ConfigError, ValueError) as exc:
        return error_exit(str(exc), 2)
    print(json.dumps(summary))
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from hvd_rl.doctor import run_doctor

    return run_doctor(num_ranks=args.np, timeout=args.timeout)


def cmd_report(args: argparse.Namespace) -> int:
    from hvd_rl.report import ReportError, write_report

    try:
        path = write_report(args.results, args.out, title=args.title)
    except ReportError as exc:
        return error_exit(str(exc), 2)
    print(path)
    return 0


def cmd_slurm(args: argparse.Namespace) -> int:
    from hvd_rl.slurm import SlurmRenderError, render_from_args

    try:
        path = render_from_args(args)
    except SlurmRenderError as exc:
        return error_exit(str(exc), 2)
    print(path)
    return 0


COMMANDS = {"train": cmd_train, "evaluate": cmd_evaluate, "doctor": cmd_doctor,
            "report": cmd_report, "slurm": cmd_slurm}


def _exit_now(code: int) -> None:
    """Leaves without interpreter/Horovod teardown, which could wait on peers that are already
    gone; the launcher sees the exit code and ends the other ranks (mpirun, horovodrun, srun
    --kill-on-bad-exit). A clean finish (0) still shuts MPI down properly: all ranks get there."""
    import os

    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = COMMANDS[args.command](args)
    except KeyboardInterrupt:
        code = 130
    except Exception:  # noqa: BLE001 - an unexpected error on one rank must not leave others hanging
        traceback.print_exc()
        code = 1
    if code != 0 and args.command == "train":
        _exit_now(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
