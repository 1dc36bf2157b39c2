"""`hvd-rl` command line: train, evaluate (and record), export, doctor, report, slurm, k8s, aws-batch.

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
  1   unexpected error (a bug, a crashed rank)
  2   bad input: config, environment id, checkpoint or run directory (one message, nothing damaged)
  3   NaN/Inf loss: all ranks stopped; the last good checkpoint is untouched
  4   a peer rank stopped answering for distributed.peer_timeout seconds (a node lost)
  75  preempted (SIGTERM/SIGUSR1): checkpoint written; rerun with --resume auto

examples:
  hvd-rl train --config configs/cartpole_ppo.toml
  horovodrun -np 4 hvd-rl train --config configs/atari_ppo.toml --set env.id=ALE/Pong-v5 --run-dir runs/pong
  mpirun -np 4 hvd-rl train --config configs/atari_ppo.toml
  srun --mpi=pmix hvd-rl train --config configs/atari_ppo.toml --resume auto
  horovodrun -np 3 --min-np 2 --max-np 4 --host-discovery-script ./hosts.sh hvd-rl train --elastic ...
"""


def _train_epilog() -> str:
    """The exit codes and examples, after the config's sections and their fields."""
    import dataclasses
    import textwrap

    from hvd_rl.config import TrainConfig, section_classes

    sections = section_classes()
    top = [f.name for f in dataclasses.fields(TrainConfig) if f.name not in sections]
    lines = ["config (TOML sections; set any field with --set section.field=value; every field, its default and",
             "its rules: docs/reference/config.md; --check-config prints the resolved config):",
             f"  top level     {', '.join(top)}"]
    for name, cls in sections.items():
        fields = ", ".join(f.name for f in dataclasses.fields(cls))
        wrapped = textwrap.wrap(fields, width=84)
        lines.append(f"  [{name}]".ljust(16) + wrapped[0])
        lines += [" " * 16 + more for more in wrapped[1:]]
    return "\n".join(lines) + "\n\n" + TRAIN_EPILOG


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", "-c", help="TOML config file (see configs/)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config value; repeatable (e.g. --set ppo.total_timesteps=1e6)")
    parser.add_argument("--run-dir", help="output directory (overrides run_dir in the config)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hvd-rl", description="Distributed PPO with Horovod for Atari and Gymnasium.")
    from hvd_rl import __version__

    parser.add_argument("--version", action="version", version=f"hvd-rl {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = sub.add_parser("train", help="train a PPO agent (any launcher, or none)",
                           description="Train a PPO agent; every rank runs its own environments.",
                           epilog=_train_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_config_args(train)
    train.add_argument("--resume", metavar="auto|PATH",
                       help="'auto': newest valid checkpoint in the run directory (fresh start if "
                            "none); or a checkpoint file")
    train.add_argument("--elastic", action="store_true",
                       help="elastic Horovod (run under horovodrun --min-np/--max-np/--host-discovery-script)")
    train.add_argument("--check-config", action="store_true",
                       help="validate the config, print it resolved, and exit")

    evaluate = sub.add_parser("evaluate", help="run a checkpoint's policy (or record it) and print a JSON summary",
                              description="Evaluate a checkpoint on fresh episodes (single process). With "
                                          "--video/--gif, record greedy episodes from the environment's screen.")
    evaluate.add_argument("--checkpoint", required=True, help="checkpoint file, e.g. runs/x/checkpoints/latest.pt")
    evaluate.add_argument("--episodes", type=int, help="episodes to evaluate, split evenly over the envs, each "
                                                         "env's first ones counted (default 10; 1 when recording)")
    evaluate.add_argument("--video", metavar="FILE.mp4", help="record greedy episodes into this H.264 video")
    evaluate.add_argument("--gif", metavar="FILE.gif", help="record greedy episodes into this animated GIF")
    evaluate.add_argument("--max-frames", type=int, default=27_000,
                          help="stop recording after this many frames (default 27000: 30 min of Atari)")
    evaluate.add_argument("--num-envs", type=int, default=0, help="parallel envs (default 8; at most --episodes)")
    evaluate.add_argument("--seed", type=int, default=10_000, help="first environment seed")
    evaluate.add_argument("--greedy", action="store_true", help="argmax actions instead of sampling")
    evaluate.add_argument("--set", dest="overrides", action="append", default=[],
                          metavar="SECTION.KEY=VALUE", help="override the checkpoint's env config")

    export = sub.add_parser("export", help="export a checkpoint's policy network (ONNX or TorchScript)",
                            description="Export the policy network for use without hvd_rl: observations in "
                                        "(preprocessing included), logits / Gaussian mean / Q-values out.")
    export.add_argument("--checkpoint", required=True, help="checkpoint file, e.g. runs/x/checkpoints/latest.pt")
    export.add_argument("--format", choices=["onnx", "torchscript"], default="onnx")
    export.add_argument("--out", required=True, help="the file to write, e.g. policy.onnx")
    export.add_argument("--set", dest="overrides", action="append", default=[],
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
    from hvd_rl.cluster.slurm import add_render_arguments

    add_render_arguments(render)

    k8s = sub.add_parser("k8s", help="render a Kubeflow MPIJob for Kubernetes",
                         description="Render a Kubeflow MPI Operator v2beta1 MPIJob (and its run-directory "
                                     "claim) from deploy/kubernetes/mpijob.yaml.")
    k8s_sub = k8s.add_subparsers(dest="k8s_command", required=True, metavar="ACTION")
    from hvd_rl.cluster import k8s as k8s_render

    k8s_render.add_render_arguments(k8s_sub.add_parser("render", help="write an MPIJob manifest",
                                                       description="Write a ready-to-apply MPIJob manifest."))

    from hvd_rl.cluster.sweeps.commands import add_sweep_parser

    add_sweep_parser(sub)

    batch = sub.add_parser("aws-batch", help="this node's part of an AWS Batch multi-node parallel job",
                           description="Run on every node of an AWS Batch multi-node parallel job (the image's "
                                       "entry point does): the main node runs COMMAND under mpirun across all "
                                       "nodes, every node exits with its code. Required: HVD_RL_RENDEZVOUS_SECRET (the job's "
                                       "secret, the same on every node: it authenticates each node; never forwarded "
                                       "to the ranks). Settings: HVD_RL_RENDEZVOUS_ALLOW_CIDR (default: the /16 "
                                       "around the main node), HVD_RL_RENDEZVOUS_BIND, HVD_RL_STOP_TIMEOUT_S (SIGTERM "
                                       "to exit 75, default 25), HVD_RL_RANKS_PER_NODE, HVD_RL_NODE_WAIT_S, "
                                       "HVD_RL_RENDEZVOUS_PORT, HVD_RL_SSH_PORT, HVD_RL_MPIRUN_ARGS.")
    batch.add_argument("command_line", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                       help="what the ranks run, e.g. -- hvd-rl train --config configs/atari_ppo.toml")
    return parser


def _load_train_config(args: argparse.Namespace):
    from hvd_rl.config import load_config, validate

    overrides = list(args.overrides)
    if getattr(args, "run_dir", None):
        overrides.append(f"run_dir={_toml_string(args.run_dir)}")
    cfg = load_config(args.config, overrides)
    # The launcher says the rank count before Horovod starts (where it does not: _check_world).
    validate(cfg, world_size=_launcher_rank()[1], elastic=bool(getattr(args, "elastic", False)))
    return cfg


def _check_world(cfg, topo) -> int | None:
    """A launcher that did not say the rank count before Horovod started: the rules that need it
    (distributed.env_counts' length), once Horovod knows it, before any file is written. The ranks
    agree on the verdict (an allgather), rank 0 prints it once, and once it has, every rank leaves
    Horovod and MPI cleanly and exits 2. None: the config fits this world."""
    import horovod.torch as hvd

    from hvd_rl.config import ConfigError, validate
    from hvd_rl.runtime import distributed as dist
    from hvd_rl.runtime.trainer import EXIT_BAD_INPUT

    try:
        validate(cfg, world_size=topo.size)
        mine = None
    except ConfigError as exc:
        mine = str(exc)
    refusal = next((v for v in dist.allgather_object(mine, name="startup.world_rules") if v), None)
    if refusal is None:
        return None
    if topo.size == 1:
        return error_exit(refusal, EXIT_BAD_INPUT)
    if topo.rank == 0:
        _write_stderr(f"hvd-rl: error (all {topo.size} ranks): {refusal}")
    dist.any_rank(False, name="startup.world_rules_printed")  # nobody leaves before rank 0 printed
    hvd.shutdown()
    return EXIT_BAD_INPUT


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
    from hvd_rl.runtime import trainer as R

    try:
        cfg = _load_train_config(args)  # before hvd.init: a bad config fails the same on every rank
    except ConfigError as exc:
        return error_exit(str(exc), R.EXIT_BAD_INPUT, agreed=True)
    if args.check_config:
        print(cfg.to_toml(), end="")
        return 0
    from hvd_rl.algorithms.base import UnsupportedSetup
    from hvd_rl.runtime.checkpoint import CheckpointError
    from hvd_rl.runtime.distributed import CollectiveError, LaunchError
    from hvd_rl.algorithms.models import ModelError
    from hvd_rl.runtime.precision import PrecisionError

    try:
        # Errors before the first collective (config, model/observation mismatch, precision,
        # launch) are deterministic: every rank raises the same one and exits 2 on its own.
        runtime = R.Runtime(cfg, resume=args.resume)
        if not args.elastic and _launcher_rank()[1] is None:
            refused = _check_world(cfg, runtime.topo)
            if refused is not None:
                return refused
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
    except R.Pruned as exc:  # a sweep's pruner ended this trial: a finished run, not a failure
        if _launcher_rank()[0] in (None, "0"):
            print(f"hvd-rl: {exc}", flush=True)
        return R.EXIT_OK
    except R.Preempted as exc:
        _write_stderr(f"{_rank_prefix()}hvd-rl: {exc}")
        return R.preempted_exit_code()
    return R.EXIT_OK


def cmd_evaluate(args: argparse.Namespace) -> int:
    import json

    from hvd_rl.config import ConfigError
    from hvd_rl.policy.evaluate import evaluate_checkpoint
    from hvd_rl.policy.video import record_checkpoint
    from hvd_rl.runtime.checkpoint import CheckpointError

    try:
        if args.video or args.gif:
            summary = record_checkpoint(args.checkpoint, video=args.video, gif=args.gif,
                                        episodes=args.episodes or 1, seed=args.seed, max_frames=args.max_frames,
                                        overrides=args.overrides, note=lambda text: print(f"[hvd_rl] {text}"))
        else:
            summary = evaluate_checkpoint(args.checkpoint, episodes=args.episodes or 10, num_envs=args.num_envs,
                                          seed=args.seed, greedy=args.greedy, overrides=args.overrides)
    except (CheckpointError, ConfigError, ValueError) as exc:
        return error_exit(str(exc), 2)
    print(json.dumps(summary))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    import json

    from hvd_rl.config import ConfigError
    from hvd_rl.policy.export import export_checkpoint
    from hvd_rl.runtime.checkpoint import CheckpointError

    try:
        summary = export_checkpoint(args.checkpoint, args.out, args.format, overrides=args.overrides)
    except (CheckpointError, ConfigError, ValueError) as exc:
        return error_exit(str(exc), 2)
    print(json.dumps(summary))
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from hvd_rl.cluster.doctor import run_doctor

    return run_doctor(num_ranks=args.np, timeout=args.timeout)


def cmd_report(args: argparse.Namespace) -> int:
    from hvd_rl.analysis.report import ReportError, write_report

    try:
        path = write_report(args.results, args.out, title=args.title)
    except ReportError as exc:
        return error_exit(str(exc), 2)
    print(path)
    return 0


def _render(render_from_args, args: argparse.Namespace) -> int:
    """A renderer's run: the written file's path, or its one-line refusal (exit 2)."""
    from hvd_rl.cluster.rendering import RenderError

    try:
        path = render_from_args(args)
    except RenderError as exc:
        return error_exit(str(exc), 2)
    print(path)
    return 0


def cmd_slurm(args: argparse.Namespace) -> int:
    from hvd_rl.cluster.slurm import render_from_args

    return _render(render_from_args, args)


def cmd_k8s(args: argparse.Namespace) -> int:
    from hvd_rl.cluster.k8s import render_from_args

    return _render(render_from_args, args)


def cmd_aws_batch(args: argparse.Namespace) -> int:
    from hvd_rl.cluster.aws_batch import BatchSetupError, run

    command = list(args.command_line)
    if command[:1] == ["--"]:
        command = command[1:]
    try:
        return run(command)
    except BatchSetupError as exc:
        return error_exit(f"aws-batch: {exc}", 2)


def cmd_sweep(args: argparse.Namespace) -> int:
    from hvd_rl.cluster.sweeps.commands import cmd_sweep as run_sweep

    return run_sweep(args)


COMMANDS = {"sweep": cmd_sweep, "train": cmd_train, "evaluate": cmd_evaluate, "export": cmd_export, "doctor": cmd_doctor,
            "report": cmd_report, "slurm": cmd_slurm, "k8s": cmd_k8s, "aws-batch": cmd_aws_batch}


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
