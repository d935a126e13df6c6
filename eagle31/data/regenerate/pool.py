"""`regenerate`: one pool of requests over this rank's missing shards, a shard written once all its answers are in."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from itertools import islice
from pathlib import Path

from eagle31.data.regenerate.core import Outcome, RegenerateError, Reply, Settings, regenerate_conversation
from eagle31.data.regenerate.shards import ShardStats, check_resumable, input_sha256, shard_done, write_shard
from eagle31.data.sources import Conversation


class _Shard:
    def __init__(self, index: int, conversations: list[Conversation]):
        self.index, self.conversations = index, conversations
        self.outcomes: list[Outcome | None] = [None] * len(conversations)
        self.started: float | None = None

    def stats(self) -> tuple[list[dict], ShardStats]:
        stats = ShardStats()
        for conv, outcome in zip(self.conversations, self.outcomes, strict=False):
            stats.add(outcome, conv.where)  # type: ignore[arg-type]  # every outcome is in once the shard is done
        stats.seconds = time.monotonic() - (self.started or time.monotonic())
        stats.input_sha256 = input_sha256(self.conversations)
        return [o.record for o in self.outcomes if o is not None and o.record is not None], stats


class _FirstRequestGate:
    """One request first, the others waiting up to `wait_s` for it: a server refusing all stops the run after one."""

    def __init__(self, complete: Callable[..., Reply], wait_s: float = 1.0):
        self.open, self.stop, self._first = threading.Event(), threading.Event(), threading.Lock()
        self.complete, self.wait_s = complete, wait_s

    def call(self, *request) -> Reply:
        """`complete(*request)`: (messages, seed, template options)."""
        first = not self.open.is_set() and self._first.acquire(blocking=False)  # the lock is never released
        if not first and not self.open.is_set():
            self.open.wait(self.wait_s)
        if self.stop.is_set():
            raise _Stopped()
        if not first:
            return self.complete(*request)
        try:
            reply = self.complete(*request)
        except BaseException:
            self.stop.set()  # the requests waiting here are not sent
            raise
        self.open.set()
        return reply


class _Stopped(Exception):
    """Another request failed; this conversation is not asked further."""


class _DaemonPool:
    """Daemon threads running calls: unlike ThreadPoolExecutor's, an interrupted run exits without waiting on them."""

    def __init__(self, workers: int):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._workers = workers
        for i in range(workers):
            threading.Thread(target=self._work, daemon=True, name=f"regenerate-{i}").start()

    def submit(self, fn: Callable, *args) -> Future:
        future: Future = Future()
        self._jobs.put((fn, args, future))
        return future

    def close(self) -> None:
        """Stop each thread after its current call; calls not started are cancelled."""
        for _ in range(self._workers):
            self._jobs.put(None)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, args, future = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as e:  # the caller raises it
                    future.set_exception(e)


def regenerate(conversations: Iterable[Conversation], backend, out_dir: str | Path, settings: Settings, *,
               rank: int = 0, world_size: int = 1,
               progress: Callable[[int], None] = lambda n: None) -> dict[str, int]:  # fmt: skip
    """Write this rank's missing shards of `out_dir` (`prepare_output`); the counts of shards written and skipped."""
    out = Path(out_dir)
    counts = {"written": 0, "skipped": 0}
    it = iter(conversations)
    chunks = list(enumerate(iter(lambda: list(islice(it, settings.shard_size)), [])))  # shard i: its conversations
    check_resumable(out, chunks, settings.shard_size)
    todo: list[_Shard] = []
    for index, chunk in chunks:
        if index % world_size != rank:
            continue
        if shard_done(out, index):
            counts["skipped"] += 1
            progress(len(chunk))
        else:
            todo.append(_Shard(index, chunk))
    jobs = ((shard, i) for shard in todo for i in range(len(shard.conversations)))
    gate = _FirstRequestGate(backend.complete)
    finished: list[_Shard] = []  # complete, waiting for the gate to open (nothing is written before the first answer)

    def run(shard: _Shard, i: int) -> Outcome:
        shard.started = shard.started or time.monotonic()
        index = shard.index * settings.shard_size + i  # the conversation's index in the input
        return regenerate_conversation(shard.conversations[i], index, settings, gate.call)

    def flush(end: bool = False) -> None:
        while finished and (gate.open.is_set() or end):
            shard = finished.pop(0)
            write_shard(out, shard.index, *shard.stats())
            counts["written"] += 1
            progress(len(shard.conversations))

    pending: dict[Future, tuple[_Shard, int]] = {}
    pool = _DaemonPool(backend.workers)
    try:
        while True:
            while (
                not gate.stop.is_set() and len(pending) < 2 * backend.workers and (job := next(jobs, None)) is not None
            ):
                pending[pool.submit(run, *job)] = job
            if not pending:
                break
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            failure = None
            for future in done:
                shard, i = pending.pop(future)
                if future.exception() is not None:  # this shard is never written
                    if not isinstance(future.exception(), _Stopped):  # the cause (stopped ones follow it)
                        failure = failure or future.exception()
                    continue
                shard.outcomes[i] = future.result()
                if None not in shard.outcomes:
                    finished.append(shard)
            flush()
            if failure is not None:
                raise failure
        if gate.stop.is_set():  # every failure was a stopped conversation: cannot happen without a cause
            raise RegenerateError("regeneration stopped")
        flush(end=True)  # shards that needed no request (every conversation dropped before asking)
    except BaseException:
        gate.stop.set()
        for future in pending:
            future.cancel()
        raise
    finally:
        pool.close()
    return counts
