"""Training and evaluation of ReFusion (and the AR / MDM baselines) on one backbone.

    python -m refusion_jax.train --config configs/demo.py --workdir /tmp/refusion_demo
    python -m refusion_jax.train --config configs/demo.py --workdir DIR --config.num_train_steps=200

`train_and_evaluate(config, workdir)` does everything; `refusion_jax.train` only parses flags.
The loop:

1. Build (once) and open the data: the built-in tasks or query/response JSON.
2. Build the train state where it lives (`refusion_jax.training.state`):
   parameters and optimizer state are created by a jitted init whose outputs
   carry the mesh shardings. Precedence: resume from `workdir/checkpoints`, else `init_from_hf` (or an
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
   a non-finite value stops the run before anything of it is saved. SIGTERM
   (preemption) sets a flag, polled at the same syncs; the loop saves and
   returns cleanly.
5. Periodically: TensorBoard / console metrics, validation loss, exact match
   and tokens-per-forward of decoding (`refusion_jax.training.evaluate`), and
   checkpoints.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import threading
import time
from collections.abc import Sequence
from types import FrameType
from typing import Any

import grain
import jax
import ml_collections
import numpy as np
from absl import logging
from flax import nnx
from jax.experimental import multihost_utils

from refusion_jax.checkpoints.hf import load_hf_config
from refusion_jax.checkpoints.orbax import (
  CHECKPOINT_SUBDIR,
  Checkpoints,
  abstract_model,
  load_model_from_checkpoint,
  local_path,
  model_meta,
)
from refusion_jax.checkpoints.vocab import MASK_TOKEN, load_hf_for_training
from refusion_jax.data import pipeline
from refusion_jax.data.special_tokens import SpecialTokens, resolve_special_tokens, with_special_tokens
from refusion_jax.data.tokenizer import Tokenizer, load_tokenizer
from refusion_jax.model.config import ModelConfig, preset
from refusion_jax.parallel import sharding
from refusion_jax.training.evaluate import evaluate_decoding, evaluate_loss, format_report, format_samples
from refusion_jax.training.metrics import MetricsLogger, console
from refusion_jax.training.objective import ObjectiveConfig
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


# ----------------------------------------------------------------- configuration

# The `config.model` fields that configure how a model runs, not what it is.
_RUNTIME_FIELDS = ("preset", "dtype", "param_dtype", "remat")
# The fields an `init_from_hf` checkpoint must share with `config.model.preset` (the vocabulary may differ:
# it follows the tokenizer, and grows for an added mask token).
_ARCHITECTURE_FIELDS = (
  "architecture",
  "hidden_size",
  "intermediate_size",
  "num_layers",
  "num_heads",
  "num_kv_heads",
  "head_dim",
  "qk_norm",
  "qkv_bias",
  "tie_embeddings",
  "rope_theta",
)
_SPECIAL_ID_FIELDS = {"mask": "mask_token_id", "eos": "eos_token_id", "pad": "pad_token_id"}


def model_config_from(config: ml_collections.ConfigDict, tokenizer: Tokenizer) -> ModelConfig:
  """`config.model.preset` with every other `config.model` field as an override.

  Special token ids follow `resolve_special_tokens`: ids set in `config.model`,
  then the tokenizer's, then the preset's; the model config records them, so
  that a checkpoint's model config is enough to decode.
  """
  fields = dict(config.model)
  model_config = preset(fields.pop("preset"), **fields)
  explicit = SpecialTokens(**{name: fields.get(field) for name, field in _SPECIAL_ID_FIELDS.items()})
  return with_special_tokens(model_config, resolve_special_tokens(explicit, tokenizer=tokenizer, config=model_config))


def check_hf_architecture(model_fields: ml_collections.ConfigDict, hf_config: ModelConfig, path: str) -> None:
  """An `init_from_hf` checkpoint must have the architecture `config.model` describes (unless its preset is "").

  Raises:
    ValueError: naming the first field where the checkpoint's config.json and
      `config.model` differ.
  """
  name = model_fields.get("preset", "")
  if not name:
    return
  overrides = {k: v for k, v in dict(model_fields).items() if k not in _RUNTIME_FIELDS}
  expected = preset(name, **overrides)
  for field in _ARCHITECTURE_FIELDS:
    want, got = getattr(expected, field), getattr(hf_config, field)
    if want != got:
      raise ValueError(
        f"config.init_from_hf={path!r} is not the architecture config.model describes (preset {name!r}): "
        f"its config.json gives {field}={got!r}, config.model {field}={want!r}. Point config.init_from_hf at a "
        f"{name} checkpoint, or set --config.model.preset='' to fine-tune any architecture."
      )


def check_required_fields(config: ml_collections.ConfigDict, resuming: bool) -> None:
  """Fields a run cannot start without, all named at once before anything is built."""
  missing = []
  if not (resuming or config.init_from_hf or config.init_from_checkpoint or config.tokenizer):
    missing.append(
      "config.init_from_hf (a Hugging Face checkpoint directory to fine-tune) or config.tokenizer "
      "('bytes' or a tokenizer directory, to train from scratch)"
    )
  if config.data.dataset == "json" and not config.data.get("train_files"):
    missing.append("config.data.train_files (comma-separated query/response JSON files)")
  if missing:
    raise ValueError(
      "The config leaves required fields empty: " + "; ".join(missing) + ". Set them on the command line, "
      "e.g. --config.init_from_hf=/path/to/Qwen3-8B --config.data.train_files=train.json."
    )


def objective_config_from(config: ml_collections.ConfigDict, model_config: ModelConfig) -> ObjectiveConfig:
  """The objective of `config.objective`, with the model's mask and pad ids."""
  mask_id = model_config.mask_token_id
  if mask_id is None:
    if config.objective.kind != "ar":
      raise ValueError("The model has no mask token id; set config.model.mask_token_id or use a tokenizer with one.")
    mask_id = 0  # never fed: the AR objective masks nothing
  return ObjectiveConfig(
    kind=config.objective.kind,
    slot_sizes=tuple(config.objective.slot_sizes),
    eps=config.objective.eps,
    mask_id=mask_id,
    pad_id=model_config.pad_token_id,
  )


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


