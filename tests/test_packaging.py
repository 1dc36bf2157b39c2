"""setup.py and environment.yml declare the same runtime dependencies; the console script works."""
import ast
import re

import yaml

from conftest import BIN, REPO, check, run

BUILD_ONLY = {"python", "pip", "openmpi", "cmake", "cxx-compiler"}
BUILT_BY_SETUP_SH = {"horovod"}  # patched source build, see environment.yml's header


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[ ;@]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _setup_py_requirements() -> set[str]:
    tree = ast.parse((REPO / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "INSTALL_REQUIRES":
            return {_name(item) for item in ast.literal_eval(node.value)}
    raise AssertionError("INSTALL_REQUIRES not found in setup.py")


def _environment_yml_requirements() -> tuple[set[str], dict]:
    env = yaml.safe_load((REPO / "environment.yml").read_text())
    names = set()
    for dep in env["dependencies"]:
        if isinstance(dep, dict):
            names |= {_name(p) for p in dep["pip"]}
        else:
            names.add(_name(dep))
    return names - BUILD_ONLY, env


def test_runtime_dependencies_match():
    setup_names = _setup_py_requirements()
    env_names, env = _environment_yml_requirements()
    assert setup_names - BUILT_BY_SETUP_SH == env_names
    assert BUILT_BY_SETUP_SH <= setup_names
    assert "conda-forge" in env["channels"]
    assert any(str(d).startswith("python=3.11") for d in env["dependencies"])
    for flag in ("HOROVOD_WITH_PYTORCH", "HOROVOD_WITH_MPI", "HOROVOD_WITH_GLOO"):
        assert env["variables"][flag] == "1"


def test_console_script_subcommands_have_help():
    for sub in ("train", "evaluate", "doctor", "report", "slurm"):
        out = check(run([BIN / "hvd-rl", sub, "--help"], timeout=60))
        assert "usage: hvd-rl " + sub in out
