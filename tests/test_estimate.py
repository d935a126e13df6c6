"""The memory estimate of the dry run: the shipped Kimi K2.6 recipes on the cards they target, and the longest T."""

from pathlib import Path

import pytest

from eagle31.distributed import init_world
from eagle31.estimate import (
    GiB,
    activation_bytes,
    count_parameters,
    estimate_memory,
    layer_gradient_bytes,
    longest_fitting_length,
    loss_moment_bytes,
)  # fmt: skip
from eagle31.plan import plan_run
from eagle31.recipe import load_recipe

RECIPES = Path(__file__).resolve().parent.parent / "recipes"


def drafter(recipe: str):
    return plan_run(load_recipe(RECIPES, [f"recipe={recipe}", "dry_run=true"]), init_world("cpu")).drafter


@pytest.mark.parametrize(
    "recipe,T,gpus,limit",
    [
        ("kimi_k26", 131072, 1, 125),
        ("kimi_k26", 65536, 8, 60),
        ("kimi_k26", 65536, 1, 75),
        ("kimi_k26_llama", 131072, 1, 100),
    ],
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
    m = estimate_memory(
        d,
        65536,
        7,
        world_size=8,
        activation_checkpointing=True,
        device=device,
        compute_bytes=2 if device == "cuda" else 4,
    )
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
    from eagle31.estimate import prefix_block_bytes, sequence_keys_bytes
    from eagle31.sequence_parallel.query_tail import QueryTail

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
    """The full 256k context on 4 H200s (139 GiB), each sequence split 4 ways, fits in the dry run; unsplit it does
    not."""
    from eagle31.plan import describe_dry_run

    args = ["recipe=kimi_k26", "dry_run=true", "data.max_len=262144", "plan.world_size=4", "plan.gpu_memory_gib=139"]
    split = describe_dry_run(plan_run(load_recipe(RECIPES, [*args, "train.sequence_parallel=4"]), init_world("cpu")))
    assert split["sequence_parallel"] == 4 and split["memory_gib_per_gpu"]["total"] < 139
    assert split["longest_seq_len_per_gpu_gib"]["139"] >= 262144
    assert "each sequence split over 4" in capsys.readouterr().out
    whole = describe_dry_run(plan_run(load_recipe(RECIPES, args), init_world("cpu")))
    assert whole["memory_gib_per_gpu"]["total"] > 139


def test_a_sequence_parallel_size_that_does_not_divide_the_planned_gpus_is_refused():
    from eagle31 import ConfigError

    args = ["recipe=kimi_k26", "dry_run=true", "plan.world_size=6", "train.sequence_parallel=4"]
    with pytest.raises(ConfigError, match="train.sequence_parallel=4 must be >= 1 and divide the world size 6"):
        plan_run(load_recipe(RECIPES, args), init_world("cpu"))
    with pytest.raises(ConfigError, match="train.attention_kernel=reference cannot attend across sequence shards"):
        reference = ["plan.world_size=4", "train.sequence_parallel=2", "train.attention_kernel=reference"]
        plan_run(load_recipe(RECIPES, ["recipe=kimi_k26", "dry_run=true", *reference]), init_world("cpu"))


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
    assert (
        after_attention_gradient_bytes(cfg) < layer_gradient_bytes(cfg) / 2
    )  # the deepest step's attention has the fewer


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
    import dataclasses

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


def test_a_windowed_shard_gathers_only_the_keys_its_queries_see():
    import dataclasses

    from eagle31.estimate import prefix_block_bytes, sequence_keys_bytes

    d, T, K = drafter("kimi_k26_llama"), 262144, 7
    w = dataclasses.replace(d, sliding_window=2048)
    assert w.sliding_window == 2048
    shard = T // 4
    entry = 2 * 64 * 128  # Llama: the step-0 keys and values
    assert sequence_keys_bytes(w, T, 2, shard) == (shard + 2047) * entry * (2 + 2 + 4) + prefix_block_bytes(w, 2)
    assert sequence_keys_bytes(
        dataclasses.replace(d, sliding_window=None), T, 2, shard
    ) == T * entry * 8 + prefix_block_bytes(d, 2)
    split = estimate_memory(w, T, K, world_size=4, activation_checkpointing=True, sequence_parallel=4)
    full = estimate_memory(
        dataclasses.replace(d, sliding_window=None),
        T,
        K,
        world_size=4,
        activation_checkpointing=True,
        sequence_parallel=4,
    )
    assert split["sequence_keys"] < full["sequence_keys"] / 3


LONG_CONTEXTS = [(65536, []), (131072, []), (262144, ["plan.world_size=4", "train.sequence_parallel=4"])]


@pytest.mark.parametrize("T, launch", LONG_CONTEXTS, ids=["64k", "128k", "256k"])
def test_the_kimi_recipes_dry_run_at_64k_128k_and_256k_with_their_windows(T, launch, capsys):
    """recipe=kimi_k26_llama carries the 2,048-position window and recipe=kimi_k26 (MLA: vLLM serves no window)
    none; the dry run shows each one's memory at 64k and 128k on one H200 and 256k split over 4, and the window's
    bounded attention: a windowed Llama step costs less, and at 256k its shards gather only the keys they see."""
    from eagle31.plan import describe_dry_run

    def dry_run(recipe, *extra):
        args = [f"recipe={recipe}", "dry_run=true", f"data.max_len={T}", "plan.gpu_memory_gib=139", *launch, *extra]
        return describe_dry_run(plan_run(load_recipe(RECIPES, args), init_world("cpu")))

    llama, mla = dry_run("kimi_k26_llama"), dry_run("kimi_k26")
    out = capsys.readouterr().out
    assert llama["drafter"]["sliding_window"] == 2048 and mla["drafter"]["sliding_window"] is None
    assert "sliding_window=2048" in out and "sliding_window=None" in out
    assert f"memory per GPU (T={T}, K=7" in out and "TFLOP per T=" in out
    for report in (llama, mla):
        assert report["memory_gib_per_gpu"]["total"] < 139, report["memory_gib_per_gpu"]
    full = dry_run("kimi_k26_llama", "drafter.sliding_window=null")
    assert llama["flops_per_sequence"] < full["flops_per_sequence"]
    assert llama["attention_flops_share"] < 0.05 < full["attention_flops_share"]
    if launch:
        assert llama["memory_gib_per_gpu"]["sequence_keys"] < full["memory_gib_per_gpu"]["sequence_keys"] / 3
