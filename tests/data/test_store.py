"""The shard store: exact round trips, float8 error bound, checksums, unmerged stores."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from eagle31.data.batch import Sample
from eagle31.data.capture import prepared_rows, run_target
from eagle31.data.store import (
    MANIFEST,
    CorruptShardError,
    FeatureStore,
    StoreHeader,
    StoreWriter,
    dequantize_rows,
    quantize_rows,
    store_bytes_per_token,
)
from eagle31.target import TargetFeatures
from tests.tiny_targets import prepared_split, tiny_llama

HT, N_AUX = 16, 3


def random_samples(n: int, seed: int = 0, dtype=torch.bfloat16) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        T = int(torch.randint(2, 12, (1,), generator=g))
        out.append(
            Sample(
                input_ids=torch.randint(0, 1000, (T,), generator=g),
                loss_mask=(torch.rand(T, generator=g) < 0.5).long(),
                aux=(torch.randn(T, N_AUX * HT, generator=g) * 5).to(dtype),
                final=torch.randn(T, HT, generator=g).to(dtype),
            )
        )
    return out


def write_store(root, samples: list[Sample], dtype: str, shard_max_tokens: int = 20, finalize: bool = True):
    header = StoreHeader("t", None, 8, HT, (2, 4, 5), dtype)
    lengths = np.array([s.input_ids.shape[0] for s in samples])
    writer = StoreWriter(root, header, np.arange(len(samples)), lengths, shard_max_tokens)
    for index, ids in writer.pending():
        writer.write_shard(index, ids, [samples[i] for i in ids])
    return writer.finalize() if finalize else None


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_round_trip_is_bit_exact(tmp_path, dtype):
    torch_dtype = getattr(torch, dtype)
    samples = random_samples(9, dtype=torch_dtype)
    manifest = write_store(tmp_path, samples, dtype)
    assert len(manifest["shards"]) > 2 and manifest["num_samples"] == 9
    store = FeatureStore(tmp_path)
    assert store.dtype == torch_dtype and store.sample_ids.tolist() == list(range(9))
    assert store.lengths.tolist() == [s.input_ids.shape[0] for s in samples]
    for want, got in zip(samples, store.samples(range(9))):
        for a, b in zip(want, got):
            assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float8"])
def test_the_bytes_per_token_a_dry_run_prints_are_the_shards_tensors(tmp_path, dtype):
    """What a token costs on disk (the dry run's disk figure): every per-token tensor of a written shard."""
    from safetensors import safe_open

    samples = random_samples(9)
    write_store(tmp_path, samples, dtype)
    tokens = per_token = 0
    for path in tmp_path.rglob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            tokens += f.get_tensor("input_ids").shape[0]
            per_token += sum(f.get_tensor(k).nbytes for k in f.keys() if k not in ("offsets", "sample_ids"))
    assert tokens == sum(len(s.input_ids) for s in samples)
    assert per_token == tokens * store_bytes_per_token(HT, N_AUX, dtype)
    assert store_bytes_per_token(7168, 3, "bfloat16") == 57349  # Kimi K2.6: 56 KiB, 5.2 TiB per 100M tokens


def test_manifest_holds_the_header_and_a_checksum_per_shard(tmp_path):
    write_store(tmp_path, random_samples(5), "bfloat16")
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["format_version"] == 1
    assert (manifest["target_name"], manifest["num_layers"], manifest["hidden_size"]) == ("t", 8, HT)
    assert manifest["aux_layer_ids"] == [2, 4, 5] and manifest["dtype"] == "bfloat16"
    for shard in manifest["shards"]:
        assert set(shard) == {"file", "samples", "tokens", "bytes", "sha256"} and len(shard["sha256"]) == 64


def test_float8_round_trip_stays_within_half_a_step():
    """Measured on real hidden states: relative L2 error per row chunk ~2.4% mean, < 3.5% max."""
    model = tiny_llama()
    with TargetFeatures(model, (1, 3, 4)) as feats:
        samples = run_target(feats, prepared_rows(prepared_split(16), range(16)), 256)
    for x, chunks in ((torch.cat([s.aux for s in samples]), 3), (torch.cat([s.final for s in samples]), 1)):
        q, scale = quantize_rows(x, chunks)
        assert q.dtype == torch.float8_e4m3fn and scale.shape == (x.shape[0], chunks)
        y = dequantize_rows(q, scale, torch.float32)
        v, w = x.view(x.shape[0], chunks, -1), y.view(x.shape[0], chunks, -1)
        amax = v.abs().amax(-1, keepdim=True)
        assert ((v - w).abs() <= amax / 28 + 1e-7).all()  # half a float8 step at the top of the range
        rel = (v - w).norm(dim=-1) / v.norm(dim=-1)
        assert rel.mean() < 0.03 and rel.max() < 0.035


def test_float8_store_reads_back_dequantized(tmp_path):
    samples = random_samples(6, dtype=torch.float32)
    write_store(tmp_path, samples, "float8")
    store = FeatureStore(tmp_path)
    assert store.dtype == torch.bfloat16
    for want, got in zip(samples, store.samples(range(6))):
        assert torch.equal(want.input_ids, got.input_ids) and torch.equal(want.loss_mask, got.loss_mask)
        for a, b in ((want.aux, got.aux), (want.final, got.final)):
            assert b.dtype == torch.bfloat16
            # float8 step (amax/28) plus bfloat16 rounding of the result
            assert ((a - b.float()).abs() <= a.abs().amax() / 28 * 1.02 + 1e-6).all()


def flip_one_byte(path, offset_from_end: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0x01
    path.write_bytes(bytes(data))


def test_one_flipped_byte_is_detected_and_names_the_file(tmp_path):
    write_store(tmp_path, random_samples(9), "bfloat16")
    victim = tmp_path / "shard-000001.safetensors"
    flip_one_byte(victim)
    store = FeatureStore(tmp_path)  # indexing reads only the small tensors
    good, bad = (store.sample_ids[store._shard == i].tolist() for i in (0, 1))
    assert all(s is not None for s in store.samples(good))  # shard 0 is fine
    with pytest.raises(CorruptShardError, match="shard-000001.safetensors"):
        store.samples(bad)


def test_skip_corrupt_skips_and_counts(tmp_path):
    samples = random_samples(9)
    manifest = write_store(tmp_path, samples, "bfloat16")
    flip_one_byte(tmp_path / "shard-000001.safetensors")
    store = FeatureStore(tmp_path, skip_corrupt=True)
    got = store.samples(range(9))
    lost = manifest["shards"][1]["samples"]
    assert sum(s is None for s in got) == lost == store.skipped_samples
    assert store.corrupt_shards == ["shard-000001.safetensors"]
    assert all(torch.equal(s.aux, samples[i].aux) for i, s in enumerate(got) if s is not None)


def test_skipped_shards_are_said_on_the_console_and_listed(tmp_path, capsys):
    manifest = write_store(tmp_path, random_samples(9), "bfloat16")
    flip_one_byte(tmp_path / "shard-000001.safetensors")
    store = FeatureStore(tmp_path, skip_corrupt=True)
    store.samples(range(9))
    assert store.skipped() == {"shard-000001.safetensors": manifest["shards"][1]["samples"]}
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "skipping corrupt shard" in err[0] and "shard-000001.safetensors" in err[0]


@pytest.mark.parametrize("escape", ["../../outside.safetensors", "/etc/passwd", "sub/shard-000000.safetensors"])
def test_a_record_naming_a_file_outside_the_store_is_refused_unread(tmp_path, escape, monkeypatch):
    store_dir = tmp_path / "store" / "train"
    write_store(store_dir, random_samples(4), "bfloat16")
    manifest = json.loads((store_dir / MANIFEST).read_text())
    manifest["shards"][0]["file"] = escape
    (store_dir / MANIFEST).write_text(json.dumps(manifest))
    (store_dir / "shard-000000.json").unlink()
    opened = []
    monkeypatch.setattr("eagle31.data.store.safe_open", lambda path, **kw: opened.append(path))
    for skip in (False, True):
        with pytest.raises(CorruptShardError, match="not a shard of this store"):
            FeatureStore(store_dir, skip_corrupt=skip)
    assert opened == []


def test_truncated_shard_is_caught_when_indexing(tmp_path):
    write_store(tmp_path, random_samples(9), "bfloat16")
    path = tmp_path / "shard-000000.safetensors"
    path.write_bytes(path.read_bytes()[:50])
    with pytest.raises(CorruptShardError, match="shard-000000.safetensors"):
        FeatureStore(tmp_path)
    store = FeatureStore(tmp_path, skip_corrupt=True)
    assert store.corrupt_shards == ["shard-000000.safetensors"] and len(store) == 9 - store.skipped_samples


def test_an_unmerged_store_is_read_from_its_shard_records(tmp_path):
    samples = random_samples(7)
    write_store(tmp_path, samples, "bfloat16", finalize=False)  # as after a crash before the merge
    assert json.loads((tmp_path / "manifest.json").read_text())["shards"] == []
    store = FeatureStore(tmp_path)
    assert store.sample_ids.tolist() == list(range(7))
    assert torch.equal(store.sample(3).aux, samples[3].aux)
