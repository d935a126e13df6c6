"""Read single tensors of a target checkpoint (embedding, lm_head) without loading the model.

A Kimi-scale target is a terabyte of weights; the trainer needs only its input
embedding and its lm_head ([V, Ht] each). They are read from the checkpoint's
safetensors files (sharded with `model.safetensors.index.json` or single),
under any of the usual prefixes (`model.`, `language_model.` for multimodal
wrappers such as Kimi K2.6). Tied embeddings: lm_head falls back to the embedding.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from eagle31.config import ConfigError

EMBED_NAMES = ("model.embed_tokens.weight", "embed_tokens.weight", "transformer.wte.weight")
LM_HEAD_NAMES = ("lm_head.weight", "output.weight")
WRAPPER_PREFIXES = ("", "language_model.", "model.language_model.")


def _weight_map(target_dir: Path) -> dict[str, str]:
    """tensor name -> safetensors file name."""
    index = target_dir / "model.safetensors.index.json"
    if index.is_file():
        return json.loads(index.read_text())["weight_map"]
    files = sorted(target_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no safetensors weights in target directory {target_dir}")
    names: dict[str, str] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            names.update({k: f.name for k in sf.keys()})
    return names


def read_target_tensor(
    target_dir: str | Path, candidates: tuple[str, ...], *, required: bool = True, rows: int | None = None
) -> torch.Tensor | None:
    """The first of `candidates` (tried under every wrapper prefix) found in the target's weights (its first `rows` only)."""
    target_dir = Path(target_dir)
    weight_map = _weight_map(target_dir)
    for prefix in WRAPPER_PREFIXES:
        for name in candidates:
            full = prefix + name
            if full in weight_map:
                with safe_open(str(target_dir / weight_map[full]), framework="pt") as sf:
                    return sf.get_tensor(full) if rows is None else sf.get_slice(full)[:rows]
    if required:
        raise ConfigError(f"target {target_dir}: no tensor among {list(candidates)}")
    return None


def read_target_embeddings(target_dir: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(embedding [V, Ht], lm_head [V, Ht]) of the target at `target_dir`."""
    embed = read_target_tensor(target_dir, EMBED_NAMES)
    lm_head = read_target_tensor(target_dir, LM_HEAD_NAMES, required=False)
    return embed, (embed if lm_head is None else lm_head)
