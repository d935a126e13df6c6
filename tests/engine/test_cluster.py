"""Ray's start leaves the process's own SIGTERM handler in place (the preemption checkpoint depends on it); a run
starts its own cluster unless given one, and says which; the trainers' GPUs are never lent to the workers."""

from __future__ import annotations

import os
import signal
import sys
from types import SimpleNamespace

import pytest

from eagle31.engine import cluster
from eagle31.engine.cluster import init_ray
from eagle31.errors import ConfigError


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
@pytest.mark.deadline(120)
def test_the_real_ray_cluster_left_sigterm_as_it_was(ray_cluster):
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # what the test process had before Ray started


class RecordingRay:
    """Ray as `ray_session` sees it, recording how it was started and what CUDA_VISIBLE_DEVICES its processes saw."""

    def __init__(self):
        self.started, self.visible, self.stopped = None, None, False

    def is_initialized(self):
        return self.started is not None

    def init(self, **kwargs):
        self.started, self.visible = kwargs, os.environ.get("CUDA_VISIBLE_DEVICES")

    def get_runtime_context(self):
        return SimpleNamespace(gcs_address="10.0.0.1:6379")

    def shutdown(self):
        self.stopped = True


@pytest.mark.parametrize("address", [None, "auto"])
def test_a_run_starts_a_new_cluster_unless_given_an_address_and_says_which(monkeypatch, address):
    """Without features.engine.address a new cluster starts here (`local`), whatever RAY_ADDRESS or an earlier
    `ray start` points to, lent the GPUs the trainers leave; with one, that cluster is joined."""
    ray = RecordingRay()
    monkeypatch.setattr(cluster, "import_ray", lambda: ray)
    monkeypatch.setenv("RAY_ADDRESS", "10.9.9.9:6379")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    with cluster.ray_session(address, 4, gpus=["2", "3"]) as session:
        assert session.address == "10.0.0.1:6379" and not ray.stopped
    assert ray.stopped and os.environ["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"  # as it was, for this process
    if address is None:
        assert ray.started["address"] == "local" and ray.started["num_gpus"] == 2 and ray.visible == "2,3"
        assert session.how == "started a Ray cluster on this node at 10.0.0.1:6379 (4 CPUs, GPUs: 2,3)"
    else:
        assert ray.started["address"] == "auto" and "num_gpus" not in ray.started and ray.visible == "0,1,2,3"
        assert session.how == "joined the Ray cluster at features.engine.address=auto (10.0.0.1:6379)"


def test_the_trainers_gpus_are_never_lent_to_the_workers():
    """The trainers of a node use its first visible GPUs (local rank r: the r-th); Ray is lent the rest."""
    assert cluster.lendable_gpus(None, 4, trainer_gpus=2) == ["2", "3"]
    assert cluster.lendable_gpus("4,5,6,7", 8, trainer_gpus=1) == ["5", "6", "7"]
    assert cluster.lendable_gpus("GPU-a,GPU-b", 2, trainer_gpus=0) == ["GPU-a", "GPU-b"]  # CPU trainers
    assert cluster.lendable_gpus("", 8, trainer_gpus=0) == []
    cluster.check_worker_gpus(["2", "3"], 2, workers=2, worker_gpus=1)
    with pytest.raises(ConfigError) as e:
        cluster.check_worker_gpus([], 1, workers=1, worker_gpus=1)
    assert str(e.value) == (
        "features.engine.workers=1 x worker_gpus=1 need 1 GPU(s); the Ray cluster started on this node is lent 0 "
        "(its visible GPUs, CUDA_VISIBLE_DEVICES, less the 1 its trainers use): lower features.engine.workers or "
        "worker_gpus, or run the workers on other nodes (features.engine.address)"
    )
    cluster.check_joined_node(0, [], 8, "auto")  # `ray start --num-gpus 0` on the trainers' node
    cluster.check_joined_node(8, [str(i) for i in range(8)], 0, "auto")  # CPU trainers
    with pytest.raises(ConfigError, match=r"^features.engine.address=auto: this node lends Ray 8 GPU\(s\), but its 8 "):
        cluster.check_joined_node(8, [], 8, "auto")  # a plain `ray start --head` on the trainers' node
