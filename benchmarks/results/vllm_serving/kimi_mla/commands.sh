# An MLA drafter of recipe=kimi_k26_mini served by vLLM 0.32's CPU build, from the repository root (~3 min on 2
# cores once the demo target, whose corpus is the recipe's data, is in the cache; building it takes 3-4 min more).
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled
# the miniature Kimi at DeepSeek-V3's latent width (kv_lora_rank 512 + rope 64), the only one vLLM 0.32's CPU MLA runs
python -c "from eagle31.targets.kimi_mini import VLLM_CPU_MLA, build_kimi_k26_mini; build_kimi_k26_mini('runs/kimi-mini-576', **VLLM_CPU_MLA)"
# 30 steps of its MLA drafter (its shape from the target), the acceptance on 4 held-out prompts, the eagle3 export
python train/main.py recipe=kimi_k26_mini target.builtin=null target.path=runs/kimi-mini-576 train.max_steps=30 \
    eval.enabled=true "eval.data=[demo:heldout]" eval.max_prompts=4 eval.max_new_tokens=32 output_dir=runs/vllm-kimi-mla logging.progress=false
# CPU_MLA: on a CPU with AMX tiles vLLM picks AMX_MLA, whose weight packing refuses the miniature's 16-wide heads
VLLM_CPU_OMP_THREADS_BIND=nobind python -m benchmarks.vllm_serving runs=kimi_mla=runs/vllm-kimi-mla formats=eagle3 \
    attention_backend=CPU_MLA out=benchmarks/results/vllm_serving/kimi_mla
