"""Chain drafting against the training unroll, in fp32 and fp64: how far apart their logits are, by context
length and draft depth, for the Llama drafter of the miniature Kimi K2.6 (Kimi's yarn rope, factor 64, at
vLLM's magnitude for a Llama layer, 1.416).

    python -m benchmarks.drafting_parity [lengths=16,256,2048,8192] [seeds=5] [depth=4] \\
        [out=benchmarks/results/drafting_parity.json]

Per context length n and seed (0 to seeds-1, each a weight draw): a random drafter of the shape
`recipe=kimi_k26_mini drafter.attention=llama` plans (weights N(0, 0.3), norms near one, so that
logits reach ~30), n positions of random target features and tokens; `EagleProposer` drafts `depth`
tokens after them (SDPA over its cache), and the training unroll (`ttt_unroll`, the training
attention kernel), teacher-forced on those drafts, gives the logits of the same queries (n-1, j).
Reported per length, dtype and depth: the max |logit difference| of each seed, its spread over the
seeds (smallest to largest) and the largest logit; the fp32 gaps seed by seed, and how far the draw
alone moves one. The fp64 rows say whether the two forwards compute the same function; the fp32
rows how far rounding alone takes them apart (tests/eval/test_drafting.py holds them to it). A
change to either forward is judged seed by seed: the worst of a few draws moves with the draw.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from benchmarks.report import write_result_and_table
from eagle31.config import DrafterConfig
from eagle31.errors import ConfigError
from eagle31.eval.drafting import EagleProposer
from eagle31.model import Eagle31Drafter, RMSNorm
from eagle31.ttt import ttt_unroll
from eagle31.vocab import vocab_maps
from eagle31_cli import parse_key_values, wants_help

ROOT = Path(__file__).resolve().parent.parent


@cache
def kimi_llama_config() -> DrafterConfig:
    """The drafter `recipe=kimi_k26_mini drafter.attention=llama` trains (a dry-run plan: nothing is built)."""
    from eagle31.distributed import init_world
    from eagle31.plan import plan_run
    from eagle31.recipe import load_recipe

    cfg = load_recipe(ROOT / "recipes", ["recipe=kimi_k26_mini", "dry_run=true", "drafter.attention=llama"])
    return plan_run(cfg, init_world("cpu")).drafter


def kimi_llama_drafter(seed: int, dtype: torch.dtype) -> Eagle31Drafter:
    """A random drafter of that shape, its full vocabulary drawn as the target's embedding and lm_head."""
    config = kimi_llama_config()
    torch.manual_seed(seed)
    drafter = Eagle31Drafter(config)
    drafter.reset_parameters(std=0.3)
    with torch.no_grad():
        for module in drafter.modules():
            if isinstance(module, RMSNorm):
                module.weight.copy_(1 + 0.2 * torch.randn_like(module.weight))
        V, H = config.vocab_size, config.hidden_size
        d2t, t2d = vocab_maps(torch.arange(config.draft_vocab_size), V)
        drafter.init_from_target(torch.randn(V, H), torch.randn(V, H), d2t, t2d)
    return drafter.to(dtype).eval()


