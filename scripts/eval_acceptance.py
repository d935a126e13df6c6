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

Other keys: max_prompts (per split), drafter_format (auto | eagle31 | eagle3 | speculators |
specforge | torchspec), device, dtype. Writes acceptance.json, acceptance.md and
acceptance.png under `out` and prints the table; see eagle31/acceptance.py for the metrics.
"""

import sys

from eagle31.acceptance import AcceptanceConfig, run_acceptance
from eagle31.acceptance_report import REPORT_KIND, format_table, write_report
from eagle31.cli import parse_key_values, run_cli, wants_help
from eagle31.io import check_output_dir


def main(argv: list[str]) -> int:
    if wants_help(argv, __doc__):
        return 0

    def evaluate() -> None:
        config = parse_key_values(argv, AcceptanceConfig)
        check_output_dir(config.out, REPORT_KIND)  # before the decoding, which takes minutes
        report = run_acceptance(config, log=lambda line: print(line, file=sys.stderr))
        paths = write_report(report, config.out)
        print(format_table(report))
        print(f"\nwrote {', '.join(str(p) for p in paths.values())}")

    return run_cli(evaluate)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
