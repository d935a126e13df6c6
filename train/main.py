r"""Train an EAGLE 3.1 drafter from a recipe (Hydra composition over recipes/).

    python train/main.py                                   # recipe=demo: the built-in demo, on CPU
    python train/main.py recipe=kimi_k26 dry_run=true      # validate + parameter count + memory estimate
    torchrun --nproc-per-node 8 train/main.py recipe=kimi_k26 target.path=/models/Kimi-K2.6 \
        data.source=[/data/chats.jsonl] output_dir=runs/kimi
    python train/main.py train.lr=5e-5 data.max_len=16384 drafter.norm_output=false resume=auto
    python train/main.py recipe=kimi_k26 train.lr=5e-5 --cfg   # print the composed config, run nothing

Bad input exits with code 2 and one line naming the problem; a diverged run exits with 1.
"""

import sys
from pathlib import Path

from eagle31.cli import recipe_main
from eagle31.pipeline import run
from eagle31.trainer import TrainingDiverged

RECIPES = Path(__file__).resolve().parents[1] / "recipes"

if __name__ == "__main__":
    import datasets
    import transformers

    datasets.disable_progress_bars()  # the run's own bar and report say what matters
    transformers.utils.logging.disable_progress_bar()
    try:
        sys.exit(recipe_main(run, RECIPES, sys.argv[1:], usage=__doc__))
    except TrainingDiverged as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
