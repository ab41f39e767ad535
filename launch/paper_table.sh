#!/usr/bin/env bash
# The paper's benchmark table through lm-evaluation-harness, as the official eval.sh runs it: seven tasks, each
# with its decode settings (paper_task=, docs/evaluation.md "Reproduce the paper's table"), zero-shot, chat template,
# samples logged, the decode statistics beside lm-eval's results in OUTPUT_DIR/TASK.
#
#   launch/paper_table.sh [--dry_run] [--tasks=T1,T2] [--batch_size=K] [--model_args=K=V,...] \
#       [--prompts=OFFICIAL_CHECKOUT] [--tpu=TPU_NAME --zone=ZONE] CHECKPOINT OUTPUT_DIR [lm-eval flags ...]
#
#   e.g. launch/paper_table.sh --batch_size=64 --prompts=$HOME/ReFusion /ckpt/refusion_8b out/table
#        launch/paper_table.sh --tpu=refusion-pod --zone=us-east5-a --model_args=mesh=fsdp:-1 \
#          /mnt/b/refusion_8b /mnt/b/table --limit 100
#
# One machine (a GPU or TPU VM): the tasks run one after another with `python -m refusion_jax.harness`.
# A TPU pod (--tpu, --zone; create it with `launch/tpu_pod.sh --accelerator=TYPE create TPU_NAME ZONE`): each
# task runs on every worker through `launch/tpu_pod.sh exec`, which copies and installs this checkout with the
# eval extras before the first task; CHECKPOINT and OUTPUT_DIR must be paths every worker sees; process 0 writes.
# --tasks: a subset of the seven; --batch_size: rows kept busy by continuous batching (default 32);
# --model_args: more model arguments (e.g. dtype=bfloat16, mesh=fsdp:4+tensor:2); lm-eval flags pass through.
# --prompts: a checkout of ML-GSAI/ReFusion, whose lm_eval/tasks hold the paper's edited prompts (and
# humaneval_instruct_noprefix, which lm-eval lacks): each task's folder there replaces lm-eval's (--include_path).
# The datasets come from the Hugging Face Hub and mbpp / humaneval load the code_eval metric from it; those two
# run model-written code (HF_ALLOW_CODE_EVAL=1 and --confirm_run_unsafe_code, as eval.sh sets them).
# --dry_run prints every command instead of running it.
set -euo pipefail

usage() {
  sed -n '2,25p' "$0"
  exit 2
}

PAPER_TASKS=(gsm8k_cot minerva_math humaneval_instruct_noprefix mbpp arc_challenge_chat mmlu_pro
  gpqa_main_generative_n_shot)
DRY_RUN=0 TASKS="" BATCH_SIZE=32 MODEL_ARGS="" PROMPTS="" TPU_NAME="" ZONE=""
while [[ $# -gt 0 && $1 == --* ]]; do
  case $1 in
    --dry_run) DRY_RUN=1 ;;
    --tasks=*) TASKS=${1#*=} ;;
    --batch_size=*) BATCH_SIZE=${1#*=} ;;
    --model_args=*) MODEL_ARGS=${1#*=} ;;
    --prompts=*) PROMPTS=${1#*=} ;;
    --tpu=*) TPU_NAME=${1#*=} ;;
    --zone=*) ZONE=${1#*=} ;;
    *) echo "Unknown option $1" >&2; usage ;;
  esac
  shift
done
[[ $# -ge 2 ]] || usage
if [[ -n $TPU_NAME && -z $ZONE ]] || [[ -z $TPU_NAME && -n $ZONE ]]; then
  echo "A pod needs both --tpu=TPU_NAME and --zone=ZONE." >&2
  exit 2
fi
CHECKPOINT=$1 OUTPUT_DIR=$2
shift 2

tasks=("${PAPER_TASKS[@]}")
if [[ -n $TASKS ]]; then
  IFS=, read -r -a tasks <<< "$TASKS"
  for task in "${tasks[@]}"; do
    if [[ ! " ${PAPER_TASKS[*]} " == *" $task "* ]]; then
      echo "Unknown task $task; the paper's tasks are: ${PAPER_TASKS[*]}" >&2
      exit 2
    fi
  done
fi

# The folder of the official checkout's lm_eval/tasks that defines a task.
prompt_folder() {
  case $1 in
    gsm8k_cot) echo gsm8k ;;
    humaneval_instruct_noprefix) echo humaneval ;;
    arc_challenge_chat) echo arc ;;
    gpqa_main_generative_n_shot) echo gpqa ;;
    *) echo "$1" ;;
  esac
}

# quoted: a command as it can be pasted into a shell.
source "$(dirname "${BASH_SOURCE[0]}")/quoting.sh"

export HF_ALLOW_CODE_EVAL=1 HF_DATASETS_TRUST_REMOTE_CODE=true
launcher=$(dirname "$0")/tpu_pod.sh
first=1
for task in "${tasks[@]}"; do
  harness=(python3 -m refusion_jax.harness --tasks "$task" --num_fewshot 0 --apply_chat_template --log_samples
    --confirm_run_unsafe_code --output_path "$OUTPUT_DIR/$task"
    --model_args "checkpoint=$CHECKPOINT,paper_task=$task,batch_size=$BATCH_SIZE${MODEL_ARGS:+,$MODEL_ARGS}")
  if [[ -n $PROMPTS ]]; then harness+=(--include_path "$PROMPTS/lm_eval/tasks/$(prompt_folder "$task")"); fi
  harness+=("$@")
  echo "# $task"
  if [[ -z $TPU_NAME ]]; then
    quoted "${harness[@]}"
    if [[ $DRY_RUN == 0 ]]; then "${harness[@]}"; fi
  else
    flags=(--extras=eval,eval-math)
    if [[ $DRY_RUN == 1 ]]; then flags+=(--dry_run); fi
    # The checkout is copied and installed once, before the first task.
    if [[ $first == 1 ]]; then sync=1; else sync=0; fi
    SYNC=$sync INSTALL=$sync bash "$launcher" "${flags[@]}" exec "$TPU_NAME" "$ZONE" \
      "HF_ALLOW_CODE_EVAL=1 HF_DATASETS_TRUST_REMOTE_CODE=true $(quoted "${harness[@]}")"
  fi
  first=0
done
