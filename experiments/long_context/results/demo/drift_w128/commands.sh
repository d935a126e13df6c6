# 2026-12-04, from the repository root, on a 2-core CPU (torch 2.13.0+cpu).
# The two drafters: the seed-0, W = 128 pair of experiments/long_context/results/demo, trained again by the
# study's command for that pair (their acceptance equals the committed seed-0 figures to the last digit).
TARGET=$(python -c "from eagle31.targets.demo import ensure_demo_target; print(ensure_demo_target())")
OMP_NUM_THREADS=1 python -m experiments.long_context windows=128 seeds=0 max_prompts=24 k=3 max_new_tokens=48 out=runs/drift/st_study runs=runs/long_context -- recipe=demo
# drift.json, drift.md, drift_ttt.png, drift_live.png: the first 16 prompts of each split, as the full-attention
# drafters' diagnosis in experiments/eagle3_vs_eagle31/results/drift/demo
OMP_NUM_THREADS=2 python scripts/diagnose_drift.py drafter=eagle3=runs/long_context/eagle3-w128-s0/drafter,eagle31=runs/long_context/eagle31-w128-s0/drafter target=$TARGET data=heldout=$TARGET/corpus/heldout.jsonl,other_system=$TARGET/corpus/other_system.jsonl,long_prompt=$TARGET/corpus/long_prompt.jsonl depth=7 max_new_tokens=64 max_prompts=16 target_sinks=4 device=cpu out=experiments/long_context/results/demo/drift_w128
