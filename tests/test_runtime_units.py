"""Runtime pieces without ranks: the preemption flag's handler and stop file."""
import signal

from hvd_rl.runtime import PreemptionFlag, preempted_exit_code


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
