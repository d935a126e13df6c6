"""Drafter shapes of the benchmarks, read from the recipes rather than typed a second time.

A recipe whose target is a shipped config file (`recipes/targets/*.json`) composes without any
weights, so its drafter (`DrafterConfig`) is known exactly as training would build it:

    recipe_drafter("kimi_k26")   # the drafter of `python train/main.py recipe=kimi_k26`
    recipe_shapes()              # every such recipe: name -> RecipeShape

`TINY` is the one shape typed here: a CPU-sized drafter for smoke runs and CPU proxies.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path

from eagle31.attention import DrafterAttention
from eagle31.config import DrafterConfig
from eagle31.errors import ConfigError
from eagle31.plan import drafter_overrides
from eagle31.recipe import load_recipe
from eagle31.target import load_target_config

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"

TINY = dict(
    hidden_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    intermediate_size=768,
    vocab_size=8192,
    draft_vocab_size=2048,
    target_num_layers=8,
    aux_layer_ids=(2, 4, 5),
)


@dataclass(frozen=True)
class RecipeShape:
    """The drafter a recipe trains, and what it is trained for."""

    recipe: str
    target: str  # the recipe's target.name, e.g. "moonshotai/Kimi-K2.6"
    drafter: DrafterConfig

    @property
    def attention(self) -> DrafterAttention:
        """The drafter's attention kind (Llama's unless the config names another, e.g. MLA)."""
        return DrafterAttention.parse(getattr(self.drafter, "attention", DrafterAttention.llama))


def recipe_names() -> list[str]:
    return sorted(p.stem for p in (RECIPES_DIR / "recipe").glob("*.yaml"))


@functools.cache
def recipe_shape(recipe: str) -> RecipeShape | None:
    """The drafter of `recipe`; None when its target is built locally or loaded from weights (no shipped config)."""
    cfg = load_recipe(RECIPES_DIR, [f"recipe={recipe}"])
    if not cfg.target.config:
        return None
    drafter = DrafterConfig.from_target_config(load_target_config(cfg.target.config), **drafter_overrides(cfg.drafter))
    if cfg.data.max_len > drafter.max_position_embeddings:  # as training does for long-context recipes
        drafter = dataclasses.replace(drafter, max_position_embeddings=int(cfg.data.max_len))
    return RecipeShape(recipe, str(cfg.target.name), drafter)


def recipe_shapes() -> dict[str, RecipeShape]:
    """Every recipe that carries its target's config, by recipe name."""
    shapes = {name: recipe_shape(name) for name in recipe_names()}
    return {name: shape for name, shape in shapes.items() if shape is not None}


def recipe_drafter(recipe: str) -> DrafterConfig:
    shape = recipe_shape(recipe)
    if shape is None:
        raise ConfigError(f"recipe {recipe!r} has no shipped target config (target.config), so no fixed drafter shape")
    return shape.drafter
