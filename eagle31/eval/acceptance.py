"""Acceptance length by real speculative decoding, per drafter and prompt split (docs/evaluation.md)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import torch

from eagle31.data.chat import parse_template_kwargs
from eagle31.data.sources import BadInput, to_conversation
from eagle31.errors import ConfigError
from eagle31.eval.drafting import EagleProposer, Proposer, TreeSpec
from eagle31.eval.speculative import Generation, GreedyTrace, draft_length, greedy_trace, speculative_generate
from eagle31.layouts import DrafterFormat
from eagle31.target import (
    check_aux_layer_ids,
    inference_device_and_dtype,
    load_target,
    load_target_config,
    load_target_tokenizer,
    text_config,
)
from eagle31.targets.cache import portable_path


@dataclass
class AcceptanceStats:
    """Counts summed over the prompts of one (drafter, split)."""

    draft_len: int  # k, or the tree depth: the most draft tokens one round can accept
    prompts: int = 0
    prompt_tokens: int = 0
    rounds: int = 0
    accepted: int = 0
    accepted_at: list[int] = field(default_factory=list)  # [draft_len] rounds accepting position i+1
    generated_tokens: int = 0
    target_forwards: int = 0
    seconds: float = 0.0

    def __post_init__(self) -> None:
        self.accepted_at = self.accepted_at or [0] * self.draft_len

    def add(self, generation: Generation, prompt_tokens: int) -> None:
        self.prompts += 1
        self.prompt_tokens += prompt_tokens
        self.rounds += len(generation.accepted)
        self.accepted += sum(generation.accepted)
        self.accepted_at = [n + sum(a > i for a in generation.accepted) for i, n in enumerate(self.accepted_at)]
        self.generated_tokens += len(generation.tokens)
        self.target_forwards += generation.target_forwards
        self.seconds += generation.seconds

    def summary(self) -> dict[str, Any]:
        rounds = max(self.rounds, 1)
        reached = [self.rounds] + self.accepted_at[:-1]  # rounds that accepted positions 1..i
        return {
            "tau": 1 + self.accepted / rounds,
            "acceptance_rate": [a / rounds for a in self.accepted_at],
            "conditional_acceptance_rate": [a / max(r, 1) for a, r in zip(self.accepted_at, reached, strict=True)],
            "target_forwards_per_token": self.target_forwards / max(self.generated_tokens, 1),
            "tokens_per_second": self.generated_tokens / self.seconds if self.seconds else 0.0,
            "mean_prompt_tokens": self.prompt_tokens / max(self.prompts, 1),
            **asdict(self),
        }


def evaluate(
    target, proposer: Proposer, prompts: Sequence[Sequence[int]], *, aux_layer_ids: Sequence[int], max_new_tokens: int,
    k: int | None = None, tree: TreeSpec | None = None, eos_token_ids: Sequence[int] = (),
    traces: Sequence[GreedyTrace] | None = None,
) -> AcceptanceStats:  # fmt: skip
    """Speculative decoding of every prompt (token ids); with `traces` (theirs), verified from them, not the target."""
    stats = AcceptanceStats(draft_len=draft_length(k, tree))
    device = target.get_input_embeddings().weight.device
    for i, prompt in enumerate(prompts):
        ids = torch.tensor(list(prompt), dtype=torch.long, device=device)
        generation = speculative_generate(
            target if traces is None else traces[i], proposer, ids, aux_layer_ids=aux_layer_ids,
            max_new_tokens=max_new_tokens, k=k, tree=tree, eos_token_ids=eos_token_ids,
        )  # fmt: skip
        stats.add(generation, len(prompt))
    return stats


def greedy_traces(
    target, prompts: Sequence[Sequence[int]], *, aux_layer_ids: Sequence[int], length: int
) -> list[GreedyTrace]:
    """The target's greedy decoding of each prompt, `length` tokens past it, to replay verification from."""
    device = target.get_input_embeddings().weight.device
    ids = [torch.tensor(list(p), dtype=torch.long, device=device) for p in prompts]
    return [greedy_trace(target, p, aux_layer_ids=aux_layer_ids, length=length) for p in ids]


