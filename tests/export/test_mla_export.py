"""MLA drafters: export in vLLM's DeepSeek EAGLE-3 layout, the loader contract, and reading them back.

The published Kimi MLA drafters are TorchSpec exports (`torchspec/models/draft/deepseek_eagle.py`
names, `tools/convert_to_hf.py` config handling); the checkpoints below are written that way.
"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle31 import ConfigError
from eagle31.convert import detect_format, load_drafter
from eagle31.export import export_config, export_drafter
from tests.export import vllm_contract as vllm
from tests.helpers import random_batch
from tests.test_mla import KIMI_ROPE, TINY_ROPE, mla_drafter

CASES = {
    "eagle31": dict(),
    "full_vocab": dict(draft_vocab_size=40),
    "eagle3_switches": dict(fc_norm=False, norm_output=False, norm_before_residual=True),
    "kimi_rope": dict(rope=KIMI_ROPE | {"original_max_position_embeddings": 8}),
    "wide_target": dict(target_hidden_size=24),
}


def export(tmp_path, case, dtype="float32"):
    m = mla_drafter(seed=3, **CASES[case]).float()
    out = export_drafter(m, tmp_path / case, "eagle3", dtype=dtype, trained_context=1024)
    return m, json.loads((out / "config.json").read_text()), load_file(str(out / "model.safetensors")), out


@pytest.mark.parametrize("case", CASES)
def test_vllm_deepseek_eagle3_reads_the_mla_export(tmp_path, case):
    m, cfg, tensors, _ = export(tmp_path, case)
    c = m.config
    view = vllm.hf_config_view(cfg)
    assert vllm.model_class(view) == "Eagle3DeepseekV2ForCausalLM" and cfg["model_type"] == "kimi_k2"
    for name in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        assert cfg[name] == getattr(c.mla, name), name
    s = vllm.effective_settings(view)
    assert (s["aux_layer_ids"], s["num_aux"], s["target_hidden_size"]) == (
        c.aux_layer_ids,
        c.num_aux,
        c.target_hidden_size,
    )
    for flag in ("fc_norm", "norm_output", "norm_before_residual"):
        assert s[flag] == getattr(c, flag), flag
    # the embedding is written only for a drafter narrower than its target (vLLM would share the wider one)
    embed_written = c.target_hidden_size != c.hidden_size
    assert vllm.loaded_shapes(tensors) == {
        k: v for k, v in vllm.expected_params(view).items() if embed_written or k != "model.embed_tokens.weight"
    }
    assert (
        vllm.vllm_name("midlayer.self_attn.kv_a_proj_with_mqa.weight")
        == "model.layers.0.self_attn.fused_qkv_a_proj.weight"
    )
    rope = vllm.deepseek_rope(view)
    assert rope["rope_type"] == "deepseek_yarn" and rope["rope_theta"] == c.rope_parameters["rope_theta"]


@pytest.mark.parametrize("case", CASES)
def test_vllm_would_draft_what_the_mla_drafter_trained(tmp_path, case):
    """Per-step logits vLLM computes from the files (fused q_a/kv_a, DeepSeek YaRN, scale) = the unroll's."""
    m, cfg, tensors, _ = export(tmp_path, case)
    aux, _, ids, _ = random_batch(m.config, 1, 9, seed=4, dtype=torch.float32)
    ours = m.double()(aux.double(), ids, ttt_length=3)
    theirs = vllm.chain_logits(cfg, tensors, m.embed_tokens.weight, aux[0], ids[0], 3)
    targets = m.draft_token_ids()
    for j in range(3):
        torch.testing.assert_close(theirs[j][:, targets], ours[j][0], rtol=1e-5, atol=1e-5)


