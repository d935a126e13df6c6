# On a 2-core CPU shared with other jobs, torch 2.13.0+cpu. The data, features and eagle31-s0 are the chain's
# (scripts/smollm2_chain.sh's regenerate, prepare and capture stages and its seed-0 EAGLE 3.1 training, the
# commands in experiments/eagle3_vs_eagle31/results/smollm2/drift/commands.sh); the other three trainings ran in two processes
# with measure=false, then one call measured all four drafters. The prompt files:
python -m experiments.eagle3_vs_eagle31.heldout_questions source=sharegpt: skip=640 count=32 format=messages out=runs/smollm2/side_by_side_prompts/heldout.jsonl
python -m experiments.eagle3_vs_eagle31.heldout_questions source=sharegpt: skip=640 count=32 format=messages out=runs/smollm2/side_by_side_prompts/unseen_system.jsonl 'system_prompt=You are Captain Byte, a cheerful pirate who answers every question in a seafaring voice.'
# 2026-12-02T14:06:31, from the repository root
OMP_NUM_THREADS=1 python -m experiments.side_by_side seeds=1 measure=false threads=1 k=3 max_prompts=32 max_new_tokens=128 out=experiments/side_by_side/results/smollm2 runs=runs/smollm2 -- recipe=smollm2_135m regenerate.output_dir=runs/smollm2/regenerated 'data.source=[runs/smollm2/regenerated/conversations]' 'eval.data=[runs/smollm2/side_by_side_prompts/heldout.jsonl,runs/smollm2/side_by_side_prompts/unseen_system.jsonl]'
# 2026-12-02T14:33:42, from the repository root
OMP_NUM_THREADS=1 python -m experiments.side_by_side seeds=0 measure=false threads=1 k=3 max_prompts=32 max_new_tokens=128 out=experiments/side_by_side/results/smollm2 runs=runs/smollm2 -- recipe=smollm2_135m regenerate.output_dir=runs/smollm2/regenerated 'data.source=[runs/smollm2/regenerated/conversations]' 'eval.data=[runs/smollm2/side_by_side_prompts/heldout.jsonl,runs/smollm2/side_by_side_prompts/unseen_system.jsonl]'
# 2026-12-02T15:13:21, from the repository root
OMP_NUM_THREADS=2 python -m experiments.side_by_side seeds=0,1 measure=true threads=2 k=3 max_prompts=16 max_new_tokens=128 out=experiments/side_by_side/results/smollm2 runs=runs/smollm2 -- recipe=smollm2_135m regenerate.output_dir=runs/smollm2/regenerated 'data.source=[runs/smollm2/regenerated/conversations]' 'eval.data=[runs/smollm2/side_by_side_prompts/heldout.jsonl,runs/smollm2/side_by_side_prompts/unseen_system.jsonl]'
