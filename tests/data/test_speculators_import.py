"""Import of speculators' vLLM captures: files written here in their layout, checked against our capture."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from eagle31.config import ConfigError
from eagle31.data.capture import prepared_rows, run_target
from eagle31.target import TargetFeatures
from eagle31.data.speculators_import import final_norm_weight, import_speculators
from eagle31.data.store import FeatureStore
from eagle31.errors import CorruptDataError
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
        root / "hidden_states", tmp_path, target_dir=root / "target", dataset_dir=root / "prepared",
        aux_layer_ids=AUX_IDS, dtype="float32", shard_max_tokens=40,
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
        root / "hidden_states", tmp_path, target_dir=root / "target", dataset_dir=root / "prepared",
        aux_layer_ids=AUX_IDS, dtype="float32", shard_max_tokens=40,
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
            root / "hidden_states", tmp_path / "b", target_dir=root / "target", dataset_dir=tmp_path / "other",
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
