#!/usr/bin/env bash
# Train on a SLURM GPU cluster: one process per GPU, jax.distributed auto-detects the job from SLURM's variables.
#
#   launch/slurm_gpu.sh [--dry_run] [--nodes=N] [--gpus_per_node=G] [--partition=P] [--time=HH:MM:SS] \
#       [--max_restarts=N] CONFIG WORKDIR [--config.field=value ...]
#   launch/slurm_gpu.sh [--dry_run] logs|stop JOB_ID WORKDIR
#
#   e.g. launch/slurm_gpu.sh --nodes=4 --gpus_per_node=8 --partition=gpu configs/refusion_qwen3_8b.py \
#          /shared/refusion --config.init_from=/shared/Qwen3-8B --config.data.train_files=/shared/train.json
#
# Training (the first form), from a login node:
#   1. set-up: a virtualenv in $VENV (default WORKDIR/venv) with this checkout and its [cuda12] extra, the CUDA
#      build of the jax setup.py pins for the node's Python (skip with INSTALL=0);
#   2. queue: sbatch a job of N nodes x G tasks (one per GPU) that `srun`s `python -m refusion_jax.train`
#      with REFUSION_DISTRIBUTED=1; SLURM sends SIGTERM 120 s before the time limit and on preemption, the
#      run saves a checkpoint, and --requeue puts a preempted job back in the queue; when a process exits with
#      status 75 (a node was lost or stalled) the job runs `srun` again, resuming from the last checkpoint, at
#      most --max_restarts times (default 3; launch/restarting.sh);
#   3. prints how to follow the log (WORKDIR/slurm-JOB_ID.out) and stop the job.
# WORKDIR and this checkout must be on a filesystem every node sees. A requeued, stopped or timed-out job
# resumes from the latest checkpoint in WORKDIR when the same command is run again (or when SLURM requeues it).
#
#   logs   follow the job's log
#   stop   SIGTERM to every task: the run saves a checkpoint and exits
#
# --dry_run prints every command (set-up, sbatch with its job script, follow logs, stop) instead of running it.
set -euo pipefail

usage() {
  sed -n '2,27p' "$0"
  exit 2
}

DRY_RUN=0 NODES=1 GPUS_PER_NODE=8 PARTITION="" TIME_LIMIT=24:00:00 MAX_RESTARTS=3
while [[ $# -gt 0 && $1 == --* ]]; do
  case $1 in
    --dry_run) DRY_RUN=1 ;;
    --nodes=*) NODES=${1#*=} ;;
    --gpus_per_node=*) GPUS_PER_NODE=${1#*=} ;;
    --partition=*) PARTITION=${1#*=} ;;
    --time=*) TIME_LIMIT=${1#*=} ;;
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

case ${1:-} in
  logs)
    [[ $# -eq 3 ]] || usage
    run tail -f "$3/slurm-$2.out"
    exit 0
    ;;
  stop)
    [[ $# -eq 3 ]] || usage
    run scancel --signal=TERM "$2"
    exit 0
    ;;
esac

[[ $# -ge 2 ]] || usage
CONFIG=$1 WORKDIR=$2
shift 2
REPO=$(cd "$(dirname "$0")/.." && pwd)
VENV=${VENV:-$WORKDIR/venv}

echo "# set up"
run mkdir -p "$WORKDIR"
if [[ "${INSTALL:-1}" == 1 ]]; then
  run python3 -m venv "$VENV"
  run "$VENV/bin/pip" install -q -e "$REPO[cuda12]"
fi

echo "# queue (sbatch reads the job script below from stdin)"
args=$(printf ' %q' --config "$CONFIG" --workdir "$WORKDIR" "$@")
job_script="#!/usr/bin/env bash
set -euo pipefail
cd $(printf '%q' "$REPO")
# srun reports one status for all tasks: a task that exits with 75 (restart) creates this file instead.
export REFUSION_RESTART_MARKER=$(printf '%q' "$WORKDIR/.restart_requested")
bash launch/restarting.sh $MAX_RESTARTS \\
  srun --kill-on-bad-exit=1 env REFUSION_DISTRIBUTED=1 $(printf '%q' "$VENV/bin/python") -m refusion_jax.train$args"
partition=()
if [[ -n $PARTITION ]]; then partition=(--partition "$PARTITION"); fi
sbatch=(sbatch --parsable --job-name refusion --nodes "$NODES" --ntasks-per-node "$GPUS_PER_NODE"
  --gpus-per-node "$GPUS_PER_NODE" --time "$TIME_LIMIT" --signal TERM@120 --requeue
  --output "$WORKDIR/slurm-%j.out" "${partition[@]}")
echo "$(quoted "${sbatch[@]}") <<'JOB'"
echo "$job_script"
echo "JOB"
JOB_ID=JOB_ID
if [[ $DRY_RUN == 0 ]]; then
  JOB_ID=$("${sbatch[@]}" <<<"$job_script")
  echo "Queued job $JOB_ID."
fi
echo "# follow logs (launch/slurm_gpu.sh logs $JOB_ID $WORKDIR):"
DRY_RUN=1 run tail -f "$WORKDIR/slurm-$JOB_ID.out"
echo "# stop, saving a checkpoint first (launch/slurm_gpu.sh stop $JOB_ID $WORKDIR):"
DRY_RUN=1 run scancel --signal=TERM "$JOB_ID"
