"""Chat tokenizers built locally for the data tests, and small input writers."""

from __future__ import annotations

import json
from pathlib import Path

# A Llama-3-style chat format, written for the tests.
LLAMA3_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' -}}"
    "{{- message['content'] | trim + '<|eot_id|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}{%- endif -%}"
)
LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

_CORPUS = """\
You are a helpful assistant. The user asks and the assistant answers.
Hello! How can I help you today? What is two plus two? It is four.
Tell me about the weather. It is sunny and warm, with a light wind.
"""


def build_tokenizer(template: str, special: list[str], **kwargs):
    """A byte-level BPE (any text round-trips) with `special` as single-id special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    tok.add_special_tokens(special)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, additional_special_tokens=special, chat_template=template, **kwargs
    )


def supervised_spans(tok, ids: list[int], mask: list[int]) -> list[str]:
    """The decoded text of each run of supervised tokens."""
    spans, run = [], []
    for i, m in zip(ids, mask):
        if m:
            run.append(i)
        elif run:
            spans.append(tok.decode(run))
            run = []
    if run:
        spans.append(tok.decode(run))
    return spans


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path
