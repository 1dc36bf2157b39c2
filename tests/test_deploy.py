"""The deployment routes that cannot run here, checked as far as they can be without their platform:
Kubernetes MPIJob manifests (rendered by `hvd-rl k8s render`) against the MPIJob v2beta1 schema
and Kubernetes' own strict schemas for the pods and the claim; the AWS Batch job definition
against the Batch API's RegisterJobDefinition input (botocore's service model); Apptainer inside
the SLURM templates: the rendered scripts' launch lines, with srun/mpirun replaced by a printer of
their arguments (apptainer itself is not installed here). Each validation is shown to fail on a
broken document, so none of them passes vacuously."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import botocore.session
import jsonschema
import kubernetes_validate
import pytest
import yaml
from botocore.validate import ParamValidator

from conftest import BIN, REPO, check, run

K8S_VERSION = "1.30.0"
MPIJOB_SCHEMA = json.loads((REPO / "deploy" / "kubernetes" / "mpijob-v2beta1.schema.json").read_text())
JOB_DEFINITION = REPO / "deploy" / "aws-batch" / "job-definition.json"


def validate_manifest(docs: list[dict]) -> None:
    """Raises on the first document, or pod template, that its schema refuses."""
    for doc in docs:
        if doc["kind"] == "MPIJob":
            jsonschema.validate(doc, MPIJOB_SCHEMA)
            for role, replica in doc["spec"]["mpiReplicaSpecs"].items():
                template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"{role.lower()}"},
                            "template": replica["template"]}
                kubernetes_validate.validate(template, K8S_VERSION, strict=True)
        else:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def k8s_render(tmp_path: Path, *options: str) -> list[dict]:
    out = tmp_path / "job.yaml"
    check(run([BIN / "hvd-rl", "k8s", "render", "--out", out, *options], timeout=60))
    return list(yaml.safe_load_all(out.read_text()))


def launcher_args(docs: list[dict]) -> list[str]:
    job = next(d for d in docs if d["kind"] == "MPIJob")
    container = job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]
    return [*container["command"], *container["args"]]


def test_the_committed_manifest_is_valid():
    validate_manifest(list(yaml.safe_load_all((REPO / "deploy" / "kubernetes" / "mpijob.yaml").read_text())))


def test_rendered_mpijob_carries_the_knobs_and_validates(tmp_path):
    docs = k8s_render(tmp_path, "--image", "registry.example/hvd-rl:cpu", "--job-name", "pong4", "--nodes", "4",
                      "--ntasks-per-node", "2", "--cpus-per-task", "3", "--memory-per-node", "12Gi",
                      "--namespace", "rl", "--set", "env.id=ALE/Pong-v5", "--storage", "50Gi", "--restarts", "9")
    validate_manifest(docs)
    claim, job = docs
    assert claim["metadata"] == {"name": "pong4-runs", "namespace": "rl"}
    assert claim["spec"]["resources"]["requests"]["storage"] == "50Gi"
    spec = job["spec"]
    assert spec["slotsPerWorker"] == 2 and spec["mpiReplicaSpecs"]["Worker"]["replicas"] == 4
    assert spec["runPolicy"]["backoffLimit"] == 9
    assert spec["mpiReplicaSpecs"]["Launcher"]["restartPolicy"] == "OnFailure"
    worker = spec["mpiReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    assert worker["resources"]["limits"] == {"cpu": "6", "memory": "12Gi"} and worker["command"] == ["hvd-rl-sshd"]
    args = launcher_args(docs)
    assert args[:3] == ["mpirun", "-np", "8"]
    train = args[args.index("hvd-rl"):]
    assert train[:8] == ["hvd-rl", "train", "--config", "configs/atari_ppo.toml", "--run-dir", "/runs/pong4",
                         "--resume", "auto"]
    assert "env.id=ALE/Pong-v5" in train and "distributed.threads_per_rank=3" in train
    for pod in spec["mpiReplicaSpecs"].values():
        assert pod["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] == "pong4-runs"
        assert pod["template"]["spec"]["containers"][0]["image"] == "registry.example/hvd-rl:cpu"


def test_gpu_workers_and_an_existing_claim(tmp_path):
    docs = k8s_render(tmp_path, "--image", "hvd-rl:gpu", "--nodes", "2", "--gpus-per-node", "8", "--claim", "shared")
    validate_manifest(docs)
    assert [d["kind"] for d in docs] == ["MPIJob"]  # the claim exists: not created
    spec = docs[0]["spec"]
    assert spec["slotsPerWorker"] == 8
    limits = spec["mpiReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == 8
    args = launcher_args(docs)
    assert args[:3] == ["mpirun", "-np", "16"] and "distributed.device=cuda" in args


@pytest.mark.parametrize("option, value, expect", [
    ("--job-name", "Pong_4", "is not a Kubernetes name"),
    ("--storage", "lots", "is not a quantity"),
    ("--set", "env.id=x\nid", "expected section.key=value on one line"),
    ("--run-root", "runs", "must be an absolute path"),
    ("--nodes", "0", "must be positive"),
    ("--image", "x y", "is not an image reference"),
])
def test_bad_knobs_are_refused_in_one_line_and_nothing_is_written(tmp_path, option, value, expect):
    out = tmp_path / "job.yaml"
    result = run([BIN / "hvd-rl", "k8s", "render", "--out", out, "--image", "hvd-rl:cpu", option, value], timeout=60)
    assert result.returncode == 2 and expect in result.stdout, result.stdout
    assert len(result.stdout.strip().splitlines()) == 1 and not out.exists()


def test_schema_validation_can_fail(tmp_path):
    docs = k8s_render(tmp_path, "--image", "hvd-rl:cpu")
    job = docs[1]
    misspelled = json.loads(json.dumps(job))
    misspelled["spec"]["slotPerWorker"] = misspelled["spec"].pop("slotsPerWorker")
    with pytest.raises(jsonschema.ValidationError):
        validate_manifest([misspelled])
    bad_pod = json.loads(json.dumps(job))
    bad_pod["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["cmd"] = ["x"]
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_manifest([bad_pod])


def _validate_job_definition(definition: dict) -> None:
    model = botocore.session.get_session().get_service_model("batch")
    report = ParamValidator().validate(definition, model.operation_model("RegisterJobDefinition").input_shape)
    if report.has_errors():
        raise ValueError(report.generate_report())


def test_aws_batch_job_definition_is_a_valid_multinode_registration():
    definition = json.loads(JOB_DEFINITION.read_text())
    _validate_job_definition(definition)
    assert definition["type"] == "multinode"
    nodes = definition["nodeProperties"]
    container = nodes["nodeRangeProperties"][0]["container"]
    assert nodes["nodeRangeProperties"][0]["targetNodes"] == "0:"  # every node runs the same image
    assert container["command"][:1] == ["train"] and "auto" in container["command"]  # resumes on retry
    exits = {rule.get("onExitCode"): rule["action"] for rule in definition["retryStrategy"]["evaluateOnExit"]}
    assert exits["75"] == "RETRY" and exits["4"] == "RETRY"  # preempted / a node lost: retry, resume
    broken = json.loads(JOB_DEFINITION.read_text())
    broken["nodeProperties"]["numNode"] = broken["nodeProperties"].pop("numNodes")
    with pytest.raises(ValueError, match="numNode"):
        _validate_job_definition(broken)


# ---- Apptainer / pyxis inside the SLURM templates ---------------------------------------------

def _launch_line(tmp_path: Path, script: Path, launcher: str) -> list[str]:
    """What the rendered script's hvd_rl_launch would exec, with the launcher replaced by a program
    that prints its arguments (no SLURM, no Apptainer needed)."""
    fake = tmp_path / "fakebin"
    fake.mkdir(exist_ok=True)
    printer = fake / launcher
    printer.write_text('#!/bin/bash\nprintf "%s\\0" "$(basename "$0")" "$@"\n')
    printer.chmod(0o755)
    settings = [line for line in script.read_text().splitlines() if "# hvd-rl:" in line and not line.startswith("#")]
    body = "\n".join(settings) + f'\nLAUNCHER={launcher}\nsource "{REPO}/slurm/lib.sh"\n' \
        + ("CONTAINER_GPU=1\n" if "CONTAINER_GPU=1" in script.read_text() else "") \
        + "hvd_rl_launch train --config c.toml\n"
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "SLURM_NTASKS": "4", "SLURM_CPUS_PER_TASK": "2"}
    out = subprocess.run(["bash", "-c", body], capture_output=True, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr.decode()
    return out.stdout.decode().split("\0")[:-1]


@pytest.mark.parametrize("template", ["cpu", "gpu"])
def test_apptainer_container_goes_into_the_srun_and_mpirun_lines(tmp_path, template):
    script = tmp_path / f"{template}.sbatch"
    check(run([BIN / "hvd-rl", "slurm", "render", "--template", template, "--out", script,
               "--container", "/images/hvd rl.sif"], timeout=60))
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    nv = ["--nv"] if template == "gpu" else []
    srun = _launch_line(tmp_path, script, "srun")
    assert srun[:2] == ["srun", "--mpi=pmix"]
    tail = srun[srun.index("apptainer"):]
    assert tail == ["apptainer", "exec", *nv, "--bind", str(tmp_path), "--pwd", str(tmp_path), "/images/hvd rl.sif",
                    "hvd-rl", "train", "--config", "c.toml"]
    mpirun = _launch_line(tmp_path, script, "mpirun")
    assert mpirun[0] == "mpirun" and mpirun[mpirun.index("apptainer"):] == tail


def test_pyxis_container_goes_into_srun_and_needs_it(tmp_path):
    script = tmp_path / "cpu.sbatch"
    check(run([BIN / "hvd-rl", "slurm", "render", "--out", script, "--container", "nvcr.io#me/hvd-rl:cpu",
               "--container-runtime", "pyxis"], timeout=60))
    srun = _launch_line(tmp_path, script, "srun")
    assert "--container-image=nvcr.io#me/hvd-rl:cpu" in srun and f"--container-workdir={tmp_path}" in srun
    assert srun[-4:] == ["hvd-rl", "train", "--config", "c.toml"] and "apptainer" not in srun
    refused = run([BIN / "hvd-rl", "slurm", "render", "--out", tmp_path / "x.sbatch", "--container", "img",
                   "--container-runtime", "pyxis", "--launcher", "mpirun"], timeout=60)
    assert refused.returncode == 2 and "needs --launcher srun" in refused.stdout
    plain = tmp_path / "plain.sbatch"
    check(run([BIN / "hvd-rl", "slurm", "render", "--out", plain], timeout=60))
    assert _launch_line(tmp_path, plain, "srun")[-4:] == ["hvd-rl", "train", "--config", "c.toml"]


def test_apptainer_definition_builds_from_the_image_archive():
    text = (REPO / "containers" / "hvd_rl.def").read_text()
    header = [line for line in text.splitlines() if line and not line.startswith("#")][:2]
    assert header == ["Bootstrap: oci-archive", "From: hvd-rl.oci.tar"]
    assert "exec /opt/hvd_rl/src/containers/entrypoint.sh" in text
    assert shlex.split("podman save --format oci-archive -o hvd-rl.oci.tar localhost/hvd-rl:cpu")[-1] in text
