"""The drafter's rotary embedding as vLLM serves it (docs/design.md §3: train what vLLM serves).

A Llama-attention drafter trains with the rope that vLLM builds from its exported config:
vLLM's `get_rope(head_dim, max_position, rope_parameters)` for the EAGLE-3 Llama layer.
`inverse_frequencies` gives that rope's inverse frequencies and the factor its cos/sin
tables are multiplied by (the magnitude); every q·k logit scales with its square.

    default   theta^(-2i/d)
    linear    default / factor
    dynamic   default: vLLM's dynamic-NTK table keeps theta at every position
              (transformers changes theta only past max_position_embeddings, which is
              never below the trained context)
    llama3    default divided by factor for wavelengths above original/low_freq_factor,
              kept below original/high_freq_factor, blended linearly in between
    yarn      a ramp between default/factor and default over the dimensions whose
              rotations at original_max_position_embeddings lie between beta_slow and
              beta_fast; magnitude (0.1·ln(factor) + 1)·attn_factor

transformers and vLLM read some yarn fields differently. transformers takes the magnitude
from `attention_factor`, or from DeepSeek's `mscale`/`mscale_all_dim` ratio (1.0 for Kimi
K2.6's block); vLLM's Llama layer ignores all three. vLLM alone reads `attn_factor`,
`extrapolation_factor` and `apply_yarn_scaling`. (A proposal in vLLM would honour
the DeepSeek fields, so they may also mean different things in different vLLM versions.)
`ambiguity` says when a block means different ropes in the two; `for_llama_drafter` drops
the DeepSeek-only fields from a target's block, so that the drafter's rope means the same
everywhere and no number has to work around one reader.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from eagle31.errors import ConfigError

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
# magnitude fields of DeepSeek's yarn that transformers honours and vLLM's Llama layer ignores
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
        raise ConfigError(f"drafter.rope_parameters.rope_type={rope_type!r} is not supported (one of {list(ROPE_TYPES)})")
    if "rope_theta" not in rope:
        raise ConfigError(f"drafter.rope_parameters needs rope_theta, got {rope!r}")
    for name in _REQUIRED.get(rope_type, ()):
        value = rope.get(name)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ConfigError(f"drafter.rope_parameters.{name} must be a number for rope_type={rope_type!r}, got {value!r}")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(
            f"drafter.rope_parameters.partial_rotary_factor={rope['partial_rotary_factor']!r} is not supported "
            "(the drafter rotates whole heads)"
        )


def inverse_frequencies(rope: dict[str, Any], head_dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim // 2] float64, cos/sin magnitude) as vLLM's `get_rope` builds them."""
    check_rope(rope)
    rope_type = rope["rope_type"]
    theta = float(rope["rope_theta"])
    base = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if rope_type in ("default", "dynamic"):
        return base, 1.0
    factor = float(rope["factor"])
    if rope_type == "linear":
        return base / factor, 1.0
    original = int(rope.get("original_max_position_embeddings") or max_position_embeddings)
    if rope_type == "llama3":
        return _llama3(base, factor, float(rope["low_freq_factor"]), float(rope["high_freq_factor"]), original), 1.0
    return _yarn(base, head_dim, theta, factor, original, rope), vllm_yarn_magnitude(rope)


def _llama3(base: torch.Tensor, factor: float, low: float, high: float, original: int) -> torch.Tensor:
    wavelength = 2 * math.pi / base
    if low == high:
        blend = torch.zeros_like(base)
    else:
        blend = ((original / wavelength - low) / (high - low)).clamp(0, 1)
    scaled = torch.where(wavelength > original / low, base / factor, (1 - blend) * base / factor + blend * base)
    return torch.where(wavelength < original / high, base, scaled)


def _yarn(
    base: torch.Tensor, head_dim: int, theta: float, factor: float, original: int, rope: dict[str, Any]
) -> torch.Tensor:
    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times over `original` positions
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(float(rope.get("beta_fast") or 32)), dim_of(float(rope.get("beta_slow") or 1))
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = (1 - ramp) * float(rope.get("extrapolation_factor", 1.0))  # 1: unscaled, 0: divided by factor
    return base / factor * (1 - keep) + base * keep


def _log_magnitude(factor: float, weight: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * weight * math.log(factor) + 1.0


def vllm_yarn_magnitude(rope: dict[str, Any]) -> float:
    """The cos/sin factor of vLLM's YaRN: (0.1·ln(factor) + 1)·attn_factor (attn_factor alone without yarn scaling)."""
    attn_factor = float(rope.get("attn_factor", 1.0))
    return _log_magnitude(float(rope["factor"])) * attn_factor if rope.get("apply_yarn_scaling", True) else attn_factor


def transformers_yarn_magnitude(rope: dict[str, Any]) -> float:
    """The cos/sin factor transformers' yarn gives the same block (attention_factor, then DeepSeek's mscale ratio)."""
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    factor = float(rope["factor"])
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return _log_magnitude(factor, mscale) / _log_magnitude(factor, mscale_all_dim)
    return _log_magnitude(factor)


def ambiguity(rope: dict[str, Any]) -> str | None:
    """None when transformers and vLLM read `rope` as the same rope; otherwise why not, in one line."""
    if rope.get("rope_type") != "yarn" or not isinstance(rope.get("factor"), (int, float)):
        return None
    reasons = []
    served, read = vllm_yarn_magnitude(rope), transformers_yarn_magnitude(rope)
    if not math.isclose(served, read, rel_tol=1e-6):
        fields = [k for k in (*DEEPSEEK_YARN_FIELDS, "attn_factor", "apply_yarn_scaling") if k in rope]
        reasons.append(f"cos/sin magnitude {read:.4g} in transformers but {served:.4g} in vLLM (fields {', '.join(fields)})")
    if float(rope.get("extrapolation_factor", 1.0)) != 1.0:
        reasons.append(f"extrapolation_factor={rope['extrapolation_factor']} changes the frequencies in vLLM only")
    return "; ".join(reasons) or None


def for_llama_drafter(rope: dict[str, Any]) -> dict[str, Any]:
    """A target's rope block for a Llama-attention drafter: yarn without DeepSeek's magnitude fields.

    Both transformers and vLLM then give the magnitude (0.1·ln(factor) + 1); for Kimi K2.6
    (factor 64) that is 1.416 where transformers read Kimi's own block as 1.0.
    """
    if rope.get("rope_type") != "yarn":
        return dict(rope)
    return {k: v for k, v in rope.items() if k not in DEEPSEEK_YARN_FIELDS}
