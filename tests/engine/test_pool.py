"""The feature pool on a local Ray cluster: the loader's batches, bit-identical to online features, whichever
worker computed what; backpressure, a pool smaller than a micro-batch included; a killed worker, a hung one and one
briefly unreachable (nothing lost, nothing repeated); failures in one line; a rank's bounded wait. The features
travel through Ray's store or a Mooncake store (`transport`: a master this module starts, stopped at its end), and
the guarantees are the same."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch
from datasets import DatasetDict

from eagle31.data.loader import FeatureLoader
from eagle31.data.online import OnlineFeatures
from eagle31.engine import features
from eagle31.engine.cluster import actor_runtime_env
from eagle31.engine.features import EngineFeatures, FeatureEngine, close_pool, pool_actor
from eagle31.engine.pool import PoolSettings
from eagle31.engine.transport import (
    MooncakeClient,
    ObjectStoreTransport,
    mooncake_master,
    segment_bytes,
)
from eagle31.engine.worker import HFInferenceWorker, WorkerSpec, expected_info
from eagle31.errors import EngineError
from eagle31.target import load_target
from tests.engine.workers import FaultyWorker, RaisingWorker, ReadKeysMooncake, SilentPool, UndescribedWorker
from tests.peers import mooncake_store
from tests.tiny_targets import prepared_split, tiny_llama

# each test starts a pool and its workers: 10-40 s on 2 cores (the first also starts the session's Ray cluster)
pytestmark = [pytest.mark.slow, pytest.mark.deadline(240)]

AUX = (1, 3, 4)
LOADER = dict(batching="pack", tokens_per_batch=64, seed=3)  # 40 samples of 3-24 tokens: about 10 batches an epoch
BATCH_TOKENS = 40  # each micro-batch is several target forwards (requests)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory, llama_tok) -> Path:
    path = tmp_path_factory.mktemp("engine_target")
    tiny_llama(seed=0).save_pretrained(path)
    llama_tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def mooncake_address(ray_cluster):
    """A Mooncake master for this module's pools, stopped at the module's end (and by the kernel with this process)."""
    mooncake_store()
    with mooncake_master(ray_cluster.util.get_node_ip_address(), "tcp") as address:
        yield address


@pytest.fixture(params=["ray", "mooncake"])
def transport(request):
    """How the training features travel: Ray's store, or the module's Mooncake store (its smallest segment)."""
    if request.param == "ray":
        yield ObjectStoreTransport()
        return
    carrier = ReadKeysMooncake(request.getfixturevalue("mooncake_address"), segment_bytes(0, 0))
    yield carrier
    carrier.close()


def assert_read_keys_were_removed(transport, stats, pool_tokens) -> None:
    """transport=mooncake: every key a rank read is gone from the store, and the budget held what was stored. A rank
    tells the pool what it read without waiting for it (`consumed`): the last keys go within seconds, not at once."""
    if isinstance(transport, ReadKeysMooncake):
        assert transport.read and stats["held_tokens"] <= pool_tokens
        client = MooncakeClient(transport.address, transport.address.master.rpartition(":")[0])
        try:
            deadline = time.monotonic() + 30
            while left := [key for key in transport.read if client.exists(key)]:
                assert time.monotonic() < deadline, f"keys read and never removed: {left}"
                time.sleep(0.2)
        finally:
            client.close()


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prepared")
    DatasetDict(train=prepared_split(40, seed=3), eval=prepared_split(9, seed=4)).save_to_disk(str(path))
    return path


def make_pool(
    target_dir,
    prepared,
    kind=HFInferenceWorker,
    workers=2,
    pool_tokens=100_000,
    max_restarts=3,
    aux=AUX,
    world_size=1,
    copies=1,
    recipe_target=None,
    worker_cpus=0.5,
    request_timeout_s=60.0,
    placement_timeout_s=60.0,
    transport=None,
):
    """recipe_target: the target the trainer expects (default: the workers' `target_dir`); transport: how the
    training features travel (default Ray's store)."""
    settings = PoolSettings(
        prepared_dir=str(prepared), workers=workers, world_size=world_size, copies=copies,
        capture_batch_tokens=BATCH_TOKENS,
        pool_tokens=pool_tokens, max_restarts=max_restarts, request_timeout_s=request_timeout_s, load_timeout_s=60.0,
        placement_timeout_s=placement_timeout_s, worker_options={"num_cpus": worker_cpus}, **LOADER,
        transport=transport or ObjectStoreTransport(),
    )  # fmt: skip
    spec = WorkerSpec(str(target_dir), "float32", None, False, AUX, BATCH_TOKENS, threads=1, gpus=0)
    expected = (
        expected_info(recipe_target or target_dir, aux, 32, "float32")
        if kind is HFInferenceWorker
        else {"aux_layer_ids": aux, "hidden_size": 32, "dtype": "float32"}
    )  # the failing workers' directories hold their instructions
    return pool_actor(settings, kind, spec, expected)


def rank_engine(pool, rank=0, data_rank=0, data_size=1, trainers=1, transport=None):
    return FeatureEngine(pool, rank, data_rank, data_size, trainers, 32, len(AUX) * 32, torch.float32,
                         transport or ObjectStoreTransport())  # fmt: skip


def make_engine(target_dir, prepared, **kwargs):
    pool = make_pool(target_dir, prepared, **kwargs)
    return pool, rank_engine(pool, transport=kwargs.get("transport"))


def loaders(engine, prepared):
    from eagle31.data.prepare import load_prepared_splits

    sources = engine.sources(load_prepared_splits(prepared))
    return FeatureLoader(sources["train"], world_size=engine.data_size, rank=engine.data_rank, **LOADER), sources


def online_batches(target_dir, prepared, n, start=0, rank=0, world_size=1):
    """The first n batches (from batch `start`) of rank `rank`'s loader over features computed in this process."""
    from eagle31.data.prepare import load_prepared_splits

    model = load_target(target_dir, torch.device("cpu"), dtype="float32")
    source = OnlineFeatures(model, load_prepared_splits(prepared)["train"], AUX, batch_tokens=BATCH_TOKENS)
    loader = FeatureLoader(source, rank=rank, world_size=world_size, **LOADER)
    loader.position = start
    stream = iter_batches(loader)
    return [next(stream) for _ in range(n)], loader


def iter_batches(loader):
    while True:
        yield from loader


def assert_same(a, b):
    for name in ("input_ids", "loss_mask", "document_ids", "aux", "final"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


@pytest.fixture
def target_copy(target_dir, tmp_path) -> Path:
    """A copy of the target, whose directory can carry the dying worker's instructions (tests/engine/workers.py)."""
    return Path(shutil.copytree(target_dir, tmp_path / "target"))


@pytest.mark.parametrize(
    "pool_tokens, transport", [(100, "ray"), (20, "ray"), (100, "mooncake")], indirect=["transport"]
)
def test_two_workers_give_the_loader_s_batches_bit_identical_to_online_features_within_the_pool_budget(
    ray_cluster, target_dir, prepared, pool_tokens, transport
):
    """15 batches (over an epoch's end) from 2 workers, each micro-batch cut into several forwards, the pool held
    to 100 tokens: the same batches, bit for bit, as the loader over features computed in this process. Held to
    20 tokens, less than a micro-batch (which the plan refuses; the pool itself admits one whole at a time).
    Through a Mooncake store, no key a rank has read is left in the store, and the budget held what it stored."""
    expected, online = online_batches(target_dir, prepared, 15)
    pool, engine = make_engine(target_dir, prepared, pool_tokens=pool_tokens, transport=transport)
    try:
        loader, _ = loaders(engine, prepared)
        engine.start(loader)
        stream = iter_batches(loader)
        for want in expected:
            assert_same(next(stream), want)
        stats = ray_cluster.get(pool.stats.remote())
        assert stats["delivered_samples"] == sum(b.num_samples for b in expected)
        assert stats["worker_restarts"] == 0 and stats["requeued"] == 0
        largest = max(b.num_tokens for b in expected)  # a micro-batch's tokens
        assert 0 < stats["max_held_tokens"] <= max(pool_tokens, largest)  # a micro-batch goes out within the budget
        assert loader.consumed == online.consumed  # the same samples in the same order
        metrics = engine.metrics()
        assert metrics["engine/inference_samples_per_s"] > 0 and metrics["engine/workers"] == 2
        assert_read_keys_were_removed(transport, ray_cluster.get(pool.stats.remote()), max(pool_tokens, largest))
    finally:
        close_pool(pool)


def test_a_worker_killed_mid_request_is_restarted_and_its_samples_asked_again(ray_cluster, target_copy, prepared):
    """A worker ends its process in the middle of its 3rd computation: the run goes on, the worker is replaced
    once, the samples it held are asked again, and the batches are the uninterrupted ones: nothing lost, nothing
    repeated. Started at batch 4 (a resumed run), with held-out asks between."""
    expected, online = online_batches(target_copy, prepared, 10, start=4)
    (target_copy / "die_at").write_text("3")
    pool, engine = make_engine(target_copy, prepared, kind=FaultyWorker)
    try:
        loader, sources = loaders(engine, prepared)
        loader.position = 4
        engine.start(loader)
        stream = iter_batches(loader)
        got = [next(stream) for _ in range(10)]
        held_out = sources["eval"].samples([4, 0, 8])
        for a, b in zip(got, expected):
            assert_same(a, b)
        assert (target_copy / "died").is_file()
        stats = ray_cluster.get(pool.stats.remote())
        assert stats["worker_restarts"] == 1 and stats["requeued"] >= 1, stats
        assert stats["delivered_samples"] == sum(b.num_samples for b in expected)  # each sample once
        assert loader.consumed == online.consumed
        model = load_target(target_copy, torch.device("cpu"), dtype="float32")
        from eagle31.data.prepare import load_prepared_splits

        direct = OnlineFeatures(model, load_prepared_splits(prepared)["eval"], AUX, batch_tokens=BATCH_TOKENS).samples(
            [4, 0, 8]
        )
        for a, b in zip(held_out, direct):
            assert all(torch.equal(x, y) for x, y in zip(a, b))
        assert engine.metrics()["engine/worker_restarts"] == 1
    finally:
        close_pool(pool)


@pytest.mark.parametrize(
    "data_size, copies, transport", [(2, 1, "ray"), (1, 2, "ray"), (1, 2, "mooncake")], indirect=["transport"]
)
def test_ranks_take_their_own_batches_or_share_them_in_a_sequence_parallel_group(
    ray_cluster, target_dir, prepared, data_size, copies, transport
):
    """Two trainer ranks in lockstep: on 2 data ranks each gets its loader's batches; as one sequence-parallel
    group (1 data rank) both get every batch. Bit-identical to online features either way; through a Mooncake
    store a shared batch's keys stay until both ranks have read them."""
    pool = make_pool(target_dir, prepared, world_size=data_size, copies=copies, pool_tokens=120, transport=transport)
    try:
        engines = [rank_engine(pool, rank, rank % data_size, data_size, 2, transport) for rank in range(2)]
        streams = []
        for engine in engines:
            loader, _ = loaders(engine, prepared)
            engine.start(loader)
            streams.append(iter_batches(loader))
        expected = [
            online_batches(target_dir, prepared, 8, rank=r % data_size, world_size=data_size)[0] for r in range(2)
        ]
        for step in range(8):
            for rank, stream in enumerate(streams):
                assert_same(next(stream), expected[rank][step])
        stats = ray_cluster.get(pool.stats.remote())
        assert stats["delivered_samples"] == sum(b.num_samples for e in expected for b in e)
        assert_read_keys_were_removed(transport, stats, 120)
    finally:
        close_pool(pool)


@pytest.mark.parametrize(
    "case, expected",
    [
        ("raises", "inference worker 0 failed on samples"),
        ("dies_always", "inference worker 0 died 2 times, more than features.engine.max_restarts=1"),
        ("hangs_always", "inference worker 0 died 2 times, more than features.engine.max_restarts=1; the last time: "
                         "no answer within features.engine.request_timeout_s=2 s"),
        ("cannot_describe", "inference worker 0 could not describe itself: RuntimeError: the engine's first answer "
                            "is unreadable"),
        ("too_big", "inference worker 0 could not be placed within features.engine.placement_timeout_s=2 s: it asks "
                    "for CPU 3, GPU 0; the cluster has CPU 2, GPU 0 in all (at most CPU 2, GPU 0 on one node)"),
        ("other_aux_ids", "inference worker 0 (hf) computes aux_layer_ids (1, 3, 4), the recipe asks for (1, 3, 5)"),
        ("other_tokenizer", "inference worker 0 (hf) runs a target whose tokenizer differs from the recipe's target "),
        ("other_weights", "inference worker 0 (hf) runs a target whose weights or config differ from the recipe's "
                          "target "),
        ("no_target", "inference worker 0 could not start"),
    ],
)  # fmt: skip
def test_a_failing_worker_stops_the_trainers_with_one_line(
    ray_cluster, target_dir, target_copy, prepared, case, expected
):
    """other_tokenizer, other_weights: the worker's node holds another checkpoint at the recipe's path. Here the
    worker reads a copy of the trainer's target (standing for the same path on another node) with two tokens' ids
    swapped, or with another model's weights of the same shape. too_big: a worker asking for more CPUs than the
    cluster has waits for a place, and stops the run at the placement timeout, naming both."""
    kind = {"raises": RaisingWorker, "dies_always": FaultyWorker, "hangs_always": FaultyWorker,
            "cannot_describe": UndescribedWorker}.get(case, HFInferenceWorker)  # fmt: skip
    if case in ("dies_always", "hangs_always"):
        (target_copy / ("die_at" if case == "dies_always" else "hang_at")).write_text("always")
    if case == "no_target":
        shutil.rmtree(target_copy)
    if case == "other_tokenizer":
        tokenizer = json.loads((target_copy / "tokenizer.json").read_text())
        vocab = tokenizer["model"]["vocab"]
        vocab["A"], vocab["B"] = vocab["B"], vocab["A"]  # two ids that mean each other's token
        (target_copy / "tokenizer.json").write_text(json.dumps(tokenizer))
    if case == "other_weights":
        tiny_llama(seed=1).save_pretrained(target_copy)
    pool, engine = make_engine(
        target_copy, prepared, kind=kind, workers=1, max_restarts=1, recipe_target=target_dir,
        aux=(1, 3, 5) if case == "other_aux_ids" else AUX,
        request_timeout_s=2 if case == "hangs_always" else 60,
        worker_cpus=3 if case == "too_big" else 0.5,
        placement_timeout_s=2 if case == "too_big" else 60,
    )  # fmt: skip
    try:
        loader, _ = loaders(engine, prepared)
        with pytest.raises(EngineError) as error:
            engine.start(loader)
            next(iter(loader))
        line = str(error.value)
        print(line)
        assert expected in line and "\n" not in line, line
        if case == "raises":
            assert "ValueError: cannot compute" in line
        if case in ("other_tokenizer", "other_weights"):
            assert (
                f"recipe's target {target_copy} (fingerprint " in line and ", expected " in line
            )  # the path both read
    finally:
        close_pool(pool)


def test_a_hung_worker_is_replaced_and_one_briefly_unreachable_is_asked_again(ray_cluster, target_copy, prepared):
    """One worker: Ray says it is unreachable in its 2nd computation (asked again: no restart), and it stops answering
    in its 5th (after features.engine.request_timeout_s it is taken for dead: killed, replaced, its samples asked
    again). The batches are the uninterrupted ones: nothing lost, nothing repeated."""
    expected, online = online_batches(target_copy, prepared, 10)
    (target_copy / "unreachable_at").write_text("2")
    (target_copy / "hang_at").write_text("5")
    pool, engine = make_engine(target_copy, prepared, kind=FaultyWorker, workers=1, request_timeout_s=3)
    try:
        loader, _ = loaders(engine, prepared)
        engine.start(loader)
        stream = iter_batches(loader)
        for want in expected:
            assert_same(next(stream), want)
        assert (target_copy / "unreachable").is_file() and (target_copy / "hung").is_file()
        stats = ray_cluster.get(pool.stats.remote())
        assert stats["unavailable"] == 1 and stats["worker_restarts"] == 1 and stats["requeued"] >= 1, stats
        assert stats["delivered_samples"] == sum(b.num_samples for b in expected)
        assert loader.consumed == online.consumed
    finally:
        close_pool(pool)


@pytest.mark.parametrize("stalled_s", [5.0, None])
def test_a_rank_waits_for_a_stalled_pool_no_longer_than_its_timeouts_allow(
    ray_cluster, prepared, monkeypatch, stalled_s
):
    """A pool that has made no progress for longer than its timeouts allow (its own checks failed), or that does not
    even say its state: the waiting rank stops with one line naming what the pool waits on, or that it is silent."""
    from eagle31.data.prepare import load_prepared_splits

    monkeypatch.setattr(features, "POLL_S", 0.2)
    monkeypatch.setattr(features, "POOL_ANSWER_S", 1.0)
    pool = ray_cluster.remote(SilentPool).options(num_cpus=0, runtime_env=actor_runtime_env()).remote(stalled_s)
    ray_cluster.get(pool.__ray_ready__.remote())  # started: its silence is its own, not its process's start
    try:
        source = EngineFeatures(pool, load_prepared_splits(prepared)["train"], 0, True, 32, 96, torch.float32)
        with pytest.raises(EngineError) as error:
            source.samples([3, 1])
        said = str(error.value)
        if stalled_s is None:
            assert said.startswith(
                "the feature pool did not answer for 1 s while rank 0 waited for the features of samples [3, 1]..."
            )
        else:
            assert said.startswith(
                "rank 0 waited for the features of samples [3, 1]..., and the feature pool has made no progress for "
                "5 s, more than its timeouts allow (features.engine.*_timeout_s): worker 0 ready for 9 s holding 2 "
                "request(s); the last complete checkpoint is kept"
            )
    finally:
        ray_cluster.kill(pool)
