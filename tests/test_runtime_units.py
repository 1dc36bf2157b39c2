"""Runtime pieces without ranks: the preemption flag's handler and stop file, the time left."""
import math
import signal

from hvd_rl.runtime.metrics import RemainingTime
from hvd_rl.runtime.trainer import PreemptionFlag, preempted_exit_code


def test_signal_handler_only_records_the_signal(capsys, tmp_path):
    """A handler runs between any two bytecodes: printing there can raise a reentrant-call error
    and Horovod may be shut down or mid-reset. It must touch nothing but the flag."""
    flag = PreemptionFlag(tmp_path / "stop.request")
    flag._handle(signal.SIGTERM, None)  # no Horovod initialised here: any call into it would raise
    flag._handle(signal.SIGUSR1, None)
    assert capsys.readouterr() == ("", "")
    assert flag.raised and flag.signum == signal.SIGTERM and "SIGTERM" in flag.describe()


def test_stop_file_is_seen_and_described(tmp_path):
    flag = PreemptionFlag(tmp_path / "stop.request")
    assert not flag.raised
    (tmp_path / "stop.request").touch()
    flag._next_file_check = 0.0  # checked at most once a second
    assert flag.raised and "stop.request" in flag.describe()


def test_preempted_exit_code(monkeypatch):
    monkeypatch.delenv("HVD_RL_PREEMPTED_EXIT_CODE", raising=False)
    assert preempted_exit_code() == 75
    monkeypatch.setenv("HVD_RL_PREEMPTED_EXIT_CODE", "0")
    assert preempted_exit_code() == 0


def test_remaining_time_follows_the_recent_pace():
    """DQN: 80k steps at 1,250 SPS before learning starts, then 200 SPS. The time left must follow
    the new pace within the window, not the run's average (which said 32 min instead of 79)."""
    eta = RemainingTime(window=10)
    eta.start(0.0, 0)
    now, step = 0.0, 0
    for _ in range(20):
        now, step = now + 3.2, step + 4000  # 1,250 SPS
        left = eta.update(now, step, 1_000_000)
    assert math.isclose(left, (1_000_000 - step) / 1250)
    for _ in range(10):
        now, step = now + 20.0, step + 4000  # 200 SPS
        left = eta.update(now, step, 1_000_000)
    assert math.isclose(left, (1_000_000 - step) / 200)
    assert math.isnan(RemainingTime().update(5.0, 0, 100))  # no step done yet


def test_resume_truncation_drops_rolled_back_decisions_and_environment_builds(tmp_path):
    """Resuming from the checkpoint of iteration 6: decisions after it and builds from it on are
    run again, so their rows go (balance.jsonl kept rows of iterations a resume rolled back)."""
    import json

    from hvd_rl.runtime.metrics import BALANCE_FILE, ENV_SEEDS_FILE, read_jsonl, truncate_metrics

    def write(name, iterations):
        (tmp_path / name).write_text("".join(json.dumps({"iteration": i}) + "\n" for i in iterations))

    write("metrics.jsonl", range(1, 10))
    write(BALANCE_FILE, [3, 6, 9])
    write(ENV_SEEDS_FILE, [0, 3, 6, 9])  # the build at 6 came after the decision (and checkpoint) at 6
    truncate_metrics(tmp_path, 6, 600)
    assert [r["iteration"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == list(range(1, 7))
    assert [r["iteration"] for r in read_jsonl(tmp_path / BALANCE_FILE)] == [3, 6]
    assert [r["iteration"] for r in read_jsonl(tmp_path / ENV_SEEDS_FILE)] == [0, 3]
