"""The drafter's rope as vLLM serves it, release by release (`VLLM_RELEASES`; docs/export.md, "The rope rule")."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from eagle31.errors import ConfigError

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
# the oldest and the newest vLLM release the exports are tested against
VLLM_RELEASES = ("0.22.0", "0.33.0")
NEWEST = VLLM_RELEASES[-1]
# what each release's get_rope passes to YaRN in a Llama layer (rotary_embedding/__init__.py::get_rope)
YARN_FIELDS = {
    "0.22.0": ("extrapolation_factor", "attn_factor", "beta_fast", "beta_slow", "apply_yarn_scaling", "truncate"),
    "0.33.0": ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate"),
}
# ... and to DeepSeek YaRN in the MLA layer, plus the field that picks deepseek_yarn or deepseek_llama_scaling
# (deepseek_v2.py::DeepseekV2MLAAttention.__init__)
DEEPSEEK_YARN_FIELDS_READ = {
    "0.22.0": ("extrapolation_factor", "attn_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
               "apply_yarn_scaling"),
    "0.33.0": ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor"),
}  # fmt: skip
# magnitude fields of DeepSeek's yarn, dropped from a target's block for a Llama drafter
DEEPSEEK_YARN_FIELDS = ("mscale", "mscale_all_dim", "attention_factor")
_REQUIRED = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
    "yarn": ("factor",),
}


def check_rope(rope: dict[str, Any]) -> None:
    """Refuse, naming the field, a rope block vLLM's EAGLE-3 Llama layer cannot build as eagle31 trains it."""
    rope_type = rope.get("rope_type")
    if rope_type not in ROPE_TYPES:
        raise ConfigError(
            f"drafter.rope_parameters.rope_type={rope_type!r} is not supported (one of {list(ROPE_TYPES)})"
        )
    if "rope_theta" not in rope:
        raise ConfigError(f"drafter.rope_parameters needs rope_theta, got {rope!r}")
    for name in _REQUIRED.get(rope_type, ()):
        value = rope.get(name)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ConfigError(
                f"drafter.rope_parameters.{name} must be a number for rope_type={rope_type!r}, got {value!r}"
            )
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(
            f"drafter.rope_parameters.partial_rotary_factor={rope['partial_rotary_factor']!r} is not supported "
            "(the drafter rotates whole heads)"
        )


