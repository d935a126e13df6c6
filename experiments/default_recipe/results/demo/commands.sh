# 2026-12-06T22:15:48, from the repository root
OMP_NUM_THREADS=1 python -m experiments.default_recipe seeds=0,1 max_steps=150 max_prompts=8 max_new_tokens=32 levers=optimizer=muon,schedule=linear,loss=lk_alpha out=experiments/default_recipe/results/demo runs=runs/default_recipe -- recipe=demo
# 2026-12-07T00:16:16, from the repository root
OMP_NUM_THREADS=1 python -m experiments.default_recipe seeds=0,1 max_steps=150 max_prompts=8 max_new_tokens=32 levers=optimizer=muon,schedule=linear,loss=lk_alpha,ttt_length=7,ttt_decay=null,drafter.sliding_window=128 out=experiments/default_recipe/results/demo runs=runs/default_recipe -- recipe=demo
