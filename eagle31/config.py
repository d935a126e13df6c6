"""`DrafterConfig`: everything that defines an EAGLE 3.1 drafter (docs/design.md §2-§3), saved in its config.json."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle31.attention import KINDS, AttentionKind, DrafterAttention
from eagle31.attention.mla import MLAConfig
from eagle31.errors import ConfigError

# Where a recipe's `drafter.<field>` comes from: `eagle31.recipe.DrafterSection` is made of these fields. TARGET:
# only the target says (no recipe field); OVERRIDE: the target's unless a recipe sets it (None keeps it); the
# rest: a recipe's setting, with the default below.
TARGET = {"recipe": "target"}
OVERRIDE = {"recipe": "override"}


@dataclass
class DrafterConfig:
    # the decoder layer (H, heads, ...)
    hidden_size: int = field(metadata=OVERRIDE)  # H, the drafter layer's width; the target's unless set
    num_attention_heads: int = field(metadata=OVERRIDE)  # query heads; the target's unless set
    num_key_value_heads: int = field(metadata=OVERRIDE)  # key/value heads (GQA); the target's unless set
    head_dim: int = field(metadata=OVERRIDE)  # per head (Llama attention); the target's unless set
    intermediate_size: int = field(metadata=OVERRIDE)  # the MLP's width; the target's (dense) unless set
    rms_norm_eps: float = field(default=1e-6, metadata=TARGET)
    hidden_act: str = field(default="silu", metadata=TARGET)
    # transformers >= 5 form: {"rope_type": ..., "rope_theta": ..., yarn fields ...}
    rope_parameters: dict[str, Any] = field(
        default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0}, metadata=TARGET
    )
    max_position_embeddings: int = field(default=4096, metadata=OVERRIDE)  # the rope's context; the target's unless set
    # vocabularies
    vocab_size: int = field(default=32000, metadata=TARGET)  # V, the target's
    draft_vocab_size: int = 32000  # Vd, the drafter's vocabulary: the Vd most frequent supervised target tokens
    # the target
    target_hidden_size: int = field(default=0, metadata=TARGET)  # Ht; 0 means "same as hidden_size"
    target_num_layers: int = field(default=0, metadata=TARGET)  # L
    # the target layers whose hidden states feed the drafter, vLLM's convention (id k = input of decoder layer k);
    # default (2, L // 2, L - 3)
    aux_layer_ids: tuple[int, ...] = field(default=(), metadata=OVERRIDE)
    target_name_or_path: str | None = field(default=None, metadata=TARGET)
    target_architectures: tuple[str, ...] = field(default=(), metadata=TARGET)
    # EAGLE 3 / 3.1 switches (`SWITCHES`)
    fc_norm: bool = True  # EAGLE 3.1: one RMSNorm per aux chunk before fc
    norm_before_fc: bool = False  # one RMSNorm over the whole concat (gpt-oss style)
    norm_output: bool = True  # EAGLE 3.1: feed norm(o) to the next TTT step
    norm_before_residual: bool = False  # the layer adds its output to hidden_norm(h), not to h (a speculators switch)
    # the drafter layer's attention (eagle31.attention.KINDS): llama (q/k/v projections, both export layouts) or mla
    # (the target's latent attention, eagle3 layout)
    attention: DrafterAttention = DrafterAttention.llama
    # the mla kind's own fields (a kind's `config_type`; 0 for the other kinds): the target's MLA shape unless set
    mla: MLAConfig = field(default_factory=MLAConfig, metadata=OVERRIDE)
    # sliding window of the attention, in positions (vLLM's `sliding_window`): the query at position P sees
    # the keys of P - W + 1 .. P (`eagle31.kernels.ttt_attention`); None = full attention
    sliding_window: int | None = None
    # parallel drafting (P-EAGLE, vLLM's `parallel_drafting`): steps k >= 1 read a mask token and the learned
    # `mask_hidden` instead of the previous step's output, so one forward drafts every position of a round
    parallel_drafting: bool = False
    # its mask token: the target's pad token (else its eos token, else 0) unless set
    mask_token_id: int | None = field(default=None, metadata=OVERRIDE)

    def __post_init__(self) -> None:
        if not self.target_hidden_size:
            self.target_hidden_size = self.hidden_size
        self.aux_layer_ids = tuple(int(i) for i in self.aux_layer_ids)
        self.target_architectures = tuple(self.target_architectures)
        self.rope_parameters = dict(self.rope_parameters)
        self.attention = DrafterAttention.parse(self.attention)  # type: ignore[assignment]  # a registered kind's name
        for kind in KINDS.values():  # a kind's fields given as a dict (a config file, a recipe)
            if kind.config_field and isinstance(value := getattr(self, kind.config_field), dict):
                setattr(self, kind.config_field, kind.own_config(value))
        self.validate()

    @property
    def num_aux(self) -> int:
        return len(self.aux_layer_ids)

    @property
    def fc_in_features(self) -> int:
        return self.num_aux * self.target_hidden_size

    @property
    def kind(self) -> AttentionKind:
        """What this drafter's attention does differently (`eagle31.attention`)."""
        return KINDS[self.attention]

    @property
    def qk_head_dim(self) -> int:
        """Head dim of q and k: `head_dim` (Llama), `qk_nope_head_dim + qk_rope_head_dim` (MLA)."""
        return self.kind.qk_head_dim(self)

    def validate(self) -> None:
        for f in dataclasses.fields(self):  # the sizes and counts
            value = getattr(self, f.name)
            if f.type == "int" and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ConfigError(f"drafter.{f.name} must be a positive integer, got {value!r}")
        if not self.rms_norm_eps > 0:
            raise ConfigError(f"drafter.rms_norm_eps must be positive, got {self.rms_norm_eps!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"drafter.num_key_value_heads={self.num_key_value_heads} must divide "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if self.draft_vocab_size > self.vocab_size:
            raise ConfigError(
                f"drafter.draft_vocab_size={self.draft_vocab_size} exceeds the target vocab_size={self.vocab_size}"
            )
        if self.fc_norm and self.norm_before_fc:
            raise ConfigError("drafter.fc_norm and drafter.norm_before_fc are mutually exclusive; enable one of them")
        ids = self.aux_layer_ids
        if len(ids) < 1:
            raise ConfigError("drafter.aux_layer_ids must name at least one target layer")
        if len(set(ids)) != len(ids):
            raise ConfigError(f"drafter.aux_layer_ids must be distinct, got {list(ids)}")
        if list(ids) != sorted(ids):
            raise ConfigError(f"drafter.aux_layer_ids must be in increasing order, got {list(ids)}")
        if bad := [i for i in ids if not 0 <= i < self.target_num_layers]:
            raise ConfigError(
                f"drafter.aux_layer_ids {bad} out of range: ids are decoder-layer inputs "
                f"(vLLM convention), valid 0..{self.target_num_layers - 1} for a {self.target_num_layers}-layer target"
            )
        if "rope_type" not in self.rope_parameters or "rope_theta" not in self.rope_parameters:
            raise ConfigError(f"drafter.rope_parameters needs rope_type and rope_theta, got {self.rope_parameters!r}")
        w = self.sliding_window
        if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w < 1):
            raise ConfigError(f"drafter.sliding_window must be a positive integer (positions) or null, got {w!r}")
        if self.parallel_drafting:
            m = self.mask_token_id
            if not isinstance(m, int) or isinstance(m, bool) or not 0 <= m < self.vocab_size:
                raise ConfigError(
                    f"drafter.mask_token_id must be a token id below vocab_size={self.vocab_size}, got {m!r}"
                )
            if not self.kind.serves_parallel_drafting:
                raise ConfigError(
                    f"drafter.parallel_drafting: vLLM serves {self.kind.label} without parallel drafting (0.22 to "
                    "0.33); train it with drafter.parallel_drafting=false"
                )
        for other, kind in KINDS.items():
            own = getattr(self, kind.config_field) if kind.config_field else None
            if used := [name for name in kind.fields() if other != self.attention and getattr(own, name)]:
                raise ConfigError(
                    f"drafter.{kind.config_field}.{used[0]} is a field of {kind.label}: set drafter.attention={other} "
                    "or leave it 0"
                )
        self.kind.validate(self)

    @classmethod
    def from_target_config(cls, hf_config: Any, **overrides: Any) -> DrafterConfig:
        """A drafter for a target from its HF config (dict or object) and `overrides` (None: unset); docs/targets.md."""
        outer = _as_dict(hf_config)
        t = dict(text_config(outer))  # multimodal wrappers (Kimi K2.5/K2.6) nest the language model
        for key in ("architectures", "_name_or_path"):  # the wrapper's identity is the target's
            t[key] = outer.get(key) or t.get(key)
        num_layers = _require(t, "num_hidden_layers")
        hidden = _require(t, "hidden_size")
        heads = _require(t, "num_attention_heads")
        mla_target = t.get("model_type") in ("deepseek_v3", "deepseek_v2", "kimi_k2") or "kv_lora_rank" in t
        head_dim = t.get("v_head_dim" if mla_target else "head_dim") or hidden // heads  # MLA: a Llama drafter's is v's
        values: dict[str, Any] = dict(
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=t.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            intermediate_size=_require(t, "intermediate_size"),
            rms_norm_eps=float(t.get("rms_norm_eps", 1e-6)),
            hidden_act=t.get("hidden_act", "silu"),
            max_position_embeddings=int(t.get("max_position_embeddings", 4096)),
            vocab_size=_require(t, "vocab_size"),
            draft_vocab_size=min(32000, int(t["vocab_size"])),
            target_hidden_size=hidden,
            target_num_layers=num_layers,
            aux_layer_ids=default_aux_layer_ids(num_layers),
            target_name_or_path=t.get("_name_or_path") or None,
            target_architectures=tuple(t.get("architectures") or ()),
        )
        if unknown := set(overrides) - {f.name for f in dataclasses.fields(cls)}:
            raise ConfigError(f"unknown drafter field(s): {sorted(unknown)}")
        overrides = {k: v for k, v in overrides.items() if v is not None}
        kind = KINDS[DrafterAttention.parse(overrides.get("attention", DrafterAttention.llama))]
        # each kind's own fields, those set: the chosen kind's complete the target's shape, another's are refused
        given = {
            k.config_field: _set_fields(overrides.pop(k.config_field, None)) for k in KINDS.values() if k.config_field
        }
        values.update(kind.from_target(t, rope_parameters_from(t), {**overrides, **given}))
        values.update(overrides)
        values.update({name: fields for name, fields in given.items() if fields and name != kind.config_field})
        if values.get("parallel_drafting") and values.get("mask_token_id") is None:
            ids = (t[k] for k in ("pad_token_id", "eos_token_id") if isinstance(t.get(k), int))
            values["mask_token_id"] = next(ids, 0)
        if reason := kind.rope_ambiguity(values["rope_parameters"]):
            raise ConfigError(f"drafter.rope_parameters {values['rope_parameters']!r} is read two ways: {reason}")
        if values["target_hidden_size"] != hidden:
            raise ConfigError(
                f"drafter.target_hidden_size={values['target_hidden_size']} differs from the target's "
                f"hidden_size={hidden}"
            )
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["attention"] = str(self.attention)
        d["aux_layer_ids"] = list(self.aux_layer_ids)
        d["target_architectures"] = list(self.target_architectures)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DrafterConfig:
        d = dict(d)
        for kind in KINDS.values():  # a config written before the kind's fields had their own block
            flat = {name: d.pop(name) for name in kind.fields() if name in d}
            if flat and kind.config_field:
                d[kind.config_field] = {**flat, **(d.get(kind.config_field) or {})}
        if unknown := set(d) - {f.name for f in dataclasses.fields(cls)}:
            raise ConfigError(f"unknown drafter field(s): {sorted(unknown)}")
        return cls(**d)

    def layer_config(self):
        """The decoder layer as a transformers `LlamaConfig` (rope, export)."""
        from transformers import LlamaConfig

        return LlamaConfig(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=1,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            hidden_act=self.hidden_act,
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters=dict(self.rope_parameters),
            max_position_embeddings=self.max_position_embeddings,
            vocab_size=self.vocab_size,
            tie_word_embeddings=False,
        )


