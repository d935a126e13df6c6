"""DrafterConfig: derivation from target configs and one clear error per bad field."""

import pytest
from transformers import DeepseekV3Config, LlamaConfig, Qwen3Config

from eagle31 import ConfigError, DrafterConfig
from tests.helpers import tiny_config


def test_from_llama_config_copies_layer_shape_rope_and_default_aux_ids():
    t = LlamaConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    c = DrafterConfig.from_target_config(t)
    assert (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (4096, 32, 8, 128)
    assert c.intermediate_size == 14336 and c.rms_norm_eps == 1e-5 and c.max_position_embeddings == 131072
    assert c.rope_parameters["rope_type"] == "llama3" and c.rope_parameters["rope_theta"] == 500000.0
    assert c.aux_layer_ids == (2, 16, 29)  # (2, L//2, L-3), vLLM convention
    assert (c.vocab_size, c.draft_vocab_size, c.target_hidden_size) == (128256, 32000, 4096)
    assert c.fc_norm and c.norm_output and not c.norm_before_fc and not c.norm_before_residual


def test_from_qwen3_config_takes_explicit_head_dim():
    t = Qwen3Config(
        hidden_size=4096,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=12288,
        num_hidden_layers=36,
        vocab_size=151936,
    )
    c = DrafterConfig.from_target_config(t, draft_vocab_size=16000)
    assert c.head_dim == 128 and c.aux_layer_ids == (2, 18, 33) and c.draft_vocab_size == 16000


def test_from_kimi_style_nested_deepseek_v3_config_with_yarn():
    text = DeepseekV3Config(
        hidden_size=7168,
        num_hidden_layers=61,
        num_attention_heads=64,
        num_key_value_heads=64,
        intermediate_size=18432,
        vocab_size=163840,
        v_head_dim=128,
        qk_rope_head_dim=64,
        max_position_embeddings=262144,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 50000.0,
            "factor": 64.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 1.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    ).to_dict()
    wrapper = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": text}
    c = DrafterConfig.from_target_config(wrapper, intermediate_size=12288)
    assert c.aux_layer_ids == (2, 30, 58)
    assert (c.num_attention_heads, c.head_dim, c.intermediate_size) == (64, 128, 12288)
    assert c.rope_parameters["rope_type"] == "yarn" and c.rope_parameters["factor"] == 64.0
    assert c.target_architectures == ("KimiK25ForConditionalGeneration",)


def test_legacy_rope_scaling_is_read():
    t = {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 8,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "vocab_size": 1000,
        "rope_theta": 50000.0,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
    }
    c = DrafterConfig.from_target_config(t)
    assert c.rope_parameters == {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 512,
        "rope_theta": 50000.0,
    }


def test_round_trip_through_dict():
    c = tiny_config(fc_norm=False, norm_output=False)
    assert DrafterConfig.from_dict(c.to_dict()) == c


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(fc_norm=True, norm_before_fc=True), "norm_before_fc"),
        (dict(aux_layer_ids=(2, 4, 8)), "aux_layer_ids"),
        (dict(aux_layer_ids=(-1, 4, 5)), "aux_layer_ids"),
        (dict(aux_layer_ids=(2, 2, 5)), "aux_layer_ids"),
        (dict(aux_layer_ids=(5, 2, 4)), "aux_layer_ids"),
        (dict(aux_layer_ids=()), "aux_layer_ids"),
        (dict(draft_vocab_size=41), "draft_vocab_size"),
        (dict(num_key_value_heads=3), "num_key_value_heads"),
        (dict(hidden_size=0), "hidden_size"),
        (dict(intermediate_size=-4), "intermediate_size"),
        (dict(head_dim=0), "head_dim"),
        (dict(num_attention_heads=0), "num_attention_heads"),
        (dict(rms_norm_eps=0.0), "rms_norm_eps"),
        (dict(rope_parameters={"rope_type": "default"}), "rope_parameters"),
        (dict(sliding_window=0), "sliding_window"),
        (dict(sliding_window=True), "sliding_window"),
        (dict(sliding_window=2.5), "sliding_window"),
    ],
)
def test_bad_config_is_one_clear_error_naming_the_field(overrides, field):
    with pytest.raises(ConfigError) as e:
        tiny_config(**overrides)
    assert field in str(e.value) and "\n" not in str(e.value)


def test_unknown_override_is_rejected():
    t = LlamaConfig(hidden_size=64, num_hidden_layers=8, num_attention_heads=4, intermediate_size=128, vocab_size=100)
    with pytest.raises(ConfigError, match="norm_outputs"):
        DrafterConfig.from_target_config(t, norm_outputs=True)


def test_missing_or_malformed_config_json_is_one_line_naming_the_file(tmp_path):
    from eagle31.convert import load_drafter
    from eagle31.target import load_target_config

    with pytest.raises(ConfigError, match=f"target config not found: {tmp_path}/config.json"):
        load_target_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    for call, what in ((load_target_config, "target config"), (load_drafter, "drafter config")):
        with pytest.raises(ConfigError, match=f"{what} {tmp_path}/config.json is not valid JSON") as e:
            call(tmp_path)
        assert "\n" not in str(e.value)


def test_config_rope_and_target_import_no_circle():
    """eagle31.config, eagle31.rope and eagle31.target import each other one way only, function-level imports
    included (a circle there works only while every import in it stays lazy)."""
    import ast
    from pathlib import Path

    package = Path(__file__).resolve().parents[1] / "eagle31"
    modules = ("config", "rope", "target", "errors")
    imports = {}
    for name in modules:
        tree = ast.parse((package / f"{name}.py").read_text())
        found = {
            node.module.split(".")[1]
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("eagle31.")
        }
        imports[name] = found & set(modules)

    def reaches(start, goal, seen=()):
        return any(m == goal or (m not in seen and reaches(m, goal, (*seen, m))) for m in imports[start])

    assert not [m for m in modules if reaches(m, m)], imports
