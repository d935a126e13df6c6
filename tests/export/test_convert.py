"""load_drafter on hand-built SpecForge-, TorchSpec- and speculators-style checkpoints.

Each checkpoint is written the way its tool writes it (config fields and weight names
read from SpecForge's configs and `llama3_eagle.py`, TorchSpec's `tools/convert_to_hf.py`,
the speculators converter), from a reference eagle31 drafter; reading it back must give
that drafter's config and logits.
"""

import json
import warnings

import pytest
import torch
from safetensors.torch import save_file

from eagle31 import ConfigError
from eagle31.convert import detect_format, load_drafter, to_eagle31
from tests.helpers import random_batch, tiny_drafter

LAYER = {  # tests.helpers.tiny_config as an HF Llama layer
    "model_type": "llama",
    "hidden_size": 16,
    "intermediate_size": 24,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-06,
    "max_position_embeddings": 256,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "vocab_size": 40,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
OUTPUT_OF_LAYER_IDS = [1, 3, 4]  # tiny_config's vLLM ids (2, 4, 5) in SpecForge/TorchSpec's convention


def write_checkpoint(path, config, m, *, layer_prefix="midlayer.", drop=(), legacy_bin=False):
    state = {k.replace("midlayer.", layer_prefix): v for k, v in m.state_dict().items() if k not in drop}
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    if legacy_bin:
        torch.save(state, path / "pytorch_model.bin")
    else:
        save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
    return path


def assert_same_drafter(loaded, m):
    assert loaded.config.aux_layer_ids == m.config.aux_layer_ids
    for flag in ("fc_norm", "norm_output", "norm_before_residual", "norm_before_fc"):
        assert getattr(loaded.config, flag) == getattr(m.config, flag), flag
    aux, _, ids, _ = random_batch(m.config, 2, 6, dtype=torch.float32)
    for a, b in zip(m(aux, ids, ttt_length=3), loaded(aux, ids, ttt_length=3)):
        assert torch.equal(a, b)


# ------------------------------------------------------------------- SpecForge


def specforge_config(**fields):
    return {"architectures": ["LlamaForCausalLMEagle3"], **LAYER, "draft_vocab_size": 24, **fields}


def test_specforge_eagle3_ids_are_shifted_to_vllms_convention(tmp_path):
    m = tiny_drafter(seed=4, dtype=torch.float32, fc_norm=False, norm_output=False)
    cfg = specforge_config(
        eagle_config={"eagle_aux_hidden_state_layer_ids": OUTPUT_OF_LAYER_IDS, "use_aux_hidden_state": True}
    )
    path = write_checkpoint(tmp_path / "sf", cfg, m)
    assert detect_format(cfg) == "specforge"
    assert_same_drafter(load_drafter(path), m)


def test_specforge_norm_output_is_read_as_pre_norm_feedback(tmp_path):
    """SpecForge before its fix fed back the pre-norm state even with norm_output: true."""
    m = tiny_drafter(seed=5, dtype=torch.float32, fc_norm=True, norm_output=False)
    path = write_checkpoint(tmp_path / "sf31", specforge_config(fc_norm=True, norm_output=True), m)
    with pytest.raises(ConfigError, match="source_format='specforge'"):
        load_drafter(path, target_num_layers=8)  # auto cannot know which semantics trained it
    with pytest.warns(UserWarning, match="pre-norm state fed back.*pass norm_output=True") as record:
        assert_same_drafter(load_drafter(path, source_format="specforge", target_num_layers=8), m)
    assert all("\n" not in str(w.message) for w in record)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the choice made explicitly: no warning
        fixed = load_drafter(path, source_format="specforge", target_num_layers=8, norm_output=True)
    assert fixed.config.norm_output  # a checkpoint trained after SpecForge's fix


def test_specforge_lm_head_without_final_norm_is_refused(tmp_path):
    m = tiny_drafter(seed=5, dtype=torch.float32, fc_norm=False, norm_output=False)
    path = write_checkpoint(tmp_path / "sf", specforge_config(norm_output=False), m)
    with pytest.raises(ConfigError, match="cannot represent"):
        load_drafter(path, source_format="specforge", target_num_layers=8)


def test_missing_aux_ids_need_the_target_layer_count(tmp_path):
    m = tiny_drafter(seed=4, dtype=torch.float32, fc_norm=False, norm_output=False)
    path = write_checkpoint(tmp_path / "sf", specforge_config(), m)
    with pytest.raises(ConfigError, match="target_num_layers"):
        load_drafter(path)
    assert load_drafter(path, target_num_layers=8).config.aux_layer_ids == (2, 4, 5)  # (2, L//2, L-3)
    assert load_drafter(path, aux_layer_ids=(1, 2, 3)).config.aux_layer_ids == (1, 2, 3)


# -------------------------------------------------------------------- TorchSpec


def torchspec_config(**fields):
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        **LAYER,
        "eagle_aux_hidden_state_layer_ids": OUTPUT_OF_LAYER_IDS,
        "_torchspec_version": "0.1.0",
        **fields,
    }


