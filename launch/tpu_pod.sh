#!/usr/bin/env bash
# Train on a Cloud TPU VM pod: one process per host, all started together (gcloud ... ssh --worker=all).
#
#   launch/tpu_pod.sh [--dry_run] [--accelerator=TYPE [--spot] [--runtime=VERSION]] [--setup=COMMAND] \
#       [--max_restarts=N] TPU_NAME ZONE CONFIG WORKDIR [--config.field=value ...]
#   launch/tpu_pod.sh [--dry_run] --accelerator=TYPE [--spot] [--runtime=VERSION] create TPU_NAME ZONE
#   launch/tpu_pod.sh [--dry_run] logs|stop|delete TPU_NAME ZONE
#   launch/tpu_pod.sh [--dry_run] [--extras=LIST] exec TPU_NAME ZONE COMMAND
#
#   e.g. launch/tpu_pod.sh --accelerator=v5p-128 --spot \
#          --setup='sudo mkdir -p /mnt/b && sudo chmod 777 /mnt/b && gcsfuse --implicit-dirs my-bucket /mnt/b' \
#          refusion-pod us-east5-a configs/refusion_qwen3_8b.py /mnt/b/refusion \
#          --config.init_from=/mnt/b/Qwen3-8B --config.data.train_files=/mnt/b/train.json
#   GRPO with LoRA on Qwen3-8B over a v5p-16 slice (2 hosts, 8 chips; results/rl_scale.md has its fit), e.g.
#        launch/tpu_pod.sh --accelerator=v5p-16 grpo-pod us-east5-a configs/grpo_qwen3_8b.py /mnt/b/grpo \
#          --config.init_from=/mnt/b/refusion_qwen3_8b --config.data.train_files=/mnt/b/prompts.json
#
# Training (the first form):
#   1. with --accelerator: creates the TPU as a queued resource (TYPE as gcloud names it: v5p-128 is 64
#      chips) and waits until it is ACTIVE; without it the TPU must exist already;
#   2. runs --setup's COMMAND on every worker (e.g. mounting the shared WORKDIR), copies this checkout to
#      ~/refusion_jax on every worker (skip with SYNC=0) and installs it with the TPU extra (skip with INSTALL=0);
#   3. starts training in the background with REFUSION_DISTRIBUTED=1 (jax.distributed auto-detects the pod),
#      logging to ~/refusion_train.log on every worker, and prints how to follow it and stop it. A run that
#      exits with status 75 (a host was lost or stalled) is started again on that worker, resuming from its last
#      checkpoint, at most --max_restarts times (default 3; launch/restarting.sh).
# WORKDIR must be one directory every worker sees (NFS / Filestore, or a gcsfuse-mounted bucket): orbax
# writes each checkpoint there from all hosts together. A preempted or stopped job resumes from its latest
# checkpoint when the same command is run again (after `delete` if the TPU was preempted).
#
#   create  only step 1          logs    follow worker 0's log
#   stop    SIGTERM on every worker: the run saves a checkpoint and exits
#   delete  delete the queued resource and its TPU
#   exec    copy and install this checkout as step 2 does (the [tpu] extra plus --extras, e.g. eval,eval-math),
#           then run COMMAND in it on every worker with REFUSION_DISTRIBUTED=1, in the foreground (what
#           launch/paper_table.sh runs the benchmark table with)
#
# --dry_run prints every command (create, set-up, run, follow logs, stop) instead of running it.
set -euo pipefail

usage() {
  sed -n '2,38p' "$0"
  exit 2
}

DRY_RUN=0 ACCELERATOR="" SPOT=0 RUNTIME="" SETUP="" EXTRAS="" MAX_RESTARTS=3
while [[ $# -gt 0 && $1 == --* ]]; do
  case $1 in
    --dry_run) DRY_RUN=1 ;;
    --accelerator=*) ACCELERATOR=${1#*=} ;;
    --spot) SPOT=1 ;;
    --runtime=*) RUNTIME=${1#*=} ;;
    --setup=*) SETUP=${1#*=} ;;
    --extras=*) EXTRAS=${1#*=} ;;
    --max_restarts=*) MAX_RESTARTS=${1#*=} ;;
    *) echo "Unknown option $1" >&2; usage ;;
  esac
  shift
done

# quoted: a command as it can be pasted into a shell.
source "$(dirname "${BASH_SOURCE[0]}")/quoting.sh"

