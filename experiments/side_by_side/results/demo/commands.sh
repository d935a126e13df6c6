# 2026-12-01T21:51:40, from the repository root (interrupted after eagle31 seed 1; the next lines continue it)
OMP_NUM_THREADS=1 python -m experiments.side_by_side seeds=0,1 max_steps=50 max_prompts=8 max_new_tokens=32 out=experiments/side_by_side/results/demo runs=runs/side_by_side -- recipe=demo
# 2026-12-01T22:16:03, from the repository root
OMP_NUM_THREADS=1 python -m experiments.side_by_side seeds=0 max_steps=50 max_prompts=8 max_new_tokens=32 out=experiments/side_by_side/results/demo runs=runs/side_by_side -- recipe=demo
# 2026-12-01T22:25:59, from the repository root (speculators seed 1 and the acceptance of all four ran with this
# command into a scratch out= directory whose acceptance/ was copied here; this run found everything done and summarised)
OMP_NUM_THREADS=1 python -m experiments.side_by_side seeds=0,1 max_steps=50 max_prompts=8 max_new_tokens=32 out=experiments/side_by_side/results/demo runs=runs/side_by_side -- recipe=demo
