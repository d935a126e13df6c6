# 2026-12-04T18:29:25, from the repository root
OMP_NUM_THREADS=1 python -m experiments.long_context windows=none,128 seeds=0,1 max_prompts=24 k=3 max_new_tokens=48 train_turns=8 out=experiments/long_context/results/demo_turns8_len1536 runs=runs/long_context_4x -- recipe=demo data.max_len=1536
