"""torchrun process groups (no torchrun: each helper the identity), collectives, `RankWatch` (docs/reliability.md)."""

from __future__ import annotations

import os
import re
import signal
import socket
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack, suppress
from dataclasses import dataclass, field
from datetime import timedelta
from enum import StrEnum

import torch
import torch.distributed as dist

from eagle31.errors import ConfigError, RankLost, choose, exit_now
from eagle31.io import pid_alive

# a collective that failed because a peer went away (gloo: "Connection reset by peer"; NCCL: a timeout or abort)
_PEER_FAILURE = re.compile(r"connection|peer|timed? ?out|timeout|abort|nccl|gloo", re.IGNORECASE)


class Device(StrEnum):
    auto = "auto"  # cuda when available
    cpu = "cpu"
    cuda = "cuda"


class Precision(StrEnum):
    auto = "auto"  # bf16 compute on GPU, fp32 on CPU
    bf16 = "bf16"
    fp32 = "fp32"


@dataclass(frozen=True)
class World:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    watch: RankWatch | None = field(default=None, compare=False, repr=False)
    local_world_size: int = 1  # processes on this node

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def resolve_device(requested: str, local_rank: int) -> torch.device:
    requested = choose(Device, requested, "train.device")
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("train.device=cuda but no CUDA device is available (use train.device=cpu or auto)")
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_world(device: str = "auto", rank_timeout_s: float | None = None) -> World:
    """Join torchrun's process group when launched by it; `rank_timeout_s`: a `RankWatch` runs until `close_world`."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if rank_timeout_s is not None and not rank_timeout_s > 0:
        raise ConfigError(f"train.rank_timeout_s must be positive, got {rank_timeout_s}")
    dev = resolve_device(device, local_rank)
    if world_size > 1 and not dist.is_initialized():
        init_process_group(dev)
    elif dev.type == "cuda":
        ensure_single_process_group(dev)  # FSDP2 (mixed precision) runs on one GPU too
    watch = None
    if world_size > 1 and rank_timeout_s is not None and "MASTER_ADDR" in os.environ:
        watch = RankWatch(rendezvous_store(rank_timeout_s), rank, world_size, rank_timeout_s)
        watch.start()
    return World(rank, world_size, local_rank, dev, watch, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def rendezvous_store(timeout_s: float) -> dist.Store:
    """A client of the store the ranks met in (torchrun's agent or rank 0 hosts it), keys of this launch only."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    client = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
    launch = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return dist.PrefixStore(f"eagle31/ranks/{launch}/", client)


def init_process_group(device: torch.device, **init) -> None:
    """The process group, NCCL on CUDA (with `device` current), gloo on CPU; `init`: `dist.init_process_group`'s."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None, **init)


def ensure_single_process_group(device: torch.device) -> None:
    """A one-process group on localhost (NCCL on CUDA, gloo on CPU), for FSDP2 or collectives without torchrun."""
    if not dist.is_initialized():
        init_process_group(device, init_method=f"tcp://127.0.0.1:{free_ports(1)[0]}", rank=0, world_size=1)


def free_ports(n: int) -> list[int]:
    """`n` distinct TCP ports free on this node now."""
    with ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in sockets:
            s.bind(("", 0))
        return [s.getsockname()[1] for s in sockets]


def close_world(world: World | None = None, left: str = "finished") -> None:
    """Leave the process group; the watch of `world` ends, telling the other ranks why this one left (not lost)."""
    if world is not None and world.watch is not None:
        world.watch.stop(left)
    if dist.is_initialized():
        dist.destroy_process_group()


def exit_rank_lost(message: str) -> None:
    """Leave at once (a collective may never return), after one line."""
    line = f"error: {message}; stopping this rank too. The last complete checkpoint is kept: rerun with resume=auto"
    exit_now(f"{line} (on the same or another number of ranks)", RankLost.exit_code)


class RankWatch:
    """Heartbeats in the rendezvous store; `on_lost(verdict)` for a lost rank (docs/reliability.md, "A dead rank")."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, timeout_s: float, *,
                 interval_s: float | None = None, on_lost: Callable[[str], None] = exit_rank_lost,
                 clock: Callable[[], float] = time.monotonic):  # fmt: skip
        self.store, self.rank, self.world_size, self.timeout_s = store, rank, world_size, timeout_s
        self.clock, self.on_lost = clock, on_lost
        self.interval_s = interval_s or min(5.0, timeout_s / 10)
        self.lost: str | None = None
        self._explaining = False  # the main thread's collective failed: a rank that left on an error is the cause
        self._stopping = threading.Event()
        self._wake = threading.Event()  # a check now, not at the next interval
        self._done = threading.Event()  # the verdict was given, or the watch stopped
        self._thread = threading.Thread(target=self._run, name="eagle31-rank-watch", daemon=True)

    def start(self) -> None:
        self.store.set(f"pid/{self.rank}", f"{socket.gethostname()} {os.getpid()}")
        self.store.add(f"beat/{self.rank}", 1)
        self._thread.start()

    def stop(self, left: str = "finished") -> None:
        """End the watch; `left` (why this rank leaves) is what the others read instead of taking it for lost."""
        if self._stopping.is_set():
            return
        with suppress(Exception):  # the store's host is gone: nobody is left to tell
            self.store.set(f"done/{self.rank}", left)
        self._stopping.set()
        self._wake.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join()

    def explain(self, error: BaseException) -> None:
        """A collective failed in the main thread: if a peer went away, wait for the verdict naming it (which exits)."""
        if not (self._thread.is_alive() and _PEER_FAILURE.search(str(error))):
            return
        self._explaining = True
        self._wake.set()
        in_main = threading.current_thread() is threading.main_thread()
        # torchrun's agent SIGTERMs the survivors of a dead rank: the line naming it comes first (bounded by this wait)
        previous = signal.signal(signal.SIGTERM, signal.SIG_IGN) if in_main else None
        try:
            self._done.wait(self.timeout_s + 2 * self.interval_s)
        finally:
            if in_main:
                signal.signal(signal.SIGTERM, previous)

    def _run(self) -> None:
        watched = [r for r in (range(self.world_size) if self.rank == 0 else [0]) if r != self.rank]
        seen: dict[int, tuple[int, float]] = {}  # rank -> (beats, when they last changed)
        where: dict[int, str] = {}
        try:
            while True:
                self._wake.wait(self.interval_s)
                self._wake.clear()
                if self._stopping.is_set():
                    return
                self.store.add(f"beat/{self.rank}", 1)
                verdict = self.store.get("lost").decode() if self.store.check(["lost"]) else None
                verdict = verdict or next(filter(None, (self._check(r, seen, where) for r in watched)), None)
                if verdict:
                    self._give(verdict)
                    return
        except Exception as e:  # noqa: BLE001 - the store itself went away: its host (rank 0's node, torchrun's agent)
            if not self._stopping.is_set():
                why = " ".join(str(e).split())[:200]
                self._give(f"the rendezvous store stopped answering ({why}): rank 0's node or torchrun is gone")
        finally:
            self._done.set()

    def _check(self, r: int, seen: dict, where: dict) -> str | None:
        """Why rank `r` is lost, or None while it is alive (or finished)."""
        if self.store.check([f"done/{r}"]):
            left = self.store.get(f"done/{r}").decode()
            return f"rank {r} left ({left})" if self._explaining and left != "finished" else None
        now = self.clock()
        beats = self.store.add(f"beat/{r}", 0)
        if r not in seen or seen[r][0] != beats:
            seen[r] = (beats, now)
        if r not in where and self.store.check([f"pid/{r}"]):
            where[r] = self.store.get(f"pid/{r}").decode()
        host, _, pid = where.get(r, "? 0").partition(" ")
        if host == socket.gethostname() and not pid_alive(int(pid)) and not self.store.check([f"done/{r}"]):
            return f"rank {r} (pid {pid} on {host}) has died"
        if now - seen[r][1] > self.timeout_s:
            return (
                f"rank {r} (pid {pid} on {host}) sent no heartbeat for {self.timeout_s:g} s (train.rank_timeout_s): "
                "it died or its node was lost"
            )
        return None

    def _give(self, verdict: str) -> None:
        self.lost = verdict
        with suppress(Exception):
            self.store.set("lost", verdict)  # the other ranks read it at their next beat
        self.on_lost(verdict)


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over ranks (in place); identity when undistributed. `x` on the world's device: NCCL refuses host memory."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x


def broadcast_object(obj, device: torch.device, src: int = 0):
    """`obj` (picklable) from rank `src` to every rank, staged on the world's `device` (NCCL needs CUDA memory)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [obj]
        dist.broadcast_object_list(box, src=src, device=device)
        return box[0]
    return obj


def all_gather_objects(obj) -> list:
    """`obj` (picklable) of every rank, in rank order; `[obj]` when undistributed."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, obj)
        return gathered
    return [obj]


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
