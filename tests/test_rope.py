"""The drafter trains with the rope vLLM serves (docs/design.md §3), for every rope type and recipe.

The reference is `tests/export/vllm_contract.rope_cos_sin`, a re-implementation of vLLM 0.22.0's
and 0.33.0's rotary-embedding classes applied to the exported config, never eagle31's rope code.
tests/export/test_vllm_peers.py checks both against the tables vLLM's own `get_rope` builds.
"""

import json
import math
import warnings
from functools import cache
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from eagle31.attention import DrafterAttention
from eagle31.attention.llama import RotaryEmbedding
from eagle31.config import DrafterConfig
from eagle31.convert import load_drafter
from eagle31.distributed import init_world
from eagle31.errors import ConfigError
from eagle31.export import export_config
from eagle31.layouts import ExportFormat
from eagle31.plan import plan_run
from eagle31.recipe import load_recipe
from eagle31.rope import DEEPSEEK_YARN_FIELDS, for_llama_drafter
from eagle31.target import load_target_config
from eagle31.targets.kimi_mini import KIMI_YARN
from tests.export import vllm_contract as vllm
from tests.helpers import tiny_config, tiny_drafter

REPO = Path(__file__).resolve().parents[1]
LLAMA, MLA = DrafterAttention.llama.kind, DrafterAttention.mla.kind
KIMI_MAGNITUDE = 0.1 * math.log(64) + 1  # 1.416: what vLLM serves for Kimi's factor 64
YARN = {
    "rope_type": "yarn",
    "rope_theta": 50000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
}
# blocks that vLLM 0.22.0 and 0.33.0 (and transformers, as 0.33.0) read alike
SAME_IN_BOTH = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": YARN,
    "yarn_untruncated": {**YARN, "truncate": False, "beta_fast": 8.0},
    "kimi_yarn_for_llama": for_llama_drafter(KIMI_YARN),
    "yarn_mscale_alone": {**YARN, "mscale": 0.7},  # transformers needs both mscale fields to use them
}
# blocks that they read differently
READ_TWO_WAYS = {
    "kimi_yarn": dict(KIMI_YARN),  # mscale = mscale_all_dim = 1: 1.0 in 0.33.0 (and transformers), 1.416 in 0.22.0
    "yarn_attention_factor": {**YARN, "attention_factor": 1.0},
    "yarn_attn_factor": {**YARN, "attn_factor": 0.5},  # vLLM's own field
    "yarn_no_scaling": {**YARN, "apply_yarn_scaling": False},
    "yarn_extrapolation": {**YARN, "extrapolation_factor": 0.5},
}
POSITIONS = torch.tensor([0, 1, 2, 5, 31, 63, 64, 100, 200, 255])


def layer_view(config: DrafterConfig) -> dict:
    """The Llama layer fields vLLM reads, for a block that export would refuse."""
    return {
        "hidden_size": config.hidden_size,
        "num_attention_heads": config.num_attention_heads,
        "head_dim": config.head_dim,
        "max_position_embeddings": config.max_position_embeddings,
        "rope_parameters": dict(config.rope_parameters),
    }


def drafter_cos_sin(config: DrafterConfig, positions: torch.Tensor):
    cos, sin = RotaryEmbedding(config)(positions[None], torch.float64)
    return cos[0], sin[0]


@pytest.mark.parametrize("rope", [*SAME_IN_BOTH.values(), *READ_TWO_WAYS.values()], ids=[*SAME_IN_BOTH, *READ_TWO_WAYS])
def test_the_drafters_rope_is_vllms_for_every_rope_type(rope):
    config = tiny_config(rope_parameters=rope)
    ours = drafter_cos_sin(config, POSITIONS)
    theirs = vllm.rope_cos_sin(layer_view(config), POSITIONS)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-9)


