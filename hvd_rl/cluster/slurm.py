"""`hvd-rl slurm render`: ready-to-submit sbatch scripts from the templates in slurm/.

The templates stay valid sbatch scripts on their own. Rendering rewrites their `#SBATCH` header
and the settings lines tagged `# hvd-rl:<name>`, so users never hand-edit a template.
"""
from __future__ import annotations

import argparse
import re
import shlex
import subprocess
from pathlib import Path

from hvd_rl import CHECKOUT
from hvd_rl.cluster.rendering import RenderError, has_control, show, write_atomically

TEMPLATES = {"cpu": "train_cpu.sbatch", "gpu": "train_gpu.sbatch", "scaling": "scaling_sweep.sbatch",
             "sweep": "hyperparameter_sweep.sbatch",
             "learning": "learning_array.sbatch"}
_TIME = re.compile(r"(\d+-)?\d{1,3}(:\d{2}){0,2}")  # used with fullmatch: no trailing newline
# What may reach an #SBATCH line. sbatch reads its options up to the first line that is not a
# comment, so a newline in a value would end the header (the later directives silently dropped)
# and start a line the batch shell runs. Names are also pieces of file names (slurm-%x-%j.out,
# $RUN_ROOT/$SLURM_JOB_NAME-$SLURM_JOB_ID): no '/', no whitespace, nothing a shell would expand.
_NAME = r"[A-Za-z0-9._+-]+"
_SBATCH_VALUES = {
    "job_name": (re.compile(r"[A-Za-z0-9._+,@:=-]+"), "letters, digits and . _ + , @ : = -"),
    "partition": (re.compile(rf"{_NAME}(,{_NAME})*"), "names of letters, digits and . _ + -, separated by commas"),
    "account": (re.compile(_NAME), "letters, digits and . _ + -"),
}
# ASCII digits only (str.isdigit takes '\u00b2'), at most 9 a number (int() refuses 4300+ digits)
_RANK_LIST = re.compile(r"[0-9]{1,9}(\s+[0-9]{1,9})*")


class SlurmRenderError(RenderError):
    pass


def template_dir() -> Path:
    return CHECKOUT / "slurm"


