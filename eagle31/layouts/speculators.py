"""The `speculators` library's layout (`export.formats=[speculators]`), which vLLM also serves (docs/export.md)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from eagle31.config import DrafterConfig
from eagle31.errors import ConfigError
from eagle31.layouts.layout import VLLM_PREFIX, Layout, eagle_fields, layer_fields, provenance, read_eagle, read_layer

# speculators' model type and architecture of a chain drafter and of a parallel one (P-EAGLE)
MODEL_TYPES = {False: ("eagle3", "Eagle3Speculator"), True: ("peagle", "PEagleSpeculator")}
LAYER_MODEL_TYPES = ("llama", "qwen3")  # the layers vLLM's speculators reader maps
THREE_ONE_FLAGS = ("fc_norm", "norm_output")  # the switches vLLM 0.22 reads from transformer_layer_config only


class SpeculatorsLayout(Layout):
    name = "speculators"
    library_name = "speculators"
    card_name = "`speculators` layout (`speculators_model_type: eagle3`)"
    min_vllm = "0.22"
    layer_prefix = VLLM_PREFIX
    embeds_by_default = True

    def recognises(self, meta: dict[str, Any]) -> bool:
        return "speculators_model_type" in meta

    def check(self, config: DrafterConfig, target: str | None) -> None:
        kind = config.kind
        if kind.model_type not in LAYER_MODEL_TYPES:
            raise ConfigError(
                f"export format 'speculators' cannot carry {kind.label} (drafter.attention={config.attention}): the "
                f"speculators layout maps only Llama/Qwen3 layers; export it as 'eagle3' (vLLM's {kind.architecture})"
            )
        if not target:
            raise ConfigError(
                "the speculators layout must name its target (speculators_config.verifier.name_or_path; speculators' "
                "from_pretrained fails on null) and the drafter's config names none: pass the target's Hub id or path "
                "(scripts/export.py target=...)"
            )
        if Path(target).exists() or target.startswith(("/", ".", "~")):
            warnings.warn(
                f"speculators_config.verifier.name_or_path={target} is a local path, which `vllm serve <export>` (vLLM "
                f'0.33) refuses: serve it as `vllm serve {target} --speculative-config \'{{"method": "eagle3", '
                "\"model\": <export>}'`, or give target.name the target's Hub id",
                stacklevel=2,
            )

    def config(
        self, config: DrafterConfig, *, dtype: str, trained_context: int | None, num_speculative_tokens: int,
        target: str | None,
    ) -> dict[str, Any]:  # fmt: skip
        model_type, architecture = MODEL_TYPES[config.parallel_drafting]
        return {
            "architectures": [architecture],
            "speculators_model_type": model_type,
            "speculators_config": {
                "algorithm": model_type,
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": num_speculative_tokens,
                                      "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": target, "architectures": list(config.target_architectures)},
            },
            "transformer_layer_config": {**layer_fields(config, dtype, trained_context),
                                         **{name: getattr(config, name) for name in THREE_ONE_FLAGS}},
            **eagle_fields(config),
            **provenance(config, target),
        }  # fmt: skip

    def stored(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """`mask_hidden` as speculators' `PEagleDraftModel` holds it, [1, 1, n·Ht] (vLLM views it as [1, n·Ht])."""
        return tensor.view(1, 1, -1) if name == "mask_hidden" else tensor

    def num_speculative_tokens(self, meta: dict[str, Any]) -> int | None:
        methods = (meta.get("speculators_config") or {}).get("proposal_methods") or []
        return methods[0]["speculative_tokens"] if methods else None

    def read(self, meta: dict[str, Any]) -> dict[str, Any]:
        if meta.get("speculators_model_type") not in {t for t, _ in MODEL_TYPES.values()}:
            raise ConfigError(
                f"speculators_model_type={meta.get('speculators_model_type')!r} is not an EAGLE-3 drafter"
            )
        block = meta.get("transformer_layer_config")
        if not isinstance(block, dict):
            raise ConfigError("a speculators config needs a transformer_layer_config block")
        layer = read_layer(block)
        values = {**layer, **read_eagle(meta, layer, switch_defaults={"norm_before_residual": True})}
        verifier = (meta.get("speculators_config") or {}).get("verifier") or {}
        values["target_name_or_path"] = values["target_name_or_path"] or verifier.get("name_or_path")
        values["target_architectures"] = values["target_architectures"] or tuple(verifier.get("architectures") or ())
        return values