def load_prompts(
    path: str | Path, tokenizer, max_prompts: int | None = None, template_kwargs: dict | None = None
) -> list[list[int]]:
    """Token ids of the prompts of one JSON Lines file (docs/evaluation.md)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"data: prompt file not found: {path}")
    prompts: list[list[int]] = []
    with open(path, "rb") as f:  # decoded line by line, so a binary file is refused naming the line
        for n, raw in enumerate(f, start=1):
            if max_prompts is not None and len(prompts) >= max_prompts:
                break
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ConfigError(
                    f"{path}:{n}: not UTF-8 text (byte 0x{raw[e.start]:02x}); prompts are a JSON Lines file"
                ) from None
            if line.strip():
                prompts.append(_prompt_ids(line, tokenizer, f"{path}:{n}", template_kwargs or {}))
    if not prompts:
        raise ConfigError(f"data: no prompts in {path}")
    return prompts


def _prompt_ids(line: str, tokenizer, where: str, template_kwargs: dict) -> list[int]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}: invalid JSON ({e.msg})") from None
    if isinstance(record, dict) and isinstance(record.get("prompt"), str):
        return tokenizer(record["prompt"])["input_ids"]
    try:
        conversation = to_conversation(record, where)
    except BadInput as e:
        raise ConfigError(f"{where}: not a prompt: needs 'prompt' (a string) or 'messages' ({e})") from None
    messages = conversation.messages
    if messages[-1]["role"] == "assistant":
        messages = messages[:-1]
    if not messages:
        raise ConfigError(f"{where}: no messages before the assistant turn")
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"{where}: a 'messages' prompt needs a chat template, and the target tokenizer has none")
    return render(tokenizer, messages, template_kwargs=template_kwargs, tools=conversation.tools)


def render(
    tokenizer, messages: list[dict], add_generation_prompt: bool = True, template_kwargs: dict | None = None,
    tools: list | None = None,
) -> list[int]:  # fmt: skip
    """Token ids of `messages` in the tokenizer's chat template (its special tokens not added twice)."""
    text = tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt, **(template_kwargs or {})
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


class Verification(StrEnum):
    """Who verifies the drafts: the target every round, or its greedy decoding of the prompt."""

    live = "live"
    replay = "replay"


class EvalArgs:
    """What the `key=value` arguments of the evaluations share: a target, `[label=]path` drafters, template options."""

    drafter: str
    target: str
    chat_template_kwargs: str | None
    device: str
    dtype: str

    @property
    def drafters(self) -> dict[str, str]:
        """label -> drafter directory."""
        return labelled_paths("drafter", self.drafter)

    @property
    def template_kwargs(self) -> dict[str, Any]:
        return parse_template_kwargs(self.chat_template_kwargs)

    @property
    def splits(self) -> dict[str, str]:
        """split name -> JSONL prompt file: those of the `data` argument, none without one."""
        data = getattr(self, "data", None)  # MT-Bench's arguments have none
        return {} if data is None else labelled_paths("data", data)

    def split_prompts(self, tokenizer, max_prompts: int | None) -> dict[str, list[list[int]]]:
        """split name -> the token ids of its first `max_prompts` prompts (`load_prompts`)."""
        return {
            name: load_prompts(path, tokenizer, max_prompts, self.template_kwargs) for name, path in self.splits.items()
        }

    def settings(self, **settings: Any) -> dict[str, Any]:
        """A report's settings: the target and drafters (`portable_path`), `settings`, then the device and dtype."""
        device, dtype = inference_device_and_dtype(self.device, self.dtype)
        drafters = {label: portable_path(p) for label, p in self.drafters.items()}
        return {"target": portable_path(self.target), "drafters": drafters, **settings, "device": str(device),
                "dtype": str(dtype).removeprefix("torch.")}  # fmt: skip

    def load_target_for(self, drafters: dict[str, Any], tokenizer) -> tuple[Any, list[int]]:
        """(the target, its EOS ids); the drafters moved to its device and dtype (`share_target_embedding` first)."""
        device, dtype = inference_device_and_dtype(self.device, self.dtype)
        target = load_target(self.target, device, dtype=dtype, attn_implementation="sdpa")
        for drafter in drafters.values():
            share_target_embedding(drafter, target).to(device=device, dtype=dtype).eval()
        return target, eos_ids(target, tokenizer)

    def check_paths(self) -> None:
        """Refuse malformed template options, a missing target or drafter directory, or a missing prompt file."""
        parse_template_kwargs(self.chat_template_kwargs)
        if not Path(self.target).is_dir():
            raise ConfigError(f"target: not a directory: {self.target}")
        for label, path in self.drafters.items():
            if not Path(path).is_dir():
                raise ConfigError(f"drafter {label}: not a directory: {path}")
        for split, path in self.splits.items():
            if not Path(path).is_file():
                raise ConfigError(f"data {split}: prompt file not found: {path}")