@pytest.mark.parametrize("layer_prefix", ["midlayer.", "layers.0."])  # native keys, or `--vllm`
def test_torchspec_pruned_vocab_export(tmp_path, layer_prefix):
    m = tiny_drafter(seed=6, dtype=torch.float32, fc_norm=False, norm_output=False)
    path = write_checkpoint(tmp_path / "ts", torchspec_config(draft_vocab_size=24), m, layer_prefix=layer_prefix)
    assert_same_drafter(load_drafter(path), m)


def test_torchspec_kimi_style_legacy_yarn_rope(tmp_path):
    """configs/draft_models/kimi_k25_eagle3.json writes rope_theta + rope_scaling with `type: yarn`."""
    yarn = {
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    }
    m = tiny_drafter(
        seed=6,
        dtype=torch.float32,
        fc_norm=False,
        norm_output=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, **yarn},
    )
    cfg = torchspec_config(draft_vocab_size=24, rope_theta=50000.0, rope_scaling={"type": "yarn", **yarn})
    with pytest.warns(UserWarning, match="rope block is read two ways"):  # DeepSeek's mscale fields in a Llama layer
        loaded = load_drafter(write_checkpoint(tmp_path / "ts", cfg, m))
    assert loaded.config.rope_parameters == m.config.rope_parameters
    assert_same_drafter(loaded, m)


def test_torchspec_full_vocab_export_without_vocab_maps_is_the_identity(tmp_path):
    m = tiny_drafter(seed=6, dtype=torch.float32, fc_norm=False, norm_output=False, draft_vocab_size=40)
    path = write_checkpoint(tmp_path / "ts", torchspec_config(draft_vocab_size=40), m, drop=("d2t", "t2d"))
    loaded = load_drafter(path)
    assert torch.equal(loaded.d2t, torch.zeros(40, dtype=torch.long)) and bool(loaded.t2d.all())
    assert_same_drafter(loaded, m)


def test_a_reduced_vocab_without_d2t_is_refused(tmp_path):
    m = tiny_drafter(seed=6, dtype=torch.float32, fc_norm=False, norm_output=False)
    path = write_checkpoint(tmp_path / "ts", torchspec_config(draft_vocab_size=24), m, drop=("d2t", "t2d"))
    with pytest.raises(ConfigError, match="no d2t"):
        load_drafter(path)


def test_a_missing_half_of_the_vocab_maps_is_derived(tmp_path):
    m = tiny_drafter(seed=6, dtype=torch.float32, fc_norm=False, norm_output=False)
    for drop in ("d2t", "t2d"):
        loaded = load_drafter(write_checkpoint(tmp_path / drop, torchspec_config(draft_vocab_size=24), m, drop=(drop,)))
        assert torch.equal(loaded.d2t, m.d2t) and torch.equal(loaded.t2d, m.t2d)


# ------------------------------------------------------------------ speculators


def speculators_config(**fields):
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": "org/target", "architectures": ["LlamaForCausalLM"]},
        },
        "transformer_layer_config": dict(LAYER),
        "draft_vocab_size": 24,
        "eagle_aux_hidden_state_layer_ids": [2, 4, 5],
        **fields,
    }


