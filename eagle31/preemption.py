"""SIGTERM / SIGUSR1: stop after the step with a checkpoint (docs/reliability.md, "Preemption")."""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from eagle31.errors import StoppedAtOnce, exit_now

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def exit_at_once(message: str) -> None:
    """Leave without unwinding (the main thread may be stuck), after one line."""
    exit_now(f"error: {message}", StoppedAtOnce.exit_code)


class StopSignals:
    """While entered in the main thread, a stop signal sets `requested`; `on_expire(message)` ends the process on a
    second one (not within `same_within_s`: the same, delivered twice) or when `grace_s` runs out."""

    def __init__(
        self,
        grace_s: float,
        checkpoints: str | Path,
        on_expire: Callable[[str], None] = exit_at_once,
        same_within_s: float = 2.0,
    ):
        self.grace_s = grace_s
        self.same_within_s = same_within_s
        self.checkpoints = Path(checkpoints)
        self.received: signal.Signals | None = None
        self._on_expire = on_expire
        self._active = False

    @property
    def requested(self) -> bool:
        return self.received is not None

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is not threading.main_thread():
            return self  # signal handlers belong to the main thread; a loop run elsewhere is not preemptible
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._previous = {s: signal.signal(s, lambda signum, frame: None) for s in STOP_SIGNALS}  # the thread acts
        self._previous_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="eagle31-stop-signals", daemon=True)
        self._thread.start()
        self._active = True
        return self

    def __exit__(self, *exc) -> None:
        if not self._active:
            return
        self._active = False
        signal.set_wakeup_fd(self._previous_fd)
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._closing.set()
        os.write(self._write, b"\0")  # wakes the thread
        self._thread.join()
        os.close(self._read)
        os.close(self._write)

    def _watch(self) -> None:
        deadline: float | None = None
        first: float | None = None
        stop_numbers = {int(s) for s in STOP_SIGNALS}
        kept = f"exited at once: the last complete checkpoint in {self.checkpoints} is kept, rerun with resume=auto"
        while True:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self._read], [], [], wait)
            if self._closing.is_set():
                return
            if not ready:
                assert self.received is not None  # the deadline is set with it
                grace = f"train.preempt_grace_s={self.grace_s:g} s of {self.received.name}"
                self._on_expire(f"the run did not stop within {grace}; {kept}")
                return
            for number in os.read(self._read, 64):
                if number not in stop_numbers:
                    continue  # SIGINT has its own handler (KeyboardInterrupt)
                name = signal.Signals(number).name
                if first is not None and time.monotonic() - first < self.same_within_s:
                    continue  # the same request, delivered twice
                if self.received is not None:
                    self._on_expire(f"a second {name} while stopping on {self.received.name}; {kept}")
                    return
                self.received = signal.Signals(number)
                first = time.monotonic()
                deadline = first + self.grace_s
                said = f"stopping after this step with a checkpoint (within {self.grace_s:g} s"
                print(f"warning: {name}: {said}; a second signal exits at once)", file=sys.stderr, flush=True)