def test_speculators_layout_refuses_an_mla_drafter_in_one_line():
    m = mla_drafter()
    with pytest.raises(ConfigError, match="cannot carry an MLA drafter") as e:
        export_config(m.config, "speculators")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_export_then_load_is_bit_identical(tmp_path, dtype):
    m, _, _, out = export(tmp_path, "full_vocab", dtype=dtype)
    loaded = load_drafter(out)
    assert loaded.config.attention == "mla" and loaded.config.aux_layer_ids == m.config.aux_layer_ids
    reference = m.to(getattr(torch, dtype)).float()  # the exported values, read back as float32
    for name, tensor in reference.state_dict().items():
        if name != "embed_tokens.weight":
            assert torch.equal(loaded.state_dict()[name], tensor), name
    loaded.embed_tokens.weight.data.copy_(reference.embed_tokens.weight)
    aux, _, ids, _ = random_batch(m.config, 2, 6, dtype=torch.float32)
    for a, b in zip(reference(aux, ids, ttt_length=3), loaded(aux, ids, ttt_length=3)):
        assert torch.equal(a, b)


# ------------------------------------------------------------- published (TorchSpec) MLA drafters


def torchspec_mla_checkpoint(path, m, *, ids, model_type="kimi_k2", layer_prefix="midlayer.", version=True):
    """A checkpoint as TorchSpec publishes its Kimi MLA drafters: DeepSeek config fields, ids under
    `eagle_config`, full vocabulary without d2t/t2d, rope as rope_theta + rope_scaling `type: yarn`."""
    c = m.config
    rope = {k: v for k, v in c.rope_parameters.items() if k not in ("rope_type", "rope_theta")}
    cfg = {
        "architectures": ["Eagle3DeepseekV2ForCausalLM"],
        "model_type": model_type,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_attention_heads,
        "q_lora_rank": c.mla.q_lora_rank,
        "kv_lora_rank": c.mla.kv_lora_rank,
        "qk_nope_head_dim": c.mla.qk_nope_head_dim,
        "qk_rope_head_dim": c.mla.qk_rope_head_dim,
        "v_head_dim": c.mla.v_head_dim,
        "mla_use_nope": True,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "vocab_size": c.vocab_size,
        "draft_vocab_size": c.draft_vocab_size,
        "torch_dtype": "float32",
        "rope_theta": c.rope_parameters["rope_theta"],
        "rope_scaling": {"type": "yarn", **rope},
        "max_position_embeddings": c.max_position_embeddings,
        "fc_norm": c.fc_norm,
        "norm_output": c.norm_output,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(ids), "use_aux_hidden_state": True},
    }
    if version:
        cfg["_torchspec_version"] = "0.2.0"
    state = {
        k.replace("midlayer.", layer_prefix): v.contiguous()
        for k, v in m.state_dict().items()
        if k not in ("d2t", "t2d")
    }
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(state, str(path / "model.safetensors"))
    return path


@pytest.mark.parametrize("version", [True, False], ids=["torchspec_version", "hub_config"])
def test_published_mla_drafter_reads_back_exactly(tmp_path, version):
    m = mla_drafter(seed=5, draft_vocab_size=40, rope=TINY_ROPE).float()
    path = torchspec_mla_checkpoint(tmp_path / "ts", m, ids=[1, 3, 4], version=version)  # vLLM ids (2, 4, 5)
    assert detect_format(json.loads((path / "config.json").read_text())) == "torchspec"
    loaded = load_drafter(path)
    assert loaded.config.attention == "mla" and loaded.config.aux_layer_ids == (2, 4, 5)
    assert loaded.config.norm_output and loaded.config.fc_norm and loaded.config.rope_parameters["rope_type"] == "yarn"
    assert torch.equal(loaded.d2t, torch.zeros(40, dtype=torch.long)) and bool(loaded.t2d.all())
    aux, _, ids, _ = random_batch(m.config, 2, 6, dtype=torch.float32)
    for a, b in zip(m(aux, ids, ttt_length=3), loaded(aux, ids, ttt_length=3)):
        assert torch.equal(a, b)


