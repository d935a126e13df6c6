"""The target model: all eagle31 reads of it (config, shape, single tensors, fingerprints, the model, features)."""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from enum import StrEnum
from functools import partial, reduce
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from eagle31.config import read_json_config, text_config
from eagle31.errors import ConfigError


class Dtype(StrEnum):
    bfloat16 = "bfloat16"
    float16 = "float16"
    float32 = "float32"


# Where decoder layers live: Llama / Qwen / DeepSeek-V3 (`model.layers`), multimodal wrappers.
_LAYER_PATHS = ("model.layers", "model.language_model.layers", "language_model.model.layers")
_FINGERPRINT_WINDOW = 64  # bytes of a tensor read at each of its sampled places
_FINGERPRINT_WINDOWS = 3  # a tensor's sampled places: its first, middle and last bytes
_VOLATILE_CONFIG_KEYS = ("_name_or_path", "transformers_version")  # change when a checkpoint is copied or re-saved
# What `AutoTokenizer.from_pretrained` reads from a folder: the fast tokenizer, its config and special tokens, the
# slow tokenizers' vocabularies (BPE, WordPiece, SentencePiece, tiktoken) and the chat template saved beside them.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
    "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model", "tiktoken.model", "chat_template.jinja",
    "chat_template.json",
)  # fmt: skip


def load_target_config(path: str | Path) -> dict[str, Any]:
    """Read a target's `config.json` (a file or a model directory) as a dict."""
    p = Path(path)
    return read_json_config(p / "config.json" if p.is_dir() else p, "target config")


def remote_code(path: str | Path) -> str | None:
    """What of the target at `path` (a directory or its config.json) only its own code (`auto_map`) loads, or None."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    p = Path(path)
    has_config = not p.is_dir() or (p / "config.json").is_file()  # prepare needs only a tokenizer's directory
    config = load_target_config(path) if has_config else {}
    if config.get("auto_map") and config.get("model_type") not in CONFIG_MAPPING_NAMES:
        return f"model (model_type {config.get('model_type')})"
    if p.is_dir() and (p / "tokenizer_config.json").is_file():
        tok = read_json_config(p / "tokenizer_config.json", "tokenizer config")
        if tok.get("auto_map") and tokenizer_class_from_name(tok.get("tokenizer_class") or "") is None:
            return f"tokenizer ({tok.get('tokenizer_class')})"
    return None


def check_remote_code(path: str | Path, trust_remote_code: bool) -> None:
    """One line, before anything loads, when the target needs its own code and `target.trust_remote_code` is off."""
    needed = None if trust_remote_code else remote_code(path)
    if needed:
        raise ConfigError(
            f"target {path}: its {needed} is code shipped with the model, not part of transformers; "
            "set target.trust_remote_code=true to run it"
        )


def target_shape(target_config: dict) -> tuple[int, int]:
    """(L, Ht): decoder layers and hidden size of the target."""
    text = text_config(target_config)
    return int(text["num_hidden_layers"]), int(text["hidden_size"])


def attention_shape(t: dict) -> tuple[int, int, int]:
    """(heads, q·k dim, v dim) of the attention of a text config (a target's, or a drafter's layer)."""
    heads = int(t["num_attention_heads"])
    if t.get("kv_lora_rank"):  # MLA
        return heads, int(t["qk_nope_head_dim"]) + int(t["qk_rope_head_dim"]), int(t["v_head_dim"])
    head_dim = int(t.get("head_dim") or int(t["hidden_size"]) // heads)
    return heads, head_dim, head_dim


def decoder_parameters(target_config: dict, active: bool = False) -> int:
    """The decoder layers' parameters: attention, MLP (MoE: all experts, `active`: routed; shared, router)."""
    t = text_config(target_config)
    H, L = int(t["hidden_size"]), int(t["num_hidden_layers"])
    heads, qk, v = attention_shape(t)
    if t.get("kv_lora_rank"):
        q_rank, kv_rank, rope = t.get("q_lora_rank"), int(t["kv_lora_rank"]), int(t["qk_rope_head_dim"])
        q = H * q_rank + q_rank * heads * qk if q_rank else H * heads * qk
        attention = q + H * (kv_rank + rope) + kv_rank * heads * (qk - rope + v) + heads * v * H
    else:
        kv_heads = int(t.get("num_key_value_heads") or heads)
        attention = H * heads * qk + 2 * H * kv_heads * v + heads * v * H
    dense = 3 * H * int(t["intermediate_size"])
    routed = int(t.get("n_routed_experts") or t.get("num_experts") or 0)
    if not routed:
        return L * (attention + dense)
    expert = 3 * H * int(t["moe_intermediate_size"])
    shared = int(t.get("n_shared_experts") or 0) * expert + 3 * H * int(t.get("shared_expert_intermediate_size") or 0)
    experts = int(t["num_experts_per_tok"]) if active else routed
    moe = experts * expert + shared + H * routed  # the router too
    dense_layers = int(t.get("first_k_dense_replace") or 0)
    return dense_layers * (attention + dense) + (L - dense_layers) * (attention + moe)