# Print a command, then run it (unless --dry_run).
run() {
  quoted "$@"
  if [[ $DRY_RUN == 0 ]]; then "$@"; fi
}

ssh_workers() {  # ssh_workers WORKERS COMMAND
  run gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" --worker="$1" --command "$2"
}

follow_logs() { ssh_workers 0 'tail -f ~/refusion_train.log'; }
stop_training() { ssh_workers all 'pkill -TERM -f "refusion_jax.train --config"'; }

# gcloud's TPU software version for an accelerator family.
runtime_for() {
  case $1 in
    v4-*) echo tpu-ubuntu2204-base ;;
    v5litepod-*) echo v2-alpha-tpuv5-lite ;;
    v5p-*) echo v2-alpha-tpuv5 ;;
    v6e-*) echo v2-alpha-tpuv6e ;;
    *) echo "Unknown accelerator $1; pass --runtime=VERSION (gcloud compute tpus versions list)." >&2; exit 2 ;;
  esac
}

create_tpu() {
  if [[ -z $ACCELERATOR ]]; then
    echo "Creating a TPU needs --accelerator=TYPE (e.g. v5p-128)." >&2
    exit 2
  fi
  local runtime=${RUNTIME:-$(runtime_for "$ACCELERATOR")}
  local spot=()
  if [[ $SPOT == 1 ]]; then spot=(--spot); fi
  run gcloud compute tpus queued-resources create "$TPU_NAME" --node-id "$TPU_NAME" --zone "$ZONE" \
    --accelerator-type "$ACCELERATOR" --runtime-version "$runtime" "${spot[@]}"
  local state=(gcloud compute tpus queued-resources describe "$TPU_NAME" --zone "$ZONE" --format 'value(state.state)')
  echo "# wait until the queued resource is ACTIVE:"
  run "${state[@]}"
  if [[ $DRY_RUN == 0 ]]; then
    until [[ $("${state[@]}") == ACTIVE ]]; do sleep 60; done
  fi
}

# Copy this checkout to every worker and install it (SYNC=0 / INSTALL=0 skip either).
sync_and_install() {
  if [[ "${SYNC:-1}" == 1 ]]; then
    repo_root=$(cd "$(dirname "$0")/.." && pwd)
    run gcloud compute tpus tpu-vm scp --zone "$ZONE" --worker=all --recurse "$repo_root" "$TPU_NAME:$REMOTE_DIR"
  fi
  if [[ "${INSTALL:-1}" == 1 ]]; then
    ssh_workers all "cd $REMOTE_DIR && python3 -m pip install -q -e '.[tpu${EXTRAS:+,$EXTRAS}]'"
  fi
}
REMOTE_DIR='~/refusion_jax'

case ${1:-} in
  exec)
    [[ $# -eq 4 ]] || usage
    TPU_NAME=$2 ZONE=$3
    sync_and_install
    ssh_workers all "cd $REMOTE_DIR && REFUSION_DISTRIBUTED=1 $4"
    exit 0
    ;;
  create | logs | stop | delete)
    [[ $# -eq 3 ]] || usage
    STEP=$1 TPU_NAME=$2 ZONE=$3
    case $STEP in
      create) create_tpu ;;
      logs) follow_logs ;;
      stop) stop_training ;;
      delete) run gcloud compute tpus queued-resources delete "$TPU_NAME" --zone "$ZONE" --force --quiet ;;
    esac
    exit 0
    ;;
esac

[[ $# -ge 4 ]] || usage
TPU_NAME=$1 ZONE=$2 CONFIG=$3 WORKDIR=$4
shift 4

if [[ -n $ACCELERATOR ]]; then
  echo "# create"
  create_tpu
fi
echo "# set up"
if [[ -n $SETUP ]]; then
  ssh_workers all "$SETUP"
fi
sync_and_install
echo "# run"
args=$(printf ' %q' --config "$CONFIG" --workdir "$WORKDIR" "$@")
train="launch/restarting.sh $MAX_RESTARTS python3 -m refusion_jax.train$args"
ssh_workers all "cd $REMOTE_DIR && REFUSION_DISTRIBUTED=1 nohup bash $train > ~/refusion_train.log 2>&1 &"
echo "# follow logs (launch/tpu_pod.sh logs $TPU_NAME $ZONE):"
DRY_RUN=1 follow_logs
echo "# stop, saving a checkpoint first (launch/tpu_pod.sh stop $TPU_NAME $ZONE):"
DRY_RUN=1 stop_training