def inverse_frequencies(
    rope: dict[str, Any], head_dim: int, max_position_embeddings: int, release: str = NEWEST
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim // 2] float64, cos/sin magnitude) as vLLM `release`'s `get_rope` builds them."""
    check_rope(rope)
    rope_type = rope["rope_type"]
    base = 1.0 / float(rope["rope_theta"]) ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if rope_type in ("default", "dynamic"):  # vLLM's dynamic NTK keeps theta at every position it serves
        return base, 1.0
    factor = float(rope["factor"])
    if rope_type == "linear":
        return base / factor, 1.0
    original = int(rope.get("original_max_position_embeddings") or max_position_embeddings)
    if rope_type == "llama3":
        return _llama3(base, factor, float(rope["low_freq_factor"]), float(rope["high_freq_factor"]), original), 1.0
    extrapolation, magnitude = llama_yarn_reading(rope, release)
    return yarn_frequencies(base, rope, original, extrapolation, rope.get("truncate", True)), magnitude


def _llama3(base: torch.Tensor, factor: float, low: float, high: float, original: int) -> torch.Tensor:
    wavelength = 2 * math.pi / base
    blend = ((original / wavelength - low) / (high - low)).clamp(0, 1) if low != high else torch.zeros_like(base)
    scaled = torch.where(wavelength > original / low, base / factor, (1 - blend) * base / factor + blend * base)
    return torch.where(wavelength < original / high, base, scaled)


def yarn_frequencies(
    base: torch.Tensor, rope: dict[str, Any], original: int, extrapolation: float, truncate: bool = True
) -> torch.Tensor:
    """YaRN's ramp from `base` [d/2] to `base / factor` between the dims of beta_fast and beta_slow turns."""
    d, theta = 2 * base.numel(), float(rope["rope_theta"])

    def dim_of(rotations: float) -> float:
        return d * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(float(rope.get("beta_fast") or 32)), dim_of(float(rope.get("beta_slow") or 1))
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / (high - low if high != low else 0.001)).clamp(0, 1)
    keep = (1 - ramp) * extrapolation  # 1: unscaled, 0: divided by factor
    return base / float(rope["factor"]) * (1 - keep) + base * keep


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude `0.1 * mscale * ln(factor) + 1` (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def deepseek_yarn_scales(rope: dict[str, Any], release: str = NEWEST) -> tuple[float, float, float]:
    """(extrapolation, cos/sin magnitude, softmax-scale factor) of vLLM `release`'s MLA yarn (docs/export.md)."""
    factor = float(rope["factor"])
    read = DEEPSEEK_YARN_FIELDS_READ[release]
    if "apply_yarn_scaling" in read:
        llama_scaling = rope.get("apply_yarn_scaling", True) is False
    else:
        llama_scaling = rope.get("attention_factor") == 1.0
    attn_factor = float(rope.get("attn_factor", 1.0)) if "attn_factor" in read else 1.0
    extrapolation = float(rope.get("extrapolation_factor", 1.0)) if "extrapolation_factor" in read else 1.0
    all_dim = yarn_mscale(factor, float(rope.get("mscale_all_dim", 0)))
    magnitude = yarn_mscale(factor, float(rope.get("mscale", 1))) / all_dim
    return extrapolation, magnitude * attn_factor, 1.0 if llama_scaling else all_dim**2


def ambiguity(
    rope: dict[str, Any], reading: Callable[[dict[str, Any], str], tuple[float, ...]],
    fields: dict[str, tuple[str, ...]], quantities: str,
) -> str | None:  # fmt: skip
    """None when the supported vLLM releases read `rope` alike, else one line naming the fields they read differently;
    `reading(rope, release)`: the numbers (`quantities`) a release makes of a yarn block, reading `fields[release]`."""
    if rope.get("rope_type") not in ("yarn", "deepseek_yarn") or not isinstance(rope.get("factor"), (int, float)):
        return None
    readings = {release: reading(rope, release) for release in VLLM_RELEASES}
    if all(math.isclose(x, y, rel_tol=1e-6) for r in VLLM_RELEASES for x, y in zip(readings[r], readings[NEWEST])):
        return None
    readers = {k: [r for r in VLLM_RELEASES if k in fields[r]] for k in rope}
    named = ", ".join(f"{k} (read by vLLM {' and '.join(rs)} only)" for k, rs in readers.items() if 0 < len(rs) < 2)
    numbers = "; ".join(f"{r}: " + ", ".join(f"{x:.4g}" for x in readings[r]) for r in VLLM_RELEASES)
    return f"fields {named or 'mscale, mscale_all_dim'} give another rope in each release ({quantities}: {numbers})"


def llama_yarn_reading(rope: dict[str, Any], release: str = NEWEST) -> tuple[float, float]:
    """(extrapolation factor, cos/sin magnitude) of vLLM `release`'s YaRN in a Llama layer (docs/export.md)."""
    factor, read = float(rope["factor"]), YARN_FIELDS[release]
    extrapolation = float(rope.get("extrapolation_factor", 1.0)) if "extrapolation_factor" in read else 1.0
    if "attn_factor" in read:  # 0.22.0
        scaling = yarn_mscale(factor) if rope.get("apply_yarn_scaling", True) else 1.0
        return extrapolation, scaling * float(rope.get("attn_factor", 1.0))
    if rope.get("attention_factor") is not None:
        return extrapolation, float(rope["attention_factor"])
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return extrapolation, yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return extrapolation, yarn_mscale(factor)


def for_llama_drafter(rope: dict[str, Any]) -> dict[str, Any]:
    """A target's rope for a Llama-attention drafter: yarn without DeepSeek's magnitude fields (docs/export.md)."""
    return {k: v for k, v in rope.items() if rope.get("rope_type") != "yarn" or k not in DEEPSEEK_YARN_FIELDS}
