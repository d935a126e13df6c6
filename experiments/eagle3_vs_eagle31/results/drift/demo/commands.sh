# 2026-12-02, from the repository root, on a 2-core CPU shared with other jobs (torch 2.13.0+cpu).
# The demo target is built into the cache once; $TARGET is its directory:
TARGET=$(python -c "from eagle31.targets.demo import ensure_demo_target; print(ensure_demo_target())")
# The two drafters: the seed-0, TTT-length-5 pair of experiments/eagle3_vs_eagle31/results/demo (the same commands).
# EAGLE 3.1 prepared runs/drift/data first. Both were stopped at step 200 and continued from their
# step-200 checkpoint with resume=auto, one thread each side by side; everything else as written.
# train_eagle3.json, train_eagle31.json: the report.json each training wrote in its output_dir.
OMP_NUM_THREADS=1 python train/main.py recipe=demo output_dir=runs/drift/eagle31 data.prepared_dir=runs/drift/data seed=0 train.ttt_length=5 train.max_steps=300 eval.enabled=false logging.wandb.mode=disabled logging.progress=false resume=auto
OMP_NUM_THREADS=1 python train/main.py recipe=demo output_dir=runs/drift/eagle3 data.prepared_dir=runs/drift/data seed=0 train.ttt_length=5 train.max_steps=300 eval.enabled=false logging.wandb.mode=disabled logging.progress=false drafter.fc_norm=false drafter.norm_output=false resume=auto
# drift.json, drift.md, drift_ttt.png, drift_live.png: the first 16 prompts of each split
OMP_NUM_THREADS=1 python scripts/diagnose_drift.py drafter=eagle3=runs/drift/eagle3/drafter,eagle31=runs/drift/eagle31/drafter target=$TARGET data=heldout=$TARGET/corpus/heldout.jsonl,other_system=$TARGET/corpus/other_system.jsonl,long_prompt=$TARGET/corpus/long_prompt.jsonl depth=7 max_new_tokens=64 max_prompts=16 target_sinks=4 device=cpu out=experiments/eagle3_vs_eagle31/results/drift/demo