def target_parameters(target_config: dict) -> int:
    """All the target's parameters: embedding, decoder layers and their norms, final norm, lm_head unless tied."""
    t = text_config(target_config)
    H, L, V = int(t["hidden_size"]), int(t["num_hidden_layers"]), int(t["vocab_size"])
    tied = t.get("tie_word_embeddings", target_config.get("tie_word_embeddings", False))
    return V * H * (1 if tied else 2) + decoder_parameters(target_config) + (2 * L + 1) * H


def target_vocab_size(target_dir: Path) -> int | None:
    """The target's vocab_size from its config.json, when the directory has one."""
    if not (target_dir / "config.json").is_file():
        return None
    return text_config(load_target_config(target_dir)).get("vocab_size")


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
    target_dir: str | Path, candidates: tuple[str, ...], *, required: bool = True
) -> torch.Tensor | None:
    """The first of `candidates` (under every wrapper prefix) in the target's weights, read without the model."""
    target_dir = Path(target_dir)
    weight_map = _weight_map(target_dir)
    for full in (prefix + name for prefix in WRAPPER_PREFIXES for name in candidates):
        if full in weight_map:
            with safe_open(str(target_dir / weight_map[full]), framework="pt") as sf:
                return sf.get_tensor(full)
    if required:
        raise ConfigError(f"target {target_dir}: no tensor among {list(candidates)}")
    return None


def read_target_embeddings(target_dir: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(embedding [V, Ht], lm_head [V, Ht]) of the target at `target_dir`; tied: the embedding as lm_head."""
    embed = read_target_tensor(target_dir, EMBED_NAMES)
    lm_head = read_target_tensor(target_dir, LM_HEAD_NAMES, required=False)
    return embed, (embed if lm_head is None else lm_head)


def target_fingerprint(target_dir) -> str:
    """sha256 of config.json (less path, version keys), each tensor's dtype, shape, sampled bytes (docs/engine.md)."""
    target_dir = Path(target_dir)
    config = {k: v for k, v in load_target_config(target_dir).items() if k not in _VOLATILE_CONFIG_KEYS}
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    tensors: dict[str, bytes] = {}
    for file in sorted(set(_weight_map(target_dir).values())):
        tensors.update(_sampled_tensors(target_dir / file))
    for name in sorted(tensors):
        digest.update(hashlib.sha256(name.encode() + b"\0" + tensors[name]).digest())
    return digest.hexdigest()


def _sampled_tensors(path: Path) -> dict[str, bytes]:
    """{tensor name: its dtype and shape, and its bytes at the sampled places} of one safetensors file."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))  # the format: a u64 header length, the JSON header, the data
        header = json.loads(f.read(length))
        header.pop("__metadata__", None)
        out = {}
        for name, entry in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):  # reads in file order
            begin, end = entry["data_offsets"]
            size, window, n = end - begin, _FINGERPRINT_WINDOW, _FINGERPRINT_WINDOWS
            if size <= window * n:  # a small tensor is read whole; else n windows, its first and last bytes included
                window, n = size, 1
            sampled = [f"{entry['dtype']}{entry['shape']}".encode()]
            for i in range(n):
                f.seek(8 + length + begin + (size - window) * i // max(n - 1, 1))
                sampled.append(f.read(window))
            out[name] = b"".join(sampled)
    return out


def tokenizer_fingerprint(target_dir) -> str:
    """sha256 of the tokenizer files (`TOKENIZER_FILES`) in the target's folder: each present file's name and bytes."""
    digest = hashlib.sha256()
    for name in TOKENIZER_FILES:
        path = Path(target_dir) / name
        if path.is_file():
            digest.update(f"{name}\0{path.stat().st_size}\0".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def target_fingerprints(target_dir) -> dict[str, str]:
    """{"target_fingerprint", "tokenizer_fingerprint"} of the target at `target_dir` as this node sees it."""
    return {
        "target_fingerprint": target_fingerprint(target_dir),
        "tokenizer_fingerprint": tokenizer_fingerprint(target_dir),
    }


def load_target(
    path, device: torch.device, *, dtype: str | torch.dtype, device_map: str | None = None,
    trust_remote_code: bool = False, attn_implementation: str | None = None,
) -> nn.Module:  # fmt: skip
    """The target at `path` in eval mode without gradients, on `device` or spread by `device_map` (e.g. "auto")."""
    from transformers import AutoModelForCausalLM

    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype if isinstance(dtype, torch.dtype) else getattr(torch, dtype), device_map=device_map or None,
        trust_remote_code=trust_remote_code, **kwargs,
    )  # fmt: skip
    if not device_map:
        model.to(device)
    return model.eval().requires_grad_(False)


def load_recipe_target(target_dir, section: Any, device: torch.device) -> nn.Module:
    """`load_target` as a recipe's `target` section asks (its dtype, device_map, trust_remote_code)."""
    check_remote_code(target_dir, section.trust_remote_code)
    return load_target(target_dir, device, dtype=section.dtype, device_map=section.device_map,
                       trust_remote_code=section.trust_remote_code)  # fmt: skip


def load_target_tokenizer(path: str | Path):
    """The target's tokenizer, or one line naming the folder and why it cannot be loaded."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"target {path}: cannot load its tokenizer: {str(e).splitlines()[0]}") from None


def inference_device_and_dtype(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    """`device` / `dtype` of an inference run; `auto`: CUDA in bfloat16 when there is one, else CPU in float32."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device={device} but CUDA is not available")
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    if dtype not in ("bfloat16", "float16", "float32"):
        raise ConfigError(f"dtype must be auto, bfloat16, float16 or float32, got {dtype!r}")
    try:
        return torch.device(device), getattr(torch, dtype)
    except RuntimeError as e:
        raise ConfigError(f"device: {e}") from None


