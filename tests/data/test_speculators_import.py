"""Import of speculators' vLLM captures: files written here in their layout, checked against our capture."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from eagle31.data.capture import prepared_rows, run_target
from eagle31.data.speculators_import import final_norm_weight, import_speculators
from eagle31.data.store import FeatureStore
from eagle31.errors import ConfigError, CorruptDataError
from eagle31.target import TargetFeatures
from tests.tiny_targets import prepared_split, tiny_llama, write_vllm_captures

AUX_IDS = (1, 3, 4)  # vLLM convention; launch_vllm.py adds L = 6


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    root = tmp_path_factory.mktemp("speculators")
    model, data = tiny_llama(seed=4), prepared_split(9, seed=4)
    model.save_pretrained(root / "target", max_shard_size="20KB")  # a sharded checkpoint with an index
    data.add_column("seq_len", [len(r) for r in data["input_ids"]]).save_to_disk(str(root / "prepared"))
    write_vllm_captures(model, data, root / "hidden_states")
    return root, model, data


def test_import_reproduces_our_capture(captured, tmp_path):
    root, model, data = captured
    assert (root / "target" / "model.safetensors.index.json").exists()
    stats = import_speculators(
        root / "hidden_states",
        tmp_path,
        target_dir=root / "target",
        dataset_dir=root / "prepared",
        aux_layer_ids=AUX_IDS,
        dtype="float32",
        shard_max_tokens=40,
    )
    assert stats.samples == 9 and stats.shards_written > 1
    store = FeatureStore(tmp_path)
    assert store.header.aux_layer_ids == AUX_IDS and store.header.num_layers == 6
    with TargetFeatures(model, AUX_IDS) as feats:
        expected = run_target(feats, prepared_rows(data, range(9)), batch_tokens=1)
    for i, (got, want) in enumerate(zip(store.samples(range(9)), expected)):
        assert got.input_ids.tolist() == data[i]["input_ids"] and got.loss_mask.tolist() == data[i]["loss_mask"]
        torch.testing.assert_close(got.aux, want.aux, rtol=0, atol=0)
        torch.testing.assert_close(got.final, want.final, rtol=1e-6, atol=1e-6)  # final norm applied on import
    again = import_speculators(
        root / "hidden_states",
        tmp_path,
        target_dir=root / "target",
        dataset_dir=root / "prepared",
        aux_layer_ids=AUX_IDS,
        dtype="float32",
        shard_max_tokens=40,
    )
    assert again.shards_written == 0 and again.shards_skipped == stats.shards_written


def test_loss_masks_from_the_files_or_every_token(captured, tmp_path):
    root, model, data = captured
    with pytest.raises(ConfigError, match="holds no loss_mask"):
        import_speculators(root / "hidden_states", tmp_path / "a", target_dir=root / "target", aux_layer_ids=AUX_IDS)
    import_speculators(
        root / "hidden_states", tmp_path / "a", target_dir=root / "target", aux_layer_ids=AUX_IDS, all_tokens=True
    )
    assert all(s.loss_mask.all() for s in FeatureStore(tmp_path / "a").samples(range(9)))

    write_vllm_captures(model, data, tmp_path / "with_mask", with_loss_mask=True)
    import_speculators(tmp_path / "with_mask", tmp_path / "b", target_dir=root / "target", aux_layer_ids=AUX_IDS)
    got = FeatureStore(tmp_path / "b").samples(range(9))
    assert [s.loss_mask.tolist() for s in got] == data["loss_mask"]


def test_files_that_do_not_fit_are_refused(captured, tmp_path):
    root, model, data = captured
    with pytest.raises(ConfigError, match=r"shape \[\d+, 4, 32\], expected \[\d+, 3, 32\]"):
        import_speculators(root / "hidden_states", tmp_path / "a", target_dir=root / "target", aux_layer_ids=(1, 3))
    other = prepared_split(9, seed=5).add_column("seq_len", [0] * 9)
    other.save_to_disk(str(tmp_path / "other"))
    with pytest.raises(ConfigError, match=r"hs_0.safetensors: token_ids differ from row 0"):
        import_speculators(
            root / "hidden_states",
            tmp_path / "b",
            target_dir=root / "target",
            dataset_dir=tmp_path / "other",
            aux_layer_ids=AUX_IDS,
        )
    with pytest.raises(ConfigError, match="no hs_<i>.safetensors"):
        import_speculators(tmp_path / "other", tmp_path / "c", target_dir=root / "target", all_tokens=True)


def test_final_norm_weight_under_a_multimodal_prefix(tmp_path):
    weight = torch.arange(4.0)
    tensors = {"language_model.model.norm.weight": weight, "language_model.model.layers.0.x": weight.clone()}
    save_file(tensors, str(tmp_path / "a.safetensors"))
    assert torch.equal(final_norm_weight(tmp_path), weight)
    index = {"weight_map": {"lm_head.weight": "a.safetensors"}}  # a checkpoint without the norm
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match="no final norm weight"):
        final_norm_weight(tmp_path)


def test_a_garbage_file_is_one_error_naming_it_before_anything_is_written(captured, tmp_path):
    root, model, data = captured
    hs = tmp_path / "hidden_states"
    hs.mkdir()
    for f in (root / "hidden_states").iterdir():
        (hs / f.name).write_bytes(f.read_bytes())
    (hs / "hs_3.safetensors").write_bytes(b"\x00garbage from a failed copy" * 4)
    with pytest.raises(CorruptDataError, match=r"hs_3.safetensors: not a readable safetensors file"):
        import_speculators(hs, tmp_path / "store", target_dir=root / "target", aux_layer_ids=AUX_IDS, all_tokens=True)
    assert not (tmp_path / "store").exists()


# vLLM 0.33.0's own writer: the hidden states of each row go through the KV-cache layout of the
# `extract_hidden_states` drafter (`model_executor/models/extract_hidden_states.py::basic_cache`, [blocks, n slots,
# block size, Ht], block 0 the null block) and out through `ExampleHiddenStatesConnector`'s
# `extract_from_kv_cache` and `_write_tensors` (`distributed/kv_transfer/kv_connector/v1/
# example_hidden_states_connector.py`), with its `.lock` file beside; `load_hidden_states` reads it back. The
# model forward and the CUDA copy stream that fill the cache need a GPU: the rows come from
# `write_vllm_captures` (slots in `eagle_aux_hidden_state_layer_ids` order, the extra final-layer slot L last).
CONNECTOR_SCRIPT = r"""
import json, os, sys
import torch
from safetensors.torch import load_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector, extract_from_kv_cache, load_hidden_states)
from vllm.model_executor.models.extract_hidden_states import basic_cache

