"""Target capture: hooks against output_hidden_states and lm_head, and capture into the store with resume."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from eagle31.data.capture import capture_to_store, check_one_process_per_node, prepared_rows, run_target
from eagle31.data.store import (
    FeatureStore,
    StoreHeader,
    StoreMismatchError,
    StoreWriter,
    check_store_compatible,
    prepared_lengths,
)
from eagle31.errors import ConfigError
from eagle31.target import TargetFeatures
from tests.tiny_targets import prepared_split, tiny_deepseek_v3, tiny_llama

BUILDERS = {"llama": tiny_llama, "deepseek_v3": tiny_deepseek_v3}


def padded_batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, 96, (3, 11), generator=g)
    attention_mask = torch.ones(3, 11, dtype=torch.long)
    attention_mask[1, 7:] = 0
    attention_mask[2, 4:] = 0
    return input_ids, attention_mask


@pytest.mark.parametrize("arch", BUILDERS)
def test_aux_and_final_match_hidden_states_and_lm_head_input(arch):
    model = BUILDERS[arch]()
    L = model.config.num_hidden_layers
    ids = (0, 2, L - 1)
    input_ids, attention_mask = padded_batch()
    with torch.no_grad():
        ref = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
    with TargetFeatures(model, ids) as feats:
        aux, final = feats.capture(input_ids, attention_mask)
    Ht = model.config.hidden_size
    assert aux.shape == (3, 11, 3 * Ht) and final.shape == (3, 11, Ht)
    real = attention_mask.bool()
    for j, k in enumerate(ids):  # id k = input of decoder layer k = output_hidden_states[k]
        torch.testing.assert_close(aux[..., j * Ht : (j + 1) * Ht][real], ref.hidden_states[k][real], rtol=0, atol=0)
    # final is what lm_head reads: it reproduces the logits
    torch.testing.assert_close(model.lm_head(final)[real], ref.logits[real], rtol=0, atol=0)


def test_features_of_incremental_forwards_with_kv_cache():
    model = tiny_llama()
    input_ids = torch.randint(1, 96, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(input_ids=input_ids, output_hidden_states=True)
        with TargetFeatures(model, (1, 3)) as feats:
            out = model(input_ids=input_ids[:, :6], use_cache=True)
            feats.pop()
            model(input_ids=input_ids[:, 6:], cache=out.cache, use_cache=True)
            aux, final = feats.pop()
    assert aux.shape == (2, 3, 64)
    torch.testing.assert_close(aux[..., :32], ref.hidden_states[1][:, 6:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(aux[..., 32:], ref.hidden_states[3][:, 6:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.lm_head(final), ref.logits[:, 6:], rtol=1e-5, atol=1e-5)


def test_capture_never_computes_logits_and_removes_its_hooks():
    model = tiny_llama()
    head_calls = []
    model.lm_head.register_forward_hook(lambda *args: head_calls.append(1))
    with TargetFeatures(model, (1, 2)) as feats:
        feats.capture(*padded_batch())
        with pytest.raises(RuntimeError, match="no complete forward"):
            feats.pop()
    assert head_calls == []  # the forward stopped at lm_head's input
    assert not model.model.layers[1]._forward_pre_hooks and not model.lm_head._forward_pre_hooks


def test_bad_targets_and_ids_are_config_errors():
    with pytest.raises(ConfigError, match="decoder layers"):
        TargetFeatures(nn.Linear(2, 2), (0,))
    with pytest.raises(ConfigError, match=r"\[6\] out of range"):
        TargetFeatures(tiny_llama(), (2, 6))


def test_run_target_batches_match_single_sample_forwards():
    model = tiny_llama()
    data = prepared_split(7, seed=3)
    rows = prepared_rows(data, range(7))
    with TargetFeatures(model, (1, 4)) as feats:
        batched = run_target(feats, rows, batch_tokens=64)
        single = run_target(feats, rows, batch_tokens=1)
    for b, s, (ids, mask) in zip(batched, single, rows):
        assert b.input_ids.tolist() == ids and b.loss_mask.tolist() == mask
        torch.testing.assert_close(b.aux, s.aux, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(b.final, s.final, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- capture into the store


def header(model, **overrides) -> StoreHeader:
    values = dict(
        target_name="tiny-llama",
        target_revision=None,
        num_layers=model.config.num_hidden_layers,
        hidden_size=model.config.hidden_size,
        aux_layer_ids=(1, 3, 4),
        dtype="float32",
    )
    values.update(overrides)
    return StoreHeader(**values)


def writer_for(root, model, data, **overrides) -> StoreWriter:
    lengths = prepared_lengths(data)
    return StoreWriter(root, header(model, **overrides), np.arange(len(lengths)), lengths, shard_max_tokens=30)


def test_capture_writes_every_sample_once_with_its_features(tmp_path):
    model, data = tiny_llama(), prepared_split(12)
    writer = writer_for(tmp_path, model, data)
    stats = capture_to_store(model, data, writer, batch_tokens=40)
    writer.finalize()
    assert stats.shards_written == len(writer.plan) > 2 and stats.samples == 12
    assert "tokens/s" in stats.summary() and stats.bytes > 0
    store = FeatureStore(tmp_path)
    assert store.sample_ids.tolist() == list(range(12))
    with TargetFeatures(model, (1, 3, 4)) as feats:
        expected = run_target(feats, prepared_rows(data, range(12)), batch_tokens=1)
    for i, sample in enumerate(store.samples(range(12))):
        assert sample.input_ids.tolist() == data[i]["input_ids"]
        assert sample.loss_mask.tolist() == data[i]["loss_mask"]
        torch.testing.assert_close(sample.aux, expected[i].aux, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(sample.final, expected[i].final, rtol=1e-5, atol=1e-5)


def test_interrupted_capture_resumes_to_the_same_manifest(tmp_path, monkeypatch):
    model, data = tiny_llama(), prepared_split(12)
    full = writer_for(tmp_path / "full", model, data)
    capture_to_store(model, data, full, batch_tokens=40)
    expected = full.finalize()

    # rank 0 of 2 crashes after writing two shards
    crashed = writer_for(tmp_path / "crash", model, data)
    written = []
    real_write = StoreWriter.write_shard

    def crash_after_two(self, *args):
        if len(written) == 2:
            raise KeyboardInterrupt("simulated crash")
        written.append(args[0])
        return real_write(self, *args)

    monkeypatch.setattr(StoreWriter, "write_shard", crash_after_two)
    with pytest.raises(KeyboardInterrupt):
        capture_to_store(model, data, crashed, batch_tokens=40, rank=0, world_size=2)
    monkeypatch.setattr(StoreWriter, "write_shard", real_write)
    assert written == [0, 2]

    # resume as a single rank: finished shards are skipped, the rest captured
    resumed = writer_for(tmp_path / "crash", model, data)
    stats = capture_to_store(model, data, resumed, batch_tokens=40)
    assert stats.shards_skipped == 2 and stats.shards_written == len(resumed.plan) - 2
    manifest = resumed.finalize()
    assert manifest == expected
    assert json.loads((tmp_path / "crash" / "manifest.json").read_text()) == json.loads(
        (tmp_path / "full" / "manifest.json").read_text()
    )


@pytest.mark.parametrize(
    "change", [{"aux_layer_ids": (1, 2, 4)}, {"dtype": "bfloat16"}, {"target_name": "other"}, {"hidden_size": 48}]
)
def test_appending_to_a_store_made_differently_is_refused(tmp_path, change):
    model, data = tiny_llama(), prepared_split(4)
    writer_for(tmp_path, model, data)
    key = next(iter(change))
    with pytest.raises(StoreMismatchError, match=f"made with {key}="):
        writer_for(tmp_path, model, data, **change)


def test_appending_from_other_data_is_refused(tmp_path):
    model = tiny_llama()
    writer_for(tmp_path, model, prepared_split(4, seed=0))
    with pytest.raises(StoreMismatchError, match="made with plan="):
        writer_for(tmp_path, model, prepared_split(4, seed=1))


def test_writer_from_recipe_sections_and_the_trainers_compatibility_check(tmp_path):
    data = prepared_split(5)
    target = SimpleNamespace(name=None, builtin=None, path="/models/tiny", revision="abc")
    features = SimpleNamespace(store_dtype="bfloat16", shard_max_tokens=30)
    config = {"text_config": {"num_hidden_layers": 6, "hidden_size": 32}}  # a multimodal wrapper's nesting
    writer = StoreWriter.for_dataset(tmp_path / "train", data, config, (1, 3, 4), target, features, fingerprint="f1")
    assert writer.header == StoreHeader("/models/tiny", "abc", 6, 32, (1, 3, 4), "bfloat16", "f1")
    assert sorted(int(i) for ids in writer.plan for i in ids) == list(range(5))
    identity = dict(target_name="/models/tiny", target_revision="abc", target_fingerprint="f1")
    check_store_compatible(tmp_path, config, (1, 3, 4), **identity)
    check_store_compatible(
        tmp_path / "absent", config, (1, 2, 4), **identity
    )  # nothing captured yet: nothing to refuse
    with pytest.raises(StoreMismatchError, match=r"train/manifest.json: the store was made with aux_layer_ids"):
        check_store_compatible(tmp_path, config, (1, 2, 4), **identity)
    with pytest.raises(
        StoreMismatchError, match=r"made with target_fingerprint='f1', this run has target_fingerprint='f2'"
    ):
        check_store_compatible(tmp_path, config, (1, 3, 4), **{**identity, "target_fingerprint": "f2"})
    with pytest.raises(StoreMismatchError, match=r"made with target_revision='abc'"):
        check_store_compatible(tmp_path, config, (1, 3, 4), **{**identity, "target_revision": "def"})


def test_the_fingerprint_tells_targets_of_one_shape_apart_and_survives_a_move(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from eagle31.target import target_fingerprint

    cfg = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2, vocab_size=64)
    for seed, name in ((0, "a"), (1, "b")):
        torch.manual_seed(seed)
        LlamaForCausalLM(cfg).save_pretrained(tmp_path / name)
    (tmp_path / "a").rename(tmp_path / "moved")
    a, b = target_fingerprint(tmp_path / "moved"), target_fingerprint(tmp_path / "b")
    assert a != b  # same config, other weights
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "a_again")  # the same checkpoint written elsewhere
    assert target_fingerprint(tmp_path / "a_again") == a


@pytest.mark.slow
def test_a_full_disk_during_capture_is_one_line_leaves_only_whole_shards_and_the_rerun_completes(small_disk):
    import subprocess

    from eagle31.errors import DiskFullError

    model, data = tiny_llama(), prepared_split(200)  # ~2,700 tokens of float32 features: more than the 1 MiB disk
    root = small_disk / "store"
    with pytest.raises(DiskFullError) as full:
        capture_to_store(model, data, writer_for(root, model, data), batch_tokens=40)
    assert str(full.value) == (
        f"the disk holding the feature store {root} filled up; the finished shards are kept and the one "
        "being written was removed; a rerun captures the rest; free space, then rerun the same command"
    )
    assert not [p.name for p in root.iterdir() if ".tmp-" in p.name]
    writer = writer_for(root, model, data)
    finished = [i for i in range(len(writer.plan)) if writer.is_finished(i)]
    assert 0 < len(finished) < len(writer.plan)
    store = FeatureStore(root)  # every shard with a record reads back and matches its checksum
    assert all(s is not None for s in store.samples(store.sample_ids.tolist()))

    subprocess.run(["mount", "-o", "remount,size=16m", str(small_disk)], check=True)  # space freed
    stats = capture_to_store(model, data, writer, batch_tokens=40)
    assert stats.shards_skipped == len(finished) and stats.shards_written == len(writer.plan) - len(finished)
    writer.finalize()
    assert FeatureStore(root).sample_ids.tolist() == list(range(200))


def test_a_target_spread_over_the_node_is_loaded_by_one_process_per_node(tmp_path):
    """Each of 8 trainers of a node loading Kimi over all 8 GPUs is refused before any load: in capture (the
    pipeline's, for an empty store) and in online training."""
    from eagle31.distributed import World
    from eagle31.pipeline import capture_store

    spread, single = SimpleNamespace(device_map="auto"), SimpleNamespace(device_map=None)
    node = World(rank=3, world_size=16, local_rank=3, device=torch.device("cpu"), local_world_size=8)
    check_one_process_per_node(node, single, "")  # a copy per GPU: data parallel
    check_one_process_per_node(dataclasses.replace(node, local_world_size=1), spread, "")  # one process per node
    with pytest.raises(ConfigError, match=r"^target.device_map=auto spreads .* not each of the 8 launched here: x$"):
        check_one_process_per_node(node, spread, "x")
    plan = SimpleNamespace(cfg=SimpleNamespace(target=spread), world=node)
    with pytest.raises(ConfigError, match=f"capture {tmp_path} first"):
        capture_store(plan, {}, tmp_path)
