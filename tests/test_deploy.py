"""The deployment routes that cannot run here, checked as far as they can be without their platform:
Kubernetes MPIJob manifests (rendered by `hvd-rl k8s render`) against the MPI Operator's own
v2beta1 CRD schema (read from ../shared/schemas, with the API server's strict field validation)
and Kubernetes' own strict schemas for the pods and the claim; the AWS Batch job definition
against the Batch API's RegisterJobDefinition input (botocore's service model); Apptainer inside
the SLURM templates: the rendered scripts' launch lines, with srun/mpirun replaced by a printer of
their arguments (apptainer itself is not installed here), and `make sif` with podman and apptainer
replaced by recorders. Each validation is shown to fail on a broken document, so none of them
passes vacuously."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import botocore.session
import jsonschema
import kubernetes_validate
import pytest
import yaml
from botocore.validate import ParamValidator

from conftest import BIN, REPO, check, missing_prerequisite, run

K8S_VERSION = "1.30.0"
# The CRD exactly as MPI Operator v0.8.2 ships it (Apache-2.0, its LICENSE beside it), provided
# beside the checkout (CI copies shared/ next to its clone), not vendored into the repository.
MPIJOB_CRD = REPO.parent / "shared" / "schemas" / "mpi-operator-v0.8.2" / "kubeflow.org_mpijobs.yaml"
JOB_DEFINITION = REPO / "deploy" / "aws-batch" / "job-definition.json"
_VALUES = ("default", "enum", "example")  # keywords whose values are data, not schemas


def strict_fields(schema):
    """The CRD schema as the API server applies it with strict field validation (kubectl's default
    since 1.27): a field the structural schema does not declare is an error, not silently pruned,
    except under x-kubernetes-preserve-unknown-fields. JSON Schema alone would let it through."""
    if isinstance(schema, list):
        return [strict_fields(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: value if key in _VALUES else strict_fields(value) for key, value in schema.items()}
    if out.get("type") == "object" and "additionalProperties" not in out \
            and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def _list_type(validator, list_type, instance, schema) -> Iterator[jsonschema.ValidationError]:
    """x-kubernetes-list-type: `set` items are unique, `map` items unique by their map keys
    (containers by name, ports by port and protocol), as the API server checks them."""
    if not isinstance(instance, list):
        return
    if list_type == "set":
        keys = [json.dumps(item, sort_keys=True) for item in instance]
    elif list_type == "map":
        fields = schema.get("x-kubernetes-list-map-keys", [])
        defaults = schema.get("items", {}).get("properties", {})
        keys = [json.dumps([item.get(f, defaults.get(f, {}).get("default")) for f in fields]) for item in instance]
    else:
        return
    duplicates = sorted({k for k in keys if keys.count(k) > 1})
    if duplicates:
        yield jsonschema.ValidationError(f"duplicate entries in a list of type {list_type}: {duplicates}")


_FORMATS = jsonschema.FormatChecker(formats=())
_FORMATS.checks("int32")(lambda v: not isinstance(v, int) or -2**31 <= v < 2**31)
_FORMATS.checks("int64")(lambda v: not isinstance(v, int) or -2**63 <= v < 2**63)
CRDValidator = jsonschema.validators.extend(jsonschema.Draft202012Validator,
                                            {"x-kubernetes-list-type": _list_type})


@pytest.fixture(scope="module")
def mpijob_crd() -> Callable[[dict], None]:
    """Validates an MPIJob against the CRD: apiVersion and kind from its group, served version and
    names, `spec` against its openAPIV3Schema (strict fields, int32/int64 ranges, list types)."""
    if not MPIJOB_CRD.is_file():
        missing_prerequisite(f"the MPI Operator v0.8.2 CRD is not at {MPIJOB_CRD} (shared/ beside the checkout)")
    crd = yaml.safe_load(MPIJOB_CRD.read_text())
    version = next(v for v in crd["spec"]["versions"] if v["served"] and v["storage"])
    api_version, kind = f"{crd['spec']['group']}/{version['name']}", crd["spec"]["names"]["kind"]
    spec_schema = strict_fields(version["schema"]["openAPIV3Schema"]["properties"]["spec"])
    CRDValidator.check_schema(spec_schema)
    validator = CRDValidator(spec_schema, format_checker=_FORMATS)

    def validate(job: dict) -> None:
        if (job.get("apiVersion"), job.get("kind")) != (api_version, kind):
            raise jsonschema.ValidationError(f"{job.get('apiVersion')}/{job.get('kind')} is not {api_version}/{kind}")
        validator.validate(job["spec"])
    return validate


def validate_manifest(docs: list[dict], mpijob_crd: Callable[[dict], None]) -> None:
    """Raises on the first document, or pod template, that its schema refuses. The pod templates
    also go through Kubernetes' own PodTemplate schema (kubernetes-validate), which knows the
    core API beyond the CRD's copy of it."""
    for doc in docs:
        if doc["kind"] == "MPIJob":
            mpijob_crd(doc)
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


