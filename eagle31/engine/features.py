"""The engine as the trainers see it: `open_engine` starts it, `FeatureEngine` streams, `EngineFeatures` is a source."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eagle31.data.batch import Sample
from eagle31.data.capture import as_samples, prepared_rows
from eagle31.data.store import prepared_lengths
from eagle31.distributed import broadcast_object
from eagle31.engine.cluster import (
    NAMESPACE,
    actor_runtime_env,
    check_joined_node,
    check_worker_gpus,
    import_ray,
    lendable_gpus,
    ray_session,
)
from eagle31.engine.transport import (
    FeatureLayout,
    FeatureTransport,
    MooncakeAddress,
    MooncakeTransport,
    ObjectStoreTransport,
    Transport,
    given_master,
    mooncake_master,
    segment_bytes,
)
from eagle31.errors import EngineError
from eagle31.target import target_shape

# Ray is imported when first needed: a rank joining rank 0's cluster must first learn how Ray authenticates there.

KEPT = "the last complete checkpoint is kept: rerun with resume=auto"
POOL_GONE = f"the feature pool is gone (rank 0 or its node stopped); {KEPT}"
FEATURES_LOST = f"features an inference worker had computed were lost with its node before a trainer took them; {KEPT}"
POLL_S = 10.0  # a waiting rank reads the pool's state this often
POOL_ANSWER_S = 60.0  # a pool that does not say its state in this long is taken for hung


def _get(refs, timeout: float | None = None):
    """`ray.get`, a pool that is gone or features lost with their node being one `EngineError` line."""
    ray = import_ray()
    try:
        return ray.get(refs, timeout=timeout)
    except (ray.exceptions.RayActorError, ray.exceptions.OwnerDiedError):  # the pool owns the features' objects
        raise EngineError(POOL_GONE) from None
    except ray.exceptions.ObjectLostError:
        raise EngineError(FEATURES_LOST) from None


def _await_pool(pool, ref, rank: int, what: str):
    """`_get(ref)` of a pool call while the pool makes progress; one `EngineError` line when it stalls or is silent."""
    ray = import_ray()
    while True:
        with suppress(ray.exceptions.GetTimeoutError):
            return _get(ref, timeout=POLL_S)
        try:
            state = _get(pool.state.remote(), timeout=POOL_ANSWER_S)
        except ray.exceptions.GetTimeoutError:
            raise EngineError(
                f"the feature pool did not answer for {POOL_ANSWER_S:g} s while rank {rank} waited for {what}; {KEPT}"
            ) from None
        if state["stalled_s"] > state["limit_s"]:
            stalled = f"the feature pool has made no progress for {state['stalled_s']:.0f} s"
            allowed = "more than its timeouts allow (features.engine.*_timeout_s)"
            raise EngineError(f"rank {rank} waited for {what}, and {stalled}, {allowed}: {state['line']}; {KEPT}")


@dataclass
class EngineFeatures:
    """A `FeatureSource` computed by the pool's workers: the training stream (`stream`) or held-out asks."""

    pool: Any  # the FeaturePool actor
    dataset: Any  # the prepared split
    rank: int
    stream: bool
    hidden_size: int
    aux_size: int
    dtype: torch.dtype
    metrics: Callable[[], dict[str, float]] | None = None  # the `engine/*` metrics the trainer logs with this source's
    transport: FeatureTransport = field(default_factory=ObjectStoreTransport)  # how the features arrive

    def __post_init__(self):
        self.lengths = prepared_lengths(self.dataset)
        self.sample_ids = np.arange(len(self.lengths))  # rows of the split, as the pool plans them

    def samples(self, ids: Sequence[int]) -> list[Sample]:
        ids = [int(i) for i in ids]
        call = self.pool.take.remote(self.rank, ids) if self.stream else self.pool.ask.remote(ids)
        status, reply = _await_pool(self.pool, call, self.rank, f"the features of samples {ids[:4]}...")
        if status == "error":
            raise EngineError(reply)
        handles = [handle for _, handle in reply]
        shape = (self.aux_size, self.hidden_size, self.dtype)
        layouts = [FeatureLayout(tuple(int(self.lengths[ids[p]]) for p in positions), *shape) for positions, _ in reply]
        computed = self.transport.receive(handles, layouts, _get)  # per request: [(aux [T, n*Ht], final [T, Ht])]
        self.transport.consumed(self.pool, handles)
        feats = {p: f for (positions, _), part in zip(reply, computed) for p, f in zip(positions, part)}  # by position
        features = [feats[p] for p in range(len(ids))]
        rows = prepared_rows(self.dataset, ids)  # TOKEN_COLUMNS, input ids first
        for i, row, (aux, final) in zip(ids, rows, features):
            T = len(row[0])
            if aux.shape[0] != T or final.shape[0] != T:
                raise EngineError(f"sample {i}: the engine sent features of {aux.shape[0]} tokens for its {T}")
        return as_samples(rows, features)


