"""The memory estimate of the dry run: the shipped Kimi K2.6 recipes on the cards they target, and the longest T."""

from pathlib import Path

import pytest

from eagle31.distributed import init_world
from eagle31.estimate import (
    GiB, activation_bytes, count_parameters, estimate_memory, layer_gradient_bytes, longest_fitting_length, loss_moment_bytes,
)  # fmt: skip
from eagle31.plan import plan_run
from eagle31.recipe import load_recipe

RECIPES = Path(__file__).resolve().parent.parent / "recipes"


def drafter(recipe: str):
    return plan_run(load_recipe(RECIPES, [f"recipe={recipe}", "dry_run=true"]), init_world("cpu")).drafter


@pytest.mark.parametrize(
    "recipe,T,gpus,limit",
    [("kimi_k26", 131072, 1, 125), ("kimi_k26", 65536, 8, 60), ("kimi_k26", 65536, 1, 75), ("kimi_k26_llama", 131072, 1, 100)],
)
def test_the_kimi_drafters_fit_their_cards(recipe, T, gpus, limit):
    """128k tokens on one H200 and 64k on 8 cards of 80 GB for the published MLA drafter (as shipped:
    activation checkpointing on, K = 7, bf16)."""
    memory = estimate_memory(drafter(recipe), T, 7, world_size=gpus, activation_checkpointing=True)
    assert memory["total"] <= limit, memory


def test_mla_keeps_latents_and_one_lm_head_gradient():
    """What the estimate says MLA keeps across steps is its latents, and the loss one fp32 lm_head gradient."""
    d = drafter("kimi_k26")
    kept = activation_bytes(d, 1, 7, checkpointing=True, c=2, device="cuda")["kept"]
    assert kept == 7 * (7168 * 2 + (512 + 64) * 2 + 16)  # state, latents, token ids and positions per step
    loss = loss_moment_bytes(d, 65536, 7, c=2, fsdp=True)
    assert 163840 * 7168 * 4 < loss["lm_head_gradient"] < 2 * 163840 * 7168 * 4


def test_llama_keeps_step_inputs_and_only_the_step0_keys_and_values():
    """A Llama step's chain entry is its input (kept anyway): across steps only step 0's keys and values."""
    d = drafter("kimi_k26_llama")
    kept = activation_bytes(d, 1, 7, checkpointing=True, c=2, device="cuda")["kept"]
    assert kept == 7 * (7168 * 2 + 16) + 2 * 64 * 128 * 2


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_the_total_leaves_out_the_gradients_not_yet_formed_at_the_peak(device):
    """FSDP2 forms the sharded fp32 gradients after the backward; one CPU process holds the layer's as
    autograd buffers (counted in the activations) until then, and the lm_head's is in `.grad` once the
    loss's backward has run: the total is the sum less those not there at the peak (a step's here)."""
    d = drafter("kimi_k26")
    m = estimate_memory(d, 65536, 7, world_size=8, activation_checkpointing=True, device=device, compute_bytes=2 if device == "cuda" else 4)
    terms = sum(v for k, v in m.items() if k not in ("total", "gradients_after_the_peak"))
    trainable = count_parameters(d).trainable
    absent = trainable * 4 / 8 if device == "cuda" else (trainable - 163840 * 7168) * 4  # CPU: the lm_head's is there
    assert m["activations"] * GiB > layer_gradient_bytes(d) or device == "cuda"
    assert m["gradients_after_the_peak"] == pytest.approx(-absent / GiB)
    assert m["total"] == pytest.approx(terms - absent / GiB)
    if device == "cuda":
        assert m["frozen_embedding"] == pytest.approx(163840 * 7168 * 2 / GiB)  # whole, bf16, on every GPU
        assert m["gathered_parameters"] == pytest.approx(2 * count_parameters(d).trainable * 2 / GiB)


@pytest.mark.parametrize("gib", [80, 139])
def test_longest_fitting_length_is_the_boundary(gib):
    d = drafter("kimi_k26")
    T = longest_fitting_length(d, 7, gib, activation_checkpointing=True)
    assert estimate_memory(d, T, 7, activation_checkpointing=True)["total"] <= gib
    assert estimate_memory(d, T + 1024, 7, activation_checkpointing=True)["total"] > gib


def test_nothing_fits_a_card_smaller_than_the_fixed_terms():
    assert longest_fitting_length(drafter("kimi_k26"), 7, 20, activation_checkpointing=True) == 0