def add_render_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--template", choices=sorted(TEMPLATES), default="cpu",
                        help="cpu: CPU nodes; gpu: one rank per GPU with NCCL; scaling: scaling-study job array; "
                             "sweep: hyperparameter sweep, one Optuna worker per array task (--sweep-file); "
                             "learning: learning-benchmark job array, one element per (experiment, seed) of --plan")
    parser.add_argument("--out", "-o", required=True, help="where to write the script")
    parser.add_argument("--job-name", help="#SBATCH --job-name")
    parser.add_argument("--nodes", type=int, help="#SBATCH --nodes")
    parser.add_argument("--ntasks-per-node", type=int, help="ranks per node")
    parser.add_argument("--cpus-per-task", type=int, help="CPU threads per rank")
    parser.add_argument("--gpus-per-node", type=int, help="GPUs per node (gpu template: one rank each)")
    parser.add_argument("--time", help="time limit, e.g. 02:00:00 or 1-12:00:00")
    parser.add_argument("--partition", help="#SBATCH --partition")
    parser.add_argument("--account", help="#SBATCH --account")
    parser.add_argument("--signal-seconds", type=int,
                        help="seconds before the time limit to checkpoint and requeue (default 120)")
    parser.add_argument("--config", help="training config (path as seen from the submit directory)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="SECTION.KEY=VALUE", help="config override passed to hvd-rl train; repeatable")
    parser.add_argument("--run-root", help="parent directory of the per-job run directories")
    parser.add_argument("--home", help="project checkout on the cluster (default: this one)")
    parser.add_argument("--container", help="run every rank in this image: an Apptainer .sif (default runtime) "
                                            "or, with --container-runtime pyxis, an enroot/pyxis image")
    parser.add_argument("--container-runtime", choices=["apptainer", "pyxis"],
                        help="apptainer: srun/mpirun start 'apptainer exec IMAGE hvd-rl' (--nv on the gpu "
                             "template); pyxis: srun --container-image (default apptainer)")
    parser.add_argument("--launcher", choices=["srun", "mpirun", "horovodrun"],
                        help="how ranks are started inside the allocation (default srun --mpi=pmix)")
    parser.add_argument("--ranks", help="scaling: space-separated rank counts, one array element each")
    parser.add_argument("--sweep-nodes", help="scaling: space-separated node counts matching --ranks")
    parser.add_argument("--mode", choices=["weak", "strong"], help="scaling: scaling mode")
    parser.add_argument("--iterations", type=int, help="scaling: measured iterations per point")
    parser.add_argument("--sweep-file", help="sweep: the sweep file (e.g. configs/sweeps/acrobot_ppo.toml); sets "
                                             "--ntasks-per-node from its ranks unless given")
    parser.add_argument("--study-dir", help="sweep: the study directory, on a filesystem every node shares")
    parser.add_argument("--workers", type=int, help="sweep: array tasks, one worker each (default 4)")
    parser.add_argument("--concurrency", type=int, help="sweep: array tasks running at once (--array=...%%N)")
    parser.add_argument("--plan", help="learning: the study's plan (e.g. benchmarks/learning_atari.toml); "
                                       "sets --array and, unless given, --ntasks-per-node from it")


def _sbatch_lines(args: argparse.Namespace) -> dict[str, str | None]:
    lines: dict[str, str | None] = {
        "job-name": args.job_name, "nodes": args.nodes, "ntasks-per-node": args.ntasks_per_node,
        "cpus-per-task": args.cpus_per_task, "time": args.time, "partition": args.partition,
        "account": args.account,
    }
    if args.gpus_per_node is not None:
        lines["gpus-per-node"] = args.gpus_per_node
    if args.signal_seconds is not None:
        lines["signal"] = f"B:USR1@{args.signal_seconds}"
    return {k: (None if v is None else str(v)) for k, v in lines.items()}


def _check(args: argparse.Namespace) -> None:
    # Every text that lands in the script (or names it): one line, no control characters. Shell
    # lines quote what they take (shlex.quote); #SBATCH lines cannot quote, so they take only
    # what SLURM itself accepts there.
    for name in ("out", "job_name", "time", "partition", "account", "config", "run_root", "home",
                 "ranks", "sweep_nodes", "plan", "launcher", "mode", "container", "sweep_file", "study_dir"):
        value = getattr(args, name, None)
        if value is not None and (not value.strip() or has_control(value)):
            what = "is empty" if not value.strip() else "contains a newline or control character"
            raise SlurmRenderError(f"--{name.replace('_', '-')} {show(value)} {what}")
    for text in args.overrides:
        if has_control(text):
            raise SlurmRenderError(f"--set {show(text)} contains a newline or control character")
    for name, (pattern, allowed) in _SBATCH_VALUES.items():
        value = getattr(args, name, None)
        if value is not None and not pattern.fullmatch(value):
            raise SlurmRenderError(f"--{name.replace('_', '-')} {show(value)} cannot go on an #SBATCH line: "
                                   f"use {allowed}")
    for name in ("nodes", "ntasks_per_node", "cpus_per_task", "signal_seconds", "iterations", "workers",
                 "concurrency"):
        value = getattr(args, name, None)
        if value is not None and value <= 0:
            raise SlurmRenderError(f"--{name.replace('_', '-')} must be positive, got {value}")
    if args.gpus_per_node is not None and args.gpus_per_node < 0:
        raise SlurmRenderError("--gpus-per-node must be >= 0")
    if args.time is not None and not _TIME.fullmatch(args.time):
        raise SlurmRenderError(f"--time {show(args.time)} is not a SLURM time (HH:MM:SS or D-HH:MM:SS)")
    for name in ("ranks", "sweep_nodes"):
        value = getattr(args, name, None)
        if value is not None and not (_RANK_LIST.fullmatch(value.strip()) and all(int(v) > 0 for v in value.split())):
            raise SlurmRenderError(f"--{name.replace('_', '-')} must be positive integers, got {show(value)}")
    if args.ranks and args.sweep_nodes and len(args.ranks.split()) != len(args.sweep_nodes.split()):
        raise SlurmRenderError("--ranks and --sweep-nodes must have the same number of entries")
    for text in args.overrides:
        if "=" not in text or not text.split("=", 1)[0].strip():
            raise SlurmRenderError(f"--set {show(text)}: expected section.key=value")


def render(template_text: str, sbatch: dict[str, str | None], settings: dict[str, str]) -> str:
    """Rewrites #SBATCH options (adding missing ones after the last) and tagged settings lines."""
    lines = template_text.splitlines()
    pending = {k: v for k, v in sbatch.items() if v is not None}
    last_sbatch = 0
    for i, line in enumerate(lines):
        m = re.match(r"^#{1,2}SBATCH\s+--([a-z-]+)(?:[= ](.*))?$", line)
        if m:
            last_sbatch = i
            key = m.group(1)
            if key in pending:
                lines[i] = f"#SBATCH --{key}={pending.pop(key)}"
            continue
        m = re.match(r"^(\s*)([A-Z_]+)=(.*?)(\s+)(# hvd-rl:([a-z_]+).*)$", line)
        if m and m.group(6) in settings:
            assignment = f"{m.group(1)}{m.group(2)}={settings[m.group(6)]}"
            column = len(line) - len(m.group(5))  # keep the tag comments aligned where possible
            lines[i] = assignment + " " * max(1, column - len(assignment)) + m.group(5)
    extra = [f"#SBATCH --{k}={v}" for k, v in pending.items()]
    lines[last_sbatch + 1:last_sbatch + 1] = extra
    return "\n".join(lines) + "\n"


def _home_file(args: argparse.Namespace, given: str) -> Path:
    """A file named on the command line: as given, else relative to the checkout (--home)."""
    home = Path(args.home or template_dir().parent).resolve()
    path = Path(given)
    if not path.is_file() and not path.is_absolute() and (home / path).is_file():
        path = home / path
    return path


def _learning_settings(args: argparse.Namespace, settings: dict[str, str], sbatch: dict[str, str | None]) -> None:
    """One array element per (experiment, seed), each allocated the plan's largest rank count."""
    from hvd_rl.analysis.study import PlanError, load_plan

    path = _home_file(args, args.plan)
    try:
        plan = load_plan(path)
    except PlanError as exc:
        raise SlurmRenderError(str(exc)) from None
    settings["plan"] = shlex.quote(str(path.resolve()))
    elements = sum(len(e.seeds) for e in plan.experiments)
    sbatch["array"] = f"0-{elements - 1}"
    nodes = int(sbatch["nodes"] or 1)
    sbatch["ntasks-per-node"] = sbatch["ntasks-per-node"] or str(-(-max(e.ranks for e in plan.experiments) // nodes))


def _sweep_settings(args: argparse.Namespace, settings: dict[str, str], sbatch: dict[str, str | None]) -> None:
    """One array task per worker, each allocated one trial's ranks (the sweep file's)."""
    from hvd_rl.cluster.sweeps.spec import SweepError, load_sweep

    if not args.sweep_file or not args.study_dir:
        raise SlurmRenderError("--template sweep needs --sweep-file and --study-dir")
    path = _home_file(args, args.sweep_file)
    try:
        spec = load_sweep(path)
    except SweepError as exc:
        raise SlurmRenderError(str(exc)) from None
    settings["sweep_file"] = shlex.quote(str(path.resolve()))
    settings["study_dir"] = shlex.quote(args.study_dir)
    workers = args.workers or 4
    sbatch["array"] = f"0-{workers - 1}" + (f"%{args.concurrency}" if args.concurrency else "")
    nodes = int(sbatch["nodes"] or 1)
    sbatch["ntasks-per-node"] = sbatch["ntasks-per-node"] or str(-(-spec.ranks // nodes))


def render_from_args(args: argparse.Namespace) -> Path:
    _check(args)
    template = template_dir() / TEMPLATES[args.template]
    # Rendered scripts name the checkout they were rendered from, so they run from anywhere.
    settings: dict[str, str] = {"home": shlex.quote(str(Path(args.home or template_dir().parent).resolve()))}
    if args.config:
        settings["config"] = shlex.quote(args.config)
    overrides = list(args.overrides)
    if args.template == "gpu" and not any(o.split("=", 1)[0].strip() == "distributed.device" for o in overrides):
        overrides.insert(0, "distributed.device=cuda")  # the template's own setting, kept under --set
    if overrides:
        settings["set"] = "(" + " ".join(shlex.quote(f"--set={o}") for o in overrides) + ")"
    if args.run_root:
        settings["run_root"] = shlex.quote(args.run_root)
    if args.launcher:
        settings["launcher"] = shlex.quote(args.launcher)
    if args.container_runtime and not args.container:
        raise SlurmRenderError("--container-runtime needs --container")
    if args.container:
        runtime = args.container_runtime or "apptainer"
        launcher = args.launcher or "srun"
        if launcher == "horovodrun" or (runtime == "pyxis" and launcher != "srun"):
            raise SlurmRenderError(f"--container with --container-runtime {runtime} needs --launcher "
                                   f"{'srun' if runtime == 'pyxis' else 'srun or mpirun'}, not {launcher}")
        if args.template not in ("cpu", "gpu"):
            raise SlurmRenderError("--container applies to the cpu and gpu templates")
        settings["container"] = shlex.quote(args.container)
        settings["container_runtime"] = shlex.quote(runtime)
    if args.ranks:
        settings["ranks"] = "(" + " ".join(args.ranks.split()) + ")"  # checked: ASCII digits
    if args.sweep_nodes or args.ranks:
        settings["sweep_nodes"] = "(" + " ".join((args.sweep_nodes or " ".join("1" for _ in args.ranks.split())).split()) + ")"
    if args.mode:
        settings["mode"] = shlex.quote(args.mode)
    if args.iterations:
        settings["iterations"] = str(args.iterations)
    sbatch = _sbatch_lines(args)
    if args.plan:
        if args.template != "learning":
            raise SlurmRenderError("--plan belongs to --template learning")
        _learning_settings(args, settings, sbatch)
    sweep_only = [name for name in ("sweep_file", "study_dir", "workers", "concurrency") if getattr(args, name) is not None]
    if args.template == "sweep":
        _sweep_settings(args, settings, sbatch)
    elif sweep_only:
        raise SlurmRenderError(f"--{sweep_only[0].replace('_', '-')} belongs to --template sweep")
    if args.template == "scaling" and args.ranks:
        # Every array element gets the same allocation: size it for the largest point.
        ranks = [int(r) for r in args.ranks.split()]
        nodes = [int(n) for n in args.sweep_nodes.split()] if args.sweep_nodes else [1] * len(ranks)
        sbatch["array"] = f"0-{len(ranks) - 1}"
        sbatch["nodes"] = sbatch["nodes"] or str(max(nodes))
        sbatch["ntasks-per-node"] = sbatch["ntasks-per-node"] or str(max(-(-r // n) for r, n in zip(ranks, nodes)))
    text = render(template.read_text(), sbatch, settings)
    # Checked before anything is written: a refused script never replaces an earlier one.
    check = subprocess.run(["bash", "-n"], input=text, capture_output=True, text=True)
    if check.returncode != 0:
        raise SlurmRenderError(f"rendered script fails 'bash -n': {' '.join(check.stderr.split())}")
    out = Path(args.out)
    write_atomically(out, text, mode=0o755)
    return out
