"""The memory estimate of the dry run: the step traced (eagle31.memory_trace) beside the counted terms, the shipped
Kimi K2.6 recipes on the cards they target, the longest T, the online target's weights; the FLOPs of a step."""

import dataclasses
import functools
from pathlib import Path

import pytest
import torch

from eagle31.config import DrafterConfig
from eagle31.distributed import init_world
from eagle31.estimate import GiB, RunMemory, count_parameters
from eagle31.model import Eagle31Drafter
from eagle31.plan import describe_dry_run, online_target_bytes, plan_run
from eagle31.recipe import load_recipe
from eagle31.target import load_target_config, target_parameters

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
TINY = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=512,
    draft_vocab_size=256,
    target_num_layers=8,
    aux_layer_ids=(2, 4, 5),
    max_position_embeddings=4096,
)


def plan(recipe: str, *args: str):
    return plan_run(load_recipe(RECIPES, [f"recipe={recipe}", "dry_run=true", *args]), init_world("cpu"))


def drafter(recipe: str):
    return plan(recipe).drafter


@functools.cache
def memory(recipe: str, world_size: int = 1) -> RunMemory:
    """The recipe's run as shipped (activation checkpointing on, K = 7, bf16), its step traced once per recipe."""
    step = memory(recipe, 1).step if world_size > 1 else None
    return RunMemory(drafter(recipe), 7, world_size=world_size, activation_checkpointing=True, step=step)


@pytest.mark.parametrize(
    "recipe,T,gpus,limit",
    [
        ("kimi_k26", 131072, 1, 125),
        ("kimi_k26", 65536, 8, 60),
        ("kimi_k26", 65536, 1, 75),
        ("kimi_k26_llama", 131072, 1, 100),
    ],
)
@pytest.mark.slow
def test_the_kimi_drafters_fit_their_cards(recipe, T, gpus, limit):
    """128k tokens on one H200 and 64k on 8 cards of 80 GB for the published MLA drafter (as shipped:
    activation checkpointing on, K = 7, bf16)."""
    estimate = memory(recipe, gpus).at(T)
    assert estimate["total"] <= limit, estimate


@pytest.mark.slow
def test_the_counted_terms_are_the_drafters_and_the_batchs_bytes():
    """Beside the traced step: AdamW's fp32 master weights and two moments sharded, the embedding whole and
    FSDP2's gathered copies in bf16, the target's lm_head rows, the batch's aux and final states."""
    d, T = drafter("kimi_k26"), 65536
    trainable, embedding = count_parameters(d).trainable, 163840 * 7168
    m = memory("kimi_k26", 8).at(T)
    expected = {
        "weights_and_optimizer_states": trainable * 12 / 8,
        "frozen_embedding": embedding * 2,
        "gathered_parameters": trainable * 2,
        "target_lm_head": 163840 * 7168 * 2 + 163840,  # Vd = V: the draft rows are the whole weight
        "target_features": (3 * 7168 + 7168) * 2 * T,
    }
    for term, value in expected.items():
        assert m[term] == pytest.approx(value / GiB), term
    assert m["total"] == pytest.approx(sum(v for k, v in m.items() if k != "total"))
    anchored = RunMemory(d, 7, world_size=8, anchor=True, step=memory("kimi_k26", 8).step).at(T)
    assert anchored["anchor_weights"] == pytest.approx(trainable * 4 / 8 / GiB)  # train.anchor_weight's w0, fp32
    assert anchored["total"] == pytest.approx(m["total"] + anchored["anchor_weights"]) and "anchor_weights" not in m
    assert m["training_step"] == memory("kimi_k26", 1).at(T)["training_step"]  # the step is not sharded


def test_parameters_are_counted_on_the_drafter_built_on_the_meta_device():
    d = DrafterConfig(**TINY)
    with torch.device("meta"):
        model = Eagle31Drafter(d)
    counts = count_parameters(d)
    assert counts.total == sum(p.numel() for p in model.parameters()) and counts.frozen_embedding == 512 * 64


@pytest.mark.parametrize("gib", [80, 139])
def test_longest_fitting_length_is_the_boundary(gib):
    m = memory("kimi_k26", 1)
    T = m.longest(gib)
    assert m.at(T)["total"] <= gib < m.at(T + 1024)["total"]


