r"""Attention drift per draft depth: where drafters look and how the state they feed back grows.

    python scripts/diagnose_drift.py drafter=eagle3=runs/e3/drafter,eagle31=runs/e31/drafter \
        target=<target dir> data=<corpus dir or a.jsonl,b.jsonl> depth=7 out=runs/drift

For each drafter, split and draft depth k = 1..depth, teacher-forced (the training view) and by
live chain drafting on the target's greedy continuation (the serving view, replayed): the
attention mass on the first `sink_tokens` prompt tokens, on the rest of the context and on the
drafter's own drafts (mean and per head), the RMS of the state each step reads and gives, and
the conditional acceptance at k. Other keys: sink_tokens (4), target_sinks (n: also the mass on
the n positions the target's own attention at the aux layers attends to most), max_new_tokens
(64), max_prompts (per split), pack_tokens, drafter_format (auto | eagle31 | eagle3 | speculators
| specforge | torchspec), device, dtype, chat_template_kwargs; MT-Bench instead of data=:
questions=mtbench: (or a question.jsonl) split=<name> max_per_category system_prompt history
history_tokens, as in `eval_acceptance.py mtbench`. Writes drift.json, drift.md, drift_ttt.png and
drift_live.png under `out` and prints the table; see eagle31/eval/drift.py for the definitions.
"""

import sys

from eagle31.eval.drift import DriftConfig, run_drift
from eagle31.eval.drift_report import REPORT_KIND, format_table, write_report
from eagle31.io import check_output_dir
from eagle31_cli import parse_key_values, run_cli, wants_help


def main(argv: list[str]) -> int:
    if wants_help(argv, __doc__):
        return 0

    def body() -> None:
        config = parse_key_values(argv, DriftConfig)
        check_output_dir(config.out, REPORT_KIND)  # before the decoding, which takes minutes
        report = run_drift(config, log=lambda line: print(line, file=sys.stderr))
        paths = write_report(report, config.out)
        print(format_table(report))
        print(f"\nwrote {', '.join(str(p) for p in paths.values())}")

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