# the EAGLE 3 / 3.1 switches, in the order every export writes them (`eagle31.layouts.eagle_fields`), read back
# with vLLM's default where missing, and a drafter to fine-tune must have them as the run does (`eagle31.plan`)
SWITCHES = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


def text_config(target_config: dict[str, Any]) -> dict[str, Any]:
    """The language model's config.json dict (multimodal wrappers such as Kimi K2.6 nest it under `text_config`)."""
    return target_config.get("text_config") or target_config


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """docs/design.md §2: `(2, L//2, L-3)` in vLLM's convention (input of layer k)."""
    return (2, num_layers // 2, num_layers - 3)


def rope_parameters_from(t: dict[str, Any]) -> dict[str, Any]:
    """The target's rope in transformers >= 5 form, from `rope_parameters` or legacy `rope_theta` + `rope_scaling`."""
    legacy = dict(t.get("rope_scaling") or {})
    if "type" in legacy:  # transformers 4's name of rope_type
        legacy.setdefault("rope_type", legacy.pop("type"))
    rope = {**legacy, **(t.get("rope_parameters") or {})}
    rope.setdefault("rope_type", "default")
    if "rope_theta" not in rope:
        rope["rope_theta"] = float(t.get("rope_theta", 10000.0))
    return rope


def read_json_config(path: str | Path, what: str) -> dict[str, Any]:
    """A JSON file as a dict; a missing or malformed file is a one-line ConfigError naming `what` and the path."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{what} not found: {p}")
    try:
        value = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{what} {p} is not valid JSON: {e}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{what} {p} is not a text file (expected JSON)") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{what} {p} is not a JSON object (it holds a {type(value).__name__})")
    return value


def _set_fields(value: Any) -> dict[str, Any]:
    """The fields of a kind's config (a dataclass, a dict or None) that are set: neither None nor 0."""
    is_instance = dataclasses.is_dataclass(value) and not isinstance(value, type)
    fields = dataclasses.asdict(value) if is_instance else dict(value or {})
    return {k: v for k, v in fields.items() if v}


def _as_dict(hf_config: Any) -> dict[str, Any]:
    if isinstance(hf_config, dict):
        return dict(hf_config)
    d = hf_config.to_dict()
    text = getattr(hf_config, "text_config", None)
    if text is not None and not isinstance(d.get("text_config"), dict):
        d["text_config"] = text.to_dict()
    return d


def _require(t: dict[str, Any], key: str) -> Any:
    if t.get(key) is None:
        raise ConfigError(f"target config has no {key!r} (model_type={t.get('model_type')!r})")
    return t[key]