@dataclass
class FeatureEngine:
    """One rank's handle on the pool."""

    pool: Any  # the FeaturePool actor
    rank: int
    data_rank: int
    data_size: int
    trainers: int
    hidden_size: int
    aux_size: int
    dtype: torch.dtype
    transport: FeatureTransport = field(default_factory=ObjectStoreTransport)  # how the training stream arrives
    _last: dict | None = field(default=None, init=False)  # the pool's stats at the last `metrics()`

    def sources(self, splits: dict) -> dict[str, EngineFeatures]:
        """{split: EngineFeatures}: "train" streamed through the transport, the others asked through Ray's store."""
        shape, sources = (self.hidden_size, self.aux_size, self.dtype), {}
        for name, ds in splits.items():
            stream = (self.metrics, self.transport) if name == "train" else ()
            sources[name] = EngineFeatures(self.pool, ds, self.rank, name == "train", *shape, *stream)
        return sources

    def start(self, loader) -> None:
        """Start the stream where the rank's training `loader` resumes, once every worker has loaded the target."""
        if loader.world_size != self.data_size:
            raise ValueError(
                f"the loader splits batches over {loader.world_size} ranks, the engine over {self.data_size}"
            )
        state = loader.state_dict()
        self.transport.open()  # a store this rank cannot join stops it here, before training
        start = self.pool.start.remote(self.rank, self.data_rank, state["epoch"], state["position"])
        for call in (start, self.pool.ready.remote()):
            error = _await_pool(self.pool, call, self.rank, "the inference workers to load the target")
            if error:
                raise EngineError(error)
        self._last = _get(self.pool.stats.remote())

    def metrics(self) -> dict[str, float]:
        """`engine/*` (docs/engine.md): rates over the window since the last call, counts since the engine started."""
        now = _get(self.pool.stats.remote())
        last, self._last = self._last or now, now
        seconds = now["seconds"] - last["seconds"]
        per_worker = now["worker_samples"] / now["worker_busy_s"] if now["worker_busy_s"] > 0 else 0.0
        produced = (now["produced_samples"] - last["produced_samples"]) / seconds if seconds > 0 else 0.0
        return {
            "engine/inference_samples_per_s": now["workers"] * per_worker,
            "engine/produced_samples_per_s": produced,
            "engine/worker_restarts": now["worker_restarts"],
            "engine/requeued": now["requeued"],
            "engine/pool_tokens": now["held_tokens"],
            "engine/workers": now["workers"],
            "engine/trainers": self.trainers,
        }


