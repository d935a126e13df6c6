"""export_drafter: round trips through both layouts, and the checks that run before anything is written."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle31 import ConfigError
from eagle31.convert import load_drafter
from eagle31.export import export_drafter, export_options
from eagle31.io import OUTPUT_MARKER
from eagle31.layouts import layout_of
from tests.helpers import random_batch, tiny_drafter

FORMATS = ("eagle3", "speculators")


def logits(m, seed=0, K=3):
    aux, _, ids, _ = random_batch(m.config, 2, 7, seed=seed, dtype=torch.float32)
    return m(aux, ids, ttt_length=K)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    "switches", [dict(), dict(fc_norm=False, norm_output=False), dict(draft_vocab_size=40), dict(sliding_window=4)]
)
def test_round_trip_gives_bit_identical_logits_and_config(tmp_path, fmt, switches):
    m = tiny_drafter(seed=1, dtype=torch.float32, target_name_or_path="org/target", **switches)
    loaded = load_drafter(export_drafter(m, tmp_path / fmt, fmt, dtype="float32"))
    assert loaded.config == m.config
    loaded.embed_tokens.weight.data.copy_(m.embed_tokens.weight)  # vLLM shares the target's
    for a, b in zip(logits(m), logits(loaded)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fmt", FORMATS)
def test_bf16_export_round_trips_the_rounded_weights_exactly(tmp_path, fmt):
    m = tiny_drafter(seed=2, dtype=torch.float32)
    loaded = load_drafter(export_drafter(m, tmp_path / fmt, fmt, include_embed=True, target_name_or_path="org/t"))
    rounded = m.to(torch.bfloat16).float()
    for a, b in zip(logits(rounded), logits(loaded)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_sliding_window_is_written_where_vllm_reads_a_draft_layers_window(tmp_path, fmt):
    """`sliding_window` with `layer_types: [sliding_attention]` in the layer's fields (the speculators layout's
    transformer_layer_config); a full-attention drafter writes neither."""
    windowed = export_drafter(tiny_drafter(sliding_window=6), tmp_path / "w", fmt, target_name_or_path="org/t")
    full = export_drafter(tiny_drafter(), tmp_path / "f", fmt, target_name_or_path="org/t")
    layer = lambda cfg: cfg["transformer_layer_config"] if fmt == "speculators" else cfg  # noqa: E731
    cfg = json.loads((windowed / "config.json").read_text())
    assert (layer(cfg)["sliding_window"], layer(cfg)["layer_types"]) == (6, ["sliding_attention"])
    assert not {"sliding_window", "layer_types"} & set(json.loads((full / "config.json").read_text()))


def test_an_mla_drafter_with_a_window_is_refused_in_one_line(tmp_path):
    from tests.test_mla import mla_drafter

    m = mla_drafter(sliding_window=8)
    with pytest.raises(
        ConfigError, match="sliding_window=8 cannot be served: vLLM builds an MLA drafter's attention without a window"
    ) as e:
        export_drafter(m, tmp_path / "out", "eagle3")
    assert "\n" not in str(e.value) and not (tmp_path / "out").exists()


def test_rename_table_is_the_only_difference_between_layouts():
    eagle3, speculators = layout_of("eagle3"), layout_of("speculators")
    assert speculators.key("midlayer.mlp.up_proj.weight") == "layers.0.mlp.up_proj.weight"
    assert speculators.key("fc_norm.2.weight") == "fc_norm.2.weight"
    assert eagle3.key("midlayer.hidden_norm.weight") == "midlayer.hidden_norm.weight"
    for layout in (eagle3, speculators):  # vLLM's loaders read the layer under either name
        assert layout.native_key("layers.0.self_attn.q_proj.weight") == "midlayer.self_attn.q_proj.weight"
        assert layout.native_key(layout.key("midlayer.mlp.up_proj.weight")) == "midlayer.mlp.up_proj.weight"


def test_max_positions_are_raised_to_the_trained_context_without_changing_a_yarn_rope(tmp_path):
    rope = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0}
    m = tiny_drafter(seed=1, dtype=torch.float32, rope_parameters=rope, max_position_embeddings=64)
    out = export_drafter(m, tmp_path / "e", dtype="float32", trained_context=300)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["max_position_embeddings"] == 300
    assert cfg["rope_parameters"]["original_max_position_embeddings"] == 64
    loaded = load_drafter(out)
    loaded.embed_tokens.weight.data.copy_(m.embed_tokens.weight)
    aux, _, ids, _ = random_batch(m.config, 1, 8, dtype=torch.float32)
    pos = torch.arange(8)[None] + 200  # far positions, where yarn's frequencies matter
    for a, b in zip(m(aux, ids, ttt_length=2, position_ids=pos), loaded(aux, ids, ttt_length=2, position_ids=pos)):
        assert torch.equal(a, b)


def test_max_positions_already_enough_are_kept(tmp_path):
    m = tiny_drafter(seed=1, max_position_embeddings=4096)
    cfg = json.loads((export_drafter(m, tmp_path / "e", trained_context=2048) / "config.json").read_text())
    assert cfg["max_position_embeddings"] == 4096 and "original_max_position_embeddings" not in cfg["rope_parameters"]


def bad_vocab(m):
    m.d2t[3] = m.d2t[3] + 1  # two draft ids collide or leave t2d behind


@pytest.mark.parametrize(
    "mutate, kwargs, message",
    [
        (None, dict(format="eagle2"), "export format"),
        (None, dict(dtype="int8"), "export.dtype"),
        (None, dict(num_speculative_tokens=0), "num_speculative_tokens"),
        (None, dict(trained_context=-5), "trained_context"),
        (bad_vocab, {}, "d2t|t2d"),
        (lambda m: m.embed_tokens.weight.data.zero_(), dict(include_embed=True), "all zeros"),
    ],
)
def test_bad_input_fails_before_anything_is_written(tmp_path, mutate, kwargs, message):
    m = tiny_drafter(seed=1, dtype=torch.float32)
    if mutate:
        with torch.no_grad():
            mutate(m)
    with pytest.raises(ConfigError, match=message):
        export_drafter(m, tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()


def saved_embedding(out):
    return load_file(str(out / "model.safetensors")).get("embed_tokens.weight")


def test_the_speculators_layout_carries_the_embedding_by_default_and_the_hf_layout_shares_the_targets(tmp_path):
    m = tiny_drafter(seed=1, dtype=torch.float32, target_name_or_path="org/target")
    assert torch.equal(
        saved_embedding(export_drafter(m, tmp_path / "s", "speculators", dtype="float32")), m.embed_tokens.weight
    )
    assert saved_embedding(export_drafter(m, tmp_path / "e", "eagle3")) is None
    assert saved_embedding(export_drafter(m, tmp_path / "s2", "speculators", include_embed=False)) is None
    with torch.no_grad():
        m.embed_tokens.weight.zero_()  # a checkpoint saved without it
    with pytest.raises(ConfigError, match="speculators layout carries it by default.*include_embed=false"):
        export_drafter(m, tmp_path / "s3", "speculators")


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_drafter_narrower_than_its_target_always_carries_its_own_embedding(tmp_path, fmt):
    m = tiny_drafter(seed=1, dtype=torch.float32, target_hidden_size=24, target_name_or_path="org/target")
    out = export_drafter(m, tmp_path / fmt, fmt, dtype="float32")
    assert torch.equal(saved_embedding(out), m.embed_tokens.weight)  # [V, H], not the target's [V, Ht]
    with pytest.raises(ConfigError, match="hidden_size=16 differs from target_hidden_size=24"):
        export_drafter(m, tmp_path / "no", fmt, include_embed=False)
    with torch.no_grad():
        m.embed_tokens.weight.zero_()
    with pytest.raises(ConfigError, match="cannot share the target's"):
        export_drafter(m, tmp_path / "zero", fmt)
    assert not (tmp_path / "no").exists() and not (tmp_path / "zero").exists()


def test_the_speculators_layout_needs_the_targets_name(tmp_path):
    m = tiny_drafter(seed=1)
    assert m.config.target_name_or_path is None
    with pytest.raises(ConfigError, match="verifier.name_or_path.*target="):
        export_drafter(m, tmp_path / "s", "speculators")
    assert not (tmp_path / "s").exists()
    cfg = json.loads(
        (export_drafter(m, tmp_path / "s", "speculators", target_name_or_path="org/t") / "config.json").read_text()
    )
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "org/t"


def snapshot(folder):
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_an_earlier_export_is_replaced_only_when_asked_and_leaves_nothing_stale(tmp_path):
    out = tmp_path / "out"
    m = tiny_drafter(seed=1, target_name_or_path="org/t")
    export_drafter(m, out, "speculators")
    (out / "README.md").write_text("card of the speculators export")  # scripts/push_to_hub.py's card
    before = snapshot(out)
    with pytest.raises(ConfigError, match="already holds an eagle31 export; pass overwrite=true"):
        export_drafter(m, out, "eagle3")
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"files eagle31 did not write \['notes.txt'\]"):
        export_drafter(m, out, "eagle3", overwrite=True)
    assert snapshot(out) == {**before, Path("notes.txt"): b"mine"}  # refused: nothing touched
    (out / "notes.txt").unlink()
    export_drafter(m, out, "eagle3", overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == [OUTPUT_MARKER, "config.json", "model.safetensors"]
    assert "speculators_model_type" not in json.loads((out / "config.json").read_text())


def test_a_folder_that_eagle31_did_not_write_is_never_replaced(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "model-00001-of-00002.safetensors").write_bytes(b"user weights")
    for overwrite in (False, True):
        with pytest.raises(ConfigError, match="files that eagle31 did not write"):
            export_drafter(tiny_drafter(seed=1), out, overwrite=overwrite)
    assert snapshot(out) == {Path("model-00001-of-00002.safetensors"): b"user weights"}


def test_the_source_drafter_is_never_the_output(tmp_path):
    m = tiny_drafter(seed=1)
    m.save(tmp_path / "run" / "drafter")
    before = snapshot(tmp_path / "run")
    for out in (tmp_path / "run" / "drafter", tmp_path / "run"):
        with pytest.raises(ConfigError, match="is or holds the drafter being exported"):
            export_drafter(m, out, overwrite=True, source=tmp_path / "run" / "drafter")
    assert snapshot(tmp_path / "run") == before


def test_export_options_follow_the_run_config():
    run = {
        "target": {"name": "moonshotai/Kimi-K2.6"},
        "data": {"max_len": 8192},
        "export": {"dtype": "float16", "include_embed": True},
        "eval": {"num_speculative_tokens": 4},
    }
    assert export_options(run) == dict(
        dtype="float16",
        include_embed=True,
        trained_context=8192,
        num_speculative_tokens=4,
        target_name_or_path="moonshotai/Kimi-K2.6",
    )
