"""`hvd-rl doctor` on this machine, and with mpirun missing from PATH."""
from conftest import BIN, launch_env, run


def test_doctor_passes_and_reports_the_build():
    result = run([BIN / "hvd-rl", "doctor"], timeout=300)
    assert result.returncode == 0, result.stdout
    out = result.stdout
    assert "controllers          MPI, Gloo" in out
    assert "allreduce (mpirun)     ok (2 ranks" in out and "allreduce (gloo)       ok (2 ranks" in out
    assert "atari roms             ok" in out and "all checks passed" in out


def test_doctor_fails_clearly_without_mpirun():
    env = launch_env({"PATH": f"{BIN}:/usr/local/bin"})  # no /usr/bin: no mpirun
    result = run([BIN / "hvd-rl", "doctor"], timeout=300, env=env)
    assert result.returncode != 0
    assert "PROBLEM: mpirun is not on PATH" in result.stdout
    assert "Traceback" not in result.stdout
