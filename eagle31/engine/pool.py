"""The feature pool: a Ray actor that feeds the workers the loaders' micro-batches and hands each rank its features."""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import ray
from ray.exceptions import ActorUnavailableError, RayActorError

from eagle31.data.batch import bucket_by_length
from eagle31.data.loader import plan_epoch
from eagle31.engine.transport import FeatureTransport, ObjectStoreTransport
from eagle31.engine.worker import InferenceWorker, WorkerInfo, WorkerSpec, worker_mismatch
from eagle31.errors import Eagle31Error


@dataclass(frozen=True)
class PoolSettings:
    prepared_dir: str  # the prepared splits (read on the pool's node)
    workers: int
    batching: str  # the loaders' plan: features.batching, features.tokens_per_batch, seed
    tokens_per_batch: int
    seed: int
    world_size: int  # data ranks
    copies: int  # ranks that take each micro-batch (train.sequence_parallel)
    capture_batch_tokens: int
    pool_tokens: int
    max_restarts: int
    request_timeout_s: float  # features.engine.*_timeout_s
    load_timeout_s: float
    placement_timeout_s: float
    worker_options: dict = field(default_factory=dict)  # Ray actor options of a worker (CPUs, GPUs, runtime env)
    inflight_per_worker: int = 2  # a worker's next request is queued behind the one it computes
    transport: FeatureTransport = field(default_factory=ObjectStoreTransport)  # how training features travel


STALL_MARGIN_S = 60.0  # beyond the longest timeout: the most a working pool goes without progress
UNAVAILABLE_RETRY_S = 1.0  # the wait before a call Ray found its actor unreachable for is sent again


def spawn_worker(settings: PoolSettings, kind: type, spec: WorkerSpec):
    """A new worker actor (placed by Ray; it loads the target when the pool asks)."""
    return ray.remote(WorkerActor).options(**settings.worker_options).remote(kind, spec, settings.transport)


class WorkerActor:
    """The Ray actor around an `InferenceWorker`: placed first, loaded when the pool asks."""

    worker: InferenceWorker  # from load()

    def __init__(self, kind: type, spec: WorkerSpec, transport):
        self.kind, self.spec, self.transport = kind, spec, transport

    def placed(self) -> None:
        """Answers as soon as Ray has placed the actor and started its process."""

    def load(self) -> None:
        self.transport.open()
        self.worker = self.kind(self.spec)

    def describe(self) -> WorkerInfo:
        return self.worker.describe()

    def compute(self, token_rows: list[list[int]], key: str | None):
        """(record, features); `key` None: through Ray's store whatever the transport (held-out asks)."""
        start = time.perf_counter()
        feats = self.worker.features(token_rows)
        sent = feats if key is None else self.transport.send(key, feats)
        return {"seconds": time.perf_counter() - start}, sent


@dataclass(order=True)
class Request:
    """One target forward's samples: a group of a micro-batch, or of a held-out ask (in the queue's order)."""

    order: tuple  # (0, ask, group) held-out, (1, epoch, batch, group) training
    split: str
    ids: list[int]  # sample ids, in the forward's row order
    owner: tuple  # the key of its Part in `FeaturePool.parts`
    group: int
    done: bool = False  # computed: a copy still queued or in flight is dropped


@dataclass
class Part:
    """A micro-batch (or held-out ask) being put together from its groups' features."""

    groups: list[list[int]]  # positions into ids, one list per request
    tokens: int
    refs: dict[int, object] = field(default_factory=dict)  # group -> its features' handle (an ObjectRef, or a key)
    takes: int = 0
    consumed: int = 0  # ranks that have read its stored features (transport=mooncake)
    admitted: bool = False  # its tokens count toward pool_tokens (training)

    @property
    def complete(self) -> bool:
        return len(self.refs) == len(self.groups)

    def reply(self) -> list[tuple[list[int], object]]:
        return [(self.groups[j], self.refs[j]) for j in range(len(self.groups))]