@pytest.mark.parametrize("rope", [*SAME_IN_BOTH.values(), *READ_TWO_WAYS.values()], ids=[*SAME_IN_BOTH, *READ_TWO_WAYS])
def test_ambiguity_is_exactly_where_the_supported_vllm_releases_disagree(rope):
    view = layer_view(tiny_config(rope_parameters=rope))
    (old_cos, old_sin), (new_cos, new_sin) = (vllm.rope_cos_sin(view, POSITIONS, r) for r in (vllm.OLDEST, vllm.NEWEST))
    alike = torch.allclose(old_cos, new_cos, atol=1e-9) and torch.allclose(old_sin, new_sin, atol=1e-9)
    assert alike == (LLAMA.rope_ambiguity(rope) is None)


def test_ambiguity_says_which_fields_which_release_reads():
    reason = LLAMA.rope_ambiguity({**YARN, "attn_factor": 0.5})
    assert "attn_factor (read by vLLM 0.22.0 only)" in reason and "\n" not in reason
    assert "attention_factor (read by vLLM 0.33.0 only)" in LLAMA.rope_ambiguity({**YARN, "attention_factor": 1.0})
    # an MLA drafter: 0.33.0 drops the softmax-scale correction for attention_factor 1.0, 0.22.0 keeps it
    assert MLA.rope_ambiguity(dict(KIMI_YARN)) is None
    assert "attention_factor (read by vLLM 0.33.0 only)" in MLA.rope_ambiguity({**KIMI_YARN, "attention_factor": 1.0})
    assert "attn_factor (read by vLLM 0.22.0 only)" in MLA.rope_ambiguity({**KIMI_YARN, "attn_factor": 0.9})


def test_kimis_own_yarn_block_is_1_416_in_vllm_0_22_and_1_0_in_0_33_and_transformers():
    """vLLM 0.22.0's Llama-layer YaRN ignores DeepSeek's mscale fields; 0.33.0 honours them as transformers does."""
    config = tiny_config(rope_parameters=dict(KIMI_YARN))
    hf_cos, _ = LlamaRotaryEmbedding(LlamaConfig(**layer_view(config)))(
        torch.zeros(1), torch.zeros(1, 1, dtype=torch.long)
    )
    zero = torch.zeros(1, dtype=torch.long)
    assert float(hf_cos[0, 0, 0]) == pytest.approx(1.0)
    assert float(vllm.rope_cos_sin(layer_view(config), zero, vllm.NEWEST)[0][0, 0]) == pytest.approx(1.0)
    assert float(vllm.rope_cos_sin(layer_view(config), zero, vllm.OLDEST)[0][0, 0]) == pytest.approx(KIMI_MAGNITUDE)
    assert float(drafter_cos_sin(config, zero)[0][0, 0]) == pytest.approx(1.0)  # the newest release's reading
    assert "mscale (read by vLLM 0.33.0 only), mscale_all_dim (read by vLLM 0.33.0 only)" in LLAMA.rope_ambiguity(
        KIMI_YARN
    )


# ------------------------------------------------------------------- recipes


FORMATS = list(ExportFormat)
# the recipes' Llama-attention drafters (an MLA drafter's DeepSeek YaRN is tested in tests/test_mla.py)
LLAMA_RECIPES = {"kimi_k26_llama": (), "kimi_k26_mini": ("drafter.attention=llama",), "llama31_8b": (), "qwen3_8b": ()}


@cache
def recipe_plan(name: str):
    overrides = [f"recipe={name}", "dry_run=true", *LLAMA_RECIPES[name]]
    return plan_run(load_recipe(REPO / "recipes", overrides), init_world("cpu"))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", LLAMA_RECIPES)
