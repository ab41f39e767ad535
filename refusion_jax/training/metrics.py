"""Training progress: a console progress bar with periodic log lines, and TensorBoard scalars.

Only process 0 writes; every other process gets a silent logger, so callers
never branch on the process index.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import jax
import tqdm
from tensorboardX import SummaryWriter


def format_scalars(scalars: Mapping[str, float]) -> str:
  """`loss=1.234 lr=2e-05 ...`, compact enough for one console line."""
  return " ".join(f"{name}={value:.4g}" for name, value in scalars.items())


def console(line: str) -> None:
  """Print on process 0, without breaking an active progress bar."""
  if jax.process_index() == 0:
    tqdm.tqdm.write(line)


class MetricsLogger:
  """Console (tqdm bar + `tqdm.write` lines) and TensorBoard event files under `logdir`."""

  def __init__(self, logdir: str, *, total_steps: int, initial_step: int = 0):
    self.enabled = jax.process_index() == 0
    self._writer = SummaryWriter(logdir=os.path.join(logdir, "tensorboard")) if self.enabled else None
    self._bar = tqdm.tqdm(
      total=total_steps,
      initial=initial_step,
      disable=not self.enabled,
      unit="step",
      dynamic_ncols=True,
      mininterval=2.0,
    )

  def step(self, loss: float) -> None:
    """One training step finished."""
    self._bar.update(1)
    self._bar.set_postfix(loss=f"{loss:.4f}", refresh=False)

  def write(self, step: int, scalars: Mapping[str, float], prefix: str) -> None:
    """Log `scalars` as `prefix/name` in TensorBoard and as one console line."""
    if not self.enabled:
      return
    for name, value in scalars.items():
      self._writer.add_scalar(f"{prefix}/{name}", float(value), step)
    self._writer.flush()
    console(f"[{prefix}] step {step}: {format_scalars(scalars)}")

  def write_text(self, step: int, tag: str, text: str) -> None:
    """A text summary (e.g. sampled answers) in TensorBoard."""
    if self.enabled:
      self._writer.add_text(tag, text, step)

  def close(self) -> None:
    self._bar.close()
    if self._writer is not None:
      self._writer.close()
