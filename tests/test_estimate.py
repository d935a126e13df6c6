"""The memory estimate of the dry run: the shipped Kimi K2.6 recipes on the cards they target, and the longest T."""

from pathlib import Path

import pytest

from eagle31.distributed import init_world
from eagle31.estimate import activation_bytes, estimate_memory, longest_fitting_length, loss_moment_bytes
from eagle31.plan import plan_run
from eagle31.recipe import load_recipe

RECIPES = Path(__file__).resolve().parent.parent / "recipes"


def drafter(recipe: str):
    return plan_run(load_recipe(RECIPES, [f"recipe={recipe}", "dry_run=true"]), init_world("cpu")).drafter


@pytest.mark.parametrize(
    "recipe,T,gpus,limit",
    [("kimi_k26", 131072, 1, 125), ("kimi_k26", 65536, 8, 60), ("kimi_k26", 65536, 1, 80), ("kimi_k26_llama", 131072, 1, 120)],
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


@pytest.mark.parametrize("gib", [80, 139])
def test_longest_fitting_length_is_the_boundary(gib):
    d = drafter("kimi_k26")
    T = longest_fitting_length(d, 7, gib, activation_checkpointing=True)
    assert estimate_memory(d, T, 7, activation_checkpointing=True)["total"] <= gib
    assert estimate_memory(d, T + 1024, 7, activation_checkpointing=True)["total"] > gib


def test_nothing_fits_a_card_smaller_than_the_fixed_terms():
    assert longest_fitting_length(drafter("kimi_k26"), 7, 20, activation_checkpointing=True) == 0
