"""Training and evaluation of ReFusion (and the AR / MDM baselines) on one backbone.

    python -m refusion_jax.train --config configs/demo.py --workdir /tmp/refusion_demo
    python -m refusion_jax.train --config configs/demo.py --workdir DIR --config.num_train_steps=200

`train_and_evaluate(config, workdir)` does everything; `refusion_jax.train` only parses flags.
The loop:

0. Take the workdir's lock (`run_lock`): one run per workdir.
1. Build (once) and open the data: the built-in tasks or query/response JSON.
   Data that cannot be used is a `DataError` at once (no example fits
   `seq_len`, a bad record), for the validation split too.
2. Build the train state where it lives (`refusion_jax.training.state`):
   parameters and optimizer state are created by a jitted init whose outputs
   carry the mesh shardings. Precedence: resume from the newest *intact* step
   of `workdir/checkpoints` (a damaged one is moved to `workdir/checkpoints_damaged`
   when `checkpoint.on_corrupt="fallback"`), else `init_from_hf` (or an
   `init_from` that is a Hugging Face directory), else `init_from` (a run of
   ours, a tunix or MaxText checkpoint; `init_format` says which, default
   detect), else `init_from_checkpoint` (parameters of another run), else a
   fresh init.
3. Step: one jitted function `state, batch -> state, metrics` with in/out
   shardings; gradient accumulation is a `lax.scan` over microbatches inside
   it (one optimizer update per step, so the step count, schedule and
   checkpoints are in optimizer updates).
4. The host syncs with the device only at log, eval and checkpoint steps
   (and `stop_after_step`), not every step: there it reads the metrics of
   every step since the last sync and checks their loss and gradient norm, so
   a non-finite value stops the run before anything of it is saved. The
   host runs at most `_STEPS_AHEAD` steps ahead of the device (a wait, no
   transfer), so that a stop never waits for a long queue of steps.
   SIGTERM / SIGINT (`interrupts`) end the run within seconds whatever it is
   doing: a one-process run makes the next step boundary a sync and stops
   there, or stops out of a blocked wait (data, evaluation), saving the last
   step not yet saved; a multi-process run agrees on the signal at its next
   sync, so that every process saves the same step. Stuck past the grace time
   (native code, a wait that never ends), or on a second signal, it exits at
   once.
5. Periodically: TensorBoard / console metrics, validation loss, exact match
   and tokens-per-forward of decoding (`refusion_jax.training.evaluate`), and
   checkpoints. A failed save is a `CheckpointSaveError`; the steps before it
   stay intact.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grain
import jax
import ml_collections
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils

from refusion_jax.checkpoints.hf import load_hf_config
from refusion_jax.checkpoints.orbax import (
  CHECKPOINT_SUBDIR,
  CheckpointDamagedError,
  Checkpoints,
  abstract_model,
  load_model_from_checkpoint,
  local_path,
  model_meta,
)
from refusion_jax.checkpoints.vocab import MASK_TOKEN, load_hf_for_training
from refusion_jax.data import pipeline
from refusion_jax.data.tokenizer import Tokenizer, load_tokenizer
from refusion_jax.model.config import ModelConfig
from refusion_jax.parallel import sharding
from refusion_jax.training import run_lock
from refusion_jax.training.evaluate import evaluate_decoding, evaluate_loss, format_report, format_samples
from refusion_jax.training.interrupts import Interrupts, RunInterrupted, StopRequested
from refusion_jax.training.metrics import MetricsLogger, console
from refusion_jax.training.run_config import (
  check_hf_architecture,
  check_required_fields,
  model_config_from,
  objective_config_from,
  run_as_configured,
)
from refusion_jax.training.state import (
  Placement,
  TrainState,
  init_state_fn,
  make_eval_step,
  make_optimizer,
  make_placement,
  make_train_step,
  state_with_params,
)

# Where damaged checkpoints are moved inside a workdir (next to CHECKPOINT_SUBDIR, out of the manager's sight).
DAMAGED_SUBDIR = "checkpoints_damaged"


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


# ------------------------------------------------------------------ data


def open_splits(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """{split: random-access records}, building the tfds dataset on first use (process 0 builds, the others wait)."""
  if jax.process_index() == 0:
    splits = _open_splits(config, workdir)
  multihost_utils.sync_global_devices("refusion_jax: data built")
  return splits if jax.process_index() == 0 else _open_splits(config, workdir)


def _open_splits(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  from refusion_jax.data import builders  # imports tensorflow-datasets

  data = config.data
  data_dir = data.data_dir or os.path.join(workdir, "data")
  if data.dataset == "tasks":
    return builders.build_refusion_tasks(
      data_dir,
      num_train=data.num_train,
      num_validation=data.num_validation,
      num_test=data.num_test,
      seed=data.seed,
      task_names=tuple(data.tasks),
    )
  if data.dataset == "json":
    files = {split: [f for f in data.get(f"{split}_files", "").split(",") if f] for split in ("train", "validation")}
    return builders.build_query_response_json(data_dir, {k: v for k, v in files.items() if v})
  raise ValueError(f"config.data.dataset={data.dataset!r}; choose 'tasks' or 'json'.")


def data_name(config: ml_collections.ConfigDict, split: str) -> str:
  """What a split is, for messages: its files, or the built-in tasks."""
  if config.data.dataset == "json":
    return f"the {split} data (config.data.{split}_files={config.data.get(f'{split}_files')})"
  return f"the {split} split of the built-in tasks {tuple(config.data.tasks)}"


def batches(
  source: Sequence, tokenizer: Tokenizer, config: ml_collections.ConfigDict, *, train: bool
) -> grain.IterDataset:
  """The grain dataset of this process's rows: endless and shuffled for training, one ordered pass for eval.

  Both pack examples into rows when `config.data.packing` (the loss is normalised per token and per example, so
  validation batches measure the same loss either way); the MDM baseline cannot pack (docs/method.md §1).
  """
  if config.data.packing and config.objective.kind == "mdm":
    raise ValueError(
      "The mdm objective runs every answer to the end of its row, so its rows cannot be packed "
      "(docs/method.md §1): set --config.data.packing=False."
    )
  return pipeline.make_dataset(
    source,
    tokenizer,
    seq_len=config.data.seq_len,
    batch_size=config.batch_size // jax.process_count(),
    seed=config.seed,
    shuffle=train,
    num_epochs=None if train else 1,
    chat_template=config.data.chat_template,
    name=data_name(config, "train" if train else "validation"),
    warn_drop_fraction=config.data.warn_drop_fraction,
    packing=config.data.packing,
    max_segments=config.data.max_segments,
  )


# ------------------------------------------------------------------ where the model comes from


@dataclasses.dataclass
class _Start:
  """Where the run's model comes from (see the precedence in the module docstring)."""

  model_config: ModelConfig
  tokenizer_name: str  # relative names are resolved against the checkpoint directory
  resume_step: int | None = None
  params: nnx.State | None = None  # initial parameters (HF or another run); None = random