def batches(
  source: Sequence, tokenizer: Tokenizer, config: ml_collections.ConfigDict, *, train: bool
) -> grain.IterDataset:
  """The grain dataset of this process's rows: endless and shuffled for training, one ordered pass for eval."""
  return pipeline.make_dataset(
    source,
    tokenizer,
    seq_len=config.data.seq_len,
    batch_size=config.batch_size // jax.process_count(),
    seed=config.seed,
    shuffle=train,
    num_epochs=None if train else 1,
    chat_template=config.data.chat_template,
  )


# ------------------------------------------------------------------ preemption


class StopSignal:
  """Turns SIGTERM into a flag the loop polls, so it can save and exit cleanly.

  Across processes the flag is OR-ed at every host sync (all processes must save the
  same step); JAX's own preemption notice (`reached_preemption`) counts too.
  """

  def __init__(self):
    self.received = False
    self._previous = None
    if threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._handle)
    else:
      logging.warning("Not in the main thread: SIGTERM will not trigger a checkpoint.")

  def _handle(self, signum: int, frame: FrameType | None) -> None:
    del signum, frame
    self.received = True

  def should_stop(self, checkpoints: Checkpoints, step: int) -> bool:
    """Whether any process was signalled, or JAX's preemption notice asks to save at `step`."""
    flag = self.received
    if jax.process_count() > 1:
      flag = bool(np.max(multihost_utils.process_allgather(np.int32(flag))))
    return flag or checkpoints.reached_preemption(step)

  def restore(self) -> None:
    """Reinstall the SIGTERM handler that was there before."""
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)


# ------------------------------------------------------------------ where the model comes from


@dataclasses.dataclass
class _Start:
  """Where the run's model comes from (see the precedence in the module docstring)."""

  model_config: ModelConfig
  tokenizer_name: str  # relative names are resolved against the checkpoint directory
  resume_step: int | None = None
  params: nnx.State | None = None  # initial parameters (HF or another run); None = random


