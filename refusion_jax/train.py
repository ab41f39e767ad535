"""Train ReFusion (or the AR / MDM baselines) from a config file, supervised or by reinforcement learning.

    python -m refusion_jax.train --config configs/demo.py --workdir /tmp/refusion_demo
    python -m refusion_jax.train --config configs/demo.py --workdir DIR --config.num_train_steps=200
    python -m refusion_jax.train --config configs/grpo_demo.py --workdir /tmp/refusion_grpo

Everything happens in `refusion_jax.training.loop.train_and_evaluate` (a config with a `grpo` section: GRPO's
steps in it, `refusion_jax.rl.train_grpo`, docs/rl.md); this module only parses flags and joins a
multi-process job.

Exit status: 0 done (or stopped by SIGTERM / SIGINT after saving), 1 a failure the run explains (its message),
2 bad input, 75 (`training.faults.RESTART_STATUS`) a process of the job was lost or stalled: restart the job,
which resumes from its last checkpoint (launch/*.sh do so).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from absl import app, flags, logging
from ml_collections import config_flags

from refusion_jax.checkpoints.orbax import (
  CHECKPOINT_SUBDIR,
  CheckpointDamagedError,
  CheckpointMismatchError,
  CheckpointSaveError,
)
from refusion_jax.cli import BAD_INPUT, initialize_distributed, report_errors
from refusion_jax.data.pipeline import DataError
from refusion_jax.rl import train_grpo
from refusion_jax.training import faults
from refusion_jax.training.interrupts import RunInterrupted
from refusion_jax.training.loop import NonFiniteLossError, train_and_evaluate
from refusion_jax.training.run_config import RENAMED_FIELDS
from refusion_jax.training.run_lock import WorkdirLockedError

# Failures the run explains itself: their message is the report (exit status 1), a traceback would only bury it.
_REPORTED = (
  *BAD_INPUT,
  NonFiniteLossError,
  RunInterrupted,
  DataError,
  WorkdirLockedError,
  CheckpointDamagedError,
  CheckpointMismatchError,
  CheckpointSaveError,
)


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # orbax and grain log every save at INFO
  if os.environ.get("REFUSION_DISTRIBUTED"):
    config, index = flags.FLAGS.config, os.environ.get("JAX_PROCESS_ID")
    checkpoint_dir = os.path.join(flags.FLAGS.workdir, CHECKPOINT_SUBDIR)  # named in the line (a URL is refused later)
    with faults.joining(config.faults, checkpoint_dir, None if index is None else int(index)):
      initialize_distributed(service_apart=True, **faults.jax_distributed_timeouts(config.faults))

  config = flags.FLAGS.config
  trainer = train_grpo if "grpo" in config else train_and_evaluate

  def train() -> None:
    if trainer(config, flags.FLAGS.workdir).stopped_by == "preempted":
      _exit(0)

  status = report_errors(train, errors=_REPORTED, status=1)
  if status:
    _exit(status)


def refuse_renamed_flags(argv: Sequence[str]) -> None:
  """Exit with status 2 naming the replacement when `argv` overrides a config field that was renamed."""
  for arg in argv:
    field = arg.removeprefix("--config.").split("=")[0]
    if arg.startswith("--config.") and field in RENAMED_FIELDS:
      print(f"error: --config.{field} was replaced by {RENAMED_FIELDS[field]}.", file=sys.stderr)
      sys.exit(2)


def _exit(status: int) -> None:
  """End the process now.

  A stopped run may leave data-reader threads busy (grain's prefetch keeps
  filtering); their work is moot, and waiting for them would delay the exit.
  """
  sys.stdout.flush()
  sys.stderr.flush()
  logging.flush()
  os._exit(status)


if __name__ == "__main__":
  refuse_renamed_flags(sys.argv[1:])
  # Flags are defined only when run as a program, so importing this module stays side-effect free.
  config_flags.DEFINE_config_file("config", None, "Training config file (see configs/).", lock_config=True)
  flags.DEFINE_string("workdir", None, "Directory for checkpoints, TensorBoard events and the built data.")
  flags.mark_flags_as_required(["config", "workdir"])
  app.run(main)