@dataclasses.dataclass
class _Ready:
  """The start, and what depends on it: tokenizer, state placement, data iterator, the state itself."""

  start: _Start
  tokenizer: Tokenizer
  placement: Placement
  train_iter: grain.DatasetIterator
  state: TrainState


def _prepare(
  config: ml_collections.ConfigDict,
  checkpoints: Checkpoints,
  build: Callable[[_Start], _Ready],
  interrupts: Interrupts,
  damaged_dir: str,
) -> _Ready:
  """Resume from the newest intact checkpoint, else start as `config` says (never silently from scratch)."""
  steps = checkpoints.all_steps()
  for step in reversed(steps):
    try:
      with interrupts.phase(f"restoring checkpoint step {step}", blocking=True):
        meta = checkpoints.read_meta(step)
        model_config = run_as_configured(ModelConfig(**meta["model_config"]), config.model)
        return build(_Start(model_config, meta["tokenizer"], resume_step=step))
    except CheckpointDamagedError as error:
      _set_aside(config, checkpoints, error, damaged_dir)
  if steps or (os.path.isdir(damaged_dir) and os.listdir(damaged_dir)):
    raise CheckpointDamagedError(
      f"Every checkpoint of {checkpoints.directory} is damaged (moved to {damaged_dir}); refusing to start "
      f"from scratch in a workdir that held a run. Delete {damaged_dir} to start over, or use a new workdir.",
      step=-1,
    )
  with interrupts.phase("loading the initial model", blocking=True):
    start = _find_start(config, checkpoints)
    return build(dataclasses.replace(start, model_config=run_as_configured(start.model_config, config.model)))


