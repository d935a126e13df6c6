r"""Train an EAGLE 3.1 drafter from a recipe (Hydra composition over recipes/).

    python train/main.py                                   # recipe=demo: the built-in demo, on CPU
    python train/main.py recipe=kimi_k26 dry_run=true      # validate + parameter count + memory estimate
    torchrun --nproc-per-node 8 train/main.py recipe=kimi_k26 target.path=/models/Kimi-K2.6 \
        data.source=[/data/chats.jsonl] output_dir=runs/kimi
    python train/main.py train.lr=5e-5 data.max_len=16384 drafter.norm_output=false resume=auto
    python train/main.py recipe=kimi_k26 train.lr=5e-5 --cfg   # print the composed config, run nothing

Every expected failure is one line on stderr and an exit code that says its kind: 2 for bad
input, 1 for a diverged run; the full table is docs/reliability.md.
"""

import sys
from pathlib import Path

from eagle31.pipeline import run
from eagle31_cli import recipe_main

RECIPES = Path(__file__).resolve().parents[1] / "recipes"

if __name__ == "__main__":
    import datasets
    import transformers

    datasets.disable_progress_bars()  # the run's own bar and report say what matters
    transformers.utils.logging.disable_progress_bar()
    sys.exit(recipe_main(run, RECIPES, sys.argv[1:], usage=__doc__))
