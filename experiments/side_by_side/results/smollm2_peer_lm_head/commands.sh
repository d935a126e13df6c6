# 2026-12-03T12:25:22, from the repository root
# speculators 0.9.0 with its lm_head trained (as eagle31 trains its own), seed 0, in the side-by-side's setting
# (runs/smollm2_lm_head/{data,features} link to the side-by-side's runs/smollm2/{data,features}), then measured
# as the side-by-side measures (k=3, 16 prompts per split, 128 new tokens, replay):
OMP_NUM_THREADS=1 python -c 'from experiments.side_by_side.study import *; train_speculators(side_recipe(SideBySideConfig(runs="runs/smollm2_lm_head", seeds="0"), OVERRIDES, 0, "speculators"), peer_lm_head=True)'
OMP_NUM_THREADS=1 python -c 'from experiments.side_by_side.study import *; measure_drafters({"speculators_lm_head-s0": Path("runs/smollm2_lm_head/speculators-s0/drafter")}, side_recipe(SideBySideConfig(runs="runs/smollm2_lm_head", seeds="0"), OVERRIDES, 0, "speculators"), k=3, max_new_tokens=128, max_prompts=16, out=Path("experiments/side_by_side/results/smollm2_peer_lm_head"))'
# OVERRIDES = ["recipe=smollm2_135m", "regenerate.output_dir=runs/smollm2/regenerated", "data.source=[runs/smollm2/regenerated/conversations]",
#   "eval.data=[runs/smollm2/side_by_side_prompts/heldout.jsonl,runs/smollm2/side_by_side_prompts/unseen_system.jsonl]"]