def _set_aside(
  config: ml_collections.ConfigDict, checkpoints: Checkpoints, error: CheckpointDamagedError, damaged_dir: str
) -> None:
  """Move a damaged step out of the way (`checkpoint.on_corrupt="fallback"`), or stop ("fail")."""
  where = os.path.join(checkpoints.directory, str(error.step))
  if config.checkpoint.on_corrupt == "fail":
    raise CheckpointDamagedError(
      f"{error} With checkpoint.on_corrupt='fail' the run stops: move {where} aside (or set "
      "--config.checkpoint.on_corrupt=fallback) to resume from the step before it.",
      error.step,
    ) from error
  moved = checkpoints.move_aside(error.step, damaged_dir)
  console(f"{error} Moved it to {moved} (kept, not deleted); trying the step before it.")


def _find_start(config: ml_collections.ConfigDict, checkpoints: Checkpoints) -> _Start:
  """Where a run that does not resume starts (the precedence after resuming, in the module docstring)."""
  from refusion_jax.checkpoints import load as checkpoint_loader  # the front door for every checkpoint format

  init_from = config.get("init_from", "")
  init_format = checkpoint_loader.locate(init_from, config.get("init_format", "auto")).format if init_from else ""
  if init_format == "hf":
    config = config.copy_and_resolve_references()  # an HF start takes the init_from_hf path (mask token, vocab)
    config.init_from_hf = init_from
  if config.init_from_hf:
    return _start_from_hf(config, checkpoints.directory)
  if init_from:  # a run of ours, tunix or MaxText; the latter two store no config: config.model describes them
    model, tokenizer_path = checkpoint_loader.initial_model(
      init_from,
      format=init_format,
      config=model_config_from(config, load_tokenizer(config.tokenizer)) if init_format != "refusion" else None,
      dtype=config.model.get("dtype"),
      param_dtype=config.model.get("param_dtype"),
    )
    return _Start(model.config, tokenizer_path or config.tokenizer, params=nnx.state(model))
  if config.init_from_checkpoint:
    model, tokenizer_path = load_model_from_checkpoint(config.init_from_checkpoint)
    return _Start(model.config, tokenizer_path, params=nnx.state(model))
  return _Start(model_config_from(config, load_tokenizer(config.tokenizer)), config.tokenizer)


def _start_from_hf(config: ml_collections.ConfigDict, checkpoint_dir: str) -> _Start:
  # config.json alone says whether the architecture fits: check before reading the weights.
  check_hf_architecture(config.model, load_hf_config(config.init_from_hf), config.init_from_hf)
  start = load_hf_for_training(
    config.init_from_hf,
    os.path.join(checkpoint_dir, "tokenizer"),
    dtype=config.model.get("dtype", "float32"),
    param_dtype=config.model.get("param_dtype", None),
    vocab_multiple=config.vocab_multiple,
    seed=config.seed,
  )
  if start.added_mask_id is not None:
    console(f"Added {MASK_TOKEN} to the tokenizer as id {start.added_mask_id} (written to {start.tokenizer_path}).")
  if start.resized_from is not None:
    console(f"Resized the vocabulary from {start.resized_from} to {start.model_config.vocab_size} rows.")
  tokenizer_path = start.tokenizer_path
  if tokenizer_path.startswith(checkpoint_dir):
    tokenizer_path = os.path.relpath(tokenizer_path, checkpoint_dir)
  return _Start(start.model_config, tokenizer_path, params=start.params)