def test_nothing_fits_a_card_smaller_than_the_fixed_terms():
    assert memory("kimi_k26", 1).longest(20) == 0


# ---------------------------------------------------------------------------- the online target


def test_the_online_target_is_its_parameters_in_its_dtype_on_every_gpu():
    """features.mode=online runs the target in each trainer: Llama 3.1 8B's 8,030,261,248 parameters in bf16
    (15 GiB) on every GPU; a run from the feature store (or the engine's workers) holds none of it."""
    assert target_parameters(load_target_config(RECIPES / "targets" / "llama31_8b.json")) == 8_030_261_248
    assert target_parameters(load_target_config(RECIPES / "targets" / "smollm2_135m.json")) == 134_515_008  # tied
    assert online_target_bytes(plan("llama31_8b")) == 8_030_261_248 * 2
    assert online_target_bytes(plan("llama31_8b", "target.dtype=float32")) == 8_030_261_248 * 4
    assert online_target_bytes(plan("llama31_8b", "features.mode=store")) == 0
    assert online_target_bytes(plan("kimi_k26")) == 0  # kimi's recipes read a feature store


@pytest.mark.slow
def test_the_dry_run_of_an_online_recipe_prints_the_targets_weights(capsys):
    """The same dry run online and from a store differs by the target's weights (the demo target's, in fp32)."""
    online = describe_dry_run(plan("demo"))["memory_gib_per_gpu"]
    assert "online_target" in capsys.readouterr().out
    store = describe_dry_run(plan("demo", "features.mode=store"))["memory_gib_per_gpu"]
    weights = target_parameters(load_target_config(RECIPES / "targets" / "demo.json")) * 4 / GiB
    assert "online_target" not in store and online["online_target"] == pytest.approx(weights)
    assert online["total"] - store["total"] == pytest.approx(weights)


# ---------------------------------------------------------------------------- sequence parallelism


@pytest.mark.slow
def test_a_sequence_split_n_ways_holds_a_shard_and_the_keys_before_it():
    """train.sequence_parallel = N: the last rank's step holds a shard of T / N positions, its halo and the step-0
    entries of every position before it: less than the whole sequence's step, more than a shard's alone."""
    d = DrafterConfig(**TINY)
    options = dict(activation_checkpointing=True, compute_bytes=4, device="cpu", world_size=2)
    whole = RunMemory(d, 3, **options).at(2048)
    split = RunMemory(d, 3, sequence_parallel=2, **options).at(2048)
    shard = RunMemory(d, 3, **options).at(1024)
    assert shard["training_step"] < split["training_step"] < whole["training_step"]
    assert split["target_features"] == pytest.approx((1024 * (3 * 64) + (1024 + 4) * 64) * 4 / GiB)  # + the halo


def test_a_sequence_parallel_size_that_does_not_divide_the_planned_gpus_is_refused():
    from eagle31 import ConfigError

    args = ["recipe=kimi_k26", "dry_run=true", "plan.world_size=6", "train.sequence_parallel=4"]
    with pytest.raises(ConfigError, match="train.sequence_parallel=4 must be >= 1 and divide the world size 6"):
        plan_run(load_recipe(RECIPES, args), init_world("cpu"))
    with pytest.raises(ConfigError, match="train.attention_kernel=reference cannot attend across sequence shards"):
        args = ["recipe=kimi_k26", "dry_run=true", "plan.world_size=4", "train.sequence_parallel=2"]
        plan_run(load_recipe(RECIPES, [*args, "train.attention_kernel=reference"]), init_world("cpu"))


# ---------------------------------------------------------------------------- sliding window


def test_the_visible_keys_per_step_are_counted_by_hand():
    from eagle31.estimate import visible_key_pairs

    # T = 10, K = 2: full attention sees 1..10 step-0 keys (55) plus k chain keys a query
    assert visible_key_pairs(10, 2, None) == [55, 55 + 10]
    # W = 4: step 0 sees min(p + 1, 4) (1+2+3+4 + 6*4 = 34); step 1 min(p + 1, 3) (1+2+3 + 7*3 = 27) and its chain
    assert visible_key_pairs(10, 2, 4) == [34, 27 + 10]
    assert visible_key_pairs(10, 2, 12) == visible_key_pairs(10, 2, None)  # a window past the sequence


