"""The miniature Kimi K2.6: Kimi's architecture features, offline loading, determinism."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from eagle31.config import DrafterConfig
from eagle31.io import sha256_file
from eagle31.target import load_target_config
from eagle31.targets.kimi_mini import KIMI_YARN, build_kimi_k26_mini, ensure_kimi_k26_mini


@pytest.fixture(scope="module")
def mini():
    path = ensure_kimi_k26_mini()
    return path, AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def test_loads_offline_as_deepseek_v3_with_the_kimi_tokenizer(mini):
    _, model, tok = mini
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    assert model.config.vocab_size == len(tok)
    assert model.config.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|><think>")


def test_mla_dense_first_layer_moe_with_shared_experts(mini):
    _, model, _ = mini
    cfg = model.config
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == (
        32,
        16,
        16,
        8,
        16,
    )
    attn = model.model.layers[0].self_attn
    assert attn.q_a_proj.out_features == cfg.q_lora_rank  # low-rank query
    assert attn.kv_a_proj_with_mqa.out_features == cfg.kv_lora_rank + cfg.qk_rope_head_dim  # compressed kv + rope key
    layers = model.model.layers
    assert len(layers) == 8 and cfg.first_k_dense_replace == 1
    assert type(layers[0].mlp).__name__ == "DeepseekV3MLP"
    for layer in layers[1:]:
        moe = layer.mlp
        assert type(moe).__name__ == "DeepseekV3MoE"
        assert moe.experts.gate_up_proj.shape[0] == cfg.n_routed_experts == 8
        assert moe.gate.top_k == 2 and cfg.n_shared_experts == 1
        assert moe.shared_experts.down_proj.in_features == cfg.moe_intermediate_size


def test_yarn_rope_as_kimi_configures_it(mini):
    path, model, _ = mini
    assert {k: model.config.rope_parameters[k] for k in KIMI_YARN} == KIMI_YARN
    assert model.config.max_position_embeddings == 262144
    rotary = model.model.rotary_emb
    d = model.config.qk_rope_head_dim
    plain = 1.0 / KIMI_YARN["rope_theta"] ** (torch.arange(0, d, 2).float() / d)
    assert rotary.rope_type == "yarn" and not torch.allclose(rotary.inv_freq, plain)  # low frequencies interpolated
    mscale = 0.1 * KIMI_YARN["mscale_all_dim"] * math.log(KIMI_YARN["factor"]) + 1.0
    attn = model.model.layers[0].self_attn
    assert attn.scaling == pytest.approx(model.config.qk_head_dim**-0.5 * mscale**2)  # yarn's softmax scale
    # the drafter derived from it gets Kimi's rope and distinct default aux ids
    drafter = DrafterConfig.from_target_config(load_target_config(path))
    assert drafter.rope_parameters["rope_type"] == "yarn" and drafter.aux_layer_ids == (2, 4, 5)


def test_forward_is_finite_and_not_uniform(mini):
    _, model, tok = mini
    ids = tok("def add(a, b):\n    return a + b", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    assert len(out.hidden_states) == 9 and torch.isfinite(out.logits).all()
    assert out.logits.softmax(-1).max(-1).values.mean() > 5 / len(tok)  # argmax comparisons mean something


def test_building_twice_gives_identical_files(tmp_path):
    a, b = build_kimi_k26_mini(tmp_path / "a"), build_kimi_k26_mini(tmp_path / "b")
    files = sorted(p.name for p in a.iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= set(files)
    assert files == sorted(p.name for p in b.iterdir())
    assert all(sha256_file(a / f) == sha256_file(b / f) for f in files)
    c = build_kimi_k26_mini(tmp_path / "c", seed=1)
    assert sha256_file(c / "model.safetensors") != sha256_file(a / "model.safetensors")
