"""Conversations -> a prepared directory: tokens, loss masks, the draft vocabulary (docs/data.md, design.md §6)."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from itertools import islice
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from eagle31.data.batch import TOKEN_COLUMNS
from eagle31.data.chat import ChatEncoder, ChatTemplateError, check_template_kwargs
from eagle31.data.merge_turns import TurnMerger
from eagle31.data.sources import FILE_REASONS, Conversation, DataError, Tally, plain, read_conversations, source_paths
from eagle31.data.system_prompts import data_system_prompts, draw_for_conversation, draw_system_prompt
from eagle31.errors import ConfigError, CorruptDataError
from eagle31.io import atomic_dir, atomic_save_safetensors, atomic_write_json, check_output_dir, write_errors
from eagle31.target import check_remote_code
from eagle31.vocab import build_draft_vocab, count_supervised_tokens

log = logging.getLogger(__name__)
UNRENDERED_WHY = (
    "the chat template does not render it (history turns; Kimi K2.5/K2.6 without "
    "data.chat_template_kwargs.preserve_thinking=true; templates without reasoning)"
)
# drops of a conversation once read (the chat template's and this module's): with merging, of merged ones
_ENCODING_REASONS = ("template_error", "unstable_template", "no_assistant_tokens", "too_long",
                     "no_assistant_tokens_after_truncation")  # fmt: skip


class Overflow(StrEnum):
    truncate = "truncate"  # keep the first max_len tokens
    drop = "drop"


@dataclass
class DataConfig:
    """Conversations -> tokens + loss masks (data_prep/prepare.py)."""

    # a path or a list of paths: JSONL / JSON / Parquet files, `datasets` directories
    # (Any so that both `data.source=a.jsonl` and `data.source=[a.jsonl,b.parquet]` work)
    source: Any = field(default_factory=list)
    prepared_dir: str = "${output_dir}/data"  # where prepare writes train/, eval/ and the draft vocabulary
    system_prompt: str | None = None  # added to conversations that have none
    system_prompts: Any = None  # or one of these per conversation, drawn: a list, or a file of them (docs/data.md)
    max_len: int = 2048  # tokens per sample at most; a longer one is handled by overflow
    merge_turns: int = 1  # > 1: consecutive conversations merged into samples of 1..merge_turns of them (drawn)
    # a sample over max_len: truncate keeps its first max_len tokens, drop leaves it out
    overflow: Overflow = Overflow.truncate
    last_turn_only: bool = False  # supervise only the last assistant turn
    # options of every chat-template render (prepare, acceptance prompts), e.g. Kimi K2.6's {preserve_thinking: true}
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # or one of these merged over it per conversation, drawn: [{thinking: true}, {thinking: false}] for both Kimi modes
    chat_template_variants: list[dict[str, Any]] = field(default_factory=list)
    eval_fraction: float = 0.05  # share of the samples held out as the eval split (at most eval_max_samples)
    eval_max_samples: int = 256  # the eval split's size at most
    seed: int = 0  # the draws of prepare: the eval split, system prompts, template variants, merges


@dataclass
class PrepareReport:
    prepared_dir: str
    sources: list[str]
    records: int  # records read, accepted or not
    samples: dict[str, int]  # per split
    tokens: dict[str, int]  # per split
    supervised_tokens: dict[str, int]  # per split
    dropped: dict[str, dict[str, Any]]  # reason -> {"count", "examples"}
    truncated: dict[str, Any]  # {"count", "examples"}
    unrendered_reasoning: dict[str, Any]  # eagle31.data.chat.ReasoningTally's fields + "why"
    vocab_size: int  # V
    draft_vocab_size: int  # Vd written
    draft_vocab_size_requested: int
    draft_vocab_coverage: float  # share of supervised train tokens inside the draft vocabulary
    settings: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        lines = [
            f"prepared {self.prepared_dir}: {self.samples['train']} train + {self.samples['eval']} eval samples "
            f"from {self.records} records",
            f"tokens: train {self.tokens['train']} ({self.supervised_tokens['train']} supervised), "
            f"eval {self.tokens['eval']} ({self.supervised_tokens['eval']} supervised)",
            f"draft vocabulary: {self.draft_vocab_size} of {self.vocab_size} target tokens, "
            f"covering {self.draft_vocab_coverage:.2%} of supervised train tokens",
        ]
        if self.draft_vocab_size < self.draft_vocab_size_requested:
            lines.append(f"  (draft_vocab_size {self.draft_vocab_size_requested} clamped to the vocabulary size)")
        if self.unrendered_reasoning["unrendered_turns"]:
            lines.append(f"reasoning not rendered: {self._reasoning_counts()}")
        if self.truncated["count"]:
            lines.append(f"truncated to max_len: {self.truncated['count']} [{', '.join(self.truncated['examples'])}]")
        lines += [f"dropped {reason}: {r['count']} [{', '.join(r['examples'])}]" for reason, r in self.dropped.items()]
        return "\n".join(lines)

    def reasoning_warning(self) -> str | None:
        """One line when most reasoning tokens did not reach the data, else None."""
        r = self.unrendered_reasoning
        if 2 * r["unrendered_tokens"] <= r["tokens"]:  # none unrendered when there is none
            return None
        return f"most reasoning is not in the prepared data: {self._reasoning_counts()}"

    def _reasoning_counts(self) -> str:
        r = self.unrendered_reasoning
        turns, tokens = f"{r['unrendered_turns']} of {r['turns']} turns", f"{r['unrendered_tokens']} of {r['tokens']}"
        return f"{turns}, {tokens} tokens; {r['why']}"


def template_kwargs(data_cfg: Any) -> dict[str, Any]:
    """`data.chat_template_kwargs` as a plain dict (checked)."""
    return check_template_kwargs(plain(getattr(data_cfg, "chat_template_kwargs", None)))


def template_variants(data_cfg: Any) -> list[dict[str, Any]]:
    """`data.chat_template_variants`, each merged over `data.chat_template_kwargs` (checked); none: the kwargs."""
    base = template_kwargs(data_cfg)
    variants = plain(getattr(data_cfg, "chat_template_variants", None) or [])
    if not isinstance(variants, list):
        raise ConfigError(f"data.chat_template_variants must be a list of template-option mappings, got {variants!r}")
    out = []
    for i, variant in enumerate(variants):
        name = f"data.chat_template_variants[{i}]"
        if not isinstance(variant, dict):
            raise ConfigError(f"{name} must be a mapping of template options, got {variant!r}")
        out.append(check_template_kwargs({**base, **variant}, name))
    return out or [base]


class TemplateEncoders:
    """One `ChatEncoder` per set of template options: the drawn variants, and those a regenerated record carries."""

    def __init__(self, tokenizer: Any, variants: list[dict[str, Any]], last_turn_only: bool):
        self.tokenizer, self.last_turn_only = tokenizer, last_turn_only
        self.encoders: dict[str, ChatEncoder] = {}
        self.variants = [self._encoder(kwargs, "data.chat_template_variants") for kwargs in variants]

    def _encoder(self, kwargs: dict[str, Any], name: str) -> ChatEncoder:
        key = json.dumps(kwargs, sort_keys=True)
        if key not in self.encoders:
            self.encoders[key] = ChatEncoder(
                self.tokenizer, last_turn_only=self.last_turn_only, template_kwargs=check_template_kwargs(kwargs, name)
            )
        return self.encoders[key]

    def for_conversation(self, conv: Conversation, seed: int, index: int) -> ChatEncoder:
        if conv.chat_template_kwargs is not None:
            return self._encoder(conv.chat_template_kwargs, f"{conv.where}: chat_template_kwargs")
        return draw_for_conversation(self.variants, seed, index, "template-variant")


def check_data_config(data_cfg: Any) -> list[str]:
    """Validate the `data` section and that `prepared_dir` is prepare's to write (`check_output_dir`); its sources."""
    sources = source_paths(data_cfg.source)
    if not sources:
        raise ConfigError("data.source is empty: give a .jsonl/.json/.parquet file or a datasets directory")
    if not data_cfg.prepared_dir:
        raise ConfigError("data.prepared_dir is empty")
    prepared = Path(data_cfg.prepared_dir).resolve()
    for source in sources:
        if Path(source).resolve().is_relative_to(prepared):
            raise ConfigError(
                f"data.prepared_dir {data_cfg.prepared_dir} holds data.source {source}: preparing would replace "
                "that folder; choose a prepared_dir (or output_dir) outside your data"
            )
    if not data_cfg.max_len > 0:
        raise ConfigError(f"data.max_len must be positive, got {data_cfg.max_len!r}")
    if not 0 <= data_cfg.eval_fraction < 1:
        raise ConfigError(f"data.eval_fraction must be in [0, 1), got {data_cfg.eval_fraction!r}")
    if data_cfg.eval_max_samples < 0:
        raise ConfigError(f"data.eval_max_samples must be >= 0, got {data_cfg.eval_max_samples!r}")
    if data_cfg.merge_turns < 1:
        raise ConfigError(f"data.merge_turns must be >= 1 (1: no merging), got {data_cfg.merge_turns!r}")
    template_variants(data_cfg)
    data_system_prompts(data_cfg)
    check_output_dir(prepared, "prepared-data")  # before the tokenizer (or the target) is loaded
    return sources


