"""The EAGLE-3 HF layout (`export.formats=[eagle3]`) that vLLM's `llama_eagle3.py` and `deepseek_eagle3.py` read:
eagle31's names, no embedding; that of a config no other layout recognises, SpecForge's and TorchSpec's among them."""

from __future__ import annotations

from typing import Any

from eagle31.config import DrafterConfig
from eagle31.layouts.layout import Layout, eagle_fields, layer_fields, provenance, read_eagle, read_layer


class Eagle3Layout(Layout):
    name = "eagle3"
    library_name = "vllm"
    card_name = "EAGLE-3 layout (`LlamaForCausalLMEagle3`)"
    min_vllm = "0.22"
    dialects = ("specforge", "torchspec")

    def config(
        self, config: DrafterConfig, *, dtype: str, trained_context: int | None, num_speculative_tokens: int,
        target: str | None,
    ) -> dict[str, Any]:  # fmt: skip
        return {
            "architectures": [config.kind.architecture],
            **layer_fields(config, dtype, trained_context),
            **eagle_fields(config),
            **provenance(config, target),
        }

    def read(self, meta: dict[str, Any]) -> dict[str, Any]:
        layer = read_layer(meta)
        return {**layer, **read_eagle(meta, layer, switch_defaults={})}