def test_the_committed_manifest_is_valid(mpijob_crd):
    validate_manifest(list(yaml.safe_load_all((REPO / "deploy" / "kubernetes" / "mpijob.yaml").read_text())), mpijob_crd)


def test_rendered_mpijob_carries_the_knobs_and_validates(tmp_path, mpijob_crd):
    docs = k8s_render(tmp_path, "--image", "registry.example/hvd-rl:cpu", "--job-name", "pong4", "--nodes", "4",
                      "--ntasks-per-node", "2", "--cpus-per-task", "3", "--memory-per-node", "12Gi",
                      "--namespace", "rl", "--set", "env.id=ALE/Pong-v5", "--storage", "50Gi", "--restarts", "9")
    validate_manifest(docs, mpijob_crd)
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


def test_gpu_workers_and_an_existing_claim(tmp_path, mpijob_crd):
    docs = k8s_render(tmp_path, "--image", "hvd-rl:gpu", "--nodes", "2", "--gpus-per-node", "8", "--claim", "shared")
    validate_manifest(docs, mpijob_crd)
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


def _worker(job: dict) -> dict:
    return job["spec"]["mpiReplicaSpecs"]["Worker"]


def _misspell(job: dict) -> None:
    job["spec"]["slotPerWorker"] = job["spec"].pop("slotsPerWorker")


def _misspell_nested(job: dict) -> None:
    job["spec"]["runPolicy"]["backofLimit"] = job["spec"]["runPolicy"].pop("backoffLimit")


def _slots_as_string(job: dict) -> None:
    job["spec"]["slotsPerWorker"] = str(job["spec"]["slotsPerWorker"])


def _replicas_beyond_int32(job: dict) -> None:
    _worker(job)["replicas"] = 2**31


def _unknown_mpi(job: dict) -> None:
    job["spec"]["mpiImplementation"] = "OpenMPi"


def _container_field_misspelled(job: dict) -> None:
    _worker(job)["template"]["spec"]["containers"][0]["cmd"] = ["x"]


def _two_containers_one_name(job: dict) -> None:
    containers = _worker(job)["template"]["spec"]["containers"]
    containers.append(dict(containers[0]))


def _replica_specs_not_a_map(job: dict) -> None:
    job["spec"]["mpiReplicaSpecs"] = [job["spec"]["mpiReplicaSpecs"]["Worker"]]


def _old_api_version(job: dict) -> None:
    job["apiVersion"] = "kubeflow.org/v1"


@pytest.mark.parametrize("damage", [_misspell, _misspell_nested, _slots_as_string, _replicas_beyond_int32,
                                    _unknown_mpi, _container_field_misspelled, _two_containers_one_name,
                                    _replica_specs_not_a_map, _old_api_version], ids=lambda f: f.__name__[1:])
def test_the_crd_refuses_a_broken_mpijob(tmp_path, mpijob_crd, damage):
    """The rendered MPIJob passes the CRD, and a copy with one misspelled, mistyped or out-of-range
    field does not: the CRD check itself, without the pod templates' separate check."""
    job = k8s_render(tmp_path, "--image", "hvd-rl:cpu")[1]
    mpijob_crd(job)
    broken = json.loads(json.dumps(job))
    damage(broken)
    with pytest.raises(jsonschema.ValidationError):
        mpijob_crd(broken)