def recorded_sources(prepared_dir: str | Path) -> list[str] | None:
    """The sources (absolute paths) a prepared directory was made from; None when it holds no report."""
    try:
        report = json.loads((Path(prepared_dir) / "report.json").read_text())
    except (OSError, ValueError):
        return None
    return [str(Path(s).resolve()) for s in report.get("sources", [])]


def prepare_dataset(
    data_cfg: Any, tokenizer: Any, *, draft_vocab_size: int, vocab_size: int | None = None, draft_vocab=None
) -> PrepareReport:
    """Tokenise, mask, split and count `data_cfg.source` into `prepared_dir`; `vocab_size`: V if not the tokenizer's;
    `draft_vocab`: (d2t, t2d) to keep (training goes on from a drafter), else the train split's (docs/design.md §5)."""
    import datasets

    sources = check_data_config(data_cfg)
    variants = template_variants(data_cfg)
    encoders = TemplateEncoders(tokenizer, variants, data_cfg.last_turn_only)
    prompts = data_system_prompts(data_cfg)
    V = int(vocab_size or len(tokenizer))
    Vd = min(int(draft_vocab_size), V) if draft_vocab is None else len(draft_vocab[0])
    dropped, truncated = Tally(), Tally()
    merger = TurnMerger(data_cfg.merge_turns, data_cfg.seed)  # merge_turns=1: each conversation alone, as read
    conversations = merger.merge(read_conversations(sources, dropped))
    samples = _samples(conversations, encoders, prompts, data_cfg, V, dropped, truncated)
    kept = (
        "nothing was left half-written (the partial directory was removed, an earlier prepared set there is untouched)"
    )
    with (
        write_errors(f"data.prepared_dir {data_cfg.prepared_dir}", kept),
        atomic_dir(Path(data_cfg.prepared_dir), content="prepared-data") as tmp,
    ):
        if _write_arrow(samples, tmp / "all.arrow") == 0:
            raise DataError(f"no sample left from {', '.join(sources)}: {dropped.describe() or 'no records'}")
        train, held_out = _split(datasets.Dataset.from_file(str(tmp / "all.arrow")), data_cfg)
        for name, ds in (("train", train), ("eval", held_out)):
            # datasets writes no shard for an empty split, and then cannot load it: force one
            ds.save_to_disk(str(tmp / name), num_shards=1 if len(ds) == 0 else None)

        counts, train_tokens = _supervised_counts(train, V)
        eval_counts, eval_tokens = _supervised_counts(held_out, V)
        d2t, t2d = build_draft_vocab(counts, Vd) if draft_vocab is None else draft_vocab
        atomic_save_safetensors({"counts": counts}, tmp / "token_counts.safetensors", save_file)
        atomic_save_safetensors({"d2t": d2t, "t2d": t2d}, tmp / "vocab.safetensors", save_file)
        reasoning = [asdict(e.reasoning) for e in encoders.encoders.values()]  # one tally per set of template options
        report = PrepareReport(
            prepared_dir=str(data_cfg.prepared_dir),
            sources=[str(Path(s).resolve()) for s in sources],
            # records read, accepted or not: the conversations read and the records dropped before (not whole files)
            records=merger.read + dropped.total() - dropped.total(FILE_REASONS) - dropped.total(_ENCODING_REASONS),
            samples={"train": len(train), "eval": len(held_out)},
            tokens={"train": train_tokens, "eval": eval_tokens},
            supervised_tokens={"train": int(counts.sum()), "eval": int(eval_counts.sum())},
            dropped=dropped.to_dict(),
            truncated={"count": truncated.total(), "examples": truncated.examples.get("truncated", [])},
            unrendered_reasoning={**{k: sum(r[k] for r in reasoning) for k in reasoning[0]}, "why": UNRENDERED_WHY},
            vocab_size=V,
            draft_vocab_size=Vd,
            draft_vocab_size_requested=int(draft_vocab_size),
            draft_vocab_coverage=float(counts[t2d].sum() / max(int(counts.sum()), 1)),
            settings={
                **{k: getattr(data_cfg, k) for k in ("max_len", "merge_turns", "overflow", "last_turn_only")},
                "system_prompts": prompts,
                "chat_template_kwargs": template_kwargs(data_cfg),
                "chat_template_variants": variants if getattr(data_cfg, "chat_template_variants", None) else [],
                **{k: getattr(data_cfg, k) for k in ("eval_fraction", "eval_max_samples", "seed")},
                "tokenizer": tokenizer.name_or_path,
            },
        )
        atomic_write_json(tmp / "report.json", report.to_dict())
        if warning := report.reasoning_warning():
            log.warning("warning: %s", warning)  # the CLIs show it, one line
        del train, held_out
        (tmp / "all.arrow").unlink()  # both splits were copied out of it
    return report


