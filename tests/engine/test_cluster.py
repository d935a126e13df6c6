"""Ray's start leaves the process's own SIGTERM handler in place (the preemption checkpoint depends on it)."""

from __future__ import annotations

import signal
import sys

import pytest

from eagle31.engine.cluster import init_ray


class RayThatTakesSigterm:
    """What `ray.init` does to a main thread: installs its own exit-at-once SIGTERM handler."""

    def init(self, **kwargs):
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(signal.SIGTERM))


def test_init_ray_keeps_the_sigterm_handler_the_process_had():
    def ours(*_):
        pass

    previous = signal.signal(signal.SIGTERM, ours)
    try:
        init_ray(RayThatTakesSigterm(), num_cpus=1)
        assert signal.getsignal(signal.SIGTERM) is ours
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.slow  # starts the session's Ray cluster (3 s) when no engine test has
def test_the_real_ray_cluster_left_sigterm_as_it_was(ray_cluster):
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # what the test process had before Ray started