@pytest.mark.parametrize("recipe", ["kimi_k26", "kimi_k26_llama"])
def test_a_step_counts_every_matmul_once_and_the_window_bounds_the_attentions(recipe):
    """The dense FLOPs are 2 per weight per token of the matmuls (the attention's norms excluded), for Llama and MLA
    alike; a window makes the attention's cost per query constant, so it grows linearly in T, not quadratically."""
    from eagle31.estimate import attention_flops_share, step_flops

    d = dataclasses.replace(drafter(recipe), sliding_window=None)
    weights = (
        d.kind.attention_parameters(d) + 3 * d.hidden_size * d.intermediate_size + d.hidden_size * d.draft_vocab_size
    )
    T, K = 1024, 3
    no_attention = dataclasses.replace(d, sliding_window=K)  # each query sees K - k step-0 keys: almost no attention
    assert step_flops(no_attention, T, K) < 1.01 * (
        2 * 2 * T * d.fc_in_features * d.hidden_size + 3 * K * 2 * T * weights
    )
    w = dataclasses.replace(d, sliding_window=2048)
    for T in (4096, 65536, 262144):
        assert step_flops(w, T, K) < step_flops(d, T, K)
        assert attention_flops_share(w, T, K) < attention_flops_share(d, T, K)

    def grow(c):
        return (step_flops(c, 4 * 65536, K) - step_flops(c, 2 * 65536, K)) / (
            step_flops(c, 2 * 65536, K) - step_flops(c, 65536, K)
        )

    assert grow(w) == pytest.approx(2.0, rel=1e-6) and grow(d) > 2.2  # linear with the window


@pytest.mark.parametrize("T", [65536, 131072], ids=["64k", "128k"])
@pytest.mark.slow
def test_the_kimi_recipes_fit_an_h200_at_64k_and_128k_with_their_windows(T):
    """recipe=kimi_k26_llama carries the 2,048-position window and recipe=kimi_k26 (MLA: vLLM serves no window)
    none; both fit one H200 at 64k and 128k, and the windowed Llama step costs less than the unwindowed one."""
    from eagle31.estimate import attention_flops_share, step_flops

    llama, mla = drafter("kimi_k26_llama"), drafter("kimi_k26")
    assert llama.sliding_window == 2048 and mla.sliding_window is None
    for recipe in ("kimi_k26_llama", "kimi_k26"):
        assert memory(recipe, 1).at(T)["total"] < 139
    full = dataclasses.replace(llama, sliding_window=None)
    assert step_flops(llama, T, 7) < step_flops(full, T, 7)
    assert attention_flops_share(llama, T, 7) < 0.05 < attention_flops_share(full, T, 7)


@pytest.mark.slow
def test_the_kimi_recipes_dry_run_at_256k_split_over_4_h200s_with_their_windows(capsys):
    """At 256k on 4 GPUs of 139 GiB (H200s), split 4 ways, both recipes' dry runs fit; unsplit the MLA drafter does
    not. A windowed shard gathers only the keys it sees: its step holds less than an unwindowed one's."""

    def dry_run(recipe):
        args = [f"recipe={recipe}", "dry_run=true", "data.max_len=262144", "plan.gpu_memory_gib=139"]
        return describe_dry_run(
            plan_run(load_recipe(RECIPES, [*args, "plan.world_size=4", "train.sequence_parallel=4"]), init_world("cpu"))
        )

    llama, mla = dry_run("kimi_k26_llama"), dry_run("kimi_k26")
    out = capsys.readouterr().out
    assert "sliding_window=2048" in out and "sliding_window=None" in out and "memory per GPU (T=262144, K=7" in out
    assert "each sequence split over 4" in out
    for report in (llama, mla):
        assert report["sequence_parallel"] == 4
        assert report["memory_gib_per_gpu"]["total"] < 139, report["memory_gib_per_gpu"]
    assert mla["longest_seq_len_per_gpu_gib"]["139"] >= 262144
    assert memory("kimi_k26", 4).at(262144)["total"] > 139

    windowed = drafter("kimi_k26_llama")
    split = {"world_size": 4, "sequence_parallel": 4, "activation_checkpointing": True}
    step = {d.sliding_window: RunMemory(d, 7, **split).at(262144)["training_step"] for d in
            (windowed, dataclasses.replace(windowed, sliding_window=None))}  # fmt: skip
    assert step[2048] < step[None]
