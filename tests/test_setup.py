"""scripts/setup.sh: a new environment reuses the cached Horovod wheel; a rerun is a no-op."""
import subprocess
import time

from conftest import REPO, launch_env, run


def test_new_venv_uses_cached_horovod_wheel_and_rerun_is_fast(tmp_path):
    venv = tmp_path / "venv"
    env = launch_env({"HVD_RL_VENV": str(venv)})
    first = run([REPO / "scripts" / "setup.sh"], timeout=900, env=env)
    assert first.returncode == 0, first.stdout[-3000:]
    assert "Horovod wheel cache hit" in first.stdout and "building Horovod" not in first.stdout
    assert "[X] MPI" in first.stdout and "[X] Gloo" in first.stdout  # horovodrun --check-build
    probe = subprocess.run([venv / "bin" / "python", "-c",
                            "import horovod.torch as h, hvd_rl; print(h.mpi_built(), h.gloo_built())"],
                           capture_output=True, text=True)
    assert probe.stdout.split() == ["True", "True"], probe.stderr
    started = time.time()
    second = run([REPO / "scripts" / "setup.sh"], timeout=300, env=env)
    assert second.returncode == 0 and "up to date" in second.stdout
    assert "[X] Gloo" in second.stdout and time.time() - started < 60


def test_plan_rebuilds_a_cpu_environment_when_a_gpu_build_is_asked_for():
    """Rerunning setup with HOROVOD_GPU_OPERATIONS=NCCL (and a CUDA torch) on a CPU venv must not
    say "done": torch is reinstalled and Horovod rebuilt (then checked for nccl_built())."""
    plain = run([REPO / "scripts" / "setup.sh", "--plan"], timeout=120, env=launch_env())
    assert plain.returncode == 0
    assert "torch:   keep" in plain.stdout and "horovod: keep" in plain.stdout
    gpu = run([REPO / "scripts" / "setup.sh", "--plan"], timeout=120, env=launch_env({
        "HOROVOD_GPU_OPERATIONS": "NCCL",
        "HVD_RL_TORCH": "torch==2.11.0 --index-url https://download.pytorch.org/whl/cu130"}))
    assert gpu.returncode == 0
    assert "torch:   reinstall" in gpu.stdout and "has no CUDA" in gpu.stdout
    assert "horovod: rebuild" in gpu.stdout
