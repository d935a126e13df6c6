"""Held-out prompts from the training source, as single-turn MT-Bench questions.

    python -m experiments.eagle3_vs_eagle31.heldout_questions source=sharegpt: skip=640 count=32 \\
        out=runs/smollm2/heldout.jsonl

Keeps the first user turn of the conversations that come after the first `skip` of `source`
(the ones `data_prep/regenerate.py` answered for training, with `regenerate.max_conversations`
= `skip`), up to `max_chars` characters each, and writes `count` of them in the MT-Bench
question format (`question_id`, `category`, `turns`), so `scripts/eval_acceptance.py mtbench
questions=<out>` measures drafters in their training distribution on prompts they never saw.

    python -m experiments.eagle3_vs_eagle31.heldout_questions format=messages system_prompt="You are ..." \\
        out=unseen_system.jsonl

`format=messages` writes the same prompts as acceptance prompt files (`{"messages": [...]}`, what
`eval.data` and `scripts/eval_acceptance.py` read), optionally after a `system_prompt`: the
held-out probes of `experiments.side_by_side.study`.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from enum import StrEnum
from itertools import islice

from eagle31.data.sources import Tally, read_conversations
from eagle31.errors import ConfigError
from eagle31.io import atomic_write_text
from eagle31_cli import parse_key_values, run_cli, wants_help


class QuestionFormat(StrEnum):
    mtbench = "mtbench"  # question_id, category, turns: scripts/eval_acceptance.py mtbench questions=
    messages = "messages"  # an acceptance prompt file: eval.data, scripts/eval_acceptance.py data=


@dataclass
class HeldoutConfig:
    out: str
    source: str = "sharegpt:"
    skip: int = 640  # conversations used for training come first
    count: int = 32
    max_chars: int = 1000  # ~256 tokens: the recipe's regenerate.max_prompt_tokens
    category: str = "heldout"
    format: QuestionFormat = QuestionFormat.mtbench
    system_prompt: str | None = None  # format=messages: a system turn before each prompt

    def __post_init__(self) -> None:
        if self.system_prompt is not None and self.format != QuestionFormat.messages:
            raise ConfigError("system_prompt needs format=messages (MT-Bench questions carry no system turn)")


def heldout_questions(cfg: HeldoutConfig) -> list[dict]:
    questions = []
    conversations = islice(read_conversations([cfg.source], Tally()), cfg.skip, None)
    for number, conversation in enumerate(conversations, start=cfg.skip):
        first = next((m["content"] for m in conversation.messages if m["role"] == "user"), None)
        if isinstance(first, str) and first.strip() and len(first) <= cfg.max_chars:
            questions.append({"question_id": number, "category": cfg.category, "turns": [first]})
            if len(questions) == cfg.count:
                return questions
    raise ConfigError(
        f"source {cfg.source}: only {len(questions)} prompts after the first {cfg.skip}, {cfg.count} wanted"
    )


def as_records(cfg: HeldoutConfig, questions: list[dict]) -> list[dict]:
    """The questions in `cfg.format`: as they are, or as one-turn chat prompts."""
    if cfg.format == QuestionFormat.mtbench:
        return questions
    system = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt is not None else []
    return [{"messages": [*system, {"role": "user", "content": q["turns"][0]}]} for q in questions]


def main(argv: list[str]) -> int:
    if wants_help(argv, __doc__):
        return 0

    def body() -> None:
        cfg = parse_key_values(argv, HeldoutConfig)
        questions = as_records(cfg, heldout_questions(cfg))
        atomic_write_text(cfg.out, "".join(json.dumps(q) + "\n" for q in questions))
        print(f"wrote {len(questions)} held-out questions to {cfg.out}")

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
