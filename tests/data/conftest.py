"""Fixtures of the data tests: locally built chat tokenizers (no downloads)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.data.chat_helpers import LLAMA3_SPECIAL, LLAMA3_TEMPLATE, build_tokenizer


@pytest.fixture(scope="session")
def llama_tok():
    return build_tokenizer(LLAMA3_TEMPLATE, LLAMA3_SPECIAL, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")


@pytest.fixture(scope="session")
def kimi_tok():
    from eagle31.targets.kimi_tokenizer import build_kimi_tokenizer

    return build_kimi_tokenizer()


@pytest.fixture(scope="session")
def llama_tok_dir(llama_tok, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("llama_tok")
    llama_tok.save_pretrained(path)
    return path