def test_torchspec_vllm_export_of_a_kimi_drafter_is_not_shifted_twice(tmp_path):
    """convert_to_hf.py --vllm adds 1 to a kimi_k2 drafter's ids and writes `layers.0.*` keys."""
    m = mla_drafter(seed=5, draft_vocab_size=40).float()
    path = torchspec_mla_checkpoint(tmp_path / "ts", m, ids=[2, 4, 5], layer_prefix="layers.0.")
    assert load_drafter(path).config.aux_layer_ids == (2, 4, 5)
    deepseek = torchspec_mla_checkpoint(
        tmp_path / "ds", m, ids=[1, 3, 4], model_type="deepseek_v3", layer_prefix="layers.0."
    )
    assert load_drafter(deepseek).config.aux_layer_ids == (2, 4, 5)
    # the config alone (drafter.init_from's check) reads the ids as load_drafter does
    from types import SimpleNamespace

    from eagle31.convert import read_drafter_config
    from eagle31.plan import check_init_from

    for source in (path, deepseek):
        assert read_drafter_config(source).aux_layer_ids == (2, 4, 5)
    section = SimpleNamespace(init_from=str(path), init_from_format="auto", upgrade_to_eagle31=False)
    check_init_from(m.config, section)  # no false aux_layer_ids mismatch


def test_published_kimi_k26_shape_is_read_from_its_config(tmp_path):
    """The K2.6 MLA drafter's config (TorchSpec's kimi_k2 MLA draft config, K2.6 ids [1, 29, 57])."""
    from eagle31.convert import drafter_config

    meta = {
        "architectures": ["Eagle3DeepseekV2ForCausalLM"],
        "model_type": "kimi_k2",
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "num_hidden_layers": 1,
        "num_attention_heads": 64,
        "num_key_value_heads": 64,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-05,
        "vocab_size": 163840,
        "draft_vocab_size": 163840,
        "rope_theta": 50000.0,
        "max_position_embeddings": 262144,
        "fc_norm": True,
        "norm_output": True,
        "rope_scaling": {
            "type": "yarn",
            "factor": 64.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 29, 57]},
    }
    cfg = drafter_config(meta, detect_format(meta), target_num_layers=61)
    assert cfg.attention == "mla" and cfg.aux_layer_ids == (2, 30, 58) and cfg.head_dim == 192
    assert (
        cfg.mla.q_lora_rank,
        cfg.mla.kv_lora_rank,
        cfg.mla.qk_nope_head_dim,
        cfg.mla.qk_rope_head_dim,
        cfg.mla.v_head_dim,
    ) == (
        1536,
        512,
        128,
        64,
        128,
    )
    assert cfg.num_key_value_heads == 64 and cfg.draft_vocab_size == cfg.vocab_size == 163840 and cfg.norm_output
    assert cfg.rope_parameters["rope_type"] == "yarn" and cfg.rope_parameters["factor"] == 64.0


def test_init_from_continues_training_a_published_mla_drafter(tmp_path):
    """`drafter.init_from=<dir>` (eagle31.pipeline.init_from_checkpoint) on a published MLA drafter."""
    from types import SimpleNamespace

    from eagle31 import Eagle31Drafter
    from eagle31.pipeline import init_from_checkpoint

    published = mla_drafter(seed=7, draft_vocab_size=40, rope=TINY_ROPE).float()
    path = torchspec_mla_checkpoint(tmp_path / "ts", published, ids=[1, 3, 4])
    fresh = Eagle31Drafter(published.config)  # the run's drafter: the recipe's shape, full vocabulary
    section = SimpleNamespace(init_from=str(path), init_from_format="auto", upgrade_to_eagle31=False)
    init_from_checkpoint(fresh, section)
    for name, tensor in published.state_dict().items():
        if name != "embed_tokens.weight":
            assert torch.equal(fresh.state_dict()[name], tensor), name


def test_an_older_export_of_ours_still_reads_back(tmp_path):
    """Before vLLM 0.33's rules an MLA export said model_type deepseek_v3 and carried d2t/t2d with the full
    vocabulary."""
    m, cfg, tensors, out = export(tmp_path, "full_vocab")
    assert "d2t" not in tensors and "t2d" not in tensors
    (out / "config.json").write_text(json.dumps({**cfg, "model_type": "deepseek_v3"}))
    save_file(
        {**tensors, "d2t": m.d2t.clone(), "t2d": m.t2d.clone()},
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    old, new = load_drafter(out), m
    assert old.config.attention == "mla" and torch.equal(old.d2t, new.d2t) and torch.equal(old.t2d, new.t2d)
    for name, tensor in new.state_dict().items():
        if name != "embed_tokens.weight":
            assert torch.equal(old.state_dict()[name], tensor), name