def test_speculators_checkpoint_reads_like_vllm_reads_it(tmp_path):
    m = tiny_drafter(seed=7, dtype=torch.float32, norm_before_residual=True)  # vLLM's default for this layout
    path = write_checkpoint(
        tmp_path / "sp", speculators_config(fc_norm=True, norm_output=True), m, layer_prefix="layers.0."
    )
    loaded = load_drafter(path)
    assert loaded.config.target_name_or_path == "org/target"
    assert loaded.config.target_architectures == ("LlamaForCausalLM",)
    assert_same_drafter(loaded, m)


def test_speculators_training_only_tensors_are_ignored(tmp_path):
    m = tiny_drafter(seed=7, dtype=torch.float32, fc_norm=False, norm_output=False)
    path = write_checkpoint(
        tmp_path / "sp", speculators_config(norm_before_residual=False), m, layer_prefix="layers.0."
    )
    extra = {"verifier_norm.weight": torch.ones(16), "verifier_lm_head.weight": torch.zeros(40, 16)}
    save_file(extra, str(path / "verifier.safetensors"))
    assert_same_drafter(load_drafter(path), m)


# ------------------------------------------------------------ legacy, upgrade, errors


def test_original_eagle3_release_in_pytorch_model_bin(tmp_path):
    m = tiny_drafter(seed=8, dtype=torch.float32, fc_norm=False, norm_output=False)
    path = write_checkpoint(tmp_path / "e3", specforge_config(), m, legacy_bin=True)
    assert_same_drafter(load_drafter(path, source_format="eagle3", target_num_layers=8), m)


def test_missing_embedding_stays_zero(tmp_path):
    m = tiny_drafter(seed=8, dtype=torch.float32, fc_norm=False, norm_output=False)
    path = write_checkpoint(tmp_path / "e3", specforge_config(), m, drop=("embed_tokens.weight",))
    assert not load_drafter(path, target_num_layers=8).embed_tokens.weight.any()


def test_upgrade_to_eagle31_adds_fc_norm_at_ones_and_norm_output(tmp_path):
    m = tiny_drafter(seed=9, dtype=torch.float32, fc_norm=False, norm_output=False)
    path = write_checkpoint(tmp_path / "e3", specforge_config(), m)
    up = load_drafter(path, target_num_layers=8, upgrade_to_eagle31=True)
    assert up.config.fc_norm and up.config.norm_output
    assert all(bool((n.weight == 1).all()) for n in up.fc_norm)
    kept = {k: v for k, v in up.state_dict().items() if not k.startswith("fc_norm.")}
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in kept.items())
    with pytest.raises(ConfigError, match="norm_before_fc"):
        to_eagle31(tiny_drafter(seed=9, fc_norm=False, norm_before_fc=True))


def test_native_drafter_is_read_with_overrides(tmp_path):
    m = tiny_drafter(seed=9, dtype=torch.float32, fc_norm=False, norm_output=False)
    m.save(tmp_path / "native")
    assert load_drafter(tmp_path / "native").config == m.config
    assert load_drafter(tmp_path / "native", upgrade_to_eagle31=True).config.fc_norm


@pytest.mark.parametrize(
    "config, message",
    [
        (specforge_config(num_hidden_layers=2), "decoder layers"),
        (
            specforge_config(intermediate_size=32, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}),
            "intermediate_size.*does not match the weights",
        ),
        (speculators_config(speculators_model_type="mtp"), "not an EAGLE-3"),
        (speculators_config(transformer_layer_config={**LAYER, "model_type": "qwen3"}), "only Llama-layer"),
    ],
)
def test_inconsistent_checkpoints_fail_with_a_clear_error(tmp_path, config, message):
    m = tiny_drafter(seed=10, dtype=torch.float32, fc_norm=False, norm_output=False)
    path = write_checkpoint(tmp_path / "bad", config, m)
    with pytest.raises(ConfigError, match=message):
        load_drafter(path)
    with pytest.raises(ConfigError, match="source_format"):
        load_drafter(path, source_format="medusa")


def test_unexpected_tensors_are_named(tmp_path):
    m = tiny_drafter(seed=10, dtype=torch.float32, fc_norm=False, norm_output=False)
    path = write_checkpoint(tmp_path / "bad", specforge_config(), m)
    save_file({"mtp.head.weight": torch.zeros(2)}, str(path / "extra.safetensors"))
    with pytest.raises(ConfigError, match="mtp.head.weight"):
        load_drafter(path, target_num_layers=8)
