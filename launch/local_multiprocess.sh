#!/usr/bin/env bash
# A real multi-process run on one machine: N processes joined by jax.distributed
# over 127.0.0.1, each with D CPU devices, sharing one workdir (a rehearsal of a pod).
#
#   launch/local_multiprocess.sh N D CONFIG WORKDIR [--config.field=value ...]
#   e.g. launch/local_multiprocess.sh 2 2 configs/demo.py:smoke /tmp/refusion_mp --config.mesh.fsdp=2
#
# Process 0 prints progress; every process logs to WORKDIR/process_<i>.log.
# Ctrl-C sends SIGTERM to all of them: they save a checkpoint at the same step
# and exit; running the same command again resumes.
set -euo pipefail

if [[ $# -lt 4 ]]; then
  sed -n '2,11p' "$0"
  exit 2
fi
NUM_PROCESSES=$1 DEVICES_PER_PROCESS=$2 CONFIG=$3 WORKDIR=$4
shift 4
PORT=${PORT:-$((20000 + RANDOM % 20000))}
cd "$(dirname "$0")/.."
mkdir -p "$WORKDIR"

pids=()
stop() { kill -TERM "${pids[@]}" 2>/dev/null || true; }
trap stop INT TERM
for ((i = 0; i < NUM_PROCESSES; i++)); do
  REFUSION_DISTRIBUTED=1 JAX_COORDINATOR_ADDRESS="127.0.0.1:$PORT" JAX_NUM_PROCESSES="$NUM_PROCESSES" \
  JAX_PROCESS_ID="$i" JAX_PLATFORMS=cpu XLA_FLAGS="--xla_force_host_platform_device_count=$DEVICES_PER_PROCESS" \
    python -m refusion_jax.train --config "$CONFIG" --workdir "$WORKDIR" "$@" > "$WORKDIR/process_$i.log" 2>&1 &
  pids+=($!)
done
tail -f "$WORKDIR/process_0.log" --pid "${pids[0]}" &
status=0
for pid in "${pids[@]}"; do
  wait "$pid" || status=$?
done
exit $status
