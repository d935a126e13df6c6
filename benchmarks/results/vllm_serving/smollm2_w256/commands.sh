# The SmolLM2-135M drafter with a 256-position window served by vLLM 0.32's CPU build, from the repository root.
# The drafter: what `WINDOW=256 SEEDS=1 VARIANTS=eagle31 STAGES=train bash scripts/smollm2_chain.sh` runs
# (the target is converted into the cache first; ShareGPT's user turns answered by the target, ~50 min on 2 cores).
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled
python -c "from eagle31.targets.smollm2 import ensure_smollm2_target; print(ensure_smollm2_target())"
COMMON=(recipe=smollm2_135m regenerate.output_dir=runs/smollm2/regenerated "data.source=[runs/smollm2/regenerated/conversations]"
        data.prepared_dir=runs/smollm2/data features.store_dir=runs/smollm2/features)
python data_prep/regenerate.py "${COMMON[@]}"
python data_prep/prepare.py "${COMMON[@]}"
python data_prep/capture.py "${COMMON[@]}"
python train/main.py "${COMMON[@]}" output_dir=runs/smollm2/eagle31-w256-s1 seed=1 resume=auto drafter.sliding_window=256 logging.progress=false
# The run measures no acceptance (eval.enabled=false): the benchmark decodes MT-Bench's first turns, one question per
# category, alone and after >= 512 tokens of the regenerated conversations (k=3 and 64 new tokens: the run's eval.*).
# eagle31 on one thread, vLLM on one unbound thread (~20 min here, beside another job on the 2 cores).
OMP_NUM_THREADS=1 VLLM_CPU_OMP_THREADS_BIND=nobind python -m benchmarks.vllm_serving runs=smollm2_w256=runs/smollm2/eagle31-w256-s1 \
    history=runs/smollm2/regenerated/conversations out=benchmarks/results/vllm_serving/smollm2_w256
