"""Publish an exported drafter on the Hugging Face Hub, with a model card.

    python scripts/push_to_hub.py out=exports/demo-eagle3 repo_id=me/demo-eagle3 [private=true] [dry_run=true]
        [run=runs/demo]

`out` is a folder written by scripts/export.py. The card (README.md, written into `out`)
reads the run's config.yaml, its report.json and the prepared data's report.json; it
names datasets and a local target by their last path component, never by a local path. By
default the run is the first parent of `out` that is a run directory; name it with `run=`
otherwise. `dry_run=true` writes the card and lists what would be uploaded, without touching
the network. The token comes from HF_TOKEN or `hf auth login` and is never printed or written.
Exit codes: 0 done, 1 the upload failed (nothing was committed), 2 bad arguments or folder.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from eagle31.errors import ConfigError
from eagle31.export import is_run_dir, read_run_config
from eagle31.hub import (
    HubError,
    check_repo_id,
    push_folder,
    read_data_report,
    read_export,
    read_report,
    write_model_card,
)
from eagle31_cli import parse_key_values, wants_help


@dataclass
class PushArgs:
    out: str
    repo_id: str
    private: bool = False
    dry_run: bool = False
    run: str | None = None


def find_run_dir(out: Path) -> Path | None:
    return next((p for p in out.resolve().parents if is_run_dir(p)), None)


def main(argv: list[str]) -> int:
    if wants_help(argv, __doc__):
        return 0
    try:
        args = parse_key_values(argv, PushArgs)
        check_repo_id(args.repo_id)
        out = Path(args.out)
        read_export(out)
        run = Path(args.run) if args.run else find_run_dir(out)
        if run is not None and not is_run_dir(run):
            raise ConfigError(f"run={run} is not a run directory (needs config.yaml and drafter/)")
        run_config = read_run_config(run) if run else None
        write_model_card(out, args.repo_id, run_config, read_report(run), read_data_report(run, run_config))
        files = push_folder(out, args.repo_id, private=args.private, dry_run=args.dry_run)
    except ConfigError as e:
        print(f"push_to_hub: error: {e}", file=sys.stderr)
        return 2
    except HubError as e:
        print(f"push_to_hub: error: {e}", file=sys.stderr)
        return 1
    if args.dry_run:
        print(f"dry run: would upload to https://huggingface.co/{args.repo_id}:")
        print("\n".join(f"  {f}" for f in files))
    else:
        print(f"uploaded {len(files)} files to https://huggingface.co/{args.repo_id}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
