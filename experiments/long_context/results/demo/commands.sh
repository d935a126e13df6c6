# 2026-12-04T02:44:28, from the repository root
OMP_NUM_THREADS=1 python -m experiments.long_context windows=none,128 seeds=0,1 max_prompts=24 k=3 max_new_tokens=48 out=experiments/long_context/results/demo runs=runs/long_context -- recipe=demo
