"""The export layouts as objects (`eagle31.layouts`): every format is one `Layout`, every switch goes through
every layout without a line of its own, and a new layout is one file and its line in `LAYOUTS`
(docs/architecture.md, "How to add")."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from eagle31.config import SWITCHES, DrafterConfig
from eagle31.convert import detect_format, load_drafter, read_drafter_config
from eagle31.export import export_drafter
from eagle31.hub import write_model_card
from eagle31.layouts import LAYOUTS, DrafterFormat, ExportFormat, Layout, layout_of, source_formats
from eagle31.layouts.layout import eagle_fields, layer_fields, provenance, read_eagle, read_layer
from tests.export.test_export import logits
from tests.helpers import tiny_drafter


def test_every_export_format_is_a_layout_and_each_layout_a_format():
    assert set(LAYOUTS) == set(ExportFormat)
    assert all(layout_of(fmt) is LAYOUTS[fmt] and layout_of(fmt).name == fmt for fmt in ExportFormat)
    assert list(DrafterFormat) == ["auto", "eagle31", *source_formats()]  # every layout is read back by name


def flipped(name: str) -> dict[str, bool]:
    """A drafter config with switch `name` off its default (and what that needs: fc_norm excludes norm_before_fc)."""
    value = not DrafterConfig.__dataclass_fields__[name].default
    return {name: value, **({"fc_norm": False} if name == "norm_before_fc" and value else {})}


@pytest.mark.parametrize("fmt", list(ExportFormat))
@pytest.mark.parametrize("switch", SWITCHES)
def test_every_switch_is_written_and_read_back_by_every_layout(tmp_path, fmt, switch):
    """`SWITCHES` is all a layout writes and reads back of them: a new switch there needs no line in a layout."""
    m = tiny_drafter(seed=1, dtype=torch.float32, target_name_or_path="org/target", **flipped(switch))
    out = export_drafter(m, tmp_path / fmt, fmt, dtype="float32")
    assert json.loads((out / "config.json").read_text())[switch] == getattr(m.config, switch)
    assert read_drafter_config(out) == m.config


# ----------------------------------------------------------------- a new layout from this module alone


class FlatLayout(Layout):
    """A toy format: the decoder layer's weights under `decoder.`, its HF config under `layer`, and the EAGLE
    fields and eagle31's block beside it; `flat_format` marks its configs."""

    name = "flat"
    library_name = "flatlib"
    card_name = "flat layout (`flat_format: 1`)"
    min_vllm = "9.9"
    layer_prefix = "decoder."

    def recognises(self, meta: dict[str, Any]) -> bool:
        return "flat_format" in meta

    def config(self, config, *, dtype, trained_context, num_speculative_tokens, target) -> dict[str, Any]:
        return {
            "flat_format": 1,
            "layer": layer_fields(config, dtype, trained_context),
            **eagle_fields(config),
            **provenance(config, target),
        }

    def native_key(self, key: str) -> str:
        return "midlayer." + key[len(self.layer_prefix) :] if key.startswith(self.layer_prefix) else key

    def read(self, meta: dict[str, Any]) -> dict[str, Any]:
        layer = read_layer(meta["layer"])
        return {**layer, **read_eagle(meta, layer, switch_defaults={})}


@pytest.mark.parametrize("overrides", [dict(), dict(fc_norm=False, norm_output=False, draft_vocab_size=40)])
def test_a_layout_defined_in_one_module_exports_and_reads_back_exactly(tmp_path, overrides):
    m = tiny_drafter(seed=2, dtype=torch.float32, target_name_or_path="org/target", **overrides)
    out = export_drafter(m, tmp_path / "flat", FlatLayout(), dtype="float32", trained_context=512)
    meta = json.loads((out / "config.json").read_text())
    assert meta["flat_format"] == 1 and meta["layer"]["max_position_embeddings"] == 512
    names = set(load_file(str(out / "model.safetensors")))
    assert "decoder.self_attn.q_proj.weight" in names and not any(n.startswith("midlayer.") for n in names)
    loaded = load_drafter(out, source_format=FlatLayout())
    assert loaded.config == dataclasses.replace(m.config, max_position_embeddings=512)
    assert read_drafter_config(out, source_format=FlatLayout()) == loaded.config
    loaded.embed_tokens.weight.data.copy_(m.embed_tokens.weight)  # shared with the target, as in vLLM
    for a, b in zip(logits(m), logits(loaded)):
        assert torch.equal(a, b)


def test_a_layout_and_its_line_in_layouts_are_a_format_by_name_detected_and_described(tmp_path, monkeypatch):
    """All a new format needs beyond its module: export, reading by name and by detection, and its model card."""
    monkeypatch.setitem(LAYOUTS, FlatLayout.name, FlatLayout())  # its line in LAYOUTS (restored after the test)
    m = tiny_drafter(seed=3, dtype=torch.float32, target_name_or_path="org/target")  # a reduced vocabulary
    out = export_drafter(m, tmp_path / "flat", "flat", dtype="float32")
    assert json.loads((out / "config.json").read_text())["flat_format"] == 1
    assert detect_format(json.loads((out / "config.json").read_text())) == "flat"
    by_name, detected = load_drafter(out, source_format="flat"), load_drafter(out)
    assert by_name.config == detected.config == m.config == read_drafter_config(out)
    detected.embed_tokens.weight.data.copy_(m.embed_tokens.weight)  # shared with the target, as in vLLM
    for a, b in zip(logits(m), logits(detected)):
        assert torch.equal(a, b)
    card = write_model_card(out, "me/flat", {"eval": {"num_speculative_tokens": 4}}).read_text()
    assert "library_name: flatlib" in card and "stored in vLLM's flat layout (`flat_format: 1`)." in card
    assert "Needs vLLM >= 9.9." in card and '"num_speculative_tokens": 4' in card
    assert f"draft vocabulary {m.config.draft_vocab_size} of the target's {m.config.vocab_size} tokens (`d2t`" in card
