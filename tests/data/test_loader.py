"""Batching: layouts, seeded shuffles, rank splits, resumable positions, online == offline."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from eagle31.data.batch import Sample, bucket_by_length, pack, pad
from eagle31.data.capture import capture_to_store
from eagle31.data.loader import FeatureLoader
from eagle31.data.online import OnlineFeatures
from eagle31.data.store import FeatureStore, StoreHeader, StoreWriter, prepared_lengths
from eagle31.errors import ConfigError
from tests.tiny_targets import prepared_split, tiny_llama


class ToySource:
    """A FeatureSource whose features encode the sample id, so batches can be traced back."""

    aux_size, hidden_size, dtype = 2, 1, torch.float32

    def __init__(self, lengths):
        self.lengths = np.asarray(lengths)
        self.sample_ids = np.arange(10, 10 + len(lengths))  # ids need not start at 0

    def samples(self, ids):
        out = []
        for i in ids:
            T = int(self.lengths[i - 10])
            out.append(
                Sample(
                    input_ids=torch.full((T,), i),
                    loss_mask=torch.ones(T, dtype=torch.long),
                    aux=torch.full((T, 2), float(i)),
                    final=torch.full((T, 1), float(i)),
                )
            )
        return out


def toy_lengths(n=37, seed=0):
    return np.random.default_rng(seed).integers(1, 30, n)


def ids_in(batch) -> list[int]:
    """Sample ids of a batch, one per document."""
    out = []
    for row_ids, row_docs in zip(batch.input_ids, batch.document_ids):
        for d in range(int(row_docs.max()) + 1):
            out.append(int(row_ids[row_docs == d][0]))
    return out


def test_pack_and_pad_layouts():
    src = ToySource([3, 1, 2])
    samples = src.samples([10, 11, 12])
    p = pack(samples)
    assert p.input_ids.tolist() == [[10, 10, 10, 11, 12, 12]]
    assert p.document_ids.tolist() == [[0, 0, 0, 1, 2, 2]]
    assert (p.num_tokens, p.num_samples) == (6, 3) and p.aux.shape == (1, 6, 2)
    b = pad(samples)
    assert b.document_ids.tolist() == [[0, 0, 0], [0, -1, -1], [0, 0, -1]]
    assert b.input_ids.tolist() == [[10, 10, 10], [11, 0, 0], [12, 12, 0]]
    assert (b.num_tokens, b.num_samples) == (6, 3) and b.final.shape == (3, 3, 1)
    moved = b.to("cpu", dtype=torch.float64)
    assert moved.aux.dtype == torch.float64 and moved.input_ids.dtype == torch.long and moved.num_tokens == 6


def test_bucket_by_length_respects_the_padded_budget():
    lengths = [5, 3, 9, 3, 4, 12]
    groups = bucket_by_length(lengths, 10)
    assert sorted(i for g in groups for i in g) == list(range(6))
    assert groups == [[1, 3], [4, 0], [2], [5]]  # 2 x 5 <= 10; a sample over the budget is alone


@pytest.mark.parametrize("batching", ["pack", "bucket"])
def test_batches_fit_the_budget_and_follow_the_seed(batching):
    src = ToySource(toy_lengths())

    def first_epoch(seed):
        return [ids_in(b) for b in FeatureLoader(src, batching=batching, tokens_per_batch=40, seed=seed)]

    loader = FeatureLoader(src, batching=batching, tokens_per_batch=40, seed=3)
    first, second = [[ids_in(b) for b in loader] for _ in range(2)]  # two epochs
    assert loader.epoch == 2
    assert first != second  # a new permutation each epoch
    assert first_epoch(3) == first  # the same seed gives the same batches
    assert first_epoch(4) != first
    for batch in FeatureLoader(src, batching=batching, tokens_per_batch=40, seed=3):
        assert batch.input_ids.numel() <= 40
        if batching == "pack":
            assert batch.input_ids.shape[0] == 1


@pytest.mark.parametrize("batching", ["pack", "bucket"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_rank_splits_cover_every_sample_exactly_once(batching, world_size):
    src = ToySource(toy_lengths())
    loaders = [
        FeatureLoader(src, batching=batching, tokens_per_batch=40, seed=1, rank=r, world_size=world_size)
        for r in range(world_size)
    ]
    per_rank = [list(loader) for loader in loaders]
    assert len({len(batches) for batches in per_rank}) == 1  # every rank takes the same number of steps
    interleaved = [i for step in zip(*per_rank) for b in step if b.num_samples for i in ids_in(b)]
    assert Counter(interleaved) == Counter(src.sample_ids.tolist())  # every sample exactly once
    single = [i for b in FeatureLoader(src, batching=batching, tokens_per_batch=40, seed=1) for i in ids_in(b)]
    assert interleaved == single  # global batch i is rank i % world_size's


def test_empty_batches_pad_the_last_round():
    src = ToySource([10] * 5)
    loaders = [FeatureLoader(src, batching="pack", tokens_per_batch=10, rank=r, world_size=3) for r in range(3)]
    batches = [list(loader) for loader in loaders]
    assert [len(b) for b in batches] == [2, 2, 2]
    last = batches[2][1]
    assert last.num_tokens == 0 and last.document_ids.tolist() == [[-1]] and last.loss_mask.sum() == 0


def test_resume_from_a_saved_position_continues_the_same_batches():
    src = ToySource(toy_lengths())
    full = [ids_in(b) for b in FeatureLoader(src, tokens_per_batch=40, seed=2)]
    loader = FeatureLoader(src, tokens_per_batch=40, seed=2)
    it = iter(loader)
    head = [ids_in(next(it)) for _ in range(4)]
    state = loader.state_dict()
    resumed = FeatureLoader(src, tokens_per_batch=40, seed=2)
    resumed.load_state_dict(state)
    assert head + [ids_in(b) for b in resumed] == full
    assert resumed.epoch == 1 and resumed.position == 0


def test_resume_on_another_world_size_keeps_the_global_position():
    src = ToySource(toy_lengths())
    two = [FeatureLoader(src, tokens_per_batch=40, seed=2, rank=r, world_size=2) for r in range(2)]
    for loader in two:
        it = iter(loader)
        for _ in range(3):
            next(it)
    one = FeatureLoader(src, tokens_per_batch=40, seed=2)
    one.load_state_dict(two[0].state_dict())
    assert one.position == 6
    with pytest.raises(ConfigError, match="world_size=4"):
        FeatureLoader(src, tokens_per_batch=40, seed=2, world_size=4).load_state_dict(
            {**two[0].state_dict(), "position": 1}
        )
    with pytest.raises(ConfigError, match="seed=2"):
        FeatureLoader(src, tokens_per_batch=40, seed=5).load_state_dict(two[0].state_dict())


def test_the_consumed_record_names_the_samples_in_their_order_and_survives_a_resume():
    src = ToySource(toy_lengths())
    full = FeatureLoader(src, tokens_per_batch=40, seed=2)
    ids = [i for b in full for i in ids_in(b)]
    assert full.consumed["samples"] == len(ids) == len(src.lengths)  # one epoch: every sample once
    loader = FeatureLoader(src, tokens_per_batch=40, seed=2)
    it = iter(loader)
    for _ in range(4):
        next(it)
    resumed = FeatureLoader(src, tokens_per_batch=40, seed=2)
    resumed.load_state_dict(loader.state_dict())
    list(resumed)
    assert resumed.consumed == full.consumed
    other = FeatureLoader(src, tokens_per_batch=40, seed=3)  # the same samples in another order
    list(other)
    assert other.consumed["samples"] == full.consumed["samples"] and other.consumed["sha256"] != full.consumed["sha256"]
    on_two = FeatureLoader(src, tokens_per_batch=40, seed=2, world_size=2)
    on_two.load_state_dict({**loader.state_dict(), "position": 2, "world_size": 4})  # another world size: a new record
    assert on_two.consumed == FeatureLoader(src, tokens_per_batch=40, seed=2).consumed


def test_a_sample_over_the_budget_is_an_error():
    with pytest.raises(ConfigError, match="sample 11 has 50 tokens, more than features.tokens_per_batch=40"):
        FeatureLoader(ToySource([3, 50]), tokens_per_batch=40)


# ---------------------------------------------------------------- online == offline


@pytest.mark.parametrize("batching", ["pack", "bucket"])
def test_online_and_offline_batches_are_identical(tmp_path, batching):
    model, data = tiny_llama(), prepared_split(14, seed=5)
    aux_ids = (1, 3, 4)
    lengths = prepared_lengths(data)
    header = StoreHeader("tiny", None, 6, 32, aux_ids, "float32")
    writer = StoreWriter(tmp_path, header, np.arange(len(data)), lengths, shard_max_tokens=50)
    capture_to_store(model, data, writer, batch_tokens=1)  # one sample per forward on both sides
    writer.finalize()

    def batches(source, rank, world_size):
        loader = FeatureLoader(source, batching=batching, tokens_per_batch=48, seed=7, rank=rank, world_size=world_size)
        return list(loader)

    for rank in range(2):
        offline = batches(FeatureStore(tmp_path), rank, 2)
        online = batches(OnlineFeatures(model, data, aux_ids, batch_tokens=1), rank, 2)
        assert len(offline) == len(online) > 1
        for a, b in zip(offline, online):
            for name in ("input_ids", "loss_mask", "document_ids", "aux", "final"):
                assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_online_features_in_larger_forwards_agree_to_rounding(tmp_path):
    model, data = tiny_llama(), prepared_split(10, seed=6)
    one = list(FeatureLoader(OnlineFeatures(model, data, (1, 2), batch_tokens=1), tokens_per_batch=64, seed=1))
    many = list(FeatureLoader(OnlineFeatures(model, data, (1, 2), batch_tokens=256), tokens_per_batch=64, seed=1))
    for a, b in zip(one, many):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.document_ids, b.document_ids)
        torch.testing.assert_close(a.aux, b.aux, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.final, b.final, rtol=1e-5, atol=1e-5)
