#!/usr/bin/env bash
# Run refusion_jax.train on every worker of a Cloud TPU VM pod (one process per host).
#
#   launch/tpu_pod.sh TPU_NAME ZONE CONFIG WORKDIR [--config.field=value ...]
#   e.g. launch/tpu_pod.sh refusion-v5p-64 us-east5-a configs/refusion_qwen3_8b.py /mnt/shared/refusion \
#          --config.init_from_hf=/mnt/shared/Qwen3-8B --config.data.train_files=/mnt/shared/train.json
#
# What it does, on all workers at once (gcloud ... ssh --worker=all):
#   1. copies this checkout to ~/refusion_jax (skip with SYNC=0),
#   2. installs it with the TPU extra (skip with INSTALL=0),
#   3. starts training in the background with REFUSION_DISTRIBUTED=1, so each
#      process calls jax.distributed.initialize() (auto-detected on Cloud TPU),
#      logging to ~/refusion_train.log on every worker.
# WORKDIR must be one directory every worker sees (NFS, Filestore or a gcsfuse
# mount): orbax writes each checkpoint there from all hosts together. A
# preempted or stopped job resumes from it when this script is run again.
#
# Follow worker 0:  gcloud compute tpus tpu-vm ssh TPU_NAME --zone ZONE --worker=0 --command 'tail -f ~/refusion_train.log'
# Stop (saves a checkpoint first, SIGTERM):
#   gcloud compute tpus tpu-vm ssh TPU_NAME --zone ZONE --worker=all --command 'pkill -TERM -f "refusion_jax.train --config"'
set -euo pipefail

if [[ $# -lt 4 ]]; then
  sed -n '2,20p' "$0"
  exit 2
fi
TPU_NAME=$1 ZONE=$2 CONFIG=$3 WORKDIR=$4
shift 4
REMOTE_DIR='~/refusion_jax'
ssh_all() { gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" --worker=all --command "$1"; }

if [[ "${SYNC:-1}" == 1 ]]; then
  repo_root=$(cd "$(dirname "$0")/.." && pwd)
  gcloud compute tpus tpu-vm scp --zone "$ZONE" --worker=all --recurse "$repo_root" "$TPU_NAME:$REMOTE_DIR"
fi
if [[ "${INSTALL:-1}" == 1 ]]; then
  ssh_all "cd $REMOTE_DIR && python3 -m pip install -q -e '.[tpu]'"
fi
args=$(printf ' %q' --config "$CONFIG" --workdir "$WORKDIR" "$@")
ssh_all "cd $REMOTE_DIR && REFUSION_DISTRIBUTED=1 nohup python3 -m refusion_jax.train$args > ~/refusion_train.log 2>&1 &"
echo "Started on every worker of $TPU_NAME; logs in ~/refusion_train.log on each."