def test_a_sequence_split_n_ways_holds_a_shard_of_every_length_term_and_the_whole_sequence_of_keys():
    """train.sequence_parallel = N: what grows with T is taken at a shard and its halo; the exchanged keys
    (MLA latents gathered, their gradients) are the whole sequence's on the last rank, their decompressed
    keys and values one block's."""
    from eagle31.attention.query_tail import QueryTail
    from eagle31.estimate import prefix_block_bytes, sequence_keys_bytes

    d, T, K = drafter("kimi_k26"), 262144, 7
    whole = estimate_memory(d, T, K, world_size=4, activation_checkpointing=True)
    split = estimate_memory(d, T, K, world_size=4, activation_checkpointing=True, sequence_parallel=4)
    shard = estimate_memory(d, T // 4 + K + 1, K, world_size=4, activation_checkpointing=True)
    for term in ("activations", "target_features", "loss_working_set"):
        assert split[term] == pytest.approx(shard[term]) and split[term] < whole[term] / 3.9, term
    assert "sequence_keys" not in whole
    # per token: latents (576, bf16) kept, their gradients in bf16 and fp32; the keys and padded values of
    # 64 heads x 192 exist for one block of positions, whatever T
    assert sequence_keys_bytes(d, 2 * T, 2) - sequence_keys_bytes(d, T, 2) == T * 576 * (2 + 2 + 4)
    block = QueryTail.prefix_block(64, 192)
    assert block == (1 << 24) // (2 * 64 * 192) and prefix_block_bytes(d, 2) > block * 2 * 64 * 192 * (2 + 4)
    assert prefix_block_bytes(d, 2) < 2**30 and sequence_keys_bytes(d, T, 2) < 2 * 2**30
    assert split["sequence_keys"] == pytest.approx(sequence_keys_bytes(d, T, 2) / 2**30)


def test_the_kimi_drafter_trains_256k_tokens_split_over_4_h200s(capsys):
    """The dry run of the full 256k context on 4 GPUs of 141 GiB, each sequence split 4 ways, fits; unsplit it does not."""
    from eagle31.plan import describe_dry_run

    args = ["recipe=kimi_k26", "dry_run=true", "data.max_len=262144", "plan.world_size=4", "plan.gpu_memory_gib=141"]
    split = describe_dry_run(plan_run(load_recipe(RECIPES, [*args, "train.sequence_parallel=4"]), init_world("cpu")))
    assert split["sequence_parallel"] == 4 and split["memory_gib_per_gpu"]["total"] < 141
    assert split["longest_seq_len_per_gpu_gib"]["141"] >= 262144
    assert "each sequence split over 4" in capsys.readouterr().out
    whole = describe_dry_run(plan_run(load_recipe(RECIPES, args), init_world("cpu")))
    assert whole["memory_gib_per_gpu"]["total"] > 141


def test_a_sequence_parallel_size_that_does_not_divide_the_planned_gpus_is_refused():
    from eagle31 import ConfigError

    args = ["recipe=kimi_k26", "dry_run=true", "plan.world_size=6", "train.sequence_parallel=4"]
    with pytest.raises(ConfigError, match="train.sequence_parallel=4 must be >= 1 and divide the world size 6"):
        plan_run(load_recipe(RECIPES, args), init_world("cpu"))
    with pytest.raises(ConfigError, match="train.attention_kernel=reference cannot attend across sequence shards"):
        plan_run(load_recipe(RECIPES, ["recipe=kimi_k26", "dry_run=true", "plan.world_size=4", "train.sequence_parallel=2",
                                       "train.attention_kernel=reference"]), init_world("cpu"))  # fmt: skip


@pytest.mark.parametrize("shape,T,peak_step", [("mla_kimi_heads", 128, 1), ("llama_kimi_heads_no_ckpt", 128, 1),
                                               ("llama_kimi_heads_no_ckpt", 512, 2)])  # fmt: skip
def test_the_peak_is_the_largest_of_the_steps_moments(shape, T, peak_step):
    """The working set is the largest step's moment of the backward, not the deepest step's chain block
    beside every gradient buffer: at short T step 1 (its chain block after the deepest step's backward
    made the projections' gradients), at longer T the deepest step (K - 1 entries deep), as measured
    (`benchmarks/memory_model.py`: K = 3, fp32, one CPU process)."""
    from benchmarks.memory_model import SHAPES, TTT_LENGTH
    from benchmarks.train_step import BenchConfig
    from eagle31.estimate import after_attention_gradient_bytes

    spec = SHAPES["full"][shape]
    cfg = BenchConfig(shape="tiny", overrides=spec["overrides"]).drafter_config()
    checkpointing = spec.get("checkpointing", True)
    steps = activation_bytes(cfg, T, TTT_LENGTH, checkpointing=checkpointing, c=4, device="cpu")["steps"]
    assert len(steps) == TTT_LENGTH and steps.index(max(steps)) == peak_step, steps
    m = estimate_memory(cfg, T, TTT_LENGTH, activation_checkpointing=checkpointing, compute_bytes=4, device="cpu")
    assert m["activations"] * GiB == pytest.approx(max(steps))
    assert after_attention_gradient_bytes(cfg) < layer_gradient_bytes(cfg) / 2  # the deepest step's attention has the fewer
