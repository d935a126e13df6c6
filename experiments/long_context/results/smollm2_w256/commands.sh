# what scripts/smollm2_chain.sh ran, in order (the target is converted into the cache first)
TARGET=$(python -c "from eagle31.targets.smollm2 import ensure_smollm2_target; print(ensure_smollm2_target())")
python data_prep/regenerate.py recipe=smollm2_135m regenerate.output_dir=runs/smollm2/regenerated data.source=\[runs/smollm2/regenerated/conversations\] data.prepared_dir=runs/smollm2/data features.store_dir=runs/smollm2/features 
