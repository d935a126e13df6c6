"""Build the demo target: a small Llama trained from scratch on the Python standard library.

    python scripts/make_demo_target.py                  # into the cache ($EAGLE31_CACHE, default ~/.cache/eagle31)
    python scripts/make_demo_target.py --out DIR [--seed N]

Writes an HF model folder (config.json, model.safetensors, tokenizer files),
`corpus/{train,heldout,other_system,long_prompt}.jsonl` and `build_info.json`
with the held-out metrics; ~3-4 minutes on 2 CPU cores. See docs/demo_target.md.
"""

import argparse
import json
import logging
import sys

from eagle31.targets.cache import build_atomically
from eagle31.targets.demo import build_demo_target, ensure_demo_target


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="a new directory to build into (default: the cache)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.out:
        try:
            path = build_atomically(args.out, lambda d: build_demo_target(d, seed=args.seed))
        except FileExistsError as e:
            print(f"error: --out {e}", file=sys.stderr)
            return 2
    else:
        path = ensure_demo_target(seed=args.seed)
    info = json.loads((path / "build_info.json").read_text())
    print(path)
    print(json.dumps(info["metrics"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