@dataclass
class AcceptanceConfig(EvalArgs):
    """Arguments of scripts/eval_acceptance.py (read by `eagle31_cli.parse_key_values`)."""

    drafter: str  # `[label=]dir,...`, any layout `eagle31.convert` reads
    target: str  # HF model directory (weights + tokenizer)
    data: str  # `[label=]file,...`: JSONL prompt files, one per split, or a folder of them
    k: int = 3  # draft tokens per round (chain)
    drafting: str = "auto"  # chain | parallel (P-EAGLE, one forward a round) | auto: each drafter's own
    tree_top_k: int | None = None  # set all three tree_* for EAGLE-2 draft trees instead of a chain
    tree_depth: int | None = None
    tree_total_tokens: int | None = None
    max_new_tokens: int = 128
    max_prompts: int | None = None  # per split
    drafter_format: DrafterFormat = DrafterFormat("auto")
    device: str = "auto"  # auto: cuda when available
    dtype: str = "auto"  # auto: bfloat16 on cuda, float32 on cpu
    verification: Verification = Verification.live  # replay: one greedy decoding per prompt
    out: str = "acceptance"  # directory for acceptance.json / .md / .png
    # template options for 'messages' prompts, as a JSON object: '{"preserve_thinking": true}'
    chat_template_kwargs: str | None = None

    def __post_init__(self) -> None:
        check_positive(self, ("k", "max_new_tokens", "max_prompts"))
        if self.drafting not in DRAFTING:
            raise ConfigError(f"drafting must be one of {list(DRAFTING)}, got {self.drafting!r}")
        tree_spec(self.tree_top_k, self.tree_depth, self.tree_total_tokens)
        self.check_paths()

    @property
    def tree(self) -> TreeSpec | None:
        return tree_spec(self.tree_top_k, self.tree_depth, self.tree_total_tokens)


DRAFTING = ("auto", "chain", "parallel")


def check_drafting(drafter_config, drafting: str, label: str) -> None:
    """A parallel drafter drafts in parallel, a chain drafter in chains (trees too): refuse another mode in one line."""
    own = "parallel" if drafter_config.parallel_drafting else "chain"
    if drafting not in ("auto", own):
        raise ConfigError(f"drafter {label} is a {own} drafter: it cannot draft with drafting={drafting}")


def check_positive(config: Any, names: Sequence[str]) -> None:
    """Each named field of `config` is None or a positive integer (ConfigError otherwise)."""
    for name in names:
        value = getattr(config, name)
        if value is not None and value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value}")


def load_drafters(paths: dict[str, str], source_format: str, target_config: dict) -> dict[str, Any]:
    """{label: drafter} read from `paths`, each checked against the target; errors name the drafter."""
    from eagle31.convert import load_drafter

    drafters = {}
    num_layers = text_config(target_config).get("num_hidden_layers")
    for label, path in paths.items():
        try:
            drafters[label] = load_drafter(path, source_format=source_format, target_num_layers=num_layers)
        except ConfigError as e:
            raise ConfigError(f"drafter {label} ({path}): {e}") from None
        check_drafter_fits(drafters[label].config, target_config, label)
    return drafters