@torch.no_grad()
def chain_and_unroll_logits(
    drafter: Eagle31Drafter, n: int, depth: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [depth, Vd] of a chain drafted after n context positions, and the training unroll's at the same
    queries (n-1, j), teacher-forced on the drafted ids."""
    dtype = drafter.fc.weight.dtype
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(n, drafter.config.fc_in_features, generator=g).to(dtype) * 2  # [n, n_aux*Ht]
    ids = torch.randint(0, drafter.config.vocab_size, (n + 1,), generator=g)  # x[0..n]
    proposer = EagleProposer(drafter)
    proposer.extend(aux, ids[1:])
    drafted = []  # the lm_head output of each draft step
    hook = drafter.lm_head.register_forward_hook(
        lambda module, args, out: drafted.append(out.reshape(-1, out.shape[-1])[-1])
    )
    try:
        drafts = proposer.draft_chain(depth)
    finally:
        hook.remove()
    tokens = torch.cat([ids, drafts[:-1]])[None]  # [1, n + depth]
    feats = torch.cat([aux, aux.new_zeros(depth, aux.shape[-1])])[None]  # no target feature after position n-1
    out = ttt_unroll(drafter, feats, tokens, ttt_length=depth, attention_kernel="auto")
    unrolled = torch.stack([drafter.lm_head(state[0, n - 1]) for state in out.states])
    return torch.stack(drafted), unrolled


@dataclass
class DraftingParity:
    lengths: str = "16,256,2048,8192"
    seeds: int = 5
    depth: int = 4
    out: str = str(ROOT / "benchmarks" / "results" / "drafting_parity.json")


def measure(lengths: list[int], seeds: int, depth: int) -> list[dict]:
    """Per length and dtype: each seed's max |logit difference| by depth, the worst of them, and the largest logit."""
    rows = []
    for n in lengths:
        for dtype in (torch.float32, torch.float64):
            by_seed, largest = [], 0.0
            for seed in range(seeds):
                drafted, unrolled = chain_and_unroll_logits(kimi_llama_drafter(seed, dtype), n, depth, seed)
                by_seed.append((drafted - unrolled).abs().amax(dim=-1).tolist())  # [depth]
                largest = max(largest, float(unrolled.abs().max()))
            worst = [max(gaps) for gaps in zip(*by_seed)]
            rows.append(
                {
                    "n": n,
                    "dtype": str(dtype).removeprefix("torch."),
                    "max_abs_difference_by_seed": by_seed,
                    "max_abs_difference_by_depth": worst,
                    "largest_logit": largest,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


def command(spec: dict) -> str:
    """The command that measures `spec`."""
    lengths = ",".join(map(str, spec["lengths"]))
    return f"python -m benchmarks.drafting_parity lengths={lengths} seeds={spec['seeds']} depth={spec['depth']}"


def draw_spread(runs: list[dict]) -> str | None:
    """One sentence: the widest spread over the seeds of one fp32 gap (one length, one depth); None for one seed."""
    widest = max(
        (
            (max(gaps) / min(gaps), row["n"], k + 1, min(gaps), max(gaps))
            for row in runs
            if row["dtype"] == "float32"
            for k, gaps in enumerate(zip(*row["max_abs_difference_by_seed"]))
            if len(gaps) > 1 and min(gaps) > 0
        ),
        default=None,
    )
    if widest is None:
        return None
    ratio, n, k, low, high = widest
    return (
        f"In fp32 the weight draw alone moves one gap (one length, one depth) by up to {ratio:.0f}x "
        f"({low:.1e} to {high:.1e} at n = {n}, depth {k}), so a change to either forward is judged seed by seed, "
        "not by the worst of a few draws."
    )


def markdown(result: dict) -> str:
    spec, runs = result["spec"], result["runs"]
    depths = " | ".join(f"depth {k + 1}" for k in range(spec["depth"]))
    rule = "|---|---|" + "---|" * spec["depth"]
    lines = [
        "Chain drafting against the training unroll: the max |logit difference| at each draft depth, smallest to "
        f"largest over seeds 0-{spec['seeds'] - 1} (each a random drafter), the Llama drafter of "
        f"`recipe=kimi_k26_mini` on Kimi's yarn rope, CPU, torch {result['torch']}:",
        "",
        f"    {command(spec)}",
        "",
        f"| n | dtype | {depths} | largest logit |",
        rule + "---|",
    ]
    for row in runs:
        spread = zip(*row["max_abs_difference_by_seed"])
        cells = " | ".join(f"{min(gaps):.1e} – {max(gaps):.1e}" for gaps in spread)
        lines.append(f"| {row['n']} | {row['dtype']} | {cells} | {row['largest_logit']:.1f} |")
    lines += ["", "fp32, seed by seed:", "", f"| n | seed | {depths} |", rule]
    for row in runs:
        if row["dtype"] == "float32":
            for seed, gaps in enumerate(row["max_abs_difference_by_seed"]):
                lines.append(f"| {row['n']} | {seed} | " + " | ".join(f"{x:.1e}" for x in gaps) + " |")
    reading = draw_spread(runs)
    if reading is not None:
        lines += ["", reading]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if wants_help(argv, __doc__):
        return 0
    try:
        args = parse_key_values(argv, DraftingParity)
        lengths = [int(n) for n in args.lengths.split(",")]
        if args.seeds < 1 or args.depth < 1 or min(lengths) < 1:
            raise ConfigError("lengths, seeds and depth must be positive")
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    spec = {"lengths": lengths, "seeds": args.seeds, "depth": args.depth}
    result = {
        "spec": spec,
        "torch": torch.__version__,
        "cpu_cores": os.cpu_count(),
        "runs": measure(lengths, args.seeds, args.depth),
    }
    write_result_and_table(result, out, markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
