"""The per-token columns (`eagle31.data.batch.TOKEN_COLUMNS`) travel by their table: from the prepared split's
schema through the store, packing, padding and the sequence shards, nothing names them one by one
(docs/architecture.md, "How to add a per-token data field")."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors import safe_open

import eagle31.data.batch
from eagle31.data.batch import TOKEN_COLUMNS, FeatureBatch, Sample, TokenColumn, empty_batch, pack, pad
from eagle31.data.store import FeatureStore
from eagle31.sequence_parallel import pad_positions
from tests.data.test_store import random_samples, write_store


def test_every_column_is_a_field_of_samples_and_batches():
    assert set(TOKEN_COLUMNS) <= set(Sample._fields)
    assert set(TOKEN_COLUMNS) <= {f.name for f in dataclasses.fields(FeatureBatch)}


def test_the_prepared_splits_columns_are_the_token_columns(tmp_path):
    from datasets import Dataset

    from eagle31.data.prepare import _write_arrow

    rows = [{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}, {"input_ids": [4, 5], "loss_mask": [1, 1]}]
    assert _write_arrow(iter(rows), tmp_path / "rows.arrow") == 2
    ds = Dataset.from_file(str(tmp_path / "rows.arrow"), in_memory=True)
    assert ds.column_names == list(TOKEN_COLUMNS)
    assert [ds.features[name].feature.dtype for name in TOKEN_COLUMNS] == [c.arrow for c in TOKEN_COLUMNS.values()]


@pytest.fixture
def loss_mask_padded_with_2(monkeypatch):
    """The table says how a column pads and is stored: here the loss mask pads with 2 and is stored as int16."""
    columns = {**TOKEN_COLUMNS, "loss_mask": TokenColumn("int8", torch.int16, pad=2)}
    monkeypatch.setattr(eagle31.data.batch, "TOKEN_COLUMNS", columns)
    for module in ("eagle31.data.store", "eagle31.sequence_parallel"):
        monkeypatch.setattr(f"{module}.TOKEN_COLUMNS", columns)
    return columns


def test_padding_takes_each_columns_pad_from_the_table(loss_mask_padded_with_2):
    samples = random_samples(3, seed=1)
    longest = max(s.input_ids.shape[0] for s in samples)
    padded = pad(samples)
    for b, s in enumerate(samples):
        n = s.input_ids.shape[0]
        assert torch.equal(padded.loss_mask[b, :n], s.loss_mask) and bool((padded.loss_mask[b, n:] == 2).all())
        assert bool((padded.input_ids[b, n:] == 0).all())
    assert padded.loss_mask.shape == (3, longest)
    packed = pack(samples)
    assert torch.equal(packed.loss_mask[0], torch.cat([s.loss_mask for s in samples]))
    wider = pad_positions(packed, packed.input_ids.shape[1] + 3)
    assert wider.loss_mask[0, -3:].tolist() == [2, 2, 2] and wider.input_ids[0, -3:].tolist() == [0, 0, 0]
    assert empty_batch(4, 2, torch.float32).loss_mask.tolist() == [[2]]


def test_the_store_keeps_each_column_in_its_dtype(tmp_path, loss_mask_padded_with_2):
    samples = random_samples(4, seed=2, dtype=torch.float32)
    write_store(tmp_path / "s", samples, "float32")
    shard = next((tmp_path / "s").rglob("*.safetensors"))
    with safe_open(str(shard), "pt") as f:
        assert f.get_slice("loss_mask").get_dtype() == "I16" and f.get_slice("input_ids").get_dtype() == "I32"
    store = FeatureStore(tmp_path / "s", dtype=torch.float32)
    for got, s in zip(store.samples(range(len(samples))), samples):
        assert torch.equal(got.loss_mask, s.loss_mask) and torch.equal(got.input_ids, s.input_ids)
