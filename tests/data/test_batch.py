"""The per-token columns (`eagle31.data.batch.TOKEN_COLUMNS`) travel by their table: from the prepared split's
schema through the store, packing, padding and the sequence shards, nothing names them one by one
(docs/architecture.md, "How to add a per-token data field")."""

from __future__ import annotations

import dataclasses
import sys
from typing import NamedTuple

import numpy as np
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


# ------------------------------------------------------------------ a new column, added as docs/architecture.md says


class ToySample(NamedTuple):
    """`Sample` with the toy column's field (what a new column adds to batch.py)."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    parity: torch.Tensor  # [T] long: the toy column, each input id mod 2
    aux: torch.Tensor
    final: torch.Tensor


@dataclasses.dataclass
class ToyBatch(FeatureBatch):
    """`FeatureBatch` with the toy column's field."""

    parity: torch.Tensor | None = None  # [B, T] long


PARITY_PAD = 7  # not a parity: padding is told apart from every real value


@pytest.fixture
def parity_column(monkeypatch):
    """A per-token column `parity` added as the "How to add" table says, and nowhere else: its line in
    `TOKEN_COLUMNS` and its field on `Sample` and `FeatureBatch` (batch.py; every module that bound the two
    classes by name gets the new ones, as editing batch.py would give them), and its value in each row that
    prepare.py's `_samples` yields. No reader: the column is checked where the trainer would read it."""
    import eagle31.data.capture
    import eagle31.data.loader
    import eagle31.data.online
    import eagle31.data.prepare
    import eagle31.data.speculators_import
    import eagle31.data.store
    import eagle31.engine.features
    import eagle31.sequence_parallel
    import eagle31.trainer

    monkeypatch.setitem(TOKEN_COLUMNS, "parity", TokenColumn("int8", torch.uint8, pad=PARITY_PAD))
    for old, new in ((Sample, ToySample), (FeatureBatch, ToyBatch)):
        for name, module in list(sys.modules.items()):
            if name.split(".")[0] == "eagle31":
                for attr, value in list(vars(module).items()):
                    if value is old:
                        monkeypatch.setattr(module, attr, new)
    rows = eagle31.data.prepare._samples
    with_parity = lambda *args: ({**row, "parity": [i % 2 for i in row["input_ids"]]} for row in rows(*args))  # noqa: E731
    monkeypatch.setattr(eagle31.data.prepare, "_samples", with_parity)


def assert_parity_travelled(batch: FeatureBatch) -> None:
    """The batch carries the toy column: each real token's input id mod 2, the column's pad elsewhere."""
    assert isinstance(batch, ToyBatch) and batch.parity.dtype == torch.long
    real = batch.document_ids >= 0
    assert torch.equal(batch.parity[real], batch.input_ids[real] % 2)
    assert bool((batch.parity[~real] == PARITY_PAD).all())


class OnePool:
    """An engine pool whose one request per take answers with features computed here (no Ray)."""

    def __init__(self, online):
        self.online = online
        self.take = self

    def remote(self, rank, ids):
        return "ok", [(list(range(len(ids))), [(s.aux, s.final) for s in self.online.samples(ids)])]


def test_a_new_column_travels_from_prepared_rows_to_the_trainers_batch_and_its_sequence_shard(
    parity_column, tmp_path, llama_tok, monkeypatch
):
    """Prepared split -> online features, the feature store and the engine's samples -> packed and padded
    batches -> a sequence shard with its halo: the toy column arrives everywhere the trainer reads columns."""
    import eagle31.engine.features
    import eagle31.sequence_parallel
    from eagle31.data.capture import capture_to_store
    from eagle31.data.loader import FeatureLoader
    from eagle31.data.online import OnlineFeatures
    from eagle31.data.prepare import DataConfig, load_prepared_splits, prepare_dataset
    from eagle31.data.store import StoreHeader, StoreWriter, prepared_lengths
    from eagle31.engine.features import EngineFeatures
    from eagle31.sequence_parallel import SequenceGroup, shard_batch
    from tests.data.chat_helpers import write_jsonl
    from tests.tiny_targets import tiny_llama

    chats = [
        {"messages": [{"role": "user", "content": f"Hi {i}"}, {"role": "assistant", "content": "Hello " * (i % 4 + 1)}]}
        for i in range(12)
    ]
    data = DataConfig(
        source=[str(write_jsonl(tmp_path / "chats.jsonl", chats))], prepared_dir=str(tmp_path / "prepared")
    )
    prepare_dataset(data, llama_tok, draft_vocab_size=8)
    train = load_prepared_splits(tmp_path / "prepared")["train"]
    assert train.features["parity"].feature.dtype == "int8"
    assert all(row["parity"] == [i % 2 for i in row["input_ids"]] for row in train)

    aux_ids = (1, 2, 3)
    target = tiny_llama(vocab_size=len(llama_tok))
    online = OnlineFeatures(target, train, aux_ids)
    header = StoreHeader("tiny", None, 6, online.hidden_size, aux_ids, "float32")
    writer = StoreWriter(
        tmp_path / "store", header, np.arange(len(train)), prepared_lengths(train), shard_max_tokens=64
    )
    capture_to_store(target, train, writer, batch_tokens=256)
    writer.finalize()
    with safe_open(str(next((tmp_path / "store").rglob("*.safetensors"))), "pt") as f:
        assert f.get_slice("parity").get_dtype() == "U8"
    monkeypatch.setattr(eagle31.engine.features, "_get", lambda refs, timeout=None: refs)  # answers are the values
    engine = EngineFeatures(
        OnePool(online),
        train,
        rank=0,
        stream=True,
        hidden_size=online.hidden_size,
        aux_size=online.aux_size,
        dtype=online.dtype,
    )
    # one rank's group: the gather of every rank's shard is its own
    monkeypatch.setattr(eagle31.sequence_parallel, "all_gather_shards", lambda x, group: x.unsqueeze(0))
    one_rank = SequenceGroup(size=1, rank=0, data_rank=0, data_size=1)
    for source in (online, FeatureStore(tmp_path / "store"), engine):
        for batching in ("pack", "bucket"):  # bucket: padded rows
            batches = list(FeatureLoader(source, batching=batching, tokens_per_batch=256))
            assert sum(b.num_samples for b in batches) == len(train)
            for batch in batches:
                assert_parity_travelled(batch)
                shard, _ = shard_batch(batch, one_rank, ttt_length=2, device="cpu", dtype=torch.float32)
                assert_parity_travelled(shard)
                assert shard.parity.shape[1] == shard.input_ids.shape[1] > batch.input_ids.shape[1]  # the halo