@contextmanager
def open_engine(plan, prepared: Path, sequence=None) -> Iterator[FeatureEngine]:
    """The run's engine (`features.engine`), a `FeatureEngine` on every rank; rank 0 starts and stops what it needs."""
    cfg, world, e = plan.cfg, plan.world, plan.cfg.features.engine
    data_rank, data_size = (sequence.data_rank, sequence.data_size) if sequence else (world.rank, world.world_size)
    aux_ids = tuple(plan.drafter.aux_layer_ids)
    with ExitStack() as stack:
        shared = None
        if world.is_main:
            trainer_gpus = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if world.device.type == "cuda" else 0
            lendable = lendable_gpus(os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.device_count(), trainer_gpus)
            if not e.address:
                check_worker_gpus(lendable, trainer_gpus, e.workers, e.worker_gpus)
            cluster = stack.enter_context(ray_session(e.address, e.num_cpus, gpus=lendable))
            if e.address:
                check_joined_node(node_gpus(), lendable, trainer_gpus, e.address)
            print(f"engine: rank 0 {cluster.how}")
            store = stack.enter_context(mooncake_store(e)) if e.transport == Transport.mooncake else None
            transport = run_transport(plan, store)
            name = f"features-{uuid.uuid4().hex[:12]}"
            pool = create_pool(plan, prepared, name, aux_ids, data_size, world.world_size // data_size, transport)
            stack.callback(close_pool, pool)
            shared = (cluster.address, cluster.auth_mode, name, transport)
        address, auth_mode, name, transport = broadcast_object(shared, world.device)
        if not world.is_main:
            stack.enter_context(ray_session(address, None, auth_mode))
            pool = import_ray().get_actor(name, namespace=NAMESPACE)
        stack.callback(transport.close)
        ranks, hidden = (world.rank, data_rank, data_size, world.world_size), target_shape(plan.target_config)[1]
        yield FeatureEngine(pool, *ranks, hidden, len(aux_ids) * hidden, getattr(torch, cfg.target.dtype), transport)


@contextmanager
def mooncake_store(e) -> Iterator[MooncakeAddress]:
    """transport=mooncake, on rank 0: the master `e.mooncake_master` names, or one started on this node for the run."""
    if e.mooncake_master:  # it answered when the run was planned (`check_transport`)
        store = f"the Mooncake store at features.engine.mooncake_master={e.mooncake_master}"
        print(f"engine: features travel through {store} over {e.mooncake_protocol}")
        yield given_master(e)
        return
    ray = import_ray()
    with mooncake_master(ray.util.get_node_ip_address(), e.mooncake_protocol, e.mooncake_rdma_devices) as address:
        started = f"a Mooncake master at {address.master} (metadata {address.metadata_server})"
        print(f"engine: rank 0 started {started}; features travel over {e.mooncake_protocol}")
        yield address


def run_transport(plan, store: MooncakeAddress | None):
    """How the run's training features travel: Ray's store, or the Mooncake store at `store` (the pool's segment)."""
    if store is None:
        return ObjectStoreTransport()
    cfg = plan.cfg
    hidden = target_shape(plan.target_config)[1]
    per_token = (len(plan.drafter.aux_layer_ids) + 1) * hidden * getattr(torch, cfg.target.dtype).itemsize
    tokens = max(cfg.features.engine.pool_tokens, cfg.features.tokens_per_batch, cfg.data.max_len)
    return MooncakeTransport(store, segment_bytes(tokens, per_token))


def node_gpus() -> float:
    """The GPUs this process's node lends its Ray cluster."""
    ray = import_ray()
    here = ray.get_runtime_context().get_node_id()
    return next((n["Resources"].get("GPU", 0.0) for n in ray.nodes() if n["NodeID"] == here), 0.0)


def create_pool(plan, prepared: Path, name: str, aux_ids: tuple[int, ...], data_size: int, copies: int, transport):
    """The run's named `FeaturePool` and its workers, as `plan.cfg.features` says."""
    from eagle31.engine.pool import PoolSettings
    from eagle31.engine.worker import WORKERS, WorkerSpec, expected_info

    cfg, e = plan.cfg, plan.cfg.features.engine
    spec = WorkerSpec.from_recipe(cfg, plan.target_dir, aux_ids)
    settings = PoolSettings(
        prepared_dir=str(Path(prepared).resolve()),
        workers=e.workers,
        batching=str(cfg.features.batching),
        tokens_per_batch=cfg.features.tokens_per_batch,
        seed=cfg.seed,
        world_size=data_size,
        copies=copies,
        capture_batch_tokens=cfg.features.capture_batch_tokens,
        pool_tokens=e.pool_tokens,
        max_restarts=e.max_restarts,
        request_timeout_s=e.request_timeout_s,
        load_timeout_s=e.load_timeout_s,
        placement_timeout_s=e.placement_timeout_s,
        worker_options={"num_cpus": e.worker_cpus, "num_gpus": e.worker_gpus},
        transport=transport,
    )
    expected = expected_info(plan.target_dir, aux_ids, target_shape(plan.target_config)[1], str(cfg.target.dtype))
    return pool_actor(settings, WORKERS[e.worker], spec, expected, name=name)


def pool_actor(settings, kind: type, spec, expected: dict, name: str | None = None):
    """A `FeaturePool` actor on this node (it reads the prepared splits) with `settings.workers` workers of `kind`."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from eagle31.engine.pool import FeaturePool, spawn_worker

    ray = import_ray()
    env = actor_runtime_env()
    settings = replace(settings, worker_options={**settings.worker_options, "runtime_env": env, "max_restarts": 0})
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    named = {"name": name, "namespace": NAMESPACE} if name else {}
    actor = ray.remote(FeaturePool).options(num_cpus=0, runtime_env=env, scheduling_strategy=here, **named)
    workers = [spawn_worker(settings, kind, spec) for _ in range(settings.workers)]  # they load while the pool starts
    return actor.remote(settings, kind, spec, expected, workers)


def close_pool(pool) -> None:
    """Stop the workers and the pool (whatever state the cluster is in)."""
    ray = import_ray()
    with suppress(Exception):  # a pool already gone has nothing to stop
        ray.get(pool.close.remote(), timeout=60)
    with suppress(Exception):
        ray.kill(pool)
