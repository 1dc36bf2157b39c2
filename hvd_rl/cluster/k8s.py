"""`hvd-rl k8s render`: a ready-to-apply Kubeflow MPIJob (v2beta1) from deploy/kubernetes/mpijob.yaml.

The same knobs as `hvd-rl slurm render` (nodes, ranks per node, CPUs per rank, GPUs per node,
config, --set, run root, job name), plus the image and the run directory's volume. The template
stays a valid manifest on its own; rendering edits its fields, never its text.
"""
from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import yaml

from hvd_rl import CHECKOUT
from hvd_rl.cluster.rendering import RenderError, has_control, show, write_atomically

# metadata.name of the MPIJob and the claim, and the pods the operator derives from them: an
# RFC 1123 label (the operator appends "-launcher" / "-worker-N", so leave room).
_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,40}[a-z0-9])?")
_QUANTITY = re.compile(r"[0-9]+(\.[0-9]+)?(m|k|M|G|T|Ki|Mi|Gi|Ti)?")
_IMAGE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:@+-]*")


class K8sRenderError(RenderError):
    pass


def template_path() -> Path:
    return CHECKOUT / "deploy" / "kubernetes" / "mpijob.yaml"


def add_render_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", "-o", required=True, help="where to write the manifest")
    parser.add_argument("--image", required=True, help="the hvd_rl image the pods run (make image; pushed)")
    parser.add_argument("--job-name", default="hvd-rl", help="MPIJob name (lower-case letters, digits, -)")
    parser.add_argument("--namespace", help="metadata.namespace of both objects")
    parser.add_argument("--nodes", type=int, default=2, help="worker pods")
    parser.add_argument("--ntasks-per-node", type=int, help="ranks per worker (slotsPerWorker; default 1, "
                                                           "or --gpus-per-node)")
    parser.add_argument("--cpus-per-task", type=int, default=1, help="CPU threads per rank")
    parser.add_argument("--gpus-per-node", type=int, default=0, help="nvidia.com/gpu per worker: one rank each")
    parser.add_argument("--memory-per-node", default="8Gi", help="memory request and limit per worker")
    parser.add_argument("--config", default="configs/atari_ppo.toml",
                        help="training config, as the image sees it (its working directory holds configs/)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="config override passed to hvd-rl train; repeatable")
    parser.add_argument("--run-root", default="/runs", help="where the claim is mounted; runs go to RUN_ROOT/JOB_NAME")
    parser.add_argument("--claim", help="PersistentVolumeClaim for the run directory (default JOB_NAME-runs, created "
                                        "by the manifest; an existing claim is used as it is)")
    parser.add_argument("--storage", default="20Gi", help="size of the claim the manifest creates")
    parser.add_argument("--restarts", type=int, default=6,
                        help="launcher restarts before the job fails (runPolicy.backoffLimit); each resumes")


def _check(args: argparse.Namespace) -> None:
    texts = {"out": args.out, "image": args.image, "job_name": args.job_name, "namespace": args.namespace,
             "memory_per_node": args.memory_per_node, "config": args.config, "run_root": args.run_root,
             "claim": args.claim, "storage": args.storage}
    for name, value in texts.items():
        if value is not None and (not value.strip() or has_control(value)):
            what = "is empty" if not value.strip() else "contains a newline or control character"
            raise K8sRenderError(f"--{name.replace('_', '-')} {show(value)} {what}")
    for name in ("job_name", "namespace", "claim"):
        value = getattr(args, name)
        if value is not None and not _NAME.fullmatch(value):
            raise K8sRenderError(f"--{name.replace('_', '-')} {show(value)} is not a Kubernetes name: lower-case "
                                 "letters, digits and '-', 42 characters at most, starting and ending alphanumeric")
    for name in ("memory_per_node", "storage"):
        if not _QUANTITY.fullmatch(getattr(args, name)):
            raise K8sRenderError(f"--{name.replace('_', '-')} {show(getattr(args, name))} is not a quantity "
                                 "(e.g. 8Gi, 512Mi)")
    if not _IMAGE.fullmatch(args.image):
        raise K8sRenderError(f"--image {show(args.image)} is not an image reference")
    if not args.run_root.startswith("/"):
        raise K8sRenderError(f"--run-root {show(args.run_root)} must be an absolute path in the pods")
    for name in ("nodes", "cpus_per_task", "ntasks_per_node"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise K8sRenderError(f"--{name.replace('_', '-')} must be positive, got {value}")
    for name in ("gpus_per_node", "restarts"):
        if getattr(args, name) < 0:
            raise K8sRenderError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    for text in args.overrides:
        if has_control(text) or "=" not in text or not text.split("=", 1)[0].strip():
            raise K8sRenderError(f"--set {show(text)}: expected section.key=value on one line")


def render_documents(args: argparse.Namespace) -> list[dict]:
    """The claim (unless --claim names an existing one) and the MPIJob, as dictionaries."""
    _check(args)
    claim_doc, job = yaml.safe_load_all(template_path().read_text())
    slots = args.ntasks_per_node or max(1, args.gpus_per_node)
    ranks = args.nodes * slots
    claim = args.claim or f"{args.job_name}-runs"
    overrides = list(args.overrides)
    if args.gpus_per_node and not any(o.split("=", 1)[0].strip() == "distributed.device" for o in overrides):
        overrides.insert(0, "distributed.device=cuda")
    overrides.append(f"distributed.threads_per_rank={args.cpus_per_task}")

    for doc in (claim_doc, job):
        doc["metadata"]["name"] = claim if doc is claim_doc else args.job_name
        if args.namespace:
            doc["metadata"]["namespace"] = args.namespace
    claim_doc["spec"]["resources"]["requests"]["storage"] = args.storage
    job["metadata"]["labels"]["app.kubernetes.io/instance"] = args.job_name
    spec = job["spec"]
    spec["slotsPerWorker"] = slots
    spec["runPolicy"]["backoffLimit"] = args.restarts
    launcher = spec["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]
    worker_spec = spec["mpiReplicaSpecs"]["Worker"]
    worker_spec["replicas"] = args.nodes
    worker = worker_spec["template"]["spec"]
    train = ["hvd-rl", "train", "--config", args.config, "--run-dir", f"{args.run_root.rstrip('/')}/{args.job_name}",
             "--resume", "auto"]
    for override in overrides:
        train += ["--set", override]
    args_list = launcher["containers"][0]["args"]
    launcher["containers"][0]["args"] = ["-np", str(ranks)] + args_list[2:args_list.index("hvd-rl")] + train
    resources = worker["containers"][0]["resources"]
    cpu = str(slots * args.cpus_per_task)
    for part in ("requests", "limits"):
        resources[part]["cpu"] = cpu
        resources[part]["memory"] = args.memory_per_node
        if args.gpus_per_node:
            resources[part]["nvidia.com/gpu"] = args.gpus_per_node
    for pod in (launcher, worker):
        pod["containers"][0]["image"] = args.image
        pod["containers"][0]["volumeMounts"][0]["mountPath"] = args.run_root
        pod["volumes"][0]["persistentVolumeClaim"]["claimName"] = claim
    return [job] if args.claim else [claim_doc, job]


def render_from_args(args: argparse.Namespace) -> Path:
    docs = render_documents(args)
    launch = " ".join(shlex.quote(a) for a in
                      ["mpirun", *docs[-1]["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]["args"]])
    header = ("# Rendered by hvd-rl k8s render from deploy/kubernetes/mpijob.yaml (its comments explain the\n"
              "# restart and preemption story). Apply with: kubectl apply -f THIS_FILE\n"
              f"# Launcher: {launch}\n")
    text = header + yaml.safe_dump_all(docs, sort_keys=False, default_flow_style=False, width=120)
    out = Path(args.out)
    write_atomically(out, text, mode=0o644)
    return out