def prepare_with_target_tokenizer(
    data_cfg: Any,
    target_dir: Path,
    *,
    trust_remote_code: bool,
    draft_vocab_size: int,
    vocab_size: int | None,
    draft_vocab=None,
) -> PrepareReport:
    """`prepare_dataset` with the tokenizer saved beside the target at `target_dir`."""
    from transformers import AutoTokenizer

    check_remote_code(target_dir, trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(target_dir, trust_remote_code=trust_remote_code)
    return prepare_dataset(
        data_cfg, tokenizer, draft_vocab_size=draft_vocab_size, vocab_size=vocab_size, draft_vocab=draft_vocab
    )


def check_prepared(prepared_dir: Path) -> dict:
    """The report of a prepared directory, which must hold a supervised token to train on."""
    try:
        summary = json.loads((prepared_dir / "report.json").read_text())
    except ValueError:
        raise CorruptDataError(
            f"{prepared_dir / 'report.json'} is not valid JSON; delete {prepared_dir} to prepare the data again"
        ) from None
    if summary["samples"]["train"] == 0 or summary["supervised_tokens"]["train"] == 0:
        raise ConfigError(f"the prepared training split in {prepared_dir} has no supervised token")
    return summary


def load_prepared_splits(prepared_dir: Path) -> dict[str, Any]:
    """{"train": Dataset, "eval": Dataset (when prepared)} of a prepared directory."""
    import datasets

    if not (prepared_dir / "train").is_dir():
        raise ConfigError(f"no prepared split at {prepared_dir / 'train'}; run data_prep/prepare.py first")
    return {
        name: datasets.load_from_disk(str(prepared_dir / name))
        for name in ("train", "eval")
        if (prepared_dir / name).is_dir()
    }


def load_draft_vocab(prepared_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t [Vd] int64, t2d [V] bool) written by `prepare_dataset`."""
    vocab = load_file(str(prepared_dir / "vocab.safetensors"))
    return vocab["d2t"], vocab["t2d"]


def _samples(conversations, encoders, prompts, data_cfg, V: int, dropped: Tally, truncated: Tally) -> Iterator[dict]:
    """Encoded conversations that fit `max_len` and supervise something; the others are counted."""
    for index, conv in enumerate(conversations):
        encoder = encoders.for_conversation(conv, data_cfg.seed, index)
        try:
            ids, mask = encoder.encode(conv, draw_system_prompt(prompts, data_cfg.seed, index))
        except ChatTemplateError as e:
            dropped.add(e.reason, conv.where, e.detail)
            continue
        if not any(mask):
            dropped.add("no_assistant_tokens", conv.where)
            continue
        row = {"input_ids": ids, "loss_mask": mask}  # a row's value of every token column (TOKEN_COLUMNS)
        if len(ids) > data_cfg.max_len:
            if data_cfg.overflow == "drop":
                dropped.add("too_long", conv.where, f"{len(ids)} tokens")
                continue
            truncated.add("truncated", conv.where, f"{len(ids)} tokens")
            row = {name: values[: data_cfg.max_len] for name, values in row.items()}
            if not any(row["loss_mask"]):
                dropped.add("no_assistant_tokens_after_truncation", conv.where)
                continue
        if max(row["input_ids"]) >= V:
            raise ConfigError(
                f"token id {max(row['input_ids'])} from the tokenizer is outside the target vocab_size={V}"
            )
        yield row


def _write_arrow(samples: Iterable[dict[str, list[int]]], path: Path, batch: int = 1024) -> int:
    """Stream samples into an Arrow IPC file (the format `Dataset.from_file` maps); return the count."""
    import pyarrow as pa

    schema = pa.schema([(name, pa.list_(getattr(pa, column.arrow)())) for name, column in TOKEN_COLUMNS.items()])
    n, rows = 0, iter(samples)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        for chunk in iter(lambda: list(islice(rows, batch)), []):
            writer.write_batch(pa.RecordBatch.from_pylist(chunk, schema=schema))
            n += len(chunk)
    return n


def _split(ds, data_cfg: Any):
    """(train, eval): a seeded held-out subset, both in input order."""
    n = len(ds)
    n_eval = min(math.ceil(n * data_cfg.eval_fraction), data_cfg.eval_max_samples, n - 1)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(int(data_cfg.seed))).tolist()
    return ds.select(sorted(order[n_eval:])), ds.select(sorted(order[:n_eval]))


def _supervised_counts(ds, vocab_size: int) -> tuple[torch.Tensor, int]:
    """([V] int64 counts of supervised tokens, total tokens) over a dataset."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    tokens = 0
    for batch in ds.with_format("arrow").iter(batch_size=1024):
        ids, mask = (
            torch.from_numpy(batch.column(c).combine_chunks().flatten().to_numpy(zero_copy_only=False, writable=True))
            for c in ("input_ids", "loss_mask")
        )
        counts += count_supervised_tokens(ids, mask, vocab_size)
        tokens += ids.numel()
    return counts, tokens
