# 2026-12-03, from the repository root, on a 2-core CPU shared with other jobs, torch 2.13.0+cpu.
# The side-by-side's setting (experiments/side_by_side/results/smollm2/commands.sh: the same prepared data, features,
# prompt files and measurement); runs/smollm2_vocab/{data,features} and runs/smollm2_mask/{data,features} link to
# runs/smollm2/{data,features}.
OVERRIDES='["recipe=smollm2_135m", "regenerate.output_dir=runs/smollm2/regenerated", "data.source=[runs/smollm2/regenerated/conversations]",
  "eval.data=[runs/smollm2/side_by_side_prompts/heldout.jsonl,runs/smollm2/side_by_side_prompts/unseen_system.jsonl]"]'
# eagle31 without its out-of-vocabulary mask, seeds 0, 1, 2 (one process of one thread each):
for S in 0 1 2; do OMP_NUM_THREADS=1 python -c "from experiments.side_by_side.study import *; train_eagle31(side_recipe(SideBySideConfig(runs='runs/smollm2_vocab', seeds='$S'), $OVERRIDES + ['train.mask_out_of_vocab=false'], $S, 'eagle31'))"; done
# speculators 0.9.0 (lm_head frozen, their default) on eagle31's supervised queries (peer_mask=eagle31), seeds 0, 1:
for S in 0 1; do OMP_NUM_THREADS=1 python -c "from experiments.side_by_side.study import *; train_speculators(side_recipe(SideBySideConfig(runs='runs/smollm2_mask', seeds='$S'), $OVERRIDES, $S, 'speculators'), False, 'eagle31')"; done
# all five measured as the side-by-side measures (k=3, 16 prompts per split, 128 new tokens, replay; one report,
# the last call keeping the rows of the first):
OMP_NUM_THREADS=2 python -c "from experiments.side_by_side.study import *; measure_drafters({f'eagle31_all_vocab-s{s}': Path(f'runs/smollm2_vocab/eagle31-s{s}/drafter') for s in (0, 1, 2)} | {f'speculators_eagle31_mask-s{s}': Path(f'runs/smollm2_mask/speculators-s{s}/drafter') for s in (0, 1)}, side_recipe(SideBySideConfig(runs='runs/smollm2', seeds='0'), $OVERRIDES, 0, 'eagle31'), k=3, max_new_tokens=128, max_prompts=16, out=Path('experiments/side_by_side/results/smollm2_masks'))"
