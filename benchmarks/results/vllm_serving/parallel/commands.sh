# The parallel (P-EAGLE) drafters of the parallel-drafting study (seed 0: the demo target, 60 steps; SmolLM2-135M,
# 40 steps; experiments/parallel_drafting/results/{demo,smollm2}/commands.sh trains them), exported and served by
# vLLM 0.32's CPU build with parallel_drafting, from the repository root.
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled
python scripts/export.py checkpoint=runs/parallel_drafting/parallel-s0 format=eagle3 out=runs/parallel_drafting/parallel-s0/export/eagle3
python scripts/export.py checkpoint=runs/parallel_drafting_smollm2/parallel-s0 format=eagle3 out=runs/parallel_drafting_smollm2/parallel-s0/export/eagle3
VLLM_CPU_OMP_THREADS_BIND=nobind python -m benchmarks.vllm_serving runs=demo_parallel_60_steps=runs/parallel_drafting/parallel-s0,smollm2_parallel_40_steps=runs/parallel_drafting_smollm2/parallel-s0 out=benchmarks/results/vllm_serving/parallel
