"""Where a training run's model comes from, and the train state built around it.

The precedence, stated once (docs/architecture.md repeats it):

1. **Resume** from the newest intact step of `workdir/checkpoints`: parameters,
   optimizer state, step, RNG and the data iterator's position. A step that
   cannot be read is moved to `workdir/checkpoints_damaged` and the step before
   it is tried (`checkpoint.on_corrupt="fallback"`), or the run stops ("fail");
   a workdir whose every step is damaged is never restarted from scratch.
2. **`config.init_from`**: the parameters of any checkpoint the loaders read
   (`config.init_format`, "auto" detects it): a Hugging Face directory (a mask
   token is added to its tokenizer and the embeddings grow to hold it), a run of
   ours, or a tunix / MaxText checkpoint (which store no config:
   `config.model` and `config.tokenizer` describe the model).
3. **Random init** of `config.model` with `config.tokenizer`.

With `config.lora.rank > 0` the model gets fresh adapters on top of that start (a resume restores
them), and its frozen base is written once to `workdir/lora_base` (`refusion_jax.checkpoints.lora_run`).

Each source's config is read once. Whatever the start, the run's execution
fields of `config.model` (remat, attention implementation, scanning) apply.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import grain
import jax
import ml_collections
import optax
from flax import nnx
from jax.experimental import multihost_utils

from refusion_jax.checkpoints import hf, lora_run
from refusion_jax.checkpoints.load import checkpoint_tokenizer, load_model, locate
from refusion_jax.checkpoints.orbax import TOKENIZER_SUBDIR, CheckpointDamagedError, Checkpoints
from refusion_jax.checkpoints.vocab import MASK_TOKEN, add_mask_token, resize_vocab
from refusion_jax.data.special_tokens import SpecialTokens, resolve_special_tokens, with_special_tokens
from refusion_jax.data.tokenizer import Tokenizer, load_tokenizer
from refusion_jax.model import lora
from refusion_jax.model.config import ModelConfig
from refusion_jax.model.transformer import Transformer
from refusion_jax.parallel import hosts
from refusion_jax.training.interrupts import Interrupts
from refusion_jax.training.metrics import console
from refusion_jax.training.run_config import (
  check_hf_architecture,
  lora_config_from,
  model_config_from,
  quantized_as_configured,
  run_as_configured,
)
from refusion_jax.training.state import Placement, TrainState, init_state_fn, make_placement, state_with_params

# tokenizer -> the run's training data as a grain dataset (`inputs.batches` of the training split, for supervised
# training).
TrainBatches = Callable[[Tokenizer], grain.IterDataset]

# Where damaged checkpoints are moved inside a workdir (next to the checkpoint directory, out of its manager's sight).
DAMAGED_SUBDIR = "checkpoints_damaged"


@dataclasses.dataclass
class Start:
  """Where the model comes from.

  model_config: the model's config, the run's execution fields applied.
  tokenizer_name: "bytes" or a tokenizer directory; a relative name is resolved
    against the checkpoint directory (what the checkpoints' meta records).
  resume_step: the step to restore (precedence 1), else None.
  params: the initial parameters (precedence 2), None for a resumed or random start.
  """

  model_config: ModelConfig
  tokenizer_name: str
  resume_step: int | None = None
  params: nnx.State | None = None


@dataclasses.dataclass
class Started:
  """Where the model came from and what depends on it: tokenizer, state placement, training iterator, the state."""

  origin: Start  # named apart from this module, `start`, which callers import by that name
  tokenizer: Tokenizer
  placement: Placement
  train_iterator: grain.DatasetIterator
  state: TrainState
  checkpoint_dir: str  # the run's checkpoint directory (its tokenizer, a LoRA run's base)


def begin(
  config: ml_collections.ConfigDict,
  checkpoints: Checkpoints,
  tx: optax.GradientTransformation,
  mesh: jax.sharding.Mesh,
  train_batches: TrainBatches,
  interrupts: Interrupts,
) -> Started:
  """Resume from the newest intact checkpoint, else start as `config` says (never silently from scratch).

  `train_batches(tokenizer)`: the training data as a grain dataset (its iterator's position is checkpointed).
  """
  damaged_dir = os.path.join(os.path.dirname(checkpoints.directory), DAMAGED_SUBDIR)
  steps = checkpoints.all_steps()
  for step in reversed(steps):
    try:
      with interrupts.phase(f"restoring checkpoint step {step}", blocking=True):
        meta = checkpoints.read_meta(step)
        _check_same_lora(config, meta, checkpoints.directory, step)
        start = Start(ModelConfig(**meta["model_config"]), meta["tokenizer"], resume_step=step)
        return _build(config, _as_configured(start, config), checkpoints, tx, mesh, train_batches)
    except CheckpointDamagedError as error:
      _set_aside(config, checkpoints, error, damaged_dir)
  if steps or (os.path.isdir(damaged_dir) and os.listdir(damaged_dir)):
    raise CheckpointDamagedError(
      f"Every checkpoint of {checkpoints.directory} is damaged (moved to {damaged_dir}); refusing to start "
      f"from scratch in a workdir that held a run. Delete {damaged_dir} to start over, or use a new workdir.",
      step=-1,
    )
  with interrupts.phase("loading the initial model", blocking=True):
    start = _from_init(config, checkpoints.directory, mesh) if config.init_from else _random(config)
    return _build(config, _as_configured(start, config), checkpoints, tx, mesh, train_batches)


def starting_params(
  config: ml_collections.ConfigDict, checkpoint_dir: str, model_config: ModelConfig, placement: Placement
) -> nnx.State:
  """The parameters the run started from, before any step (precedence 2 or 3: `config.init_from`, else the random
  init of `config.seed`), placed as the run's parameters are: what a resumed GRPO run keeps as its reference
  policy (refusion_jax.rl). Full parameters only (a LoRA run's start is its base, which it holds already)."""
  if config.init_from:
    params = _as_configured(_from_init(config, checkpoint_dir, placement.mesh), config).params
    return hosts.place(params, placement.state_shardings.params)
  init = lambda: nnx.state(Transformer(model_config, rngs=nnx.Rngs(params=config.seed)))
  return jax.jit(init, out_shardings=placement.state_shardings.params)()


def _check_same_lora(config: ml_collections.ConfigDict, meta: dict, directory: str, step: int) -> None:
  """A run resumes with the adapters it was saved with (its checkpoints hold nothing else to train)."""
  stored, asked = lora_run.stored_lora(meta), lora_config_from(config)
  if stored != asked:
    raise ValueError(
      f"Checkpoint step {step} in {directory} was trained with lora={stored}, but the config asks for "
      f"lora={asked}. Resume with the stored settings (--config.lora.*), or use a new workdir."
    )


def _as_configured(start: Start, config: ml_collections.ConfigDict) -> Start:
  model_config = quantized_as_configured(run_as_configured(start.model_config, config.model), config)
  return dataclasses.replace(start, model_config=model_config)


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


def _random(config: ml_collections.ConfigDict) -> Start:
  return Start(model_config_from(config, load_tokenizer(config.tokenizer)), config.tokenizer)


def _from_init(config: ml_collections.ConfigDict, checkpoint_dir: str, mesh: jax.sharding.Mesh) -> Start:
  """The parameters of `config.init_from`, whatever its format (precedence 2), read straight onto `mesh` by
  `config.sharding_rules`: each process reads its own shards (on a mesh spanning processes no device of one
  process could hold them all)."""
  found = locate(config.init_from, config.init_format)
  dtype, param_dtype = config.model.get("dtype"), config.model.get("param_dtype")
  # A QLoRA run quantizes the base while reading it: the float base never sits on the devices whole.
  quantized = dict(quantize=config.get("quantize"), quantize_group_size=config.get("quantize_group_size", 128))
  quantized.update(mesh=mesh, rules=tuple(tuple(rule) for rule in config.sharding_rules))
  if found.format == "hf":
    return _from_hf(config, found.path, checkpoint_dir, quantized)
  if found.format == "refusion":
    model = load_model(
      found.path, format="refusion", step=found.step, dtype=dtype, param_dtype=param_dtype, **quantized
    )
    return Start(model.config, checkpoint_tokenizer(found), params=nnx.state(model))
  # tunix and MaxText store no config: config.model and config.tokenizer describe the model.
  model_config = model_config_from(config, load_tokenizer(config.tokenizer))
  model = load_model(
    found.path,
    format=found.format,
    step=found.step,
    config=model_config,
    dtype=dtype,
    param_dtype=param_dtype,
    **quantized,
  )
  return Start(model.config, config.tokenizer, params=nnx.state(model))


def _from_hf(config: ml_collections.ConfigDict, path: str, checkpoint_dir: str, quantized: dict) -> Start:
  """A Hugging Face checkpoint made ready to train ReFusion: a mask token, and an embedding row for it.

  The tokenizer of a base checkpoint (Qwen3) has no mask token: one is added
  (process 0 writes the extended tokenizer into the checkpoint directory, the
  others wait for it) and, when its id lies past the embedding table, the table
  grows to hold it, rounded up to `config.vocab_multiple` rows so the vocabulary
  still shards. `quantized` (load_model's quantize, mesh and rules arguments) quantizes the projections while
  reading; the embedding and LM head, which grow, stay float.
  """
  dtype = config.model.get("dtype") or "float32"
  model_config = hf.load_hf_config(path, dtype=dtype, param_dtype=config.model.get("param_dtype") or dtype)
  # config.json alone says whether the architecture fits: checked before the weights are read.
  check_hf_architecture(config.model, model_config, path)
  params = nnx.state(load_model(path, format="hf", config=model_config, **quantized))
  tokenizer_path, mask_id = path, model_config.mask_token_id
  if mask_id is None:
    tokenizer_path = os.path.join(checkpoint_dir, TOKENIZER_SUBDIR)
    if jax.process_index() == 0:  # one writer; the others read it after the barrier
      add_mask_token(path, tokenizer_path)
    multihost_utils.sync_global_devices("refusion_jax: tokenizer with a mask token written")
    mask_id = load_tokenizer(tokenizer_path).mask_id
    console(f"Added {MASK_TOKEN} to the tokenizer as id {mask_id} (written to {tokenizer_path}).")
  if mask_id >= model_config.vocab_size:
    new_vocab = -(-(mask_id + 1) // config.vocab_multiple) * config.vocab_multiple
    params = resize_vocab(params, new_vocab, jax.random.PRNGKey(config.seed))
    console(f"Resized the vocabulary from {model_config.vocab_size} to {new_vocab} rows.")
    model_config = model_config.replace(vocab_size=new_vocab)
  tokenizer = load_tokenizer(tokenizer_path)
  ids = resolve_special_tokens(SpecialTokens(mask=mask_id), tokenizer=tokenizer, config=model_config)
  if tokenizer_path.startswith(checkpoint_dir):
    tokenizer_path = os.path.relpath(tokenizer_path, checkpoint_dir)
  return Start(with_special_tokens(model_config, ids), tokenizer_path, params=params)


def _build(
  config: ml_collections.ConfigDict,
  start: Start,
  checkpoints: Checkpoints,
  tx: optax.GradientTransformation,
  mesh: jax.sharding.Mesh,
  train_batches: TrainBatches,
) -> Started:
  """The tokenizer, the state's placement, the training iterator and the state, created where it lives."""
  local = os.path.join(checkpoints.directory, start.tokenizer_name)
  tokenizer = load_tokenizer(local if os.path.isdir(local) else start.tokenizer_name)
  lora_config = lora_config_from(config)
  init_fn = init_state_fn(start.model_config, tx, config.seed, lora_config)
  placement = make_placement(init_fn, mesh, config.sharding_rules)
  train_iterator = iter(train_batches(tokenizer))
  if start.resume_step is not None:
    abstract = placement.abstract_state
    # A LoRA run's steps hold the adapters (the trainable part); its base was written once.
    trainable, frozen = lora.trainable_part(abstract.params)
    restored = checkpoints.restore(
      start.resume_step,
      abstract_params=trainable,
      abstract_train=abstract.train_part(),
      data_iterator=train_iterator,
    )
    params = restored.params
    if lora_config.enabled:
      params = nnx.merge_state(params, lora_run.restore_base(frozen, checkpoints.directory))
    console(f"Resumed from {checkpoints.directory} at step {start.resume_step}.")
    state = TrainState(params=params, **restored.train)
  elif start.params is not None:
    console(f"Started from the parameters of {config.init_from}.")
    params = start.params
    if lora_config.enabled:
      params = lora_run.with_adapters(params, start.model_config, lora_config, config.seed)
    state = state_with_params(params, tx, config.seed, placement)
  else:
    state = jax.jit(init_fn, out_shardings=placement.state_shardings)()
  if lora_config.enabled and start.resume_step is None:
    directory = lora_run.save_base(
      lora.trainable_part(state.params)[1], start.model_config, start.tokenizer_name, checkpoints.directory
    )
    console(f"LoRA: the frozen base is written once, to {directory}; checkpoints hold the adapters.")
  return Started(start, tokenizer, placement, train_iterator, state, checkpoints.directory)
