"""Training progress: a console progress bar with periodic log lines, and TensorBoard scalars.

Only process 0 writes; every other process gets a silent logger, so callers
never branch on the process index. The bar's time left (`TimeLeft`) counts the
evaluations still due as well as the steps: on a CPU demo they are a good part
of the run.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

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


def format_seconds(seconds: float) -> str:
  """`1h02m`, `4m05s` or `38s`."""
  seconds = round(seconds)
  if seconds >= 3600:
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
  if seconds >= 60:
    return f"{seconds // 60}m{seconds % 60:02d}s"
  return f"{seconds}s"


# jax.monitoring's events for the seconds a program spends being traced, lowered and compiled (one after another).
COMPILE_EVENTS = (
  "/jax/core/compile/jaxpr_trace_duration",
  "/jax/core/compile/jaxpr_to_mlir_module_duration",
  "/jax/core/compile/backend_compile_duration",
)


@contextlib.contextmanager
def compile_seconds() -> Iterator[Callable[[], float]]:
  """Within the block, a function returning the seconds spent compiling (`COMPILE_EVENTS`) since it began."""
  total = [0.0]

  def record(event: str, seconds: float, **kwargs) -> None:
    if event in COMPILE_EVENTS:
      total[0] += seconds

  jax.monitoring.register_event_duration_secs_listener(record)
  try:
    yield lambda: total[0]
  finally:
    jax.monitoring.unregister_event_duration_listener(record)


class TimeLeft:
  """The time a run still needs: its steps to go at the measured time per step, plus its evaluations to go at the
  measured time per evaluation (the last one decodes the samples printed at the end).

  The steps' time is the clock's time outside evaluations (saves, being periodic, are spread over the steps). The
  first steps' time includes compiling the step, so once later steps are timed only those count. An evaluation's
  time is the last one's less what it spent compiling (the first compiles the decoder, which later ones reuse: on
  the CPU demo that was most of it), and later ones shorten as the model learns to fill more tokens per forward.
  Until an evaluation is timed its cost is unknown, and `describe` says how many are still to come rather than
  guessing.

  clock: seconds, monotonic (`time.perf_counter`; tests pass a fake one).
  """

  def __init__(
    self,
    total_steps: int,
    initial_step: int = 0,
    eval_steps: Iterable[int] = (),
    clock: Callable[[], float] = time.perf_counter,
  ):
    self._total, self._step, self._clock = total_steps, initial_step, clock
    self._evals_to_go = sorted(step for step in set(eval_steps) if step > initial_step)
    self._mark = clock()  # where the steps' current stretch of time began
    self._first_steps: tuple[int, float] | None = None  # (steps, seconds) up to the first report: with compiling
    self._later_steps, self._later_seconds = 0, 0.0
    self._eval_seconds: float | None = None

  def steps_done(self, step: int) -> None:
    """Training reached `step` (a report after a sync with the device)."""
    now = self._clock()
    count, seconds = step - self._step, now - self._mark
    self._step, self._mark = step, now
    if count <= 0:
      return
    if self._first_steps is None:
      self._first_steps = (count, seconds)
    else:
      self._later_steps, self._later_seconds = self._later_steps + count, self._later_seconds + seconds

  @contextlib.contextmanager
  def evaluating(self, step: int) -> Iterator[None]:
    """Times the evaluation at `step`, less its compiling; its time is not the steps' time."""
    started = self._clock()
    with compile_seconds() as compiling:
      try:
        yield
      finally:
        self._mark = self._clock()
        self._eval_seconds = max(self._mark - started - compiling(), 0.0)
        self._evals_to_go = [due for due in self._evals_to_go if due > step]

  @property
  def step_seconds(self) -> float | None:
    """Seconds per step, None before any step was reported."""
    if self._later_steps:
      return self._later_seconds / self._later_steps
    if self._first_steps is not None:
      return self._first_steps[1] / self._first_steps[0]
    return None

  @property
  def evals_to_go(self) -> int:
    return len(self._evals_to_go)

  def seconds_left(self) -> float | None:
    """Steps and evaluations to go, in seconds; None while the time of either is still unknown."""
    if self.step_seconds is None or (self._evals_to_go and self._eval_seconds is None):
      return None
    return (self._total - self._step) * self.step_seconds + len(self._evals_to_go) * (self._eval_seconds or 0.0)

  def describe(self) -> str:
    """`4m05s` (evaluations included), `3m10s + 6 evals` (their time not known yet) or `?` (nothing timed)."""
    seconds = self.seconds_left()
    if seconds is not None:
      return format_seconds(seconds)
    if self.step_seconds is None:
      return "?"
    evals = f"{self.evals_to_go} eval{'s' if self.evals_to_go != 1 else ''}"
    return f"{format_seconds((self._total - self._step) * self.step_seconds)} + {evals}"


class MetricsLogger:
  """Console (tqdm bar + `tqdm.write` lines) and TensorBoard event files under `logdir`.

  The bar's `left=` is `TimeLeft`'s estimate (steps and the evaluations at `eval_steps` still to come), in place
  of tqdm's, which sees only steps.
  """

  def __init__(
    self,
    logdir: str,
    *,
    total_steps: int,
    initial_step: int = 0,
    eval_steps: Iterable[int] = (),
    clock: Callable[[], float] = time.perf_counter,
  ):
    self.enabled = jax.process_index() == 0
    self._writer = SummaryWriter(logdir=os.path.join(logdir, "tensorboard")) if self.enabled else None
    self.time_left = TimeLeft(total_steps, initial_step, eval_steps, clock)
    self._loss = ""  # the last loss shown, as the bar's postfix writes it
    self._bar = tqdm.tqdm(
      total=total_steps,
      initial=initial_step,
      disable=not self.enabled,
      unit="step",
      dynamic_ncols=True,
      mininterval=2.0,
      bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]",
    )
    self._bar.set_postfix_str(f"left={self.time_left.describe()}", refresh=False)

  def steps_done(self, step: int, losses: Sequence[float]) -> None:
    """The steps up to `step` finished, with these training losses (the last is `step`'s)."""
    self.time_left.steps_done(step)
    self._bar.update(len(losses))
    self._refresh_postfix(losses[-1] if losses else None)

  @contextlib.contextmanager
  def evaluating(self, step: int) -> Iterator[None]:
    """Around the evaluation at `step`: its time goes into the time-left estimate, not the steps'."""
    with self.time_left.evaluating(step):
      yield
    self._refresh_postfix(None)

  def _refresh_postfix(self, loss: float | None) -> None:
    if loss is not None:
      self._loss = f"loss={loss:.4f}, "
    self._bar.set_postfix_str(f"{self._loss}left={self.time_left.describe()}")

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
