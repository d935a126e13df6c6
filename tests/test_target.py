"""eagle31.target: one reading of a target's config, shape and aux ids for every caller."""

import pytest
import torch

from eagle31.eval.acceptance import check_drafter_fits
from eagle31.config import ConfigError, DrafterConfig
from eagle31.target import check_aux_layer_ids, inference_device_and_dtype, target_shape, target_vocab_size, text_config

LLAMA = {"model_type": "llama", "num_hidden_layers": 8, "hidden_size": 64, "num_attention_heads": 4,
         "intermediate_size": 128, "vocab_size": 300, "rope_theta": 10000.0, "max_position_embeddings": 512}  # fmt: skip
WRAPPED = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": LLAMA}


def test_a_multimodal_wrapper_is_read_as_its_language_model(tmp_path):
    assert text_config(WRAPPED) is LLAMA and text_config(LLAMA) is LLAMA
    assert target_shape(WRAPPED) == target_shape(LLAMA) == (8, 64)
    (tmp_path / "config.json").write_text(__import__("json").dumps(WRAPPED))
    assert target_vocab_size(tmp_path) == 300
    assert target_vocab_size(tmp_path / "missing") is None
    drafter = DrafterConfig.from_target_config(WRAPPED)
    assert drafter.target_num_layers == 8 and drafter.target_architectures == ("KimiK25ForConditionalGeneration",)


def test_one_aux_id_check_for_capture_and_evaluation():
    check_aux_layer_ids((2, 3, 5), 6)
    with pytest.raises(ConfigError, match=r"^aux_layer_ids \[6\] out of range for a 6-layer target$"):
        check_aux_layer_ids((2, 6), 6)
    with pytest.raises(ConfigError, match="distinct and increasing"):
        check_aux_layer_ids((3, 2), 6)
    drafter = DrafterConfig.from_target_config(LLAMA, aux_layer_ids=(1, 2, 5))
    check_drafter_fits(drafter, LLAMA, "d")
    with pytest.raises(ConfigError, match=r"^drafter d: aux_layer_ids \[5\] out of range for a 4-layer target$"):
        check_drafter_fits(drafter, {**LLAMA, "num_hidden_layers": 4}, "d")


def test_inference_device_and_dtype_choices():
    assert inference_device_and_dtype("cpu", "auto") == (torch.device("cpu"), torch.float32)
    assert inference_device_and_dtype("cpu", "bfloat16") == (torch.device("cpu"), torch.bfloat16)
    with pytest.raises(ConfigError, match="dtype must be auto"):
        inference_device_and_dtype("cpu", "int8")