@dataclass
class Slot:
    """One worker's place: the actor now in it and what it holds."""

    index: int
    handle: Any = None  # the worker's actor
    incarnation: int = 0
    phase: str = "placing"  # placing, loading, describing, ready
    since: float = field(default_factory=time.monotonic)  # when the phase began
    answered_at: float = 0.0  # the last answer of the worker now in the slot
    restarts: int = 0
    inflight: dict[int, Request] = field(default_factory=dict)
    samples: int = 0
    busy_s: float = 0.0


class Computation:
    """One request's call to a worker, which can be sent again (Ray found the worker briefly unreachable)."""

    def __init__(self, handle, token_rows, key: str | None):
        self.handle, self.token_rows, self.key, self.features = handle, token_rows, key, None

    def send(self):
        """The call's record (an ObjectRef); its features' ref is kept apart, never awaited here."""
        record, self.features = self.handle.compute.options(num_returns=2).remote(self.token_rows, self.key)
        return record


class NoAnswer(Exception):
    """A worker answered nothing for the time a setting gives it."""

    def __init__(self, setting: str, seconds: float):
        super().__init__(f"no answer within features.engine.{setting}={seconds:g} s")
        self.setting = setting


def _last_line(e: BaseException) -> str:
    """The line of an error that says what happened (a death's cause without Ray's advice)."""
    lines = [x.strip() for x in str(e).splitlines() if x.strip()]
    return (lines[-1] if lines else type(e).__name__).split(" Worker exit detail:")[0]


def _future(ref) -> asyncio.Future:
    """An ObjectRef as a future whose error, if it is abandoned, is not reported as never retrieved."""
    future = asyncio.ensure_future(ref)
    future.add_done_callback(lambda f: f.cancelled() or f.exception())
    return future


def _resources(amounts: dict) -> str:
    return ", ".join(f"{name} {amounts.get(name, 0):g}" for name in ("CPU", "GPU"))


