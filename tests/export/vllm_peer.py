"""Run by a vLLM release's own interpreter (tests/peers.py), never imported by the project: vLLM's CPU-side code
applied to eagle31's exports. One call reads a JSON request (argv[1]) and prints one JSON answer.

For every export directory, what `vllm serve TARGET --speculative-config '{"method": "eagle3", "model": DIR}'`
does with it before it needs a GPU, in the release's own code:

* `transformers_utils/config.py::get_config(DIR, hf_overrides_fn=SpeculativeConfig.hf_config_override)`, as
  `config/speculative.py::SpeculativeConfig.__post_init__` builds the draft's `ModelConfig`;
* `transformers_utils/configs/eagle.py::EAGLEConfig(cfg, method="eagle3")` (skipped for a speculators config,
  which vLLM keeps), then the architecture looked up in `ModelRegistry.get_supported_archs()`;
* for a speculators export, `transformers_utils/config.py::maybe_override_with_speculators` (what
  `vllm serve DIR` runs first), its result or its error;
* the rope table the drafter's layer builds: `model_executor/layers/rotary_embedding::get_rope` on the parsed
  rope, its `cos_sin_cache` rows at the asked positions. For an MLA drafter the rope type is first chosen as
  `deepseek_v2.py::DeepseekV2MLAAttention.__init__` chooses it (0.22.0: from `rope_scaling`, as
  `deepseek_eagle3.py::DeepseekV2Eagle3DecoderLayer.__init__` rewrote it), which needs a GPU to construct;
* 0.33.0's `config/speculative.py::_rope_only_sizes_cache` (whether the served length is capped at the draft's
  `max_position_embeddings`, `VllmConfig` otherwise);
* the sliding window the drafter's attention is built with: for the Llama layer, `model_executor/models/
  llama.py::LlamaAttention.__init__` run on the parsed config (with `target_layer_count` set and the layer
  prefix given as `llama_eagle3.py::Eagle3LlamaForCausalLM` and its `LlamaModel` give them), its projections
  and its `Attention` (which need a GPU and a parallel state) replaced in that module by stand-ins that record
  what they are handed; for the MLA layer, whether `deepseek_v2.py::DeepseekV2MLAAttention.__init__` or
  `layers/mla.py::MultiHeadLatentAttentionWrapper.__init__` (which builds its `MLAAttention`) reads a window.

And the fields `SpeculativeConfig` declares, for the serving commands of docs/export.md.
"""

import dataclasses
import json
import sys
import traceback

import torch
import vllm
from vllm.config import DeviceConfig, SpeculativeConfig, VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.models import ModelRegistry
from vllm.transformers_utils.config import get_config, maybe_override_with_speculators
from vllm.transformers_utils.configs.eagle import EAGLEConfig

OLDEST = "0.22.0"
FIELDS = (
    "model_type",
    "architectures",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "draft_vocab_size",
    "target_hidden_size",
    "num_aux_hidden_states",
    "eagle_aux_hidden_state_layer_ids",
    "fc_norm",
    "norm_output",
    "norm_before_residual",
    "norm_before_fc",
    "max_position_embeddings",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "rms_norm_eps",
    "eagle_config",
    "sliding_window",
    "layer_types",
)


def plain(value):
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value if isinstance(value, (str, int, float, bool, type(None))) else str(value)


def mla_rope(cfg) -> dict:
    """The rope parameters vLLM's DeepSeek attention hands get_rope (module docstring)."""
    if vllm.__version__ == OLDEST:
        scaling = getattr(cfg, "rope_scaling", None)
        rope = {**scaling, "rope_type": "deepseek_yarn"} if scaling else {"rope_type": "default"}
        rope.setdefault("rope_theta", cfg.rope_parameters["rope_theta"])
        if rope["rope_type"] != "default":
            rope["rope_type"] = "deepseek_yarn" if rope.get("apply_yarn_scaling", True) else "deepseek_llama_scaling"
        return rope
    rope = dict(cfg.rope_parameters)
    if rope["rope_type"] != "default":
        rope["rope_type"] = "deepseek_llama_scaling" if rope.get("attention_factor") == 1.0 else "deepseek_yarn"
    return rope


def rope_rows(cfg, mla: bool, positions: list[int]) -> dict:
    if mla:
        rope = mla_rope(cfg)
        dim, neox = cfg.qk_rope_head_dim, False
    else:
        rope = dict(cfg.rope_parameters)
        dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        neox = True
    emb = get_rope(dim, max_position=cfg.max_position_embeddings, rope_parameters=rope, is_neox_style=neox)
    cache = emb.cos_sin_cache.to(torch.float64)
    return {
        "class": type(emb).__name__,
        "rope": plain(rope),
        "table_len": cache.shape[0],
        "rows": cache[[p for p in positions if p < cache.shape[0]]].tolist(),
    }


