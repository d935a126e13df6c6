# 2026-12-06T14:14:40, from the repository root
OMP_NUM_THREADS=1 python -m experiments.parallel_drafting seeds=0,1 max_steps=60 measure=false threads=1 out=experiments/parallel_drafting/results/demo runs=runs/parallel_drafting -- recipe=demo features.tokens_per_batch=1024
# 2026-12-06T14:35:30, from the repository root
OMP_NUM_THREADS=1 python -m experiments.parallel_drafting seeds=0,1 max_steps=60 max_prompts=8 threads=1 out=experiments/parallel_drafting/results/demo runs=runs/parallel_drafting -- recipe=demo features.tokens_per_batch=1024
