# 2026-12-03T11:27:48, from the repository root
OMP_NUM_THREADS=1 python -m experiments.side_by_side sides=eagle31,speculators,specforge seeds=0,1 max_steps=50 max_prompts=8 max_new_tokens=32 runs=runs/side_by_side_eagle3 out=experiments/side_by_side/results/demo_eagle3 -- recipe=demo drafter.norm_output=false