def _initial_state(
  config: ml_collections.ConfigDict,
  start: _Start,
  tx: optax.GradientTransformation,
  placement: Placement,
  checkpoints: Checkpoints,
  train_iter: grain.DatasetIterator,
) -> TrainState:
  if start.resume_step is not None:
    abstract = placement.abstract_state
    restored = checkpoints.restore(
      start.resume_step,
      abstract_params=abstract.params,
      abstract_train=abstract.train_part(),
      data_iterator=train_iter,
    )
    console(f"Resumed from {checkpoints.directory} at step {start.resume_step}.")
    return TrainState(params=restored.params, **restored.train)
  if start.params is not None:
    return state_with_params(start.params, tx, config.seed, placement)
  init = jax.jit(init_state_fn(start.model_config, tx, config.seed), out_shardings=placement.state_shardings)
  return init()


def _resolve_tokenizer(name: str, checkpoint_dir: str) -> Tokenizer:
  local = os.path.join(checkpoint_dir, name)
  return load_tokenizer(local if os.path.isdir(local) else name)


# ------------------------------------------------------------------ the loop


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> TrainResult:
  """Train (resuming from `workdir` if it holds checkpoints), evaluate, checkpoint; see the module docstring.

  `workdir` must be a path every process sees (local disk for one process;
  NFS / gcsfuse for a pod). One run at a time holds it (`run_lock`).

  Raises:
    NonFiniteLossError: the loss or gradient norm became NaN/Inf; no checkpoint
      of that step or later was written.
    RunInterrupted: SIGTERM / SIGINT came before the run had anything new to save.
    DataError: the data is unusable (no example fits, bad records).
    WorkdirLockedError: another run holds `workdir`.
    CheckpointDamagedError: a checkpoint cannot be read and `checkpoint.on_corrupt` is "fail"
      (or every checkpoint is damaged).
    CheckpointSaveError: writing a checkpoint failed; the earlier ones are intact.
  """
  workdir = local_path(workdir)
  os.makedirs(workdir, exist_ok=True)
  if config.checkpoint.on_corrupt not in ("fallback", "fail"):
    raise ValueError(f"checkpoint.on_corrupt={config.checkpoint.on_corrupt!r}; choose 'fallback' or 'fail'.")
  interrupts = Interrupts(grace_s=config.stop_grace_s)
  try:
    with _workdir_lock(workdir):
      checkpoints = Checkpoints(
        os.path.join(workdir, CHECKPOINT_SUBDIR),
        max_to_keep=config.checkpoint.max_to_keep,
        async_save=config.checkpoint.async_save,
      )
      try:
        result = _train_loop(config, workdir, checkpoints, interrupts)
        with interrupts.phase("writing checkpoints", blocking=False, patience_s=_WRITE_PATIENCE_S):
          checkpoints.wait()
        return result
      except BaseException:
        with (
          interrupts.phase("writing checkpoints", blocking=False, patience_s=_WRITE_PATIENCE_S),
          contextlib.suppress(Exception),  # the first error is the one to report
        ):
          checkpoints.wait()
        raise
      finally:
        with contextlib.suppress(Exception):
          checkpoints.close()
  except StopRequested as stop:
    raise RunInterrupted(
      f"Stopped by {stop}: nothing was trained in this run yet, so nothing new is saved. Rerun the same "
      "command to start again (a resumed run continues from its last checkpoint)."
    ) from None
  finally:
    interrupts.close()