class _Recorder(torch.nn.Module):
    """Stands in for a layer vLLM builds with a GPU; remembers the keyword arguments of its last construction."""

    handed: dict = {}

    def __init__(self, *args, **kwargs):
        super().__init__()
        type(self).handed = kwargs


def llama_attention_window(cfg, target_layers: int):
    """The `per_layer_sliding_window` vLLM's Llama EAGLE-3 layer hands its `Attention` (module docstring)."""
    from vllm.model_executor.models import llama

    stand_ins = {
        "QKVParallelLinear": _Recorder,
        "RowParallelLinear": _Recorder,
        "Attention": _Recorder,
        "get_tensor_model_parallel_world_size": lambda: 1,
    }
    kept = {name: getattr(llama, name) for name in stand_ins}
    cfg.target_layer_count = target_layers  # llama_eagle3.py::Eagle3LlamaForCausalLM.__init__
    try:
        for name, value in stand_ins.items():
            setattr(llama, name, value)
        heads = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads)
        # llama_eagle3.py::LlamaModel names its one layer f"layers.{start_layer_id}" under "model"; the decoder
        # layer hands its attention f"{prefix}.self_attn"
        llama.LlamaAttention(
            cfg,
            *heads,
            max_position_embeddings=cfg.max_position_embeddings,
            prefix=f"model.layers.{target_layers}.self_attn",
        )
        return _Recorder.handed.get("per_layer_sliding_window")
    finally:
        for name, value in kept.items():
            setattr(llama, name, value)


def mla_reads_a_window() -> bool:
    import inspect

    from vllm.model_executor.layers.mla import MultiHeadLatentAttentionWrapper
    from vllm.model_executor.models.deepseek_v2 import DeepseekV2MLAAttention

    builders = (DeepseekV2MLAAttention.__init__, MultiHeadLatentAttentionWrapper.__init__)
    return any("sliding_window" in inspect.getsource(f) for f in builders)


def parallel_drafting_token(cfg) -> dict:
    """The mask token `v1/spec_decode/llm_base_proposer.py::SpecDecodeBaseProposer._init_parallel_drafting_params`
    reads from the draft's config when the drafter is served with `parallel_drafting`, on a stand-in proposer
    (a real one needs a GPU): its token id, or the error it stops with."""
    from types import SimpleNamespace

    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    proposer = SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=cfg), pass_hidden_states_to_model=False)
    try:
        SpecDecodeBaseProposer._init_parallel_drafting_params(proposer)
    except ValueError as e:
        return {"error": str(e).splitlines()[0]}
    return {"token_id": proposer.parallel_drafting_token_id}


def read_export(path: str, positions: list[int]) -> dict:
    try:
        cfg = get_config(path, trust_remote_code=False, hf_overrides_fn=SpeculativeConfig.hf_config_override)
    except Exception as e:  # what vLLM would stop with
        return {"error": f"{type(e).__name__}: {e}"}
    speculators = type(cfg).__name__ == "SpeculatorsConfig"
    eagle = cfg if speculators else EAGLEConfig(cfg, method="eagle3", model_type="eagle")
    archs = list(eagle.architectures)
    answer = {
        "config_class": type(cfg).__name__,
        "model_type": cfg.model_type,
        "eagle_architectures": archs,
        "registered": all(a in ModelRegistry.get_supported_archs() for a in archs),
        "fields": {k: plain(getattr(eagle, k)) for k in FIELDS if hasattr(eagle, k)},
        "parallel_drafting": parallel_drafting_token(eagle),
    }
    import vllm.config.speculative as speculative

    if hasattr(speculative, "_rope_only_sizes_cache"):  # 0.33.0
        answer["rope_only_sizes_cache"] = speculative._rope_only_sizes_cache(cfg)
    mla = any("Deepseek" in a for a in archs)
    answer["rope_table"] = rope_rows(eagle, mla, positions)
    if mla:
        answer["attention_window"] = "read" if mla_reads_a_window() else None
    else:
        target_layers = json.load(open(f"{path}/config.json")).get("eagle31", {}).get("target_num_layers") or 32
        answer["attention_window"] = llama_attention_window(eagle, target_layers)
    if speculators:
        try:
            model, _, spec = maybe_override_with_speculators(model=path, tokenizer=None, trust_remote_code=False)
            answer["serve"] = {"model": model, "speculative_config": plain(spec)}
        except ValueError as e:
            answer["serve"] = {"error": str(e)}
    return answer


def main() -> None:
    request = json.loads(open(sys.argv[1]).read())
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):  # get_rope's CustomOps
        exports = {}
        for path in request.get("exports", []):
            try:
                exports[path] = read_export(path, request.get("positions", [0, 1]))
            except Exception:
                exports[path] = {"crash": traceback.format_exc()[-3000:]}
    fields = {f.name: str(f.type) for f in dataclasses.fields(SpeculativeConfig)}
    print(json.dumps({"version": vllm.__version__, "exports": exports, "speculative_config_fields": fields}))


main()