def test_pod_templates_are_also_checked_against_kubernetes_itself(tmp_path, mpijob_crd):
    """kubernetes-validate refuses a pod template field the core API lacks on its own (it stays
    in the suite for fields a CRD may leave open with x-kubernetes-preserve-unknown-fields)."""
    job = k8s_render(tmp_path, "--image", "hvd-rl:cpu")[1]
    bad_pod = json.loads(json.dumps(job))
    _container_field_misspelled(bad_pod)
    template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "worker"},
                "template": _worker(bad_pod)["template"]}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(template, K8S_VERSION, strict=True)


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


def _recorder(directory: Path, name: str, body: str = "") -> None:
    """A stand-in for a program: appends its working directory and arguments (NUL-separated, one
    call a line) to NAME.calls, then runs `body`."""
    program = directory / name
    program.write_text(f'#!/bin/bash\n{{ printf "%s\\0" "$PWD" "$@"; echo; }} >> "{directory}/{name}.calls"\n{body}\n')
    program.chmod(0o755)


def _calls(directory: Path, name: str) -> list[list[str]]:
    path = directory / f"{name}.calls"
    return [line.split("\0")[:-1] for line in path.read_text().splitlines()] if path.exists() else []


def test_make_sif_builds_the_definition_from_the_archive_it_saved(tmp_path):
    """`make sif` as written, in a copy of the files it uses, with podman and apptainer replaced by
    recorders: apptainer builds containers/hvd_rl.def in a directory where the definition's
    `From:` names the very archive `podman save` wrote of the image (IMAGE), and the runscript's
    entrypoint and PATH are where the Containerfile puts them."""
    checkout = tmp_path / "checkout"
    for name in ("Makefile", "containers/podman.sh", "containers/layer_conf.py", "containers/hvd_rl.def"):
        (checkout / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, checkout / name)
    fake = tmp_path / "fakebin"
    fake.mkdir()
    _recorder(fake, "podman", 'if [ "$1" = version ]; then echo 5.0.0; exit; fi\n'
                              'while [ $# -gt 1 ]; do [ "$1" = -o ] && out="$2"; shift; done\n'
                              'echo "archive of $1" > "$out"')
    _recorder(fake, "apptainer")
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "HVD_RL_PODMAN_QUIET": "1"}
    made = subprocess.run(["make", "-C", str(checkout), "sif", "IMAGE=registry.example/hvd-rl:cpu"],
                          capture_output=True, text=True, env=env, timeout=60, check=False)
    assert made.returncode == 0, made.stdout + made.stderr
    saves = [c for c in _calls(fake, "podman") if c[1] == "save"]
    assert len(saves) == 1 and saves[0][-1] == "registry.example/hvd-rl:cpu", saves
    archive = Path(saves[0][0]) / saves[0][saves[0].index("-o") + 1]
    [build] = _calls(fake, "apptainer")
    cwd, args = Path(build[0]), build[1:]
    assert args[:2] == ["build", "--force"] and cwd / args[2] == checkout / "build" / "hvd-rl.sif", build
    definition = (cwd / args[-1]).resolve()
    assert definition == (checkout / "containers" / "hvd_rl.def").resolve()
    header = [line for line in definition.read_text().splitlines() if line and not line.startswith("#")][:2]
    assert header[0] == "Bootstrap: oci-archive" and header[1].startswith("From: ")
    source = cwd / header[1].removeprefix("From: ").strip()  # apptainer reads it from its working directory
    assert source.resolve() == archive.resolve() and source.read_text() == "archive of registry.example/hvd-rl:cpu\n"
    text = definition.read_text()
    containerfile = (REPO / "containers" / "Containerfile").read_text().replace("\\\n", " ")
    entrypoint = text.split("%runscript", 1)[1].split()[1]
    assert entrypoint == "/opt/hvd_rl/src/containers/entrypoint.sh"
    copied = [line.split()[1:] for line in containerfile.splitlines() if line.startswith("COPY ")]
    assert any("containers/entrypoint.sh" in c[:-1] and c[-1] == "/opt/hvd_rl/src/containers/" for c in copied)
    assert "export PATH=/opt/hvd_rl/venv/bin:$PATH" in text and "ENV PATH=/opt/hvd_rl/venv/bin:$PATH" in containerfile
