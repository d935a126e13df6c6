"""SIGTERM / SIGUSR1 become a stop request; a second signal or the grace running out ends the process at once."""

import os
import signal
import threading
import time

import pytest

from eagle31.preemption import StopSignals


def wait_for(condition, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_a_signal_is_a_request_and_a_second_one_ends_at_once(tmp_path, sig, capsys):
    ended = []
    with StopSignals(60, tmp_path / "checkpoints", on_expire=ended.append, same_within_s=0.3) as stop:
        assert not stop.requested
        os.kill(os.getpid(), sig)
        os.kill(os.getpid(), sig)  # at once: the same request (a scheduler's and torchrun's agent's copies)
        wait_for(lambda: stop.requested)
        time.sleep(0.5)
        assert stop.received == sig and not ended
        os.kill(os.getpid(), sig)
        wait_for(lambda: ended)
    assert ended == [
        f"a second {sig.name} while stopping on {sig.name}; exited at once: the last complete checkpoint "
        f"in {tmp_path / 'checkpoints'} is kept, rerun with resume=auto"
    ]
    assert f"warning: {sig.name}: stopping after this step" in capsys.readouterr().err
    assert signal.getsignal(sig) is signal.SIG_DFL and signal.set_wakeup_fd(-1) == -1  # all put back


def test_the_grace_running_out_ends_at_once(tmp_path):
    ended = []
    with StopSignals(0.3, tmp_path, on_expire=ended.append) as stop:
        started = time.monotonic()
        os.kill(os.getpid(), signal.SIGTERM)
        wait_for(lambda: ended)
        assert stop.requested and 0.25 < time.monotonic() - started < 5
    assert ended[0].startswith("the run did not stop within train.preempt_grace_s=0.3 s of SIGTERM")


def test_the_end_of_the_grace_is_not_delayed_by_a_busy_main_thread(tmp_path):
    """The main thread blocked in C (here a lock; a collective whose peer died in a run) still gets the exit."""
    ended, blocked = [], threading.Lock()
    blocked.acquire()
    with StopSignals(0.2, tmp_path, on_expire=lambda m: (ended.append(m), blocked.release())):
        os.kill(os.getpid(), signal.SIGTERM)
        assert blocked.acquire(timeout=10)  # no bytecode runs here until the lock is released
    assert ended


def test_outside_the_main_thread_nothing_is_installed(tmp_path):
    seen = []
    thread = threading.Thread(target=lambda: seen.append(StopSignals(1, tmp_path).__enter__().requested))
    thread.start()
    thread.join()
    assert seen == [False] and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
