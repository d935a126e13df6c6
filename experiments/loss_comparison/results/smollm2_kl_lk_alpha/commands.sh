# seeds 0 and 1: trained and measured as ../smollm2/commands.sh lists
# 2026-12-03T12:45:22: this directory began as a copy of ../smollm2 (its measurements and training rows are kept);
# seed 2 of kl and lk_alpha was trained as the call below trains it, in two processes of one thread (one run each), then:
# 2026-12-03T12:45:23, from the repository root
OMP_NUM_THREADS=2 python -m experiments.loss_comparison losses=kl,lk_alpha seeds=0,1,2 threads=2 k=3 max_prompts=16 max_new_tokens=128 out=experiments/loss_comparison/results/smollm2_kl_lk_alpha runs=runs/smollm2 -- recipe=smollm2_135m regenerate.output_dir=runs/smollm2/regenerated 'data.source=[runs/smollm2/regenerated/conversations]' 'eval.data=[runs/smollm2/side_by_side_prompts/heldout.jsonl,runs/smollm2/side_by_side_prompts/unseen_system.jsonl]'
