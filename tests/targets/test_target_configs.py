"""The full-size target configs shipped for dry runs (recipes/targets/*.json)."""

from pathlib import Path

import pytest

from eagle31.config import DrafterConfig
from eagle31.target import load_target_config

TARGETS = Path(__file__).resolve().parents[2] / "recipes" / "targets"


@pytest.mark.parametrize(
    "name, layers, hidden, heads, kv_heads, head_dim, vocab, aux, rope_type",
    [
        ("kimi_k26", 61, 7168, 64, 64, 128, 163840, (2, 30, 58), "yarn"),
        ("llama31_8b", 32, 4096, 32, 8, 128, 128256, (2, 16, 29), "llama3"),
        ("qwen3_8b", 36, 4096, 32, 8, 128, 151936, (2, 18, 33), "default"),
        ("llama31_70b", 80, 8192, 64, 8, 128, 128256, (2, 40, 77), "llama3"),
        ("qwen3_30b_a3b", 48, 2048, 32, 4, 128, 151936, (2, 24, 45), "default"),
        ("gpt_oss_20b", 24, 2880, 64, 8, 64, 201088, (2, 12, 21), "yarn"),
        ("gpt_oss_120b", 36, 2880, 64, 8, 64, 201088, (2, 18, 33), "yarn"),
        ("deepseek_v3", 61, 7168, 128, 128, 128, 129280, (2, 30, 58), "yarn"),
    ],
)
def test_drafter_derives_from_each_config(name, layers, hidden, heads, kv_heads, head_dim, vocab, aux, rope_type):
    cfg = DrafterConfig.from_target_config(load_target_config(TARGETS / f"{name}.json"))
    assert (cfg.target_num_layers, cfg.hidden_size, cfg.num_attention_heads) == (layers, hidden, heads)
    assert (cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size) == (kv_heads, head_dim, vocab)
    assert cfg.aux_layer_ids == aux and cfg.rope_parameters["rope_type"] == rope_type


def test_kimi_k26_is_a_deepseek_v3_text_config_with_kimi_moe_and_yarn():
    text = load_target_config(TARGETS / "kimi_k26.json")["text_config"]
    assert text["model_type"] == "deepseek_v3"
    assert (text["n_routed_experts"], text["num_experts_per_tok"], text["n_shared_experts"]) == (384, 8, 1)
    assert (text["first_k_dense_replace"], text["moe_intermediate_size"], text["intermediate_size"]) == (1, 2048, 18432)
    assert (text["q_lora_rank"], text["kv_lora_rank"], text["qk_rope_head_dim"], text["qk_nope_head_dim"]) == (
        1536,
        512,
        64,
        128,
    )
    assert (text["rope_scaling"]["mscale"], text["rope_scaling"]["mscale_all_dim"]) == (1.0, 1.0)
    # a Llama-attention drafter keeps the yarn block without DeepSeek's mscale fields (the rope vLLM serves)
    rope = DrafterConfig.from_target_config(text).rope_parameters
    assert rope == {
        "rope_type": "yarn",
        "rope_theta": 50000.0,
        "factor": 64.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
    }
    assert text["max_position_embeddings"] == 262144
