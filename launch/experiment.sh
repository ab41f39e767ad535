#!/usr/bin/env bash
# The paper's speed–quality comparison at small scale, on one backbone, data set and token budget:
#   (a) AR, (b) MDM (LLaDA style), (c) ReFusion from scratch, (d) ReFusion initialised from an AR run.
# Each is evaluated on the built-in test split (ReFusion over slot_size × slot_threshold × token_threshold,
# MDM over its step count and block length) and, at its default setting, on results/test_set.json
# (query/response records, exact match). Then results/table.md and results/speed_accuracy.png are rewritten.
#
#   bash launch/experiment.sh OUTDIR [STEPS] [EXAMPLES]
#
# STEPS: optimizer steps of each of (a), (b), (c) (default: configs/demo.py's); (d) starts from (a)'s final
#   parameters, as the paper starts from a released AR model, and trains ReFusion for STEPS/2. EXAMPLES: test-split examples per
#   evaluation (default 150, the first ones: the tasks take turns; a multiple of 3). Runs that finished are not redone;
#   rerunning resumes. Extra `--config.*` overrides for every training run go in $TRAIN_FLAGS;
#   VARIANT=smoke runs the whole pipeline on the configs' seconds-long smoke variant (a plumbing check).
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${1:?usage: bash launch/experiment.sh OUTDIR [STEPS] [EXAMPLES]}
STEPS=${2:-}
EXAMPLES=${3:-150}
RESULTS=${RESULTS:-results}  # where the table and the plot go
SUFFIX=${VARIANT:+:$VARIANT}
CONFIG=configs/demo.py$SUFFIX
read -r -a EXTRA <<<"${TRAIN_FLAGS:-}"
mkdir -p "$OUT"
if [[ -z $STEPS ]]; then
  STEPS=$(python -c "from refusion_jax.training.config_file import load_config; print(load_config('${CONFIG%%:*}', '${VARIANT:-}').num_train_steps)")
fi
HALF=$((STEPS / 2))
LOG="$OUT/experiment.log"
echo "experiment: $STEPS steps per model, $EXAMPLES test examples, into $OUT (log: $LOG)"

# train NAME CONFIG STEPS [FLAGS...]: one training run; its periodic validation gives the learning curve per task.
train() {
  local name=$1 config=$2 steps=$3
  shift 3
  if [[ -f "$OUT/$name.done" ]]; then return; fi
  echo "[$(date +%T)] train $name ($steps steps)"
  local start=$SECONDS
  python -m refusion_jax.train --config "$config" --workdir "$OUT/$name" \
    --config.num_train_steps="$steps" --config.data.data_dir="$OUT/data" "${EXTRA[@]}" "$@" >>"$LOG" 2>&1
  echo "$((SECONDS - start))" >"$OUT/$name.done"
}

# evaluate NAME MODEL TAG [EVAL FLAGS...]: one eval process per model and test set; comma-separated knobs sweep.
evaluate() {
  local name=$1 model=$2 tag=$3
  shift 3
  local out="$OUT/results/$name/$tag"
  if [[ -f "$out/done" ]]; then return; fi
  echo "[$(date +%T)] eval $model ($tag)"
  python -m refusion_jax.eval --checkpoint "$OUT/$name" --config "$CONFIG" --model_name "$model" \
    --no_progress --out_dir "$out" "$@" >>"$LOG" 2>&1
  touch "$out/done"
}

train ar "configs/ar_baseline.py$SUFFIX" "$STEPS"
train mdm "configs/mdm_baseline.py$SUFFIX" "$STEPS"
train refusion "$CONFIG" "$STEPS"
train refusion_from_ar "$CONFIG" "$HALF" --config.init_from="$OUT/ar"

# A batch is one task's examples of the split (EXAMPLES / 3 of each) or the whole JSON set: few program shapes;
# each batch is timed three times and the fastest kept (the machine may be shared).
SPLIT=(--split test --num_examples "$EXAMPLES" --batch_size $((EXAMPLES / 3)) --repeats 3)
JSON=(--data results/test_set.json --batch_size 60 --repeats 3)
evaluate ar "AR" split --method ar "${SPLIT[@]}"
evaluate ar "AR" json --method ar "${JSON[@]}"
evaluate mdm "MDM" split --method mdm --block_length 16,48 --steps 48,24,12 "${SPLIT[@]}"
evaluate mdm "MDM" json --method mdm --block_length 16 --steps 48 "${JSON[@]}"
for pair in "refusion:ReFusion" "refusion_from_ar:ReFusion from AR"; do
  name=${pair%%:*} model=${pair#*:}
  evaluate "$name" "$model" split --method refusion --slot_size 4,8,16 --slot_threshold 0.6,0.9 \
    --token_threshold 0.5,0.9 "${SPLIT[@]}"
  evaluate "$name" "$model" json --method refusion --slot_size 8 --slot_threshold 0.9 --token_threshold 0.5 \
    "${JSON[@]}"
done

python -m refusion_jax.eval report "$OUT/results" --out_dir "$RESULTS" \
  --title "# ReFusion vs AR vs MDM: $STEPS training steps per model, $EXAMPLES test-split examples" | tee -a "$LOG"
for name in ar mdm refusion refusion_from_ar; do
  echo "training wall-clock $name: $(cat "$OUT/$name.done") s" | tee -a "$LOG"
done
