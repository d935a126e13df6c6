# A drafter of recipe=demo trained 100 steps, served by vLLM 0.32's CPU build, from the repository root (~3 min on
# 2 cores once the demo target is in the cache; building it the first time takes 3-4 min more).
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled
python train/main.py recipe=demo train.max_steps=100 output_dir=runs/demo100 logging.progress=false
VLLM_CPU_OMP_THREADS_BIND=nobind python -m benchmarks.vllm_serving runs=demo_100_steps=runs/demo100 out=benchmarks/results/vllm_serving/demo
