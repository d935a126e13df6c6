"""Replayed against live speculative decoding on SmolLM2-135M-Instruct: are they the same?

    python -m experiments.eagle3_vs_eagle31.replay_check drafter=runs/smollm2/eagle31-s0/drafter questions=2 \\
        out=experiments/eagle3_vs_eagle31/results/smollm2/replay_check.json

MT-Bench acceptance replays greedy speculative decoding on the target's own greedy decoding of
each turn (`eagle31.eval.speculative`). The unit tests hold the two equal on tiny random targets;
this checks it on the real model, where float32 ties between the target's top tokens could
make them differ: both turns of the first `questions` MT-Bench questions (one per category),
a chain of 3 and the EAGLE-2 tree, live (the target verifying every round) and replayed.
Writes every decoding's tau both ways and whether tokens and accepted lengths are identical.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from eagle31.io import atomic_write_json
from eagle31_cli import parse_key_values, run_cli, wants_help


@dataclass
class ReplayCheckConfig:
    drafter: str
    out: str
    questions: int = 2
    max_new_tokens: int = 128


def check(cfg: ReplayCheckConfig) -> dict:
    import torch
    from transformers import AutoTokenizer

    from eagle31.convert import load_drafter
    from eagle31.data.sources import Tally, read_mt_bench
    from eagle31.eval.acceptance import eos_ids, share_target_embedding
    from eagle31.eval.drafting import EagleProposer, TreeSpec
    from eagle31.eval.mtbench import select_questions, trace_mt_bench
    from eagle31.eval.speculative import speculative_generate
    from eagle31.target import load_target
    from eagle31.targets.smollm2 import ensure_smollm2_target

    target_dir = ensure_smollm2_target()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = load_target(target_dir, torch.device("cpu"), dtype=torch.float32, attn_implementation="sdpa")
    drafter = share_target_embedding(load_drafter(cfg.drafter), target).eval()
    aux_ids, eos = drafter.config.aux_layer_ids, eos_ids(target, tokenizer)
    modes = {"chain-k3": (3, None), "tree-8x5-32": (None, TreeSpec(8, 5, 32))}
    questions = select_questions(read_mt_bench("mtbench:", Tally()), 1)[: cfg.questions]
    turns = trace_mt_bench(
        target,
        tokenizer,
        questions,
        aux_layer_ids=aux_ids,
        max_new_tokens=cfg.max_new_tokens,
        draft_len=max(k or tree.depth for k, tree in modes.values()),
        eos_token_ids=eos,
    )
    rows = []
    for turn in turns:
        prompt = turn.trace.tokens[: turn.trace.prompt_len]
        for mode, (k, tree) in modes.items():
            kwargs = dict(max_new_tokens=cfg.max_new_tokens, k=k, tree=tree, eos_token_ids=eos)
            live = speculative_generate(target, EagleProposer(drafter), prompt, aux_layer_ids=aux_ids, **kwargs)
            replayed = speculative_generate(turn.trace, EagleProposer(drafter), prompt, aux_layer_ids=None, **kwargs)
            rows.append(
                {
                    "category": turn.category,
                    "mode": mode,
                    "tau_live": 1 + sum(live.accepted) / len(live.accepted),
                    "tau_replayed": 1 + sum(replayed.accepted) / len(replayed.accepted),
                    "identical": (live.tokens, live.accepted) == (replayed.tokens, replayed.accepted),
                }
            )
    return {
        "drafter": cfg.drafter,
        "decodings": len(rows),
        "identical": sum(r["identical"] for r in rows),
        "rows": rows,
    }


def main(argv: list[str]) -> int:
    if wants_help(argv, __doc__):
        return 0

    def body() -> None:
        cfg = parse_key_values(argv, ReplayCheckConfig)
        result = check(cfg)
        atomic_write_json(cfg.out, result)
        for r in result["rows"]:
            print(
                f"{r['category']:>12} {r['mode']:>12}  tau live {r['tau_live']:.3f}  "
                f"replayed {r['tau_replayed']:.3f}  identical {r['identical']}"
            )
        print(
            f"{result['identical']} of {result['decodings']} decodings identical (tokens and accepted lengths); "
            f"wrote {cfg.out}"
        )

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