def tree_spec(top_k: int | None, depth: int | None, total_tokens: int | None) -> TreeSpec | None:
    """The draft tree of the three `tree_*` arguments: None when none is set."""
    if top_k is None and depth is None and total_tokens is None:
        return None
    if top_k is None or depth is None or total_tokens is None:
        raise ConfigError("a draft tree needs all of tree_top_k, tree_depth and tree_total_tokens")
    try:
        return TreeSpec(top_k, depth, total_tokens)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def labelled_paths(name: str, value: str) -> dict[str, str]:
    """`a,b` or `x=a,y=b` -> {label: path}; an unlabelled `data` folder stands for its `*.jsonl` files."""
    out: dict[str, str] = {}
    for item in filter(None, (v.strip() for v in value.split(","))):
        label, path = item.split("=", 1) if "=" in item else ("", item)
        entries = {label: path}
        if name == "data" and "=" not in item and Path(path).is_dir():
            entries = {p.stem: str(p) for p in sorted(Path(path).glob("*.jsonl"))}
        for label, path in entries.items():
            label = label or Path(path.rstrip("/")).stem
            if label in out:
                raise ConfigError(f"{name}: label {label!r} given twice; name them {name}=label=path,...")
            out[label] = path
    if not out:
        raise ConfigError(f"{name}= names no path")
    return out


def run_acceptance(config: AcceptanceConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Evaluate every drafter on every split; returns the report (settings + results)."""
    tree = config.tree
    tokenizer = load_target_tokenizer(config.target)
    splits = config.split_prompts(tokenizer, config.max_prompts)
    drafters = load_drafters(config.drafters, config.drafter_format, load_target_config(config.target))
    target, eos = config.load_target_for(drafters, tokenizer)
    draft_len = tree.depth if tree else config.k
    traces: dict[tuple, list[GreedyTrace]] = {}  # (split, aux layer ids) -> one trace per prompt
    results = []
    for label, drafter in drafters.items():
        check_drafting(drafter.config, config.drafting if tree is None else "chain", label)
        aux = tuple(drafter.config.aux_layer_ids)
        for split, prompts in splits.items():
            if config.verification == Verification.replay and (split, aux) not in traces:
                log(f"{split}: the target's greedy decoding of {len(prompts)} prompts")
                traces[(split, aux)] = greedy_traces(
                    target, prompts, aux_layer_ids=aux, length=config.max_new_tokens + draft_len
                )
            stats = evaluate(
                target, EagleProposer(drafter), prompts, aux_layer_ids=drafter.config.aux_layer_ids,
                max_new_tokens=config.max_new_tokens, k=None if tree else config.k, tree=tree, eos_token_ids=eos,
                traces=traces.get((split, aux)),
            )  # fmt: skip
            summary = stats.summary()
            log(f"{label} / {split}: tau {summary['tau']:.3f} over {stats.rounds} rounds, {stats.prompts} prompts")
            results.append({"drafter": label, "split": split, **summary})
    return {"settings": report_settings(config), "results": results}


def report_settings(config: AcceptanceConfig) -> dict[str, Any]:
    """The settings of `config`'s report: the drafters, and what must match for two reports' tau to compare."""
    tree = config.tree
    return config.settings(
        data={split: portable_path(p) for split, p in config.splits.items()}, mode="tree" if tree else config.drafting,
        k=None if tree else config.k, tree=asdict(tree) if tree else None, max_new_tokens=config.max_new_tokens,
        max_prompts=config.max_prompts, verification=str(config.verification),
    )  # fmt: skip


def check_drafter_fits(drafter_config, target_config: dict[str, Any], label: str) -> None:
    """The drafter reads this target's features and vocabulary (checked before loading weights)."""
    text = text_config(target_config)
    for field_name, target_key in (("vocab_size", "vocab_size"), ("target_hidden_size", "hidden_size")):
        want, have = text.get(target_key), getattr(drafter_config, field_name)
        if want is not None and have != want:
            raise ConfigError(f"drafter {label}: {field_name}={have} but the target's {target_key}={want}")
    if text.get("num_hidden_layers") is not None:
        check_aux_layer_ids(drafter_config.aux_layer_ids, text["num_hidden_layers"], who=f"drafter {label}: ")


def share_target_embedding(drafter, target):
    """A drafter saved without `embed_tokens` (all zero after loading) reads the target's, as vLLM does."""
    if not drafter.embed_tokens.weight.any():
        with torch.no_grad():
            drafter.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
    return drafter


def eos_ids(target, tokenizer) -> list[int]:
    """The target's end-of-sequence token ids: its generation config's, and the tokenizer's."""
    ids = getattr(target.generation_config, "eos_token_id", None)
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids
