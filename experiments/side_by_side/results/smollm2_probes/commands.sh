# 2026-12-03, from the repository root, on a 2-core CPU shared with other jobs, torch 2.13.0+cpu.
# The third seed pair of the SmolLM2 side-by-side (../smollm2_seed2/commands.sh) on MT-Bench and after a long
# history: 16 MT-Bench questions (the first 2 of each category), both turns, 128 new tokens per turn,
# chains of k = 3; then the same questions after at least 2048 tokens of earlier chats with the target (its
# regenerated training conversations), as the drift diagnosis's long_history probe.
TARGET=$(python -c "from eagle31.targets.smollm2 import ensure_smollm2_target; print(ensure_smollm2_target())")
D=eagle31-s2=runs/smollm2/eagle31-s2/drafter,speculators-s2=runs/smollm2/speculators-s2/drafter
OMP_NUM_THREADS=1 python scripts/eval_acceptance.py mtbench drafter=$D target=$TARGET ks=3 max_per_category=2 max_new_tokens=128 device=cpu out=experiments/side_by_side/results/smollm2_probes/mt_bench
OMP_NUM_THREADS=1 python scripts/eval_acceptance.py mtbench drafter=$D target=$TARGET ks=3 max_per_category=2 max_new_tokens=128 device=cpu history=runs/smollm2/regenerated/conversations history_tokens=2048 out=experiments/side_by_side/results/smollm2_probes/long_history