def test_every_recipes_drafter_trains_with_the_rope_vllm_serves_from_its_export(name, fmt):
    plan = recipe_plan(name)
    max_len = int(plan.cfg.data.max_len)
    exported = export_config(plan.drafter, fmt, trained_context=max_len, target_name_or_path="org/target")
    view = vllm.hf_config_view(exported)
    positions = torch.tensor(
        sorted(p for p in {0, 1, 2, 17, 255, 1000, 4095, 4096, 8191, max_len // 2, max_len - 1} if p < max_len)
    )
    theirs = vllm.rope_cos_sin(view, positions)
    ours = drafter_cos_sin(plan.drafter, positions)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-9)


@pytest.mark.parametrize("name", ["kimi_k26_llama", "kimi_k26_mini"])
def test_kimi_drafters_train_at_vllms_yarn_magnitude(name):
    """Before: the drafter copied Kimi's block and trained at 1.0, while vLLM served it at 1.416."""
    drafter = recipe_plan(name).drafter
    assert drafter.rope_parameters["rope_type"] == "yarn" and drafter.rope_parameters["factor"] == 64.0
    assert not set(DEEPSEEK_YARN_FIELDS) & set(drafter.rope_parameters)
    assert RotaryEmbedding(drafter).attention_scaling == pytest.approx(KIMI_MAGNITUDE)
    assert LLAMA.rope_ambiguity(drafter.rope_parameters) is None


# ------------------------------------------------------- refusals and warnings


def test_a_target_rope_that_would_still_be_read_two_ways_is_refused():
    target = load_target_config(REPO / "recipes" / "targets" / "llama31_8b.json")
    target["rope_scaling"] = {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 8192,
        "attn_factor": 0.8,
    }
    with pytest.raises(ConfigError, match="attn_factor"):
        DrafterConfig.from_target_config(target)


@pytest.mark.parametrize(
    "rope, field",
    [
        (
            {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 4, "long_factor": [2.0] * 4},
            "rope_type",
        ),
        ({"rope_type": "deepseek_yarn", "rope_theta": 10000.0, "factor": 4.0}, "rope_type"),
        ({"rope_type": "yarn", "rope_theta": 10000.0, "original_max_position_embeddings": 64}, "factor"),
        ({"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "high_freq_factor": 4.0}, "low_freq_factor"),
        ({"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ],
)
def test_ropes_the_drafter_cannot_train_as_vllm_serves_are_refused_naming_the_field(rope, field):
    with pytest.raises(ConfigError, match=f"drafter.rope_parameters.{field}"):
        tiny_config(rope_parameters=rope)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", list(READ_TWO_WAYS))
def test_export_refuses_a_rope_read_two_ways_in_one_line(name, fmt, tmp_path):
    with pytest.raises(ConfigError) as e:
        export_config(tiny_config(rope_parameters=READ_TWO_WAYS[name]), fmt, target_name_or_path="org/target")
    assert "drafter.rope_parameters is read two ways" in str(e.value) and "\n" not in str(e.value)


def test_load_drafter_warns_about_a_rope_read_two_ways(tmp_path):
    tiny_drafter(rope_parameters=dict(KIMI_YARN)).save(tmp_path / "kimi")
    with pytest.warns(UserWarning, match="rope block is read two ways.*mscale"):
        loaded = load_drafter(tmp_path / "kimi")
    assert loaded.rotary_emb.attention_scaling == pytest.approx(1.0)  # run as the newest release serves it

    tiny_drafter(rope_parameters=for_llama_drafter(KIMI_YARN)).save(tmp_path / "clean")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_drafter(tmp_path / "clean")
    assert json.loads((tmp_path / "clean" / "config.json").read_text())["drafter"]["rope_parameters"] == {
        k: v for k, v in KIMI_YARN.items() if k not in ("mscale", "mscale_all_dim")
    }


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", list(SAME_IN_BOTH))
def test_raising_max_positions_at_export_keeps_the_rope_vllm_serves(name, fmt):
    """Without original_max_position_embeddings, llama3 and yarn read max_position_embeddings, which export raises."""
    rope = {k: v for k, v in SAME_IN_BOTH[name].items() if k != "original_max_position_embeddings"}
    config = tiny_config(rope_parameters=rope, max_position_embeddings=64)
    view = vllm.hf_config_view(export_config(config, fmt, trained_context=1024, target_name_or_path="org/target"))
    assert view["max_position_embeddings"] == 1024
    positions = torch.arange(0, 256, 7)  # within every table vLLM builds here (yarn: 64 * factor 4)
    for a, b in zip(drafter_cos_sin(config, positions), vllm.rope_cos_sin(view, positions)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-9)
