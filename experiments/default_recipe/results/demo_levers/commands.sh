# 2026-12-07T15:59:53, from the repository root
OMP_NUM_THREADS=1 python -m experiments.default_recipe seeds=0,1 max_steps=150 max_prompts=8 max_new_tokens=32 levers=lr=1e-3,loss=lk_hybrid out=experiments/default_recipe/results/demo_levers runs=runs/default_recipe_levers -- recipe=demo
# 2026-12-07T16:25:09, from the repository root
OMP_NUM_THREADS=1 python -m experiments.default_recipe seeds=0,1 max_steps=150 max_prompts=8 max_new_tokens=32 levers=lr=1e-3,loss=lk_hybrid,drafter.draft_vocab_size=512,drafter.draft_vocab_size=2048 out=experiments/default_recipe/results/demo_levers runs=runs/default_recipe_levers -- recipe=demo
