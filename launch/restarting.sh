#!/usr/bin/env bash
# Run a training command, and run it again while it exits with status 75 (or 137), at most MAX_RESTARTS times.
#
#   launch/restarting.sh MAX_RESTARTS COMMAND [ARG ...]
#
# 75 (refusion_jax.training.faults.RESTART_STATUS) means "a process of the job was lost or stalled; nothing is
# wrong with the run": run again, the command resumes from its last checkpoint (docs/scaling.md, "When a host is
# lost or stalls"). Any other status ends the loop and is this script's status. A launcher whose command gathers
# many processes' statuses into one (srun) sets REFUSION_RESTART_MARKER to a file every process sees: a process
# that exits with 75 creates it, and its presence counts as status 75. 137 (128 + SIGKILL) is this process itself
# killed outright (a preemption, the OOM killer): it cannot say 75, so it is restarted on the same count; on a TPU
# pod, where each worker runs its own loop, that is how the killed worker rejoins the restarted survivors.
set -uo pipefail

if [[ $# -lt 2 ]]; then
  sed -n '2,10p' "$0"
  exit 2
fi
MAX_RESTARTS=$1
shift
RESTART_STATUS=75
KILLED_STATUS=137

for ((restart = 0; ; restart++)); do
  if [[ -n ${REFUSION_RESTART_MARKER:-} ]]; then rm -f "$REFUSION_RESTART_MARKER"; fi
  "$@"
  status=$?
  if [[ -n ${REFUSION_RESTART_MARKER:-} && -e $REFUSION_RESTART_MARKER ]]; then status=$RESTART_STATUS; fi
  if [[ $status != "$RESTART_STATUS" && $status != "$KILLED_STATUS" ]]; then exit "$status"; fi
  if ((restart >= MAX_RESTARTS)); then
    echo "refusion_jax: status $status again, after $MAX_RESTARTS restarts: giving up (--max_restarts)." >&2
    exit "$status"
  fi
  why="a process was lost or stalled"
  if [[ $status == "$KILLED_STATUS" ]]; then why="this process was killed: SIGKILL, a preemption or the OOM killer"; fi
  echo "refusion_jax: status $status ($why): restart $((restart + 1)) of" \
    "$MAX_RESTARTS in ${RESTART_DELAY_S:-10} s, resuming from the last checkpoint." >&2
  sleep "${RESTART_DELAY_S:-10}"
done
