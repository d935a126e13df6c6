# 2026-12-07T03:06:03, from the repository root: the recipe's regenerated ShareGPT
OMP_NUM_THREADS=2 python data_prep/regenerate.py recipe=smollm2_135m regenerate.output_dir=runs/smollm2/regenerated 'data.source=[runs/smollm2/regenerated/conversations]'
# 2026-12-07T03:29:11, from the repository root
OMP_NUM_THREADS=2 python -m experiments.default_recipe seeds=0,1,2 threads=2 max_steps=150 measure=false out=experiments/default_recipe/results/smollm2 runs=runs/smollm2_default_recipe -- recipe=smollm2_135m regenerate.output_dir=runs/smollm2/regenerated 'data.source=[runs/smollm2/regenerated/conversations]'
# 2026-12-07T04:32:59, from the repository root
OMP_NUM_THREADS=1 python -m experiments.default_recipe seeds=2 threads=1 max_steps=150 measure=false out=experiments/default_recipe/results/smollm2 runs=runs/smollm2_default_recipe -- recipe=smollm2_135m regenerate.output_dir=runs/smollm2/regenerated 'data.source=[runs/smollm2/regenerated/conversations]'
# 2026-12-07T04:33:00, from the repository root
OMP_NUM_THREADS=1 python -m experiments.default_recipe seeds=0,1 threads=1 max_steps=150 measure=false out=experiments/default_recipe/results/smollm2 runs=runs/smollm2_default_recipe -- recipe=smollm2_135m regenerate.output_dir=runs/smollm2/regenerated 'data.source=[runs/smollm2/regenerated/conversations]'
# 2026-12-07T05:23:47, from the repository root
OMP_NUM_THREADS=1 python -m experiments.default_recipe threads=1 probes=mt_bench seeds=0 max_steps=150 max_new_tokens=128 out=experiments/default_recipe/results/smollm2 runs=runs/smollm2_default_recipe -- recipe=smollm2_135m regenerate.output_dir=runs/smollm2/regenerated 'data.source=[runs/smollm2/regenerated/conversations]'
# 2026-12-07T05:23:49, from the repository root
OMP_NUM_THREADS=1 python -m experiments.default_recipe threads=1 probes=long_history seeds=0 max_steps=150 max_new_tokens=128 out=experiments/default_recipe/results/smollm2 runs=runs/smollm2_default_recipe -- recipe=smollm2_135m regenerate.output_dir=runs/smollm2/regenerated 'data.source=[runs/smollm2/regenerated/conversations]'
# 2026-12-07T05:23:50, from the repository root
OMP_NUM_THREADS=1 python -m experiments.default_recipe threads=1 probes=unseen_system seeds=0 max_steps=150 max_new_tokens=128 out=experiments/default_recipe/results/smollm2 runs=runs/smollm2_default_recipe -- recipe=smollm2_135m regenerate.output_dir=runs/smollm2/regenerated 'data.source=[runs/smollm2/regenerated/conversations]'
# 2026-12-07T05:38:25, from the repository root
OMP_NUM_THREADS=2 python -m experiments.default_recipe threads=2 probes=mt_bench seeds=0 max_steps=150 max_new_tokens=128 out=experiments/default_recipe/results/smollm2 runs=runs/smollm2_default_recipe -- recipe=smollm2_135m regenerate.output_dir=runs/smollm2/regenerated 'data.source=[runs/smollm2/regenerated/conversations]'
# 2026-12-07T05:48:58, from the repository root
OMP_NUM_THREADS=2 python -m experiments.default_recipe threads=2 probes=mt_bench,unseen_system seeds=0 max_steps=150 max_new_tokens=128 out=experiments/default_recipe/results/smollm2 runs=runs/smollm2_default_recipe -- recipe=smollm2_135m regenerate.output_dir=runs/smollm2/regenerated 'data.source=[runs/smollm2/regenerated/conversations]'
# 2026-12-07T08:28:52, from the repository root
OMP_NUM_THREADS=2 python -m experiments.default_recipe threads=2 probes=long_history seeds=0 max_steps=150 max_new_tokens=128 out=experiments/default_recipe/results/smollm2 runs=runs/smollm2_default_recipe -- recipe=smollm2_135m regenerate.output_dir=runs/smollm2/regenerated 'data.source=[runs/smollm2/regenerated/conversations]'
# 2026-12-07T08:47:09, from the repository root
OMP_NUM_THREADS=2 python -m experiments.default_recipe threads=2 probes=mt_bench,unseen_system,long_history seeds=0 max_steps=150 max_new_tokens=128 out=experiments/default_recipe/results/smollm2 runs=runs/smollm2_default_recipe -- recipe=smollm2_135m regenerate.output_dir=runs/smollm2/regenerated 'data.source=[runs/smollm2/regenerated/conversations]'
# 2026-12-07T13:15:07, from the repository root
OMP_NUM_THREADS=1 python -m experiments.default_recipe seeds=0,1 threads=1 measure=false probes=mt_bench,unseen_system,long_history max_steps=150 max_new_tokens=128 out=experiments/default_recipe/results/smollm2 runs=runs/smollm2_default_recipe -- recipe=smollm2_135m regenerate.output_dir=runs/smollm2/regenerated 'data.source=[runs/smollm2/regenerated/conversations]'
# 2026-12-07T13:19:40, from the repository root
OMP_NUM_THREADS=1 python -m experiments.default_recipe seeds=0,2 threads=1 measure=false probes=mt_bench,unseen_system,long_history max_steps=150 max_new_tokens=128 out=experiments/default_recipe/results/smollm2 runs=runs/smollm2_default_recipe -- recipe=smollm2_135m regenerate.output_dir=runs/smollm2/regenerated 'data.source=[runs/smollm2/regenerated/conversations]'
# 2026-12-07T13:36:16, from the repository root
OMP_NUM_THREADS=1 python -m experiments.default_recipe seeds=2 threads=1 measure=false probes=mt_bench,unseen_system,long_history levers=drafter.sliding_window=170 max_steps=150 max_new_tokens=128 out=experiments/default_recipe/results/smollm2 runs=runs/smollm2_default_recipe -- recipe=smollm2_135m regenerate.output_dir=runs/smollm2/regenerated 'data.source=[runs/smollm2/regenerated/conversations]'
# 2026-12-07T13:36:16, from the repository root
OMP_NUM_THREADS=1 python -m experiments.default_recipe seeds=0,1 threads=1 measure=false probes=mt_bench,unseen_system,long_history levers=drafter.sliding_window=170 max_steps=150 max_new_tokens=128 out=experiments/default_recipe/results/smollm2 runs=runs/smollm2_default_recipe -- recipe=smollm2_135m regenerate.output_dir=runs/smollm2/regenerated 'data.source=[runs/smollm2/regenerated/conversations]'
# 2026-12-07T13:37:06, from the repository root
OMP_NUM_THREADS=1 python -m experiments.default_recipe seeds=0 threads=1 measure=false probes=mt_bench,unseen_system,long_history max_steps=150 max_new_tokens=128 out=experiments/default_recipe/results/smollm2 runs=runs/smollm2_default_recipe -- recipe=smollm2_135m regenerate.output_dir=runs/smollm2/regenerated 'data.source=[runs/smollm2/regenerated/conversations]'
# 2026-12-07T13:59:10, from the repository root
OMP_NUM_THREADS=1 python -m experiments.default_recipe seeds=0,1,2 threads=1 measure=true probes=long_history levers=drafter.sliding_window=170 max_steps=150 max_new_tokens=128 out=experiments/default_recipe/results/smollm2 runs=runs/smollm2_default_recipe -- recipe=smollm2_135m regenerate.output_dir=runs/smollm2/regenerated 'data.source=[runs/smollm2/regenerated/conversations]'
# 2026-12-07T13:59:11, from the repository root
OMP_NUM_THREADS=1 python -m experiments.default_recipe seeds=0,1,2 threads=1 measure=true probes=mt_bench levers=drafter.sliding_window=170 max_steps=150 max_new_tokens=128 out=experiments/default_recipe/results/smollm2 runs=runs/smollm2_default_recipe -- recipe=smollm2_135m regenerate.output_dir=runs/smollm2/regenerated 'data.source=[runs/smollm2/regenerated/conversations]'
# 2026-12-07T13:59:14, from the repository root
OMP_NUM_THREADS=1 python -m experiments.default_recipe seeds=0,1,2 threads=1 measure=true probes=unseen_system levers=drafter.sliding_window=170 max_steps=150 max_new_tokens=128 out=experiments/default_recipe/results/smollm2 runs=runs/smollm2_default_recipe -- recipe=smollm2_135m regenerate.output_dir=runs/smollm2/regenerated 'data.source=[runs/smollm2/regenerated/conversations]'
# 2026-12-07T14:51:49, from the repository root
OMP_NUM_THREADS=2 python -m experiments.default_recipe seeds=0,1,2 threads=2 measure=true probes=mt_bench,unseen_system,long_history levers=drafter.sliding_window=170 max_steps=150 max_new_tokens=128 out=experiments/default_recipe/results/smollm2 runs=runs/smollm2_default_recipe -- recipe=smollm2_135m regenerate.output_dir=runs/smollm2/regenerated 'data.source=[runs/smollm2/regenerated/conversations]'
# 2026-12-07T16:30:08, from the repository root
OMP_NUM_THREADS=2 python -m experiments.default_recipe seeds=0,1,2 threads=2 measure=true probes=mt_bench,unseen_system,long_history levers=drafter.sliding_window=170,loss=lk_hybrid max_steps=150 max_new_tokens=128 out=experiments/default_recipe/results/smollm2 runs=runs/smollm2_default_recipe -- recipe=smollm2_135m regenerate.output_dir=runs/smollm2/regenerated 'data.source=[runs/smollm2/regenerated/conversations]'
# stopped once the mt_bench probe had joined the lk_hybrid drafters (unseen_system and long_history not measured for them; summary.json and results.md are the 9 drafters')
# 2026-12-07T19:29:03, from the repository root: ShareGPT's own replies to the regenerated conversations' prompts
python -m experiments.default_recipe.original_replies sharegpt: runs/smollm2/regenerated/conversations runs/smollm2/original_replies.jsonl
# 2026-12-07T19:29:34, from the repository root
OMP_NUM_THREADS=1 python -m experiments.default_recipe seeds=0,1,2 threads=1 max_steps=150 measure=false 'levers=data.source=[runs/smollm2/original_replies.jsonl]' out=experiments/default_recipe/results/smollm2 runs=runs/smollm2_default_recipe -- recipe=smollm2_135m regenerate.output_dir=runs/smollm2/regenerated 'data.source=[runs/smollm2/regenerated/conversations]'
# 2026-12-07T19:31:49, from the repository root
OMP_NUM_THREADS=1 python -m experiments.default_recipe seeds=0,1,2 threads=1 max_steps=150 measure=false 'levers=data.source=[runs/smollm2/original_replies.jsonl]' out=experiments/default_recipe/results/smollm2 runs=runs/smollm2_default_recipe -- recipe=smollm2_135m regenerate.output_dir=runs/smollm2/regenerated 'data.source=[runs/smollm2/regenerated/conversations]'
# 2026-12-07T20:28:09, from the repository root
OMP_NUM_THREADS=2 python -m experiments.default_recipe seeds=0,1,2 threads=2 measure=true probes=mt_bench,unseen_system,long_history 'levers=drafter.sliding_window=170,loss=lk_hybrid,data.source=[runs/smollm2/original_replies.jsonl]' max_steps=150 max_new_tokens=128 out=experiments/default_recipe/results/smollm2 runs=runs/smollm2_default_recipe -- recipe=smollm2_135m regenerate.output_dir=runs/smollm2/regenerated 'data.source=[runs/smollm2/regenerated/conversations]'
# stopped during the unseen_system probe (2 of its 6 new drafters measured, none written) to leave the machine to CI: the original-replies lever is measured on MT-Bench only
# 2026-12-07T21:47:41, from the repository root: ShareGPT regenerated again under a mix of eight general system prompts
OMP_NUM_THREADS=2 python data_prep/regenerate.py recipe=smollm2_135m regenerate.output_dir=runs/smollm2/regenerated_mix data.system_prompts=experiments/default_recipe/system_prompts_chat.txt 'data.source=[runs/smollm2/regenerated_mix/conversations]'
# 2026-12-07T22:00:51, from the repository root
OMP_NUM_THREADS=1 python -m experiments.default_recipe seeds=0,1 threads=1 max_steps=150 measure=false 'levers=data.source=[runs/smollm2/regenerated_mix/conversations]' out=experiments/default_recipe/results/smollm2 runs=runs/smollm2_default_recipe -- recipe=smollm2_135m regenerate.output_dir=runs/smollm2/regenerated 'data.source=[runs/smollm2/regenerated/conversations]'
# 2026-12-07T22:06:47, from the repository root
OMP_NUM_THREADS=1 python -m experiments.default_recipe seeds=2 threads=1 max_steps=150 measure=false 'levers=data.source=[runs/smollm2/regenerated_mix/conversations]' out=experiments/default_recipe/results/smollm2 runs=runs/smollm2_default_recipe -- recipe=smollm2_135m regenerate.output_dir=runs/smollm2/regenerated 'data.source=[runs/smollm2/regenerated/conversations]'
# 2026-12-07T22:12, from the repository root: the "published" drafter for the init_from lever, the EAGLE-3 export of the original-replies lever's seed 0
python scripts/export.py checkpoint=runs/smollm2_default_recipe/eagle31-data.source-runs-smollm2-original_replies.jsonl-s0 format=eagle3 out=runs/smollm2_published/eagle3
# 2026-12-07T22:15:38, from the repository root
OMP_NUM_THREADS=1 python -m experiments.default_recipe seeds=2,0,1 threads=1 max_steps=150 measure=false levers=drafter.init_from=runs/smollm2_published/eagle3 out=experiments/default_recipe/results/smollm2 runs=runs/smollm2_default_recipe -- recipe=smollm2_135m regenerate.output_dir=runs/smollm2/regenerated 'data.source=[runs/smollm2/regenerated/conversations]'
# 2026-12-07T22:21:06, from the repository root
OMP_NUM_THREADS=2 python -m experiments.default_recipe seeds=0,1,2 threads=2 measure=true probes=mt_bench,unseen_system,long_history 'levers=drafter.sliding_window=170,data.source=[runs/smollm2/regenerated_mix/conversations]' max_steps=150 max_new_tokens=128 out=experiments/default_recipe/results/smollm2 runs=runs/smollm2_default_recipe -- recipe=smollm2_135m regenerate.output_dir=runs/smollm2/regenerated 'data.source=[runs/smollm2/regenerated/conversations]'
# 2026-12-07T22:59:08, from the repository root
OMP_NUM_THREADS=2 python -m experiments.default_recipe seeds=0,1,2 threads=2 measure=true probes=mt_bench levers=drafter.init_from=runs/smollm2_published/eagle3 max_steps=150 max_new_tokens=128 out=experiments/default_recipe/results/smollm2 runs=runs/smollm2_default_recipe -- recipe=smollm2_135m regenerate.output_dir=runs/smollm2/regenerated 'data.source=[runs/smollm2/regenerated/conversations]'
# stopped once the unseen_system probe had joined the mix's drafters (long_history not measured for them; summary.json and results.md are the 9 drafters')
# the last run wrote mt_bench.json with its own drafters only (the study, before it kept the drafters of levers a run
# does not name); the probe's rows of the earlier runs (the lk_hybrid, original-replies and mix levers) were joined
# back to it, all of one decoding of the target (the same target_tokens_sha256), and summary.json and results.md
# restored to the 9 drafters' of the three-probe run
