"""What a round costs, measured: the target's forwards and the drafter's calls, timed in live greedy decoding.

`measure_costs` decodes prompts live (`eagle31.eval.speculative.speculative_generate` with the target) with each
drafter at each k, timing every target forward (hooks on the model) and every drafter call (`TimedProposer`):
per round the target's verification of k + 1 tokens, and the drafter's draft and its step-0 pass over the
verified positions after it. The target's plain greedy decoding of the same prompts
(`eagle31.eval.speculative.greedy_trace`) times its one-token forwards, the cost of a token without a drafter.
Medians over all rounds (the machine is shared; a median holds against the stalls of other jobs), means beside.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import torch


class ForwardTimer:
    """Times every forward of `model` while entered: `seconds[i]` and `tokens[i]` (its input length) per call."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.seconds: list[float] = []
        self.tokens: list[int] = []
        self._handles: list = []

    def __enter__(self) -> ForwardTimer:
        started: list[float] = []

        def before(module, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            self.tokens.append(int(ids.shape[-1]))
            started.append(time.perf_counter())

        def after(module, args, kwargs, output):
            self.seconds.append(time.perf_counter() - started.pop())

        self._handles = [
            self.model.register_forward_pre_hook(before, with_kwargs=True),
            self.model.register_forward_hook(after, with_kwargs=True),
        ]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()

    def clear(self) -> None:
        self.seconds.clear()
        self.tokens.clear()


class TimedProposer:
    """A `Proposer` that times the drafter's calls of each round: `draft_chain(k)` and the `extend` over the
    verified positions that follows it (the prompt's `extend`, the drafter's prefill, is not a round's)."""

    def __init__(self, proposer):
        self.proposer = proposer
        self.draft_s: list[float] = []
        self.extend_s: list[float] = []
        self._prefilled = False

    def reset(self) -> None:
        self.proposer.reset()
        self._prefilled = False

    def extend(self, aux: torch.Tensor, next_tokens: torch.Tensor) -> None:
        start = time.perf_counter()
        self.proposer.extend(aux, next_tokens)
        if self._prefilled:
            self.extend_s.append(time.perf_counter() - start)
        self._prefilled = True

    def draft_chain(self, k: int) -> torch.Tensor:
        start = time.perf_counter()
        drafts = self.proposer.draft_chain(k)
        self.draft_s.append(time.perf_counter() - start)
        return drafts

    def draft_tree(self, spec):
        raise ValueError("the costs are measured on chains and parallel rounds, not trees")


def spread(values: Sequence[float]) -> dict:
    """Median, mean and count of `values` (seconds)."""
    return {"median": statistics.median(values), "mean": statistics.fmean(values), "n": len(values)}


def measure_costs(
    drafters: dict[str, Path], target_dir: Path, prompts: Sequence[Sequence[int]], tokenizer, *, ks: Sequence[int],
    max_new_tokens: int,
) -> dict:  # fmt: skip
    """Per k and drafter the seconds of a round: the target's verification forward, the drafter's draft and its
    step-0 pass; and the target's one-token forward of plain decoding. Drafters and k interleave prompt by prompt,
    so a change of the machine's load falls on all of them alike."""
    from eagle31.convert import load_drafter
    from eagle31.eval.acceptance import eos_ids, share_target_embedding
    from eagle31.eval.drafting import EagleProposer
    from eagle31.eval.speculative import greedy_trace, speculative_generate
    from eagle31.target import load_target

    target = load_target(target_dir, torch.device("cpu"), dtype=torch.float32, attn_implementation="sdpa")
    loaded = {
        label: share_target_embedding(load_drafter(path), target).float().eval() for label, path in drafters.items()
    }
    eos = eos_ids(target, tokenizer)
    aux = {tuple(d.config.aux_layer_ids) for d in loaded.values()}
    if len(aux) != 1:
        raise ValueError(f"the drafters read different aux layers {sorted(aux)}: their target forwards differ")
    aux_layer_ids = list(aux.pop())
    proposers = {(label, k): TimedProposer(EagleProposer(d)) for label, d in loaded.items() for k in ks}
    verify: dict[int, list[float]] = {k: [] for k in ks}
    plain: list[float] = []
    with ForwardTimer(target) as timer:
        for prompt in prompts:
            ids = torch.tensor(list(prompt), dtype=torch.long)
            timer.clear()
            greedy_trace(target, ids, aux_layer_ids=aux_layer_ids, length=max_new_tokens)
            plain += timer.seconds[1:]  # after the prefill: one token each
            for k in ks:
                for label in loaded:
                    timer.clear()
                    speculative_generate(
                        target, proposers[(label, k)], ids, aux_layer_ids=aux_layer_ids,
                        max_new_tokens=max_new_tokens, k=k, eos_token_ids=eos,
                    )  # fmt: skip
                    assert all(n == k + 1 for n in timer.tokens[1:]), "a verification forward of other than k + 1"
                    verify[k] += timer.seconds[1:]
    rounds = {}
    for (label, k), timed in proposers.items():
        per_round = [d + e for d, e in zip(timed.draft_s, timed.extend_s, strict=True)]
        rounds.setdefault(label, {})[str(k)] = {
            "round": spread(per_round),
            "draft": spread(timed.draft_s),
            "step0_pass": spread(timed.extend_s),
            "parallel_drafting": loaded[label].config.parallel_drafting,
        }
    return {
        "target": {"plain_forward": spread(plain), "verify": {str(k): spread(v) for k, v in verify.items()}},
        "drafters": rounds,
    }
