"""Exports against the loader contract of vLLM 0.33.0 (tests/export/vllm_contract.py), where vLLM's own code needs a
GPU; tests/export/test_vllm_peers.py runs what it can on a CPU from 0.22.0 and 0.33.0.

Both layouts, fc_norm on and off, Vd < V and Vd == V, more than 3 aux ids, Ht != H,
norm_before_residual, norm_before_fc, yarn and llama3 ropes: config fields as vLLM reads
them, weight names after vLLM's mapping, shapes, and the per-step logits vLLM would compute
from the files (its rope included).
"""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoConfig

from eagle31.export import export_drafter
from tests.export import vllm_contract as vllm
from tests.helpers import random_batch, tiny_drafter

CASES = {
    "eagle31": {},
    "eagle3_plain": dict(fc_norm=False, norm_output=False),
    "full_vocab": dict(draft_vocab_size=40),
    "four_aux": dict(aux_layer_ids=(1, 3, 5, 6)),
    "wide_target": dict(target_hidden_size=24),
    "norm_before_residual": dict(norm_before_residual=True),
    "norm_before_fc": dict(fc_norm=False, norm_before_fc=True, norm_output=False),
    # Kimi K2.6's yarn as a Llama drafter carries it (no DeepSeek mscale fields): magnitude 1.416 in vLLM
    "kimi_yarn": dict(
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 50000.0,
            "factor": 64.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
        }
    ),
    "llama3_rope": dict(
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    ),
    # the window cuts the 6-position sequence of the numerics test at every step (step 2: 2 step-0 keys)
    "sliding_window": dict(sliding_window=4),
}
FORMATS = ("eagle3", "speculators")
TRAINED_CONTEXT = 1024


def export(tmp_path, case, fmt, **kwargs):
    m = tiny_drafter(seed=3, dtype=torch.float32, **CASES[case])
    kwargs.setdefault("target_name_or_path", "org/target")
    out = export_drafter(m, tmp_path / fmt, fmt, dtype="float32", trained_context=TRAINED_CONTEXT, **kwargs)
    return m, json.loads((out / "config.json").read_text()), load_file(str(out / "model.safetensors")), out


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", CASES)
def test_vllm_reads_the_drafters_settings(tmp_path, case, fmt):
    m, cfg, _, _ = export(tmp_path, case, fmt)
    c = m.config
    view = vllm.hf_config_view(cfg)
    assert vllm.model_class(view) == "Eagle3LlamaForCausalLM"
    s = vllm.effective_settings(view)
    assert s["aux_layer_ids"] == c.aux_layer_ids  # vLLM convention, verbatim
    assert s["num_aux"] == c.num_aux
    assert s["target_hidden_size"] == c.target_hidden_size  # never null
    assert (s["draft_vocab_size"], s["vocab_size"]) == (c.draft_vocab_size, c.vocab_size)
    for flag in ("fc_norm", "norm_output", "norm_before_residual", "norm_before_fc", "sliding_window"):
        assert s[flag] == getattr(c, flag), flag
    assert s["max_position_embeddings"] >= TRAINED_CONTEXT


@pytest.mark.parametrize("fmt", FORMATS)
def test_switches_are_written_even_when_false_and_never_left_to_defaults(tmp_path, fmt):
    _, cfg, _, _ = export(tmp_path, "eagle3_plain", fmt)
    # vLLM reads these at the top level in both layouts; its defaults differ per layout
    for flag in ("fc_norm", "norm_output", "norm_before_residual", "norm_before_fc"):
        assert flag in cfg and cfg[flag] is False
    assert "target_hidden_size" not in cfg and "target_hidden_size" not in cfg.get("transformer_layer_config", {})
    assert "eagle_config" not in cfg  # SGLang would read nested ids as "output of layer k"
    layer = cfg.get("transformer_layer_config", cfg)
    assert layer["num_aux_hidden_states"] == 3


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", CASES)
def test_weight_names_and_shapes_match_what_vllm_builds(tmp_path, case, fmt):
    m, cfg, tensors, _ = export(tmp_path, case, fmt)
    prefix = "midlayer." if fmt == "eagle3" else "layers.0."
    assert all(k.startswith(prefix) for k in tensors if "_proj" in k or "layernorm" in k or "hidden_norm" in k)
    expected = vllm.expected_params(vllm.hf_config_view(cfg))
    loaded = vllm.loaded_shapes(tensors)
    assert set(loaded) <= set(expected), set(loaded) - set(expected)
    # the embedding: carried by the speculators layout and by a drafter narrower than its target, else shared
    carries_embed = fmt == "speculators" or m.config.target_hidden_size != m.config.hidden_size
    assert set(expected) - set(loaded) == (set() if carries_embed else {"model.embed_tokens.weight"})
    for name, shape in loaded.items():
        assert shape == expected[name], name
    if m.config.draft_vocab_size == m.config.vocab_size:  # vLLM 0.33 builds no map and refuses one
        assert "d2t" not in tensors and "t2d" not in tensors
    else:
        assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
        assert torch.equal(tensors["d2t"], m.d2t)


