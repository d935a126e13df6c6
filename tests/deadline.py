"""`@pytest.mark.deadline(seconds)`: a test that waits on another process fails when it runs past its deadline.

The whole test counts (its fixtures' setup, the call, the teardown). At the deadline SIGALRM prints every thread's
stack and fails the test where it waits (a `ray.get`, a `subprocess.run`, a `time.sleep` all return to Python for
a signal); a wait that never does is ended `GRACE_S` later with the process, stacks printed, so CI fails rather
than hangs. Main thread, POSIX. The project's own helper, not the `pytest-timeout` plugin: no dependency to
install, and its marker is not that plugin's `timeout`, so both can live side by side.
"""

from __future__ import annotations

import faulthandler
import signal
import sys
import threading

import pytest

GRACE_S = 60.0


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    mark = item.get_closest_marker("deadline")
    if mark is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    seconds = float(mark.args[0])

    def expire(signum, frame):
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)  # where each thread was waiting
        pytest.fail(f"{item.nodeid} ran past its deadline of {seconds:g} s", pytrace=False)

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    faulthandler.dump_traceback_later(seconds + GRACE_S, exit=True)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        faulthandler.cancel_dump_traceback_later()
        signal.signal(signal.SIGALRM, previous)
