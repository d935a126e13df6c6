"""The dry run's sizing of the inference workers: active parameters counted against real models, FLOPs, the rule."""

from __future__ import annotations

import json

import pytest
from transformers import LlamaConfig

from eagle31.engine.capacity import estimated_sizing, measured_sizing, target_active_parameters, workers_needed
from eagle31.errors import ConfigError
from tests.helpers import tiny_config
from tests.tiny_targets import tiny_deepseek_v3, tiny_llama


def _weights(module, skip=("layernorm",)) -> int:
    return sum(p.numel() for name, p in module.named_parameters() if not any(s in name for s in skip))


def test_active_parameters_of_a_dense_target_are_its_decoder_layers_less_the_norms():
    model = tiny_llama()
    layers = sum(_weights(layer) for layer in model.model.layers)
    assert target_active_parameters(model.config.to_dict()) == layers


def test_active_parameters_of_a_moe_target_count_the_experts_a_token_is_routed_to():
    """DeepSeek-V3 (Kimi's layout): a dense first layer, then MoE layers of which a token passes the shared
    expert, its top-k routed experts and the router; MLA with its low-rank projections."""
    model = tiny_deepseek_v3()
    cfg = model.config
    dense, moe = model.model.layers[0], model.model.layers[1]
    expert = (moe.mlp.experts.gate_up_proj.numel() + moe.mlp.experts.down_proj.numel()) // cfg.n_routed_experts
    routed_layer = (
        _weights(moe.self_attn)
        + cfg.num_experts_per_tok * expert
        + _weights(moe.mlp.shared_experts)
        + moe.mlp.gate.weight.numel()
    )
    expected = _weights(dense.self_attn) + _weights(dense.mlp) + (cfg.num_hidden_layers - 1) * routed_layer
    assert target_active_parameters(cfg.to_dict()) == expected


def test_workers_needed_is_the_rate_ratio_rounded_up():
    assert workers_needed(8, trainer_rate=35.0, worker_rate=10.0) == 28
    assert workers_needed(8, trainer_rate=10.0, worker_rate=10.0) == 8
    assert workers_needed(1, trainer_rate=1.0, worker_rate=100.0) == 1


def test_estimated_sizing_grows_with_the_target_and_shrinks_with_gpus_per_worker():
    drafter = tiny_config()
    small = tiny_llama().config.to_dict()
    big = LlamaConfig(
        vocab_size=96,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=48,
        num_attention_heads=4,
        num_key_value_heads=2,
    ).to_dict()
    one = estimated_sizing(small, drafter, 3, 256, trainers=8, worker_gpus=1)
    more = estimated_sizing(big, drafter, 3, 256, trainers=8, worker_gpus=1)
    wide = estimated_sizing(big, drafter, 3, 256, trainers=8, worker_gpus=8)
    assert more.workers > one.workers and wide.workers == -(-more.workers // 8)
    assert not one.measured and "FLOPs per token at T=256" in one.basis


def test_measured_sizing_skips_the_first_window_and_needs_one_more(tmp_path):
    path = tmp_path / "metrics.jsonl"
    first = {
        "step": 5,
        "engine/inference_samples_per_s": 1.0,
        "engine/workers": 1,
        "engine/trainers": 1,
        "train/capacity_samples_per_s": 99.0,
    }
    path.write_text(json.dumps(first) + "\n" + json.dumps({"step": 5, "train/loss": 1.0}) + "\n")
    assert measured_sizing(path, trainers=4) is None  # only the warm-up window
    later = {**first, "step": 10, "engine/inference_samples_per_s": 4.0, "train/capacity_samples_per_s": 6.0}
    path.write_text("\n".join(json.dumps(x) for x in (first, later, later)) + "\n")
    sizing = measured_sizing(path, trainers=4)
    assert (sizing.workers, sizing.worker_rate, sizing.trainer_rate, sizing.measured) == (6, 4.0, 6.0, True)
    path.write_text("not json\n")
    with pytest.raises(ConfigError, match="cannot read it as metrics.jsonl"):
        measured_sizing(path, trainers=4)