@pytest.mark.parametrize("fmt", FORMATS)
def test_weights_are_cast_and_readable_by_transformers_based_loaders(tmp_path, fmt):
    m = tiny_drafter(seed=3, dtype=torch.float32)
    out = export_drafter(m, tmp_path / fmt, fmt, include_embed=True, target_name_or_path="org/target")  # bf16
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert f.get_tensor("fc.weight").dtype == torch.bfloat16
        assert f.get_tensor("embed_tokens.weight").shape == (40, 16)
    cfg = json.loads((out / "config.json").read_text())
    layer = cfg.get("transformer_layer_config", cfg)
    assert layer["dtype"] == layer["torch_dtype"] == "bfloat16"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 500000.0},
        {
            "rope_type": "yarn",
            "rope_theta": 50000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
        },
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ],
)
def test_transformers_4_and_5_readers_get_the_same_rope(tmp_path, fmt, rope):
    m = tiny_drafter(seed=3, dtype=torch.float32, rope_parameters=rope)
    out = export_drafter(m, tmp_path / fmt, fmt, target_name_or_path="org/target")
    view = vllm.hf_config_view(json.loads((out / "config.json").read_text()))
    assert vllm.rope_v5(view) == rope
    assert vllm.rope_v4(view) == rope


@pytest.mark.parametrize("case", ["eagle31", "four_aux", "wide_target"])
def test_transformers_autoconfig_parses_the_hf_layout_as_vllm_does(tmp_path, case):
    """vLLM parses the HF layout with transformers' AutoConfig; every eagle field must survive it."""
    m, _, _, out = export(tmp_path, case, "eagle3")
    parsed = AutoConfig.from_pretrained(out)
    assert type(parsed).__name__ == "LlamaConfig"
    s = vllm.effective_settings(parsed.to_dict())
    c = m.config
    assert (s["num_aux"], s["aux_layer_ids"], s["target_hidden_size"]) == (
        c.num_aux,
        c.aux_layer_ids,
        c.target_hidden_size,
    )
    assert (parsed.fc_norm, parsed.norm_output, parsed.draft_vocab_size) == (
        c.fc_norm,
        c.norm_output,
        c.draft_vocab_size,
    )
    assert parsed.rope_parameters == m.config.rope_parameters


def test_speculators_layout_names_the_verifier_and_k(tmp_path):
    m = tiny_drafter(seed=3, dtype=torch.float32, target_architectures=("DeepseekV3ForCausalLM",))
    out = export_drafter(m, tmp_path / "s", "speculators", num_speculative_tokens=5, target_name_or_path="org/target")
    cfg = json.loads((out / "config.json").read_text())
    assert "model_type" not in cfg and cfg["transformer_layer_config"]["model_type"] == "llama"
    assert vllm.speculative_config(cfg) == {"method": "eagle3", "num_speculative_tokens": 5}
    assert cfg["speculators_config"]["verifier"] == {
        "name_or_path": "org/target",
        "architectures": ["DeepseekV3ForCausalLM"],
    }
    assert cfg["speculators_config"]["algorithm"] == "eagle3"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", [c for c in CASES if c != "full_vocab"])
def test_vllm_numerics_on_the_exported_files_match_the_drafter(tmp_path, case, fmt):
    """What vLLM computes from config.json + model.safetensors is the drafter's TTT chain."""
    K, T = 3, 6
    m, cfg, tensors, _ = export(tmp_path, case, fmt)
    m = m.double()
    aux, _, ids, _ = random_batch(m.config, 1, T, seed=5)
    ours = m(aux, ids, ttt_length=K)
    c = m.config
    # the target's embedding as vLLM would share it: the drafter's own when the widths agree (training froze
    # the target's into it), another [V, Ht] matrix when they differ
    target_embed = (
        m.embed_tokens.weight
        if c.target_hidden_size == c.hidden_size
        else torch.randn(c.vocab_size, c.target_hidden_size)
    )
    embed = vllm.drafter_embedding(cfg, tensors, target_embed)
    theirs = vllm.chain_logits(cfg, tensors, embed.double(), aux[0], ids[0], K)
    draft_ids = m.draft_token_ids()
    for k in range(K):
        torch.testing.assert_close(theirs[k][:, draft_ids], ours[k][0], rtol=1e-4, atol=1e-4)
        outside = torch.ones(m.config.vocab_size, dtype=torch.bool)
        outside[draft_ids] = False
        assert torch.isinf(theirs[k][:, outside]).all()


def test_the_contract_sees_the_known_failure_modes():
    """The contract's reading of a config that omits what eagle31 always writes."""
    bare = {
        "hidden_size": 16,
        "vocab_size": 40,
        "eagle_aux_hidden_state_layer_ids": [1, 3, 5, 6],
        "target_hidden_size": None,
        "draft_vocab_size": 24,
    }
    s = vllm.effective_settings(bare)
    assert s["num_aux"] == 3  # four ids but fc sized for three
    assert s["target_hidden_size"] is None  # null kept: fc size breaks
    assert not s["fc_norm"] and not s["norm_output"]  # 3.1 flags missing -> off
    speculators = {
        "speculators_model_type": "eagle3",
        "transformer_layer_config": {"hidden_size": 16, "vocab_size": 40},
    }
    assert vllm.effective_settings(vllm.hf_config_view(speculators))["norm_before_residual"] is True
    assert vllm.vllm_name("d2t") == "draft_id_to_target_id" and vllm.vllm_name("t2d") is None
    # a full vocabulary has no draft_id_to_target_id in 0.33: a d2t tensor would be refused
    full = {
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_attention_heads": 4,
        "vocab_size": 40,
        "draft_vocab_size": 40,
    }
    assert "draft_id_to_target_id" not in vllm.expected_params(full)
    assert "draft_id_to_target_id" in vllm.expected_params({**full, "draft_vocab_size": 24})
    assert vllm.vllm_name("midlayer.self_attn.k_proj.weight") == "model.layers.0.self_attn.qkv_proj.weight"
