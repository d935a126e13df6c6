"""The watch on ranks: a rank that dies or goes silent is named within the timeout; one that leaves in order is not."""

import socket
import subprocess
import threading
import time

import pytest
import torch.distributed as dist

from eagle31.distributed import RankWatch


class Clock:
    """The time a watch judges silence by, moved by the test: no verdict depends on how fast the machine is."""

    def __init__(self, now: float = 1024.0):  # times of a binary fraction: exact sums
        self.now = now

    def __call__(self) -> float:
        return self.now


def watch(store, rank: int, clock: Clock, timeout_s: float = 0.5) -> tuple[RankWatch, list[str], threading.Event]:
    said, lost = [], threading.Event()
    w = RankWatch(
        store, rank, 2, timeout_s, interval_s=0.01, clock=clock, on_lost=lambda m: (said.append(m), lost.set())
    )
    w.start()
    return w, said, lost


def rounds(store, rank: int, n: int = 2) -> None:
    """Return once `rank`'s watch has beaten `n` more times: every check it began before this call is done."""
    start, deadline = store.add(f"beat/{rank}", 0), time.monotonic() + 10
    while store.add(f"beat/{rank}", 0) < start + n:
        verdict = store.get("lost").decode() if store.check(["lost"]) else "no verdict"
        assert time.monotonic() < deadline, f"rank {rank}'s watch stopped beating ({verdict})"
        time.sleep(0.005)


def other_rank(store, rank: int, host: str, pid: int) -> None:
    """What a peer's `RankWatch.start` leaves in the store: its pid and one heartbeat."""
    store.set(f"pid/{rank}", f"{host} {pid}")
    store.add(f"beat/{rank}", 1)


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_rank_on_another_node_that_goes_silent_is_named_once_the_timeout_has_passed():
    store, clock = dist.HashStore(), Clock()
    other_rank(store, 1, "node-7", 4242)
    w, said, lost = watch(store, 0, clock)
    rounds(store, 0)  # it has seen rank 1's beat
    clock.now += 0.5  # silent for the timeout, not more
    rounds(store, 0)
    assert not said
    clock.now += 0.125
    assert lost.wait(10)
    assert said == [
        "rank 1 (pid 4242 on node-7) sent no heartbeat for 0.5 s (train.rank_timeout_s): it died or its node was lost"
    ]
    assert store.get("lost").decode() == said[0]  # for the other ranks to read


def test_a_rank_that_died_on_this_host_is_named_at_once():
    store = dist.HashStore()
    pid = dead_pid()
    other_rank(store, 1, socket.gethostname(), pid)
    w, said, lost = watch(store, 0, Clock(), timeout_s=60)  # the clock never moves
    assert lost.wait(10)
    assert said == [f"rank 1 (pid {pid} on {socket.gethostname()}) has died"]


def test_live_and_finished_ranks_are_not_taken_for_lost():
    store, clock = dist.HashStore(), Clock()
    w0, said0, lost0 = watch(store, 0, clock)
    w1, said1, lost1 = watch(store, 1, clock)
    for _ in range(8):  # 2 s on the clock, four times the timeout, while both keep beating
        clock.now += 0.25
        rounds(store, 0, 3)
        rounds(store, 1, 3)
    assert not said0 and not said1
    w1.stop()  # rank 1 is done; its beats stop
    clock.now += 10
    rounds(store, 0)
    assert not said0
    w0.stop()


def test_the_verdict_of_one_rank_reaches_the_others():
    store = dist.HashStore()
    other_rank(store, 0, "node-0", 1)
    store.set("lost", "rank 5 (pid 9 on node-3) has died")
    w, said, lost = watch(store, 1, Clock(), timeout_s=60)
    assert lost.wait(10) and said == ["rank 5 (pid 9 on node-3) has died"]


def test_a_failed_collective_waits_for_the_rank_that_left_on_an_error():
    store = dist.HashStore()
    other_rank(store, 1, "node-7", 4242)
    store.set("done/1", "error: the disk filled up")
    w, said, lost = watch(store, 0, Clock(), timeout_s=60)
    rounds(store, 0)
    assert not said  # in order, not lost
    w.explain(RuntimeError("Read error [127.0.0.1]:9137: Connection reset by peer"))
    assert said == ["rank 1 left (error: the disk filled up)"]


@pytest.mark.parametrize("timeout", [0, -1])
def test_a_bad_timeout_is_one_line(timeout):
    from eagle31.distributed import init_world
    from eagle31.errors import ConfigError

    with pytest.raises(ConfigError, match=f"train.rank_timeout_s must be positive, got {timeout}"):
        init_world("cpu", timeout)