class CopyDone:  # the CUDA event _write_tensors waits on; the copy here is synchronous
    def synchronize(self):
        pass

src, out = sys.argv[1], sys.argv[2]
written = []
for name in sorted(os.listdir(src)):
    row = load_file(os.path.join(src, name))
    hs = row["hidden_states"]
    T, n, H = hs.shape
    block_size = 4
    blocks = (T + block_size - 1) // block_size + 2
    kv_cache = torch.zeros(blocks, n, block_size, H, dtype=hs.dtype)
    g = torch.Generator().manual_seed(T)
    slot_mapping = torch.randperm((blocks - 1) * block_size, generator=g)[:T] + block_size
    basic_cache(hs, kv_cache, slot_mapping)
    path = os.path.join(out, name)
    open(path + ".lock", "w").close()
    tensors = {"hidden_states": extract_from_kv_cache(kv_cache, slot_mapping, T), "token_ids": row["token_ids"].clone()}
    ExampleHiddenStatesConnector._write_tensors(tensors, CopyDone(), path, None)
    back = load_hidden_states(path)
    written.append([name, list(back["hidden_states"].shape), str(back["token_ids"].dtype)])
print(json.dumps({"written": written}))
"""


@pytest.mark.slow  # vLLM 0.33.0's own code in a subprocess
def test_files_written_by_vllm_0_33s_own_connector_import_as_our_capture(captured, tmp_path):
    from tests.peers import run_peer

    root, model, data = captured
    out = tmp_path / "vllm"
    out.mkdir()
    written = run_peer("0.33.0", CONNECTOR_SCRIPT, str(root / "hidden_states"), str(out))["written"]
    assert len(written) == 9 and all(shape[1:] == [4, 32] and dtype == "torch.int64" for _, shape, dtype in written)
    assert len(list(out.glob("*.lock"))) == 9  # the connector's lock files lie beside; the import skips them
    import_speculators(
        out,
        tmp_path / "store",
        target_dir=root / "target",
        dataset_dir=root / "prepared",
        aux_layer_ids=AUX_IDS,
        dtype="float32",
    )
    with TargetFeatures(model, AUX_IDS) as feats:
        expected = run_target(feats, prepared_rows(data, range(9)), batch_tokens=1)
    for got, want in zip(FeatureStore(tmp_path / "store").samples(range(9)), expected):
        torch.testing.assert_close(got.aux, want.aux, rtol=0, atol=0)  # slots 0..n-2: layer inputs, as is
        torch.testing.assert_close(got.final, want.final, rtol=1e-6, atol=1e-6)  # slot L: normed on import
