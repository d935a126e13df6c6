"""Export a trained drafter in one of vLLM's formats.

    python scripts/export.py checkpoint=runs/demo format=eagle3 out=exports/demo-eagle3
    python scripts/export.py checkpoint=<drafter dir> format=speculators out=<dir> [dtype=bfloat16]
        [include_embed=true|false] [num_speculative_tokens=3] [trained_context=N] [target=<hub id>]
        [source_format=auto] [target_num_layers=L] [overwrite=true]

`checkpoint` is a run directory (its `drafter/` and `config.yaml`, which give the trained
context, k, dtype and the target's name) or a drafter directory of any layout
`eagle31.convert.load_drafter` reads. Arguments override the run's settings. The
layouts are described in `eagle31/export.py` and docs/export.md.

`out` must be a new or empty directory, or an earlier export (replaced whole with
`overwrite=true`); it may not be, or hold, the checkpoint. The embedding is written by
default in the speculators layout and left out of the eagle3 one (vLLM shares the
target's); `include_embed=` overrides that. Exit codes: 0 done, 2 bad arguments or input.
"""

import sys
from dataclasses import dataclass
from pathlib import Path

from eagle31.convert import load_drafter
from eagle31.errors import ConfigError
from eagle31.export import RUN_DRAFTER, check_export_out, export_drafter, export_options, is_run_dir, read_run_config
from eagle31.layouts import DrafterFormat, ExportFormat
from eagle31.target import Dtype
from eagle31_cli import parse_key_values, wants_help


@dataclass
class ExportArgs:
    checkpoint: str
    out: str
    format: ExportFormat = ExportFormat.eagle3
    dtype: Dtype | None = None
    include_embed: bool | None = None
    num_speculative_tokens: int | None = None
    trained_context: int | None = None
    target: str | None = None
    source_format: DrafterFormat = DrafterFormat.auto
    target_num_layers: int | None = None
    overwrite: bool = False


def main(argv: list[str]) -> int:
    if wants_help(argv, __doc__):
        return 0
    try:
        args = parse_key_values(argv, ExportArgs)
        checkpoint = Path(args.checkpoint)
        if not checkpoint.is_dir():
            raise ConfigError(f"checkpoint={checkpoint} is not a directory")
        options = {}
        if is_run_dir(checkpoint):
            options = export_options(read_run_config(checkpoint))
            checkpoint = checkpoint / RUN_DRAFTER
        given = {
            "dtype": args.dtype,
            "include_embed": args.include_embed,
            "num_speculative_tokens": args.num_speculative_tokens,
            "trained_context": args.trained_context,
            "target_name_or_path": args.target,
        }
        options.update({k: v for k, v in given.items() if v is not None})
        check_export_out(Path(args.out), overwrite=args.overwrite, source=checkpoint)  # before loading anything
        drafter = load_drafter(checkpoint, source_format=args.source_format, target_num_layers=args.target_num_layers)
        out = export_drafter(drafter, args.out, args.format, overwrite=args.overwrite, source=checkpoint, **options)
    except ConfigError as e:
        print(f"export: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.format} drafter to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