@contextlib.contextmanager
def _workdir_lock(workdir: str) -> Iterator[None]:
  """Process 0 holds the workdir's lock for the whole job; every process fails together if it cannot."""
  path, refusal = None, ""
  if jax.process_index() == 0:
    try:
      path = run_lock.acquire(workdir)
    except run_lock.WorkdirLockedError as error:
      refusal = str(error)
  locked = multihost_utils.broadcast_one_to_all(np.int32(not refusal))
  if not locked:
    raise run_lock.WorkdirLockedError(refusal or f"Process 0 could not lock {workdir}; see its log.")
  try:
    yield
  finally:
    if path is not None:
      run_lock.release(path)


def _total_steps(config: ml_collections.ConfigDict, num_train_records: int) -> int:
  if config.num_train_steps > 0:
    return config.num_train_steps
  return max(config.num_epochs * num_train_records // config.batch_size, 1)


def _check_batch_size(config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh) -> None:
  sharding.check_batch_divisible(config.batch_size, mesh, config.sharding_rules)
  # The strided microbatches split each device's rows: each device needs a multiple of grad_accum_steps rows.
  ways = math.lcm(sharding.batch_parallel_ways(mesh, config.sharding_rules), jax.process_count())
  if config.batch_size % (config.grad_accum_steps * ways):
    raise ValueError(
      f"batch_size={config.batch_size} must be a multiple of grad_accum_steps={config.grad_accum_steps} "
      f"times the {ways} batch-parallel devices / processes of the mesh {dict(mesh.shape)}, so that every "
      f"microbatch splits evenly over them: change batch_size, grad_accum_steps or config.mesh."
    )


class _Position:
  """The data iterator's state after the batch of a step: what that step's checkpoint must hold.

  Taken after every batch, so that a run stopped while fetching the next one
  (the iterator then mid-way) still saves where its last step stood.
  """

  def __init__(self, iterator: grain.DatasetIterator):
    self._state = iterator.get_state()

  def get_state(self) -> dict:
    return self._state


def _stop_requested(interrupts: Interrupts, checkpoints: Checkpoints, step: int) -> bool:
  """Whether any process received a signal, or JAX's preemption notice asks to save at `step`."""
  flag = interrupts.requested is not None
  if jax.process_count() > 1:  # every process must stop, and save, at the same step
    flag = bool(np.max(multihost_utils.process_allgather(np.int32(flag))))
  return flag or checkpoints.reached_preemption(step)


def _train_loop(
  config: ml_collections.ConfigDict, workdir: str, checkpoints: Checkpoints, interrupts: Interrupts
) -> TrainResult:
  check_required_fields(config, resuming=bool(checkpoints.all_steps()))
  with interrupts.phase("building the data", blocking=True):
    splits = open_splits(config, workdir)
  validation = splits.get("validation")
  total_steps = _total_steps(config, len(splits["train"]))
  tx, schedule = make_optimizer(config.optimizer, total_steps)
  mesh = sharding.make_mesh(dict(config.mesh))
  _check_batch_size(config, mesh)

  def build(start: _Start) -> _Ready:
    tokenizer = _resolve_tokenizer(start.tokenizer_name, checkpoints.directory)
    placement = make_placement(init_state_fn(start.model_config, tx, config.seed), mesh, config.sharding_rules)
    train_iter = iter(batches(splits["train"], tokenizer, config, train=True))
    state = _initial_state(config, start, tx, placement, checkpoints, train_iter)
    return _Ready(start, tokenizer, placement, train_iter, state)

  ready = _prepare(config, checkpoints, build, interrupts, os.path.join(workdir, DAMAGED_SUBDIR))
  start, tokenizer, placement, train_iter, state = (
    ready.start,
    ready.tokenizer,
    ready.placement,
    ready.train_iter,
    ready.state,
  )
  if validation is not None and config.eval_every > 0:
    with interrupts.phase("checking the validation data", blocking=True):
      next(iter(batches(validation, tokenizer, config, train=False)))  # a DataError now, not at the first eval

  objective = objective_config_from(config, start.model_config)
  graphdef, _ = abstract_model(start.model_config)
  step_fn = placement.jit_step(make_train_step(graphdef, tx, schedule, objective, config.grad_accum_steps))
  eval_fn = placement.jit_eval(make_eval_step(graphdef, objective))
  # Rematerialisation only saves memory in a backward pass, and nnx.remat fails inside the decode loop's trace.
  decode_graphdef, _ = abstract_model(start.model_config.replace(remat=False))
  meta = model_meta(start.model_config, start.tokenizer_name, objective=objective.kind)
  step = first_step = int(state.step)
  position = _Position(train_iter)
  logger = MetricsLogger(workdir, total_steps=total_steps, initial_step=step)
  result = TrainResult(step=step, losses={}, evals=[], samples=[], stopped_by="finished")
  last_saved = start.resume_step

  def save() -> None:
    nonlocal last_saved
    with interrupts.phase(f"saving step {step}", blocking=False, patience_s=_SAVE_PATIENCE_S):
      checkpoints.save(step, params=state.params, train=state.train_part(), data_iterator=position, meta=meta)
    last_saved = step

  # Only a one-process run stops out of a blocked wait (data, evaluation): the processes of a multi-process run
  # must all stop, and save, at one step, which they agree on at a host sync; a wait that never ends there meets
  # the watchdog instead.
  alone = jax.process_count() == 1

  def run_eval() -> None:
    with interrupts.phase(f"evaluating at step {step}", blocking=alone):
      metrics = evaluate_loss(
        eval_fn,
        state.params,
        batches(validation, tokenizer, config, train=False),
        num_batches=config.eval.num_loss_batches,
        seed=config.seed,
        placement=placement,
      )
      decoded, samples = evaluate_decoding(nnx.merge(decode_graphdef, state.params), validation, tokenizer, config)
    metrics.update(decoded)
    result.samples = samples
    logger.write(step, metrics, "eval")
    logger.write_text(step, "eval/samples", format_samples(samples[: config.num_samples_to_print]))
    result.evals.append((step, metrics))

  pending = []  # (step, metrics on device) since the last host sync
  # The device's seconds per step, measured between syncs (0 until the first: a signal then gets the grace time).
  step_seconds, synced_at = 0.0, time.perf_counter()

  def sync() -> dict:
    nonlocal step_seconds
    count = len(pending)
    # The device may still be running the last _STEPS_AHEAD steps: the watchdog allows for their time.
    waiting = f"waiting for the device to finish steps {pending[0][0]}-{step}"
    with interrupts.phase(waiting, blocking=False, patience_s=3 * step_seconds * _STEPS_AHEAD):
      metrics = _sync_metrics(pending, result, logger, last_saved, checkpoints)
    step_seconds = (time.perf_counter() - synced_at) / count
    return metrics

  last_time, tokens_since, pad_since, batches_since = time.perf_counter(), 0, 0.0, 0
  try:
    while step < total_steps:
      with interrupts.phase("waiting for training data", blocking=alone):
        batch = next(train_iter)
        next_position = _Position(train_iter)
      tokens_since += int(np.sum(batch["prompt_len"] + batch["answer_len"]))
      pad_since, batches_since = pad_since + pipeline.pad_fraction(batch), batches_since + 1
      # A step cannot be cut short (its input state is donated); dispatching it returns at once, after compiling
      # the first time, and then waits for the device to be at most _STEPS_AHEAD steps behind.
      busy = f"running train step {step + 1}" + (" (compiling it first)" if step == first_step else "")
      with interrupts.phase(busy, blocking=False, patience_s=3 * step_seconds):
        state, metrics = step_fn(state, placement.batch(batch))
        pending.append((step + 1, metrics))
        if len(pending) > _STEPS_AHEAD:
          jax.block_until_ready(pending[-1 - _STEPS_AHEAD][1])  # a wait, no transfer: not a host sync
      step, position = step + 1, next_position
      checkpoints.check()  # a background write that failed stops the run now (a host-side check, no device sync)
      logs = step % config.log_every == 0 or step == total_steps
      evals = (
        validation is not None and config.eval_every > 0 and (step % config.eval_every == 0 or step == total_steps)
      )
      saves = step % config.checkpoint.every == 0 or step == total_steps
      signalled = alone and interrupts.requested is not None  # a one-process run stops at this step
      if not (logs or evals or saves or signalled or step == config.stop_after_step):
        continue  # the device runs ahead; the host syncs only where it logs, evaluates, saves or may stop
      metrics = sync()
      if logs:
        elapsed = time.perf_counter() - last_time
        scalars = {k: float(v) for k, v in metrics.items() if not k.startswith("num_")}
        pad_fraction = pad_since / batches_since  # the mean over the interval's batches
        logger.write(step, dict(scalars, tokens_per_second=tokens_since / elapsed, pad_fraction=pad_fraction), "train")
        last_time, tokens_since, pad_since, batches_since = time.perf_counter(), 0, 0.0, 0
      if evals:
        run_eval()
      if saves:
        save()
      synced_at = time.perf_counter()  # evaluating and saving are not the device's step time
      if _stop_requested(interrupts, checkpoints, step):
        result.stopped_by = "preempted"
      elif step == config.stop_after_step:
        result.stopped_by = "stop_after_step"
      else:
        continue
      if last_saved != step:
        save()
      console(f"Stopping at step {step} ({result.stopped_by}); checkpoint saved in {checkpoints.directory}.")
      break
  except StopRequested as stop:
    if pending:  # check the steps not yet read back first: a non-finite state is never saved
      sync()
    _save_on_stop(stop, step, first_step, last_saved, save, checkpoints.directory)
    result.stopped_by = "preempted"
    console(f"Stopping at step {step} ({result.stopped_by}) on {stop}; checkpoint saved in {checkpoints.directory}.")
  finally:
    logger.close()
  result.step = step
  if result.samples:
    eval_step, metrics = result.evals[-1]
    console(format_report(eval_step, metrics, result.samples, config.num_samples_to_print))
  return result


def _sync_metrics(
  pending: list[tuple[int, dict]],
  result: TrainResult,
  logger: MetricsLogger,
  last_saved: int | None,
  checkpoints: Checkpoints,
) -> dict:
  """Read the steps' metrics since the last sync back in one transfer, check them, record the losses.

  Runs before every save, so a non-finite step is never saved (docs/method.md §5).

  Returns:
    The host metrics of the last pending step; `pending` is emptied.
  """
  steps = jax.device_get(pending)
  pending.clear()
  for step, metrics in steps:
    _check_finite(metrics, step, last_saved, checkpoints)
    result.losses[step] = float(metrics["loss"])
    logger.step(result.losses[step])
  return steps[-1][1]


# How many dispatched steps the device may still have to run: enough to keep it busy while the host fetches the next
# batch, few enough that a signal waits for them (before saving) seconds, not a whole log interval of steps.
_STEPS_AHEAD = 2
# Seconds a save may take to copy the state off the devices, and the last writes to reach the disk, before the
# watchdog gives up on them after a signal.
_SAVE_PATIENCE_S = 120.0
_WRITE_PATIENCE_S = 600.0


def _save_on_stop(
  stop: StopRequested, step: int, first_step: int, last_saved: int | None, save: Callable[[], None], where: str
) -> None:
  """After a signal that interrupted a blocked phase: save the last step if it is new, else stop without saving.

  Only a one-process run gets here after its first step (a multi-process run's loop does not block on signals).
  """
  if last_saved == step:
    return
  if step == first_step:
    raise RunInterrupted(
      f"Stopped by {stop} before the first step of this run: nothing new to save (the last checkpoint in "
      f"{where} is step {last_saved}). Rerun the same command to continue."
    )
  save()


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
