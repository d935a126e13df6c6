"""Conversations -> tokens + loss masks + draft vocabulary, for one recipe.

    python data_prep/prepare.py recipe=demo data.source=chats.jsonl
    python data_prep/prepare.py recipe=kimi_k26 target.path=/models/Kimi-K2.6 'data.source=[a.jsonl,b.parquet]' \
        data.max_len=8192 data.overflow=drop

Reads the target's tokenizer (`target.builtin` or `target.path`) and writes
`data.prepared_dir`: train/, eval/, token_counts.safetensors, vocab.safetensors and
report.json (see eagle31/data/prepare.py). Bad settings, or input of which nothing
can be read, stop with a one-line error and exit code 2.
"""

import sys
from pathlib import Path

from eagle31.data.prepare import check_data_config, prepare_with_target_tokenizer
from eagle31.data.sources import check_sources, data_section
from eagle31.pipeline import init_from_vocab
from eagle31.target import target_vocab_size
from eagle31.targets import resolve_target_path
from eagle31_cli import recipe_main

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def prepare(cfg) -> None:
    data = data_section(cfg)  # `demo:<split>` sources resolved
    check_sources(check_data_config(data))  # before loading (or building) the target
    path = Path(resolve_target_path(cfg.target))
    report = prepare_with_target_tokenizer(
        data,
        path,
        trust_remote_code=cfg.target.trust_remote_code,
        draft_vocab_size=cfg.drafter.draft_vocab_size,
        vocab_size=target_vocab_size(path),
        draft_vocab=init_from_vocab(cfg.drafter, path),
    )
    print(report.summary())


if __name__ == "__main__":
    sys.exit(recipe_main(prepare, RECIPES, sys.argv[1:], usage=__doc__))
