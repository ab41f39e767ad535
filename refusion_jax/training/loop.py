"""The training loop: `train_and_evaluate(config, workdir)` trains ReFusion (or the AR / MDM baselines).

    python -m refusion_jax.train --config configs/demo.py --workdir /tmp/refusion_demo

It reads top to bottom in sections:

1. **The lock and checks.** One run holds the workdir (`run_lock`); the config
   is checked before anything is built (`run_config.check_run_config`), then
   recorded in the workdir (`config_file.write_run_config`).
2. **Data** (`training/inputs.py`): built once under the workdir, then opened.
   Data that cannot be used is a `DataError` at once, for the validation split too.
3. **Where the model starts** (`training/start.py`): resume from the workdir >
   `config.init_from` > random init; the train state is created where it lives
   on the mesh.
4. **Compiled functions**: the train step (gradient accumulation is a
   `lax.scan` over microbatches inside it: one optimizer update per step), the
   validation loss, and the decode graph of the periodic evaluation.
5. **The loop.** Each iteration fetches a batch and dispatches a step; the host
   runs at most `_STEPS_AHEAD` steps ahead of the device and syncs with it only
   where a periodic action is due (log, evaluate, save, a stop check). A sync
   reads back the metrics of every step since the last one and checks them, so
   a NaN/Inf loss stops the run before anything of it is saved.

Signals (`training/interrupts.py`): SIGTERM / SIGINT end the run within seconds
whatever it is doing. A one-process run stops at the next step boundary, or out
of a blocked wait (data, evaluation), saving the last step not yet saved; a
multi-process run agrees on the signal at its next sync, so that every process
saves the same step. Stuck past the grace time, or on a second signal, it exits
at once.

Pod faults (`training/faults.py`): a process of a multi-process run that is lost
or stalls ends every process within seconds, with one line and exit status 75
("restart me"). The loop tells its watch where each step begins and which
phases are slow but live (the first step, evaluating, saving).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import grain
import jax
import ml_collections
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils

from refusion_jax.checkpoints import lora_run
from refusion_jax.checkpoints.orbax import CHECKPOINT_SUBDIR, Checkpoints, local_path, model_meta
from refusion_jax.data import pipeline
from refusion_jax.data.tokenizer import Tokenizer
from refusion_jax.model import flops, lora
from refusion_jax.model.config import ModelConfig
from refusion_jax.parallel import compiled, sharding
from refusion_jax.training import config_file, faults, inputs, run_lock, start
from refusion_jax.training.interrupts import Interrupts, RunInterrupted, StopRequested
from refusion_jax.training.metrics import MetricsLogger, console
from refusion_jax.training.objective import ObjectiveConfig
from refusion_jax.training.run_config import check_run_config, lora_config_from, objective_config_from
from refusion_jax.training.state import TrainState, make_eval_step, make_optimizer, make_train_step
from refusion_jax.training.validation import evaluate_decoding, evaluate_loss, format_report, format_samples

# How many dispatched steps the device may still have to run: enough to keep it busy while the host fetches the next
# batch, few enough that a signal waits for them (before saving) seconds, not a whole log interval of steps.
_STEPS_AHEAD = 2
# Seconds a save may take to copy the state off the devices, and the last writes to reach the disk, before the
# watchdog gives up on them after a signal.
_SAVE_PATIENCE_S = 120.0
_WRITE_PATIENCE_S = 600.0


class NonFiniteLossError(RuntimeError):
  """The loss or gradient norm became NaN/Inf; the run stopped without saving that step."""


@dataclasses.dataclass
class TrainResult:
  """What a call to `train_and_evaluate` did.

  losses: training loss of each step run in this call.
  evals: (step, validation metrics) of each evaluation.
  samples: the last evaluation's decoded examples (query, answer, correct).
  stopped_by: "finished", "preempted" or "stop_after_step".
  """

  step: int
  losses: dict[int, float]
  evals: list[tuple[int, dict[str, float]]]
  samples: list[dict[str, Any]]
  stopped_by: str


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, steps: Steps | None = None) -> TrainResult:
  """Train (resuming from `workdir` if it holds checkpoints), evaluate, checkpoint; see the module docstring.

  `workdir` must be a path every process sees (local disk for one process;
  NFS / gcsfuse for a pod). One run at a time holds it (`run_lock`). `steps`: what a training step is
  (None: `SupervisedSteps`, the objective of `config.objective` on token batches; `refusion_jax.rl` passes
  GRPO's); everything else (checkpoints, resume, signals, evaluation, logging) is the same for any.

  Raises:
    NonFiniteLossError: the loss or gradient norm became NaN/Inf; no checkpoint
      of that step or later was written.
    RunInterrupted: SIGTERM / SIGINT came before the run had anything new to save.
    DataError: the data is unusable (no example fits, bad records).
    WorkdirLockedError: another run holds `workdir`.
    CheckpointDamagedError: a checkpoint cannot be read and `checkpoint.on_corrupt` is "fail"
      (or every checkpoint is damaged).
    CheckpointSaveError: writing a checkpoint failed; the earlier ones are intact.
    ValueError: the config is refused (named fields).
  """
  # ------------------------------------------------------------ 1. the lock and checks
  workdir = local_path(workdir)
  os.makedirs(workdir, exist_ok=True)
  interrupts = Interrupts(grace_s=config.stop_grace_s)
  try:
    checkpoint_dir = os.path.join(workdir, CHECKPOINT_SUBDIR)
    with (
      _watching(config, checkpoint_dir, workdir) as watch,  # first: taking the lock is a collective too
      run_lock.workdir_lock(workdir),
      _open_checkpoints(config, checkpoint_dir, interrupts) as checkpoints,
    ):
      check_run_config(config, resuming=bool(checkpoints.all_steps()))
      if jax.process_index() == 0:
        config_file.write_run_config(config, workdir)  # what `eval --checkpoint WORKDIR` applies
      return _train(config, workdir, checkpoints, interrupts, watch, steps or SupervisedSteps())
  except StopRequested as stop:
    raise RunInterrupted(
      f"Stopped by {stop}: nothing was trained in this run yet, so nothing new is saved. Rerun the same "
      "command to start again (a resumed run continues from its last checkpoint)."
    ) from None
  finally:
    interrupts.close()


@contextlib.contextmanager
def _watching(config: ml_collections.ConfigDict, checkpoint_dir: str, workdir: str) -> Iterator[faults.FaultWatch]:
  """The run's `FaultWatch` (a lost or stalled process ends every process: training/faults.py).

  On a fault it releases the workdir's lock where this process holds it, so that a restart on another host may
  take it.
  """
  lock = os.path.join(workdir, run_lock.LOCK_NAME)
  watch = faults.FaultWatch(config.faults, checkpoint_dir, before_exit=lambda: run_lock.release(lock))
  try:
    yield watch
  except Exception:
    watch.settle()  # a process lost: its line and the restart status, not the collective's error
    raise
  finally:
    watch.close()


@contextlib.contextmanager
def _open_checkpoints(
  config: ml_collections.ConfigDict, directory: str, interrupts: Interrupts
) -> Iterator[Checkpoints]:
  """The run's `Checkpoints`; the writes still in flight are waited for on the way out (the first error wins)."""
  checkpoints = Checkpoints(
    directory, max_to_keep=config.checkpoint.max_to_keep, async_save=config.checkpoint.async_save
  )
  try:
    yield checkpoints
  except BaseException:
    with (
      interrupts.phase("writing checkpoints", blocking=False, patience_s=_WRITE_PATIENCE_S),
      contextlib.suppress(Exception),  # the error that ended the run is the one to report
    ):
      checkpoints.wait()
    raise
  else:
    with interrupts.phase("writing checkpoints", blocking=False, patience_s=_WRITE_PATIENCE_S):
      checkpoints.wait()
  finally:
    with contextlib.suppress(Exception):
      checkpoints.close()


def _train(
  config: ml_collections.ConfigDict,
  workdir: str,
  checkpoints: Checkpoints,
  interrupts: Interrupts,
  watch: faults.FaultWatch,
  steps: Steps,
) -> TrainResult:
  # ------------------------------------------------------------ 2. data
  watch.starting("building or opening the data")
  with interrupts.phase("building the data", blocking=True):
    splits = steps.open_splits(config, workdir)
  validation = splits.get("validation") if config.eval_every > 0 else None

  # ------------------------------------------------------------ 3. where the model starts
  total_steps = config.num_train_steps
  if total_steps <= 0:
    total_steps = max(config.num_epochs * len(splits["train"]) // config.batch_size, 1)
  tx, schedule = make_optimizer(config.optimizer, total_steps * steps.updates_per_step)
  mesh = sharding.make_mesh(dict(config.mesh))
  sharding.check_batch_split(steps.rows(config), config.grad_accum_steps, mesh, config.sharding_rules)
  watch.starting("restoring its newest checkpoint, or building the model it starts from")
  run = start.begin(
    config, checkpoints, tx, mesh, lambda tokenizer: steps.batches(splits["train"], tokenizer, config), interrupts
  )
  if validation is not None:
    with interrupts.phase("checking the validation data", blocking=True):
      next(iter(inputs.batches(validation, run.tokenizer, config, train=False)))  # a DataError now, not later

  # ------------------------------------------------------------ 4. compiled functions
  model_config = run.origin.model_config
  objective = objective_config_from(config, model_config)
  lora_config = lora_config_from(config)
  graphdef, _ = lora.abstract_lora_model(model_config, lora_config)
  step_fn = steps.build(StepParts(config, run, graphdef, tx, schedule, objective))
  eval_fn = run.placement.jit_eval(make_eval_step(graphdef, objective))

  # ------------------------------------------------------------ 5. the loop and its periodic actions
  state, step = run.state, int(run.state.step)
  first_step = step
  # The progress bar's time left counts the evaluations to come (on a CPU demo a good part of the run).
  eval_steps = _eval_steps(config, step, total_steps, validation is not None)
  logger = MetricsLogger(workdir, total_steps=total_steps, initial_step=step, eval_steps=eval_steps)
  result = TrainResult(step=step, losses={}, evals=[], samples=[], stopped_by="finished")
  # Only a one-process run stops out of a blocked wait (data, evaluation): the processes of a multi-process run
  # must all stop, and save, at one step, which they agree on at a host sync.
  alone = jax.process_count() == 1
  device = _DeviceQueue(interrupts)
  meta = model_meta(
    model_config,
    run.origin.tokenizer_name,
    objective=objective.kind,
    **lora_run.meta_fields(lora_config, checkpoints.directory),
  )
  saver = _Saver(checkpoints, meta, interrupts)
  saver.last_saved = run.origin.resume_step
  evaluator = _Evaluator(config, validation, run, eval_fn, graphdef, logger, interrupts, alone)
  throughput = steps.meter(model_config, objective, lora_config)
  position = _Position(run.train_iterator)
  try:
    while step < total_steps:
      watch.step_begins(step + 1, timed=step != first_step)  # the first step compiles: its time says nothing
      with interrupts.phase("waiting for training data", blocking=alone):
        batch = next(run.train_iterator)
        next_position = _Position(run.train_iterator)
      throughput.add(batch)
      # A step cannot be cut short (its input state is donated); dispatching it returns at once, after compiling
      # the first time, and then waits for the device to be at most _STEPS_AHEAD steps behind.
      busy = f"running train step {step + 1}" + (" (compiling it first)" if step == first_step else "")
      with interrupts.phase(busy, blocking=False, patience_s=3 * device.step_seconds):
        state, metrics = step_fn(state, batch)
        device.dispatched(step + 1, metrics)
      step, position = step + 1, next_position
      checkpoints.check()  # a background write that failed stops the run now (a host-side check, no device sync)

      due = _due(config, step, total_steps, evaluator.enabled)
      signalled = alone and interrupts.requested is not None  # a one-process run stops at this step
      if not (due or signalled or step == config.stop_after_step):
        continue  # the device runs ahead; the host syncs only where an action is due or it may stop
      metrics = device.sync(result, logger, saver.last_saved, checkpoints)
      if "log" in due:
        logger.write(step, dict(_scalars(metrics), **throughput.read()), "train")
      slow = " and ".join(name for action, name in _SLOW_ACTIONS.items() if action in due)
      with throughput.paused(), watch.paused(f"{slow or 'logging'} at step {step}"):
        if "eval" in due:
          evaluator.run(step, state.params, result)
        if "save" in due:
          saver.save(step, state, position)
      device.restart_clock()  # evaluating and saving are not the device's step time
      result.stopped_by = _stop_reason(config, interrupts, checkpoints, step)
      if result.stopped_by != "finished":
        watch.steps_over()
        if saver.last_saved != step:
          saver.save(step, state, position)
        console(f"Stopping at step {step} ({result.stopped_by}); checkpoint saved in {checkpoints.directory}.")
        break
  except StopRequested as stop:
    watch.steps_over()
    if device.pending:  # check the steps not yet read back first: a non-finite state is never saved
      device.sync(result, logger, saver.last_saved, checkpoints)
    _save_on_stop(stop, step, first_step, saver, state, position)
    result.stopped_by = "preempted"
    console(f"Stopping at step {step} ({result.stopped_by}) on {stop}; checkpoint saved in {checkpoints.directory}.")
  finally:
    watch.steps_over()
    logger.close()
  result.step = step
  if result.samples:
    eval_step, eval_metrics = result.evals[-1]
    console(format_report(eval_step, eval_metrics, result.samples, config.num_samples_to_print))
  return result


# ------------------------------------------------------------------ what a step is


@dataclasses.dataclass(frozen=True)
class StepParts:
  """What a step is built from: the config, the started run (its tokenizer, placement and state), the model's
  graph, the optimizer and its schedule, the objective of `config.objective`."""

  config: ml_collections.ConfigDict
  run: start.Started
  graphdef: nnx.GraphDef
  tx: optax.GradientTransformation
  schedule: optax.Schedule
  objective: ObjectiveConfig


class Steps:
  """What a run's training step is: the batches it reads and the function that updates the train state with one.

  The loop owns everything around it (the lock, resuming, checkpoints, signals, faults, evaluation, logging), so
  any kind of step gets the same guarantees. `SupervisedSteps` is the objective's step on token batches;
  refusion_jax.rl's GRPO step rolls out, scores and updates.
  """

  # Optimizer updates per step (the schedule counts updates).
  updates_per_step = 1

  def open_splits(self, config: ml_collections.ConfigDict, workdir: str) -> dict[str, Sequence[Any]]:
    """{split: records} of `config.data` (`inputs.open_splits`): "train" feeds `batches`, "validation" the
    periodic evaluation."""
    return inputs.open_splits(config, workdir)

  def rows(self, config: ml_collections.ConfigDict) -> int:
    """The rows of the global batch an update differentiates (split over the batch-parallel devices)."""
    return config.batch_size

  def batches(
    self, source: Sequence[Any], tokenizer: Tokenizer, config: ml_collections.ConfigDict
  ) -> grain.IterDataset:
    """The training split `source` as this process's grain dataset of step inputs."""
    raise NotImplementedError

  def build(self, parts: StepParts) -> Callable[[TrainState, Any], tuple[TrainState, dict]]:
    """The step function (state, one element of `batches`) -> (state, metrics), compiled where it needs to be.

    Metrics hold at least `loss` and `grad_norm` (checked finite before a step is saved).
    """
    raise NotImplementedError

  def meter(self, model_config: ModelConfig, objective: ObjectiveConfig, lora_config: lora.LoraConfig) -> Any:
    """What a log line adds about the steps' work (`_Throughput`'s interface: add, paused, read)."""
    return _NoThroughput()


class SupervisedSteps(Steps):
  """The objective of `config.objective` (ReFusion, AR or MDM) on token batches (`inputs.batches`)."""

  def batches(
    self, source: Sequence[Any], tokenizer: Tokenizer, config: ml_collections.ConfigDict
  ) -> grain.IterDataset:
    return inputs.batches(source, tokenizer, config, train=True)

  def build(self, parts: StepParts) -> Callable[[TrainState, Any], tuple[TrainState, dict]]:
    placement = parts.run.placement
    step = make_train_step(parts.graphdef, parts.tx, parts.schedule, parts.objective, parts.config.grad_accum_steps)
    jitted = placement.jit_step(step)
    return lambda state, batch: jitted(state, placement.batch(batch))

  def meter(self, model_config: ModelConfig, objective: ObjectiveConfig, lora_config: lora.LoraConfig) -> _Throughput:
    return _Throughput(model_config, causal=objective.kind != "mdm", lora_config=lora_config)


# ------------------------------------------------------------------ when actions are due

# The periodic actions that are no step: the step watchdog pauses for them (training/faults.py).
_SLOW_ACTIONS = {"eval": "evaluating", "save": "saving"}


def _due(config: ml_collections.ConfigDict, step: int, total_steps: int, evaluates: bool) -> set[str]:
  """The periodic actions due after `step`: "log", "eval", "save" (each also at the last step)."""
  last = step == total_steps
  due = set()
  if step % config.log_every == 0 or last:
    due.add("log")
  if evaluates and (step % config.eval_every == 0 or last):
    due.add("eval")
  if step % config.checkpoint.every == 0 or last:
    due.add("save")
  return due


def _eval_steps(config: ml_collections.ConfigDict, step: int, total_steps: int, evaluates: bool) -> list[int]:
  """The steps after `step` at which an evaluation is due."""
  return [s for s in range(step + 1, total_steps + 1) if "eval" in _due(config, s, total_steps, evaluates)]


def _stop_reason(config: ml_collections.ConfigDict, interrupts: Interrupts, checkpoints: Checkpoints, step: int) -> str:
  """ "preempted" when any process got a signal (or JAX's preemption notice asks to save at `step`),
  "stop_after_step" at `config.stop_after_step`, else "finished" (go on)."""
  signalled = interrupts.requested is not None
  if jax.process_count() > 1:  # every process must stop, and save, at the same step
    signalled = bool(np.max(multihost_utils.process_allgather(np.int32(signalled))))
  if signalled or checkpoints.reached_preemption(step):
    return "preempted"
  return "stop_after_step" if step == config.stop_after_step else "finished"


# ------------------------------------------------------------------ the periodic actions


class _DeviceQueue:
  """The steps dispatched since the last host sync, and the device's time per step.

  The host runs at most `_STEPS_AHEAD` steps ahead (a wait, not a transfer);
  `sync` reads every pending step's metrics back in one transfer and checks them.
  """

  def __init__(self, interrupts: Interrupts):
    self._interrupts = interrupts
    self.pending: list[tuple[int, dict]] = []
    # The device's seconds per step, measured between syncs (0 until the first: a signal then gets the grace time).
    self.step_seconds = 0.0
    self._synced_at = time.perf_counter()

  def dispatched(self, step: int, metrics: dict) -> None:
    self.pending.append((step, metrics))
    if len(self.pending) > _STEPS_AHEAD:
      jax.block_until_ready(self.pending[-1 - _STEPS_AHEAD][1])

  def sync(self, result: TrainResult, logger: MetricsLogger, last_saved: int | None, checkpoints: Checkpoints) -> dict:
    """Read the pending steps' metrics back, check them, record their losses; returns the last step's metrics.

    Runs before every save, so a non-finite step is never saved.
    """
    count = len(self.pending)
    # The device may still be running the last _STEPS_AHEAD steps: the watchdog allows for their time.
    waiting = f"waiting for the device to finish steps {self.pending[0][0]}-{self.pending[-1][0]}"
    with self._interrupts.phase(waiting, blocking=False, patience_s=3 * self.step_seconds * _STEPS_AHEAD):
      steps = jax.device_get(self.pending)
    self.pending.clear()
    for step, metrics in steps:
      _check_finite(metrics, step, last_saved, checkpoints)
      result.losses[step] = float(metrics["loss"])
    logger.steps_done(steps[-1][0], [result.losses[step] for step, _ in steps])
    self.step_seconds = (time.perf_counter() - self._synced_at) / count
    return steps[-1][1]

  def restart_clock(self) -> None:
    self._synced_at = time.perf_counter()


class _Throughput:
  """What the steps since the last log line earned: real (example) tokens per second, overall and per chip, model
  TFLOP/s per chip and MFU (model/flops.py; left out where the chip's peak is unknown, e.g. CPUs), and
  `pad_fraction`, the share of row positions that held no example (the mean over the interval's batches).

  Time spent evaluating and saving (`paused`) is not the steps' time.
  """

  def __init__(self, model_config: ModelConfig, causal: bool, lora_config: lora.LoraConfig):
    self._model_config, self._causal, self._lora = model_config, causal, lora_config
    self._chips, self._peak = jax.device_count(), compiled.peak_flops(jax.devices()[0])
    self._reset()

  def _reset(self) -> None:
    self._tokens, self._flops, self._pad, self._batches = 0, 0.0, 0.0, 0
    self._since, self._paused = time.perf_counter(), 0.0

  def add(self, batch: Mapping[str, np.ndarray]) -> None:
    lengths = flops.example_lengths(batch)
    self._tokens += int(lengths.sum())
    self._flops += flops.training_flops(self._model_config, lengths, self._causal, self._lora)
    self._pad += pipeline.pad_fraction(batch)
    self._batches += 1

  @contextlib.contextmanager
  def paused(self) -> Iterator[None]:
    started = time.perf_counter()
    try:
      yield
    finally:
      self._paused += time.perf_counter() - started

  def read(self) -> dict[str, float]:
    seconds = max(time.perf_counter() - self._since - self._paused, 1e-9)
    scalars = dict(
      tokens_per_second=self._tokens / seconds,
      **flops.per_chip(self._flops, self._tokens, seconds, self._chips, self._peak),
      pad_fraction=self._pad / max(self._batches, 1),
    )
    self._reset()
    return scalars


class _NoThroughput:
  """A meter for steps that report their own work in their metrics (`_Throughput`'s interface)."""

  def add(self, batch: Any) -> None:
    pass

  @contextlib.contextmanager
  def paused(self) -> Iterator[None]:
    yield

  def read(self) -> dict[str, float]:
    return {}


class _Position:
  """The data iterator's state after the batch of a step: what that step's checkpoint must hold.

  Taken after every batch, so that a run stopped while fetching the next one
  (the iterator then mid-way) still saves where its last step stood.
  """

  def __init__(self, iterator: grain.DatasetIterator):
    self._state = iterator.get_state()

  def get_state(self) -> dict:
    return self._state


class _Saver:
  """Saves the state, the data position and the model's meta; remembers the last step saved."""

  def __init__(self, checkpoints: Checkpoints, meta: dict, interrupts: Interrupts):
    self._checkpoints, self._meta, self._interrupts = checkpoints, meta, interrupts
    self.last_saved: int | None = None

  def save(self, step: int, state: TrainState, position: _Position) -> None:
    with self._interrupts.phase(f"saving step {step}", blocking=False, patience_s=_SAVE_PATIENCE_S):
      # The trainable part: every parameter, or only the adapters of a LoRA run (its base was written once).
      params = lora.trainable_part(state.params)[0]
      self._checkpoints.save(step, params=params, train=state.train_part(), data_iterator=position, meta=self._meta)
    self.last_saved = step


class _Evaluator:
  """Validation loss and decoding metrics (exact match, tokens per forward), logged and kept in the result."""

  def __init__(
    self,
    config: ml_collections.ConfigDict,
    validation: Sequence[Any] | None,
    run: start.Started,
    eval_fn: Callable,
    graphdef: nnx.GraphDef,
    logger: MetricsLogger,
    interrupts: Interrupts,
    alone: bool,
  ):
    self._config, self._validation, self._run, self._eval_fn = config, validation, run, eval_fn
    self._graphdef = graphdef  # the decoders run the model's inference view (no remat, weights cast once)
    self._logger, self._interrupts, self._alone = logger, interrupts, alone

  @property
  def enabled(self) -> bool:
    return self._validation is not None

  def run(self, step: int, params: Any, result: TrainResult) -> None:
    config, tokenizer = self._config, self._run.tokenizer
    with self._interrupts.phase(f"evaluating at step {step}", blocking=self._alone), self._logger.evaluating(step):
      metrics = evaluate_loss(
        self._eval_fn,
        params,
        inputs.batches(self._validation, tokenizer, config, train=False),
        num_batches=config.eval.num_loss_batches,
        seed=config.seed,
        placement=self._run.placement,
      )
      model = nnx.merge(self._graphdef, params)
      decoded, samples = evaluate_decoding(model, self._validation, tokenizer, config, self._run.placement.mesh)
    metrics.update(decoded)
    result.samples = samples
    result.evals.append((step, metrics))
    self._logger.write(step, metrics, "eval")
    self._logger.write_text(step, "eval/samples", format_samples(samples[: config.num_samples_to_print]))


# ------------------------------------------------------------------ helpers


def _scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
  """The metrics a log line shows (counts are for the host's bookkeeping)."""
  return {k: float(v) for k, v in metrics.items() if not k.startswith("num_")}


def _save_on_stop(
  stop: StopRequested, step: int, first_step: int, saver: _Saver, state: TrainState, position: _Position
) -> None:
  """After a signal that interrupted a blocked phase: save the last step if it is new, else stop without saving.

  Only a one-process run gets here after its first step (a multi-process run's loop does not block on signals).
  """
  if saver.last_saved == step:
    return
  if step == first_step:
    raise RunInterrupted(
      f"Stopped by {stop} before the first step of this run: nothing new to save (the last checkpoint is step "
      f"{saver.last_saved}). Rerun the same command to continue."
    )
  saver.save(step, state, position)


def _check_finite(metrics: dict, step: int, last_saved: int | None, checkpoints: Checkpoints) -> None:
  """Stop before anything of a step with a NaN/Inf loss or gradient norm is saved."""
  loss, grad_norm = float(metrics["loss"]), float(metrics["grad_norm"])
  if math.isfinite(loss) and math.isfinite(grad_norm):
    return
  checkpoints.wait()
  raise NonFiniteLossError(
    f"Non-finite loss or gradient at step {step} (loss={loss}, grad_norm={grad_norm}); stopping. "
    f"Nothing was saved for this step: the last good checkpoint is step {last_saved} in "
    f"{checkpoints.directory}. Lower optimizer.lr or check the data, then rerun to resume from it."
  )