def _find_start(config: ml_collections.ConfigDict, checkpoints: Checkpoints) -> _Start:
  from refusion_jax.checkpoints import load as checkpoint_loader  # the front door for every checkpoint format

  latest = checkpoints.latest_step()
  if latest is not None:
    meta = checkpoints.read_meta(latest)
    return _Start(ModelConfig(**meta["model_config"]), meta["tokenizer"], resume_step=latest)
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
    model_config = model.config.replace(remat=config.model.get("remat", False))
    return _Start(model_config, tokenizer_path or config.tokenizer, params=nnx.state(model))
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
    remat=config.model.get("remat", False),
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
  tx: Any,
  placement: Placement,
  checkpoints: Checkpoints,
  train_iter: Any,
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
  NFS / gcsfuse for a pod).

  Raises:
    NonFiniteLossError: the loss or gradient norm became NaN/Inf; no checkpoint
      of that step or later was written.
  """
  workdir = local_path(workdir)
  os.makedirs(workdir, exist_ok=True)
  stop_signal = StopSignal()
  checkpoints = Checkpoints(
    os.path.join(workdir, CHECKPOINT_SUBDIR),
    max_to_keep=config.checkpoint.max_to_keep,
    async_save=config.checkpoint.async_save,
  )
  try:
    return _train_loop(config, workdir, checkpoints, stop_signal)
  finally:
    checkpoints.wait()
    checkpoints.close()
    stop_signal.restore()


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


def _train_loop(
  config: ml_collections.ConfigDict, workdir: str, checkpoints: Checkpoints, stop_signal: StopSignal
) -> TrainResult:
  check_required_fields(config, resuming=checkpoints.latest_step() is not None)
  splits = open_splits(config, workdir)
  validation = splits.get("validation")
  total_steps = _total_steps(config, len(splits["train"]))
  tx, schedule = make_optimizer(config.optimizer, total_steps)
  mesh = sharding.make_mesh(dict(config.mesh))
  _check_batch_size(config, mesh)

  start = _find_start(config, checkpoints)
  tokenizer = _resolve_tokenizer(start.tokenizer_name, checkpoints.directory)
  placement = make_placement(init_state_fn(start.model_config, tx, config.seed), mesh, config.sharding_rules)
  train_iter = iter(batches(splits["train"], tokenizer, config, train=True))
  state = _initial_state(config, start, tx, placement, checkpoints, train_iter)

  objective = objective_config_from(config, start.model_config)
  graphdef, _ = abstract_model(start.model_config)
  step_fn = placement.jit_step(make_train_step(graphdef, tx, schedule, objective, config.grad_accum_steps))
  eval_fn = placement.jit_eval(make_eval_step(graphdef, objective))
  # Rematerialisation only saves memory in a backward pass, and nnx.remat fails inside the decode loop's trace.
  decode_graphdef, _ = abstract_model(start.model_config.replace(remat=False))
  meta = model_meta(start.model_config, start.tokenizer_name, objective=objective.kind)
  step = int(state.step)
  logger = MetricsLogger(workdir, total_steps=total_steps, initial_step=step)
  result = TrainResult(step=step, losses={}, evals=[], samples=[], stopped_by="finished")
  last_saved = start.resume_step

  def save() -> None:
    nonlocal last_saved
    checkpoints.save(step, params=state.params, train=state.train_part(), data_iterator=train_iter, meta=meta)
    last_saved = step

  def run_eval() -> None:
    metrics = evaluate_loss(
      eval_fn,
      state.params,
      batches(validation, tokenizer, config, train=False),
      num_batches=config.eval.num_loss_batches,
      seed=config.seed,
      placement=placement,
    )
    decoded, result.samples = evaluate_decoding(nnx.merge(decode_graphdef, state.params), validation, tokenizer, config)
    metrics.update(decoded)
    logger.write(step, metrics, "eval")
    logger.write_text(step, "eval/samples", format_samples(result.samples[: config.num_samples_to_print]))
    result.evals.append((step, metrics))

  last_time, tokens_since = time.perf_counter(), 0
  pending = []  # (step, metrics on device) since the last host sync
  try:
    while step < total_steps:
      batch = next(train_iter)
      tokens_since += int(np.sum(batch["prompt_len"] + batch["answer_len"]))
      state, metrics = step_fn(state, placement.batch(batch))
      step += 1
      pending.append((step, metrics))
      logs = step % config.log_every == 0 or step == total_steps
      evals = (
        validation is not None and config.eval_every > 0 and (step % config.eval_every == 0 or step == total_steps)
      )
      saves = step % config.checkpoint.every == 0 or step == total_steps
      if not (logs or evals or saves or step == config.stop_after_step):
        continue  # the device runs ahead; the host syncs only where it logs, evaluates, saves or may stop
      metrics = _sync_metrics(pending, result, logger, last_saved, checkpoints)
      if logs:
        elapsed = time.perf_counter() - last_time
        scalars = {k: float(v) for k, v in metrics.items() if not k.startswith("num_")}
        logger.write(step, dict(scalars, tokens_per_second=tokens_since / elapsed), "train")
        last_time, tokens_since = time.perf_counter(), 0
      if evals:
        run_eval()
      if saves:
        save()
      if stop_signal.should_stop(checkpoints, step):
        result.stopped_by = "preempted"
      elif step == config.stop_after_step:
        result.stopped_by = "stop_after_step"
      else:
        continue
      if last_saved != step:
        save()
      console(f"Stopping at step {step} ({result.stopped_by}); checkpoint saved in {checkpoints.directory}.")
      break
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