class _StopForward(Exception):
    """Raised by the lm_head pre-hook to end a capture-only forward."""


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The target's decoder layers, found at one of the usual attribute paths."""
    for path in _LAYER_PATHS:
        layers = reduce(lambda obj, name: getattr(obj, name, None), path.split("."), model)
        if isinstance(layers, nn.ModuleList):
            return layers
    raise ConfigError(f"cannot find the decoder layers of {type(model).__name__}: looked for {', '.join(_LAYER_PATHS)}")


def check_aux_layer_ids(ids: Sequence[int], num_layers: int, *, who: str = "") -> None:
    """Aux ids are distinct, increasing decoder-layer inputs `0 <= k < L` (vLLM's convention); `who` prefixes errors."""
    if not ids or list(ids) != sorted(set(ids)):
        raise ConfigError(f"{who}aux_layer_ids must be distinct and increasing, got {list(ids)}")
    bad = [k for k in ids if not 0 <= k < num_layers]
    if bad:
        raise ConfigError(f"{who}aux_layer_ids {bad} out of range for a {num_layers}-layer target")


class TargetFeatures:
    """Forward pre-hooks keeping the drafter's inputs (docs/design.md §2), `aux` and `final`, of any forward (KV cache
    allowed): `with TargetFeatures(model, aux_layer_ids) as feats:`, a forward, then `aux, final = feats.pop()`."""

    def __init__(self, model: nn.Module, aux_layer_ids: Sequence[int]):
        self.model = model
        self.aux_layer_ids = tuple(int(i) for i in aux_layer_ids)
        layers = decoder_layers(model)
        check_aux_layer_ids(self.aux_layer_ids, len(layers))
        self._layers = [layers[k] for k in self.aux_layer_ids]
        self._head = model.get_output_embeddings()
        if self._head is None:
            raise ConfigError(f"{type(model).__name__} has no output embeddings (lm_head)")
        self._handles: list = []
        self._stop = False
        self._reset()

    def _reset(self) -> None:
        self._aux: list[torch.Tensor | None] = [None] * len(self._layers)
        self._final: torch.Tensor | None = None

    def __enter__(self) -> TargetFeatures:
        for slot, layer in enumerate(self._layers):
            hook = partial(self._on_layer_input, slot)
            self._handles.append(layer.register_forward_pre_hook(hook, with_kwargs=True))
        self._handles.append(self._head.register_forward_pre_hook(self._on_head_input, with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._reset()

    def _on_layer_input(self, slot: int, module, args, kwargs) -> None:
        self._aux[slot] = (args[0] if args else kwargs["hidden_states"]).detach()  # [B, T, Ht]

    def _on_head_input(self, module, args, kwargs) -> None:
        self._final = (args[0] if args else kwargs["input"]).detach()  # [B, T, Ht]
        if self._stop:
            raise _StopForward

    def pop(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(aux [B, T, n*Ht], final [B, T', Ht], the T' positions lm_head saw) of the last forward; clears them."""
        if not self._handles:
            raise RuntimeError("TargetFeatures.pop() outside its `with` block")
        if self._final is None or any(a is None for a in self._aux):
            raise RuntimeError("no complete forward was captured since the last pop()")
        final = self._final
        aux = torch.cat([a.to(final.device) for a in self._aux if a is not None], dim=-1)
        self._reset()
        return aux, final

    @torch.no_grad()
    def resolved_layer_ids(self) -> tuple[int, ...]:
        """Per aux slice, the k whose `hidden_states[k]` it equals (-1: none), read off a two-token forward."""
        device = self.model.get_input_embeddings().weight.device
        with self:
            out = self.model(
                input_ids=torch.tensor([[1, 2]], device=device), output_hidden_states=True, use_cache=False
            )
            aux, _ = self.pop()
        states = [h.cpu() for h in out.hidden_states[:-1]]  # the inputs of layers 0..L-1 (the last one is post-norm)
        width = states[0].shape[-1]
        slices = [aux[..., j * width : (j + 1) * width].cpu() for j in range(len(self._layers))]
        return tuple(next((k for k, h in enumerate(states) if torch.equal(h, piece)), -1) for piece in slices)

    @torch.no_grad()  # not inference_mode: the trainer's autograd must be able to save these tensors
    def capture(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A forward that stops at lm_head's input, so no [B, T, V] logits are built; returns `pop()`'s (aux, final)."""
        self._stop = True
        try:
            self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        except _StopForward:
            pass
        finally:
            self._stop = False
        return self.pop()