class FeaturePool:
    """The pool (a Ray actor: `FeaturePool.remote(...)`, async methods)."""

    def __init__(self, settings: PoolSettings, kind: type, spec: WorkerSpec, expected: dict, workers: list):
        """kind: an InferenceWorker class; expected: `worker.expected_info`; workers: the first workers' actors."""
        from eagle31.data.prepare import load_prepared_splits
        from eagle31.data.store import prepared_lengths

        self.settings, self.kind, self.spec, self.expected = settings, kind, spec, expected
        self.splits = load_prepared_splits(Path(settings.prepared_dir))
        self.lengths = {name: prepared_lengths(ds) for name, ds in self.splits.items()}
        self.booted = False
        self.slots = [Slot(i, handle) for i, handle in enumerate(workers)]
        self.changed = asyncio.Condition()
        self.tasks: set[asyncio.Task] = set()  # the pool's own tasks, kept until they end (asyncio holds them weakly)
        self.error: str | None = None
        self.progress_at = time.monotonic()  # the last answer, worker started or micro-batch taken
        self.queues: dict[str, list[Request]] = {"eval": [], "train": []}  # heaps
        self.parts: dict[tuple, Part] = {}
        self.asks = itertools.count()
        self.sequence = itertools.count()
        self.epoch_plans: dict[int, list[np.ndarray]] = {}
        self.start_at: tuple[int, int] | None = None  # (epoch, position) every rank resumes at
        self.next_batch: tuple[int, int] | None = None  # the next training micro-batch to plan
        self.rank_next: dict[int, tuple[int, int, int]] = {}  # rank -> (epoch, g, data rank) of its next take
        self.held = 0  # tokens of the admitted training requests not yet taken (transport=mooncake: not yet read)
        self.stored: dict[str, Part] = {}  # transport=mooncake: key -> its micro-batch, until the keys are removed
        self.prefix = uuid.uuid4().hex[:12]  # of this pool's keys in the store
        self.started_at = time.perf_counter()
        counted = "produced_samples delivered_samples worker_restarts requeued unavailable max_held_tokens"
        self.counts = dict.fromkeys(counted.split(), 0)  # unavailable: calls sent again after Ray found no worker

    # ------------------------------------------------------------ the trainers' calls

    async def ready(self) -> str | None:
        """Wait until every worker has started and described itself; the pool's error, or None."""
        self._boot()
        await self._wait(lambda: all(s.phase == "ready" for s in self.slots))
        return self.error

    async def start(self, rank: int, data_rank: int, epoch: int, position: int) -> str | None:
        """Rank `rank` resumes its loader at (epoch, position); every rank must say the same."""
        self._boot()
        W = self.settings.world_size
        if self.start_at is None:
            self.start_at = (epoch, position)
            self.next_batch = self._in_plan(epoch, position * W, first=0)
        elif self.start_at != (epoch, position):
            other = f"epoch {self.start_at[0]}, batch {self.start_at[1]}"
            return self._fail(f"rank {rank} resumes at epoch {epoch}, batch {position}; another rank at {other}")
        self.rank_next[rank] = (epoch, position * W + data_rank, data_rank)
        self._pump()
        return self.error

    async def take(self, rank: int, ids: list[int]):
        """Rank `rank`'s next micro-batch, which must be `ids`: ("ok", [(positions, handle)]) or ("error", line)."""
        if rank not in self.rank_next:
            return "error", f"rank {rank} asked for features before the engine was started"
        epoch, g, data_rank = self.rank_next[rank]
        epoch, g = self._in_plan(epoch, g, first=data_rank)  # a rank asks only when a micro-batch is due to it
        key = ("train", epoch, g)
        planned = self._batch_ids(epoch, g)
        if ids != planned:
            asked = f"rank {rank} asks for samples {ids[:4]}... where the engine plans {planned[:4]}..."
            differ = "features.batching, features.tokens_per_batch, seed or world size"
            return "error", f"{asked}: the loader and the engine differ in {differ}"
        self._pump()
        await self._wait(lambda: key in self.parts and self.parts[key].complete)
        if self.error:
            return "error", self.error
        part = self.parts[key]
        part.takes += 1
        self.progress_at = time.monotonic()
        if part.takes == self.settings.copies:
            del self.parts[key]
            if not self.settings.transport.holds_until_consumed:
                self.held -= part.tokens
        self.rank_next[rank] = (epoch, g + self.settings.world_size, data_rank)
        self.counts["delivered_samples"] += len(ids)
        self._pump()
        return "ok", part.reply()

    async def ask(self, ids: list[int]):
        """The held-out features of `ids`, asked now and sent before any training request: as `take`."""
        self._boot()
        ask = next(self.asks)
        key = ("eval", ask)
        part = self._plan_part(key, "eval", ids, (0, ask))
        self._pump()
        await self._wait(lambda: part.complete)
        self.parts.pop(key, None)
        return ("error", self.error) if self.error else ("ok", part.reply())

    async def consumed(self, keys: list[str]) -> None:
        """A rank has read one micro-batch's stored `keys` (transport=mooncake); after its last, they are removed."""
        part = self.stored.get(keys[0]) if keys else None
        if part is None:
            return
        part.consumed += 1
        if part.consumed < self.settings.copies:
            return
        keys = [str(key) for key in part.refs.values()]
        for key in keys:
            self.stored.pop(key, None)
        self.settings.transport.free(keys)
        self.held -= part.tokens
        self.progress_at = time.monotonic()
        self._pump()
        await self._notify()

    def stats(self) -> dict:
        """Counters since the pool started (the trainers' metrics are differences of these)."""
        return {
            **self.counts,
            "workers": len(self.slots),
            "worker_samples": sum(s.samples for s in self.slots),
            "worker_busy_s": sum(s.busy_s for s in self.slots),
            "held_tokens": self.held,
            "seconds": time.perf_counter() - self.started_at,
        }

    def state(self) -> dict:
        """For a waiting rank: seconds without progress, the most its timeouts allow, a line of what it waits on."""
        now = time.monotonic()
        workers = "; ".join(
            f"worker {s.index} {s.phase} for {now - s.since:.0f} s"
            + (f" holding {len(s.inflight)} request(s)" if s.inflight else "")
            for s in self.slots
        )
        queued = sum(not r.done for queue in self.queues.values() for r in queue)
        held = f"{self.held} tokens held of features.engine.pool_tokens={self.settings.pool_tokens}"
        line = f"{workers}; {queued} request(s) queued; {held}"
        s = self.settings
        limit = max(s.request_timeout_s, s.load_timeout_s, s.placement_timeout_s) + STALL_MARGIN_S
        return {"stalled_s": now - self.progress_at, "limit_s": limit, "line": line}

    def workers(self) -> list[tuple[object, int]]:
        """(actor, requests it holds) of each worker, in slot order (the benchmark kills one)."""
        return [(s.handle, len(s.inflight)) for s in self.slots]

    def close(self) -> None:
        self._fail("the feature pool was closed")
        for slot in self.slots:
            if slot.handle is not None:
                ray.kill(slot.handle, no_restart=True)
                slot.handle = None
        self.settings.transport.close()  # the store's memory goes with this process's client

    # ------------------------------------------------------------ the plan

    def _epoch(self, epoch: int) -> list[np.ndarray]:
        """The global micro-batches of `epoch` (a few epochs kept: the stream runs ahead of the ranks)."""
        if epoch not in self.epoch_plans:
            if len(self.epoch_plans) >= 4:
                del self.epoch_plans[min(self.epoch_plans)]
            s, lengths = self.settings, self.lengths["train"]
            self.epoch_plans[epoch] = plan_epoch(
                lengths, batching=s.batching, tokens_per_batch=s.tokens_per_batch, seed=s.seed, epoch=epoch
            )
        return self.epoch_plans[epoch]

    def _in_plan(self, epoch: int, g: int, first: int) -> tuple[int, int]:
        """(epoch, g), or (next epoch, `first`) when the epoch has no micro-batch g (its last round's empty batches)."""
        while g >= len(self._epoch(epoch)):
            epoch, g = epoch + 1, first
        return epoch, g

    def _batch_ids(self, epoch: int, g: int) -> list[int]:
        return self._epoch(epoch)[g].tolist()  # positions are the sample ids of a prepared split (its rows)

    def _plan_part(self, key: tuple, split: str, ids: list[int], order: tuple) -> Part:
        """The Part `key` of samples `ids`, one request queued per target forward (`order`: its place in the queue)."""
        lengths = self.lengths[split][ids]
        groups = bucket_by_length(lengths.tolist(), self.settings.capture_batch_tokens)
        part = self.parts[key] = Part(groups, int(lengths.sum()))
        for j, group in enumerate(groups):
            heapq.heappush(self.queues[split], Request((*order, j), split, [ids[p] for p in group], key, j))
        return part

    def _next_request(self) -> Request | None:
        """The next request to send, held-out asks first; a training one only within pool_tokens."""
        for split in ("eval", "train"):
            queue = self.queues[split]
            while queue and queue[0].done:
                heapq.heappop(queue)
            if split == "train" and not queue and self.next_batch is not None:
                epoch, g = self.next_batch
                self._plan_part(("train", epoch, g), "train", self._batch_ids(epoch, g), (1, epoch, g))
                self.next_batch = self._in_plan(epoch, g + 1, first=0)
            if not queue:
                continue
            request = queue[0]
            part = self.parts[request.owner] if split == "train" else None
            if part is not None and not part.admitted:  # admitted whole: a trainer takes it whole
                if self.held and self.held + part.tokens > self.settings.pool_tokens:
                    return None
                part.admitted = True
                self.held += part.tokens
                self.counts["max_held_tokens"] = max(self.counts["max_held_tokens"], self.held)
            heapq.heappop(queue)
            return request
        return None

    # ------------------------------------------------------------ the workers

    def _task(self, coroutine) -> None:
        """Run `coroutine` as one of the pool's tasks; an error it raises becomes the pool's error."""
        task = asyncio.get_running_loop().create_task(coroutine)
        self.tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and (e := task.exception()) is not None:
            self._fail(f"the feature pool failed: {type(e).__name__}: {_last_line(e)}")
            self._task(self._notify())

    def _place(self, slot: Slot) -> None:
        """Start the worker now in `slot`: placed, loaded, described."""
        self._enter(slot, "placing")
        slot.answered_at = 0.0
        self._task(self._start(slot, slot.incarnation))

    def _boot(self) -> None:
        """Join the transport, start the first workers (needs the actor's event loop)."""
        if not self.booted:
            self.booted = True
            try:
                self.settings.transport.open_pool()
            except Eagle31Error as e:
                self._fail(str(e))
            for slot in self.slots:
                self._place(slot)

    def _enter(self, slot: Slot, phase: str) -> None:
        slot.phase, slot.since = phase, time.monotonic()
        self.progress_at = slot.since

    async def _start(self, slot: Slot, incarnation: int) -> None:
        """Place the worker, load the target, check what it describes; one that cannot is replaced or stops the run."""
        try:
            await self._answer(slot, slot.handle.placed.remote, "placement_timeout_s")
            self._enter(slot, "loading")
            await self._answer(slot, slot.handle.load.remote, "load_timeout_s")
            self._enter(slot, "describing")
            info = WorkerInfo(*await self._answer(slot, slot.handle.describe.remote, "request_timeout_s"))
        except Exception as e:  # noqa: BLE001 - told apart in _not_started
            if incarnation == slot.incarnation:
                self._not_started(slot, e)
        else:
            mismatch = worker_mismatch(info, self.expected, self.spec.target_dir)
            if mismatch:
                self._fail(f"inference worker {slot.index} ({info.kind}) {mismatch}")
            elif incarnation == slot.incarnation:
                self._enter(slot, "ready")
                self._pump()
        await self._notify()

    def _not_started(self, slot: Slot, e: Exception) -> None:
        """A worker that died or hung while starting is replaced; its own error, or no room for it, stops the run."""
        name = f"inference worker {slot.index}"
        if isinstance(e, NoAnswer) and e.setting == "placement_timeout_s":  # waiting longer would not make room
            limit = f"features.engine.placement_timeout_s={self.settings.placement_timeout_s:g} s"
            self._fail(f"{name} could not be placed within {limit}: {self._placement()}")
        elif isinstance(e, NoAnswer) or (isinstance(e, RayActorError) and not e.actor_init_failed):
            self._lost(slot, _last_line(e))  # hung, or its process died (killed, its node lost)
        else:  # its own error (its __init__, loading the target, describing itself): it would recur
            doing = "describe itself" if slot.phase == "describing" else "start"
            self._fail(f"{name} could not {doing}: {_last_line(e)}")

    def _placement(self) -> str:
        """What a worker asks of Ray and what the cluster has: the end of the line of a worker that was not placed."""
        options = self.settings.worker_options
        asked = {"CPU": options.get("num_cpus") or 0, "GPU": options.get("num_gpus") or 0}
        nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
        largest = {k: max((n.get(k, 0) for n in nodes), default=0) for k in asked}
        has = f"{_resources(ray.cluster_resources())} in all (at most {_resources(largest)} on one node)"
        free = _resources(ray.available_resources())
        advice = "lower features.engine.worker_cpus or worker_gpus, or add nodes"
        return f"it asks for {_resources(asked)}; the cluster has {has}, {free} free: {advice}"

    async def _answer(self, slot: Slot, send, setting: str, sent=None):
        """The answer of `slot`'s worker to `send()` (`sent`: the first call, already sent), resent if unreachable."""
        limit = getattr(self.settings, setting)
        since = time.monotonic()
        answer = _future(send() if sent is None else sent)
        while True:
            left = max(since, slot.answered_at) + limit - time.monotonic()
            if left <= 0:
                raise NoAnswer(setting, limit)
            done, _ = await asyncio.wait([answer], timeout=left)  # waits on, never cancels
            if not done:
                continue  # the worker may have answered another request meanwhile
            try:
                result = answer.result()
            except ActorUnavailableError:
                self.counts["unavailable"] += 1
                await asyncio.sleep(min(UNAVAILABLE_RETRY_S, left))
                answer = _future(send())
                continue
            slot.answered_at = self.progress_at = time.monotonic()
            return result

    def _pump(self) -> None:
        """Send requests while a worker has room and one is due."""
        while self.error is None:
            free = [s for s in self.slots if s.phase == "ready" and len(s.inflight) < self.settings.inflight_per_worker]
            if not free:
                return
            request = self._next_request()
            if request is None:
                return
            slot = min(free, key=lambda s: (len(s.inflight), s.index))
            seq = next(self.sequence)
            slot.inflight[seq] = request
            rows = self.splits[request.split][request.ids]["input_ids"]
            call = Computation(slot.handle, rows, self._key(request, seq))
            record = call.send()  # here, not in the task: a worker computes its requests in the order they are sent
            self._task(self._receive(slot, slot.incarnation, seq, request, call, record))

    async def _receive(self, slot: Slot, incarnation: int, seq: int, request: Request, call, record) -> None:
        try:
            done = await self._answer(slot, call.send, "request_timeout_s", sent=record)
        except (NoAnswer, RayActorError) as e:  # hung, or died
            if incarnation == slot.incarnation:
                self._lost(slot, _last_line(e))
        except Exception as e:  # noqa: BLE001 - the worker's own error (RayTaskError): it would fail again
            samples = f"samples {request.ids[:4]} of {request.split}"
            self._fail(f"inference worker {slot.index} failed on {samples}: {_last_line(e)}")
        else:
            slot.inflight.pop(seq, None)
            if not request.done:
                request.done = True
                part, stored = self.parts[request.owner], call.key and self.settings.transport.holds_until_consumed
                part.refs[request.group] = call.key if stored else call.features  # the store's key, or Ray's ref
                if stored:
                    self.stored[call.key] = part
                self.counts["produced_samples"] += len(request.ids)
                slot.samples += len(request.ids)
                slot.busy_s += done["seconds"]
            elif call.key is not None:  # computed twice: the first copy is the one handed out
                self.settings.transport.free([call.key])
        self._pump()
        await self._notify()

    def _lost(self, slot: Slot, cause: str) -> None:
        """A worker died or hung: its requests go back to the head of the queue, a new worker takes its place."""
        if self.error is not None:  # a pool that has failed, or was closed, replaces no one
            return
        written = []  # keys it may have written features under before it died
        for seq, request in slot.inflight.items():
            if not request.done:
                heapq.heappush(self.queues[request.split], request)
                self.counts["requeued"] += len(request.ids)
                if (key := self._key(request, seq)) is not None:
                    written.append(key)
        slot.inflight.clear()
        slot.incarnation += 1
        slot.restarts += 1
        self.counts["worker_restarts"] += 1
        with contextlib.suppress(Exception):  # already gone
            ray.kill(slot.handle, no_restart=True)  # a hung worker holds its resources until killed
        self.settings.transport.free(written)
        if slot.restarts > self.settings.max_restarts:
            limit = f"features.engine.max_restarts={self.settings.max_restarts}"
            died = f"inference worker {slot.index} died {slot.restarts} times"
            self._fail(f"{died}, more than {limit}; the last time: {cause}")
            return
        slot.handle = spawn_worker(self.settings, self.kind, self.spec)
        self._place(slot)

    def _key(self, request: Request, seq: int) -> str | None:
        """A training request's key in the store; held-out asks have none: they travel outside the store's budget."""
        return f"{self.prefix}/{seq}" if request.split == "train" else None

    # ------------------------------------------------------------ waiting

    def _fail(self, message: str) -> str:
        self.error = self.error or message
        return self.error

    async def _notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def _wait(self, done) -> None:
        async with self.changed:
            await self.changed.wait_for(lambda: self.error is not None or done())
